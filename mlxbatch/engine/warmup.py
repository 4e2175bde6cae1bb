"""Engine warm-up: every kind of step runs once before the real work, so no real step pays a first-use cost.

On a GPU, MLX compiles many kernels the first time they run (CUDA: NVRTC, cached on disk per machine; Metal:
pipeline states): the gathers and scatters of row moves and prefix copy-ins, writes at different offsets,
cached-block copy-ins, forks, the sampler's per-row paths. Measured on an H200 (0.5B shape, bf16), the first
engine run of a fresh process spent ~11 s in two steps compiling them, which made a 5.6 s workload take 18 s.
``warm_up_paths`` runs a tiny workload that takes every one of those paths on a throwaway engine core with the
same model (so the same dtypes) and a small memory budget; nothing of it is kept.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxbatch.config import EngineConfig
from mlxbatch.engine.model.loader import LoadedModel
from mlxbatch.engine.outputs import Traffic
from mlxbatch.types import SamplingParams

if TYPE_CHECKING:
    from mlxbatch.engine.model.worker import Worker


@dataclass(frozen=True)
class WarmUpReport:
    seconds: float
    steps: int
    traffic: Traffic
    cached_tokens: int  # prompt tokens that came from the prefix cache or a running row (the copy-in paths ran)


def warm_up_paths(loaded: LoadedModel, config: EngineConfig, worker: Worker | None = None) -> WarmUpReport:
    """Run a small workload through a throwaway engine core: shared prefixes (cache hits and copies from running
    rows), prefill chunks at different offsets, decode, sampled rows with top-k/top-p and penalties, logprobs, a
    forked ``n = 2`` request and finished rows retiring mid-batch."""
    from mlxbatch.engine.core import EngineCore  # the core constructs warm-ups: import it late

    t0 = time.perf_counter()
    if worker is None:
        from mlxbatch.engine.model.worker import Worker

        worker = Worker(loaded)
    per_row = 256 * worker.geometry.bytes_per_token  # a row's KV at the slot layout's smallest length step
    cfg = dataclasses.replace(config, warm_up=False, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=16,
                              kv_budget_bytes=16 * per_row, prefix_cache=True, prefix_cache_bytes=4 * per_row)
    core = EngineCore(loaded, cfg, worker=worker)
    vocab = int(loaded.config.get("vocab_size") or 1000)
    span = max(8, min(vocab, 1000) - 8)

    def toks(seed: int, n: int) -> list[int]:
        return [4 + (seed * 131 + 17 * i) % span for i in range(n)]

    shared = toks(1, 48)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    rows = [
        (shared + toks(2, 5), greedy),
        (toks(3, 30), greedy),
        (toks(4, 70), SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1, max_tokens=4, ignore_eos=True)),
        (shared + toks(5, 9), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)),
        (shared + toks(6, 20), SamplingParams(temperature=0.7, repetition_penalty=1.1, min_p=0.05, seed=2, n=2,
                                              max_tokens=3, ignore_eos=True)),
        (shared + toks(2, 5) + toks(7, 12), dataclasses.replace(greedy, max_tokens=2)),
    ]
    try:
        core.add_request(rows[0][0], rows[0][1], cache_tokens=len(shared))
        core.add_request(rows[1][0], rows[1][1])
        steps = 0
        while core.has_unfinished and steps < 3:  # the shared prefix is cached before the rows that reuse it come
            core.step()
            steps += 1
        for prompt, params in rows[2:]:
            core.add_request(prompt, params)
        while core.has_unfinished:
            core.step()
            steps += 1
        stats = core.stats()["prefix_cache"] or {}
        return WarmUpReport(time.perf_counter() - t0, steps, core.runner.traffic.snapshot(),
                            int(stats.get("tokens_reused", 0)))
    finally:
        core.shutdown()
