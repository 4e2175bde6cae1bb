"""How an engine builds its scheduler from its config and memory plan: one definition, used by the engine core
(``engine.core``) and by the dry run of its scheduling (``engine.dry_run``, what ``mlxbatch plan`` predicts with).

Owns the rules that turn the config, the slot budget, the prefix cache's blocks and the layout's facts into a
``Scheduler``: the batch the config leaves unset (``sched.sizing``), the reuse step (a block where prefill passes
are packed, else 1), the filled passes of packed layouts and the prefix index. Pure Python: the KV cost function and
the layout's facts are injected.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mlxbatch.config import EngineConfig
from mlxbatch.engine.sched.blocks import BLOCK_SIZE
from mlxbatch.engine.sched.prefix import PrefixIndex
from mlxbatch.engine.sched.scheduler import Scheduler
from mlxbatch.engine.sched.sizing import BatchSize, DeviceFacts, size_batch
from mlxbatch.engine.sched.step import KVCost, RowsCost, SchedulerConfig


@dataclass(frozen=True)
class SchedulerSetup:
    """A built scheduler and what its build decided (the core keeps them for its life)."""

    scheduler: Scheduler
    batch_size: BatchSize
    config: EngineConfig  # the config in effect: ``max_num_seqs`` and ``max_num_batched_tokens`` as sized
    # the fewest tokens a reused prefix is worth extending by (the plan's ``min_step_tokens``, the prefix index's
    # running-row margin): a block where prefill passes are packed (CUDA: a partial block's store and copy-in cost
    # more there than computing a few tokens), else 1 (reuse to the token)
    reuse_step: int


def build_scheduler(config: EngineConfig, device: DeviceFacts, slot_budget: int, prefix_blocks: int,
                    bytes_per_token: int, kv_cost: KVCost, packed_prefill: bool,
                    invariant_slice: int = 0, rows_cost: RowsCost | None = None) -> SchedulerSetup:
    """The scheduler of an engine with this config on this device: ``slot_budget`` and ``prefix_blocks`` from its
    memory plan (``engine.model.memory.plan_memory``), ``kv_cost`` (and the same as ``rows_cost``) and
    ``packed_prefill`` / ``invariant_slice`` from its KV layout (the runner's)."""
    # the batch the config leaves unset, sized by the device and the slots' budget as the layout charges it
    batch = size_batch(device, slot_budget, kv_cost, config.expected_row_tokens, config.max_num_seqs,
                       config.max_num_batched_tokens)
    config = dataclasses.replace(config, max_num_seqs=batch.max_num_seqs,
                                 max_num_batched_tokens=batch.max_num_batched_tokens)
    step = BLOCK_SIZE if packed_prefill else 1
    scheduler = Scheduler(
        SchedulerConfig(batch.max_num_seqs, batch.max_num_batched_tokens, config.prefill_chunk_size, slot_budget,
                        invariant_slice,
                        # CUDA: a pass's fixed host cost binds, so its passes are filled (a 16th of the slots)
                        batch.max_num_seqs // 16 if packed_prefill else 0),
        kv_cost,
        PrefixIndex(prefix_blocks, BLOCK_SIZE, bytes_per_token * BLOCK_SIZE, step) if prefix_blocks else None,
        rows_cost)
    return SchedulerSetup(scheduler, batch, config, step)
