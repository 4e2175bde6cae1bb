"""Frozen engine configuration, validated on construction. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from mlxbatch.errors import InvalidRequestError


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and how much memory it may use for KV.

    ``kv_memory_fraction`` of the memory the worker finds available (after the weights) goes to KV — the running
    rows' slots and the prefix and vision caches together — unless ``kv_budget_bytes`` sets that budget outright
    (the caches inside it too). ``max_num_seqs`` caps concurrency on top of memory; unset, it and
    ``max_num_batched_tokens`` are sized by the device and the KV budget (``engine.sched.sizing``), with
    ``expected_row_tokens`` as the hint of a row's length.
    ``batch_invariant`` makes each row's outputs independent of the batch (docs/architecture.md, "Batch invariance").
    """

    max_num_seqs: int | None = None  # None: by device and KV budget (CPU 128; Macs 64-256 by RAM; NVIDIA 128-512)
    max_num_batched_tokens: int | None = None  # None: by device (2048 on CPU and small Macs, 4096 on NVIDIA GPUs, up to 8192 on large Macs)
    # the tokens a row is expected to hold (prompt + max_tokens; a job passes its max_tokens): the default
    # max_num_seqs is at most the rows the KV budget holds at this length. None: unknown (the shortest row)
    expected_row_tokens: int | None = None
    prefill_chunk_size: int = 512
    kv_memory_fraction: float | None = None  # None: 0.5 (0.3 on Macs with 16 GB or less)
    kv_budget_bytes: int | None = None
    prefix_cache: bool = True  # keep full prompt blocks' KV and start matching prompts from it
    prefix_cache_bytes: int | None = None  # None: a quarter of the KV budget, at most 2 GiB
    seed: int | None = None  # engine-wide seed: unseeded requests derive theirs from it and their id
    vision_cache_bytes: int = 1 << 30  # vision-language models: image features kept by content hash (0: none)
    # GPUs: what MLX may allocate during a step beyond what it holds at the step's start (a pass's activations);
    # past it MLX waits for earlier kernels to free theirs (mx.set_memory_limit). None: by device; 0: no bound
    step_memory_bytes: int | None = None
    warm_up: bool = True
    # every row's tokens and logprobs bitwise identical whatever shares its batch, cache hits, preemption and
    # max_num_seqs: fixed forward shapes (engine.invariant); costs speed, so off by default
    batch_invariant: bool = False
    # launch each step before reading the last one's tokens, so that the host's work (reading results, scheduling,
    # building the next passes) runs while the device computes (a job's ``engine.overlap_steps``). None: by device
    # (``engine.paths.overlaps_steps``): on a GPU's text rows (on the CUDA text path its steps are launched from a
    # thread of their own too, ``engine.launcher``), not on a CPU, not for vision rows or batch-invariant runs; off,
    # every step is read before the next is built
    overlap_steps: bool | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size", "expected_row_tokens"):
            v = getattr(self, name)
            if v is None and name != "prefill_chunk_size":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidRequestError(name, v, "must be an integer >= 1")
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction <= 1:
            raise InvalidRequestError("kv_memory_fraction", self.kv_memory_fraction, "must be in (0, 1]")
        if self.step_memory_bytes is not None and (isinstance(self.step_memory_bytes, bool)
                                                   or not isinstance(self.step_memory_bytes, int)
                                                   or self.step_memory_bytes < 0):
            raise InvalidRequestError("step_memory_bytes", self.step_memory_bytes, "must be an integer >= 0")
        if self.kv_budget_bytes is not None and self.kv_budget_bytes < 1:
            raise InvalidRequestError("kv_budget_bytes", self.kv_budget_bytes, "must be >= 1")
