"""The scheduler's named types: its configuration and what one step runs (``SchedulerOutput``, which the runner
executes: decodes, prefill chunks, forks, admissions with the source of their reused KV, and cache stores).
Pure Python: no mlx.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlxbatch.engine.request import Request
from mlxbatch.engine.sched.prefix import BlockStore, PrefixSource

KVCost = Callable[[list[int]], int]  # reserved lengths of the running sequences -> bytes (the runner's layout)
# the same charge from the number of rows and the longest reserved length, for a layout whose charge depends on nothing
# else (every layout the engine has): admission then keeps both as it adds rows, where a ``KVCost`` reads every
# running row's length for each row it weighs
RowsCost = Callable[[int, int], int]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512
    kv_budget_bytes: int = 1 << 62
    # batch-invariant mode (0: off): prefill chunks and reused prefixes start at multiples of this many tokens, so a
    # position is always computed in the same slice; prefill covers the prompt only (a preempted sequence's
    # generated tokens are recomputed by decode steps, as they were first computed)
    invariant_slice: int = 0
    # fuller prefill passes where a pass's fixed host cost binds (CUDA; 0: off). In each wave of admissions a few
    # rows finish a step before the rest, and a pass for their few replacements, or for the tail of a row split at
    # the token budget's edge, cost a whole pass for a few hundred tokens. So, while rows decode and no prefill is
    # under way, new rows wait one step for this many slots to be free (or for the rest of the queue to fit), and
    # a row with at most ``prefill_chunk_size // 2`` tokens left is never split: its pass goes past the budget by
    # less than that
    fill_slots: int = 0

    def __post_init__(self) -> None:
        assert self.max_num_seqs >= 1 and self.prefill_chunk_size >= 1 and self.invariant_slice >= 0
        assert self.fill_slots >= 0 and not (self.fill_slots and self.invariant_slice)  # invariant: whole slices
        assert self.max_num_batched_tokens >= 1 and self.kv_budget_bytes >= 0


@dataclass(frozen=True)
class PrefillChunk:
    request: Request
    start: int
    end: int
    last: bool  # completes the sequence's KV, so its last logits give the next token


@dataclass(frozen=True)
class Admission:
    """A sequence that gets a row this step, and where the KV it starts from comes from (None: nothing reused)."""

    request: Request
    source: PrefixSource | None = None


@dataclass(frozen=True)
class SchedulerOutput:
    decodes: tuple[Request, ...]
    prefills: tuple[PrefillChunk, ...]
    # (parent, child): the parent's prefill ends this step and the child (another sample of the same request)
    # starts from a copy of its KV, sampling its first token from the same logits
    forks: tuple[tuple[Request, Request], ...] = ()
    admissions: tuple[Admission, ...] = ()  # new rows, in admission order (each also has a chunk in ``prefills``)
    stores: tuple[BlockStore, ...] = ()  # prompt blocks copied into the prefix cache once the step succeeded

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.end - c.start for c in self.prefills)
