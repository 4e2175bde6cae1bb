"""Engine warm-up: every kind of step runs once before the real work, so no real step pays a first-use cost.

On a GPU, MLX compiles many kernels the first time they run (CUDA: NVRTC, cached on disk per machine; Metal:
pipeline states): the gathers and scatters of row moves and prefix copy-ins, writes at different offsets,
cached-block copy-ins, forks, the sampler's per-row paths. Measured on an H200 (0.5B shape, bf16), the first
engine run of a fresh process spent ~11 s in two steps compiling them, which made a 5.6 s workload take 18 s.
``exercise`` runs a tiny workload that takes every one of those paths on a throwaway engine core (the caller makes
it: the same model, so the same dtypes, and a small memory budget) and shuts it down; nothing of it is kept.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Protocol

from mlxbatch.types import SamplingParams


class _Core(Protocol):  # what the warm-up needs of an EngineCore
    loaded: Any

    @property
    def has_unfinished(self) -> bool: ...

    def add_request(self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None,
                    stream: bool = False, cache_tokens: int | None = None) -> str: ...

    def step(self) -> list[Any]: ...

    def stats(self) -> dict[str, Any]: ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class WarmUpReport:
    seconds: float
    steps: int
    profile: dict[str, Any]  # the throwaway core's step profile (traffic included)
    cached_tokens: int  # prompt tokens that came from the prefix cache or a running row (the copy-in paths ran)


def exercise(core: _Core) -> WarmUpReport:
    """Run a small workload on ``core``, then shut it down: shared prefixes (cache hits and copies from running
    rows), prefill chunks at different offsets, decode, sampled rows with top-k/top-p and penalties, logprobs, a
    forked ``n = 2`` request and finished rows retiring mid-batch."""
    t0 = time.perf_counter()
    vocab = int(core.loaded.config.get("vocab_size") or 1000)
    span = max(8, min(vocab, 1000) - 8)

    def toks(seed: int, n: int) -> list[int]:
        return [4 + (seed * 131 + 17 * i) % span for i in range(n)]

    shared = toks(1, 48)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    rows = [
        (toks(4, 70), SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1, max_tokens=4, ignore_eos=True)),
        (shared + toks(5, 9), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)),
        (shared + toks(6, 20), SamplingParams(temperature=0.7, repetition_penalty=1.1, min_p=0.05, seed=2, n=2,
                                              max_tokens=3, ignore_eos=True)),
        (shared + toks(2, 5) + toks(7, 12), dataclasses.replace(greedy, max_tokens=2)),
    ]
    try:
        core.add_request(shared + toks(2, 5), greedy, cache_tokens=len(shared))
        core.add_request(toks(3, 30), greedy)
        steps = 0
        while core.has_unfinished and steps < 3:  # the shared prefix is cached before the rows that reuse it come
            core.step()
            steps += 1
        for prompt, params in rows:
            core.add_request(prompt, params)
        while core.has_unfinished:
            core.step()
            steps += 1
        stats = core.stats()
        return WarmUpReport(time.perf_counter() - t0, steps, stats["profile"],
                            int((stats["prefix_cache"] or {}).get("tokens_reused", 0)))
    finally:
        core.shutdown()
