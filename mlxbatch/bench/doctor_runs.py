"""The engine runs of ``mlxbatch doctor``: the engine against mlx-lm on the same prompts, and forced out-of-memory steps.

Owns what the doctor measures on the device (``doctor`` judges it). Both runs use a random-weight model built
locally (``tiny64`` on a CPU, ``small64`` on a GPU: head dim 64, MLX's fused attention on Metal and CUDA) and token-id
prompts from the bench's workloads, so nothing is downloaded:

- ``compare_with_mlx_lm``: one greedy run of the engine (its default configuration: the path a job takes on this
  device) and one of ``mlx_lm.batch_generate`` on the same prompts, EOS ignored, same concurrency. A warm-up of both
  (it compiles kernels), then a timed pass at the warm-up's size, sizes the main run to about ``RunSize.seconds``.
  Rows are compared on their first ``FIRST_TOKENS`` tokens and whole: in bfloat16 two correct paths part ways at a
  near-tie now and then, and a row differs from there on (the longer the row, the likelier).
- ``forced_oom``: the same rows with ``batch_invariant`` (each row's bits independent of its batch; where the device
  refuses it, without, and logprobs are compared within ``LOGPROB_TOLERANCE``), once unforced and once per forced
  failure: a step's launch fails for lack of memory, either at once (``MemoryError``, as CUDA and the CPU report it)
  or late, as Metal reports a failed allocation: the launch goes ahead and Metal's error comes at the next
  synchronisation or op. The engine must discard every step not read yet, shrink the batch, recompute the rows it
  dropped and give the unforced run's tokens. The failure is forced at the engine's device seam (``Traffic.fault``,
  where tests/engine/test_late_oom.py fails the device too; the failed step's results are left as they are, not made
  garbage as those tests make them); an engine without that seam makes this check say so instead of passing.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path

from mlxbatch.bench import workloads as wl
from mlxbatch.bench.harness import Bench, agreement, log
from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.errors import InvalidRequestError
from mlxbatch.types import SamplingParams

FIRST_TOKENS = 8
# a row recomputed in another batch without batch invariance: float32 GEMMs of other sizes round differently (~1e-6)
LOGPROB_TOLERANCE = 1e-3


@dataclass(frozen=True)
class RunSize:
    model: str  # a random_model shape (built once into the cache folder) or a model folder
    rows: int  # rows of the warm-up; the main run scales them towards ``seconds``
    min_len: int
    max_len: int
    max_tokens: int
    concurrency: int
    seconds: float  # about how long the main engine + mlx-lm runs take together (0: run the warm-up size)
    max_rows: int = 4096


def pick_size(on_gpu: bool, quick: bool, model: str | None = None) -> RunSize:
    """``quick``: a few seconds on a CPU (CI, the tests). Otherwise about 30 s: a larger model on a GPU."""
    if quick:
        return RunSize(model or "tiny64", 8, 16, 48, 8, 8, 0.0)
    if on_gpu:
        return RunSize(model or "small64", 64, 64, 512, 128, 128, 30.0)
    return RunSize(model or "tiny64", 32, 32, 256, 48, 32, 30.0)


@dataclass(frozen=True)
class Comparison:
    """The engine and mlx-lm's ``batch_generate`` on the same prompts (greedy, EOS ignored)."""

    model: str
    dtype: str
    rows: int
    prompt_tokens: int
    max_tokens: int
    concurrency: int
    engine_s: float
    engine_tokens: int
    mlx_lm_s: float
    mlx_lm_tokens: int
    same_rows: int  # rows whose generated tokens equal mlx-lm's
    same_first: int  # rows whose first FIRST_TOKENS generated tokens equal mlx-lm's
    kv_budget_bytes: int  # what the engine took for KV (its default share of the free memory)

    @property
    def engine_tps(self) -> float:
        return self.engine_tokens / self.engine_s

    @property
    def mlx_lm_tps(self) -> float:
        return self.mlx_lm_tokens / self.mlx_lm_s


@dataclass(frozen=True)
class ForcedOOM:
    rows: int
    failures: tuple[str, ...]  # the failure forced in each engine run, e.g. "launch 3 (prefill), late"
    equal_rows: tuple[int, ...]  # per forced run: rows whose tokens and logprobs equal the unforced run's
    preemptions: tuple[int, ...]  # per forced run: the engine's count (the failed step's shrink)
    problem: str = ""  # why the check could not run
    # rows ran batch-invariant (equal bits); else this device refused the flag (why: ``not_invariant``) and rows are
    # equal when their tokens are and their logprobs within ``LOGPROB_TOLERANCE``
    batch_invariant: bool = True
    not_invariant: str = ""


def open_bench(size: RunSize, cache_dir: Path, seed: int = 0) -> Bench:
    """The model loaded once (bfloat16 on a GPU, float32 on a CPU, as the bench) and a tokenizer without EOS."""
    return Bench(argparse.Namespace(model=size.model, dtype="auto", cache_dir=str(cache_dir),
                                    concurrency=size.concurrency, seed=seed))


def _prompts(b: Bench, size: RunSize, rows: int) -> wl.Workload:
    return b.workload("unique", rows, min_len=size.min_len, max_len=size.max_len, max_tokens=size.max_tokens)


def compare_with_mlx_lm(b: Bench, size: RunSize) -> Comparison:
    c, prefill = size.concurrency, min(8, size.concurrency)
    w = _prompts(b, size, size.rows)
    log(f"doctor: warm-up, {w.rows} rows of {size.min_len}-{size.max_len} tokens, {w.max_tokens} new each")
    b.run_b1(w, c, prefill)
    b.run_engine(w, max_num_seqs=c)
    if size.seconds > 0:  # timed once warm (the warm-up compiles); the cost grows about linearly in rows from here
        t0 = time.perf_counter()
        b.run_b1(w, c, prefill)
        b.run_engine(w, max_num_seqs=c)
        pass_s = time.perf_counter() - t0
        rows = int(min(size.max_rows, max(size.rows, size.rows * size.seconds / max(pass_s, 1e-3))))
        w = _prompts(b, size, rows)
    log(f"doctor: {w.rows} rows through mlx-lm's batch_generate, then the engine")
    ref = b.run_b1(w, c, prefill, name="mlx-lm")
    eng = b.run_engine(w, max_num_seqs=c)
    same, _ = agreement(eng.tokens, ref.tokens, w.max_tokens)
    first, _ = agreement(eng.tokens, ref.tokens, FIRST_TOKENS)
    return Comparison(b.args.model, b.loaded.dtype, w.rows, w.prompt_tokens, w.max_tokens, c, eng.wall_s,
                      eng.gen_tokens, ref.wall_s, ref.gen_tokens, same, first, int(eng.extra["kv_budget_bytes"]))


METAL_OOM = "[metal::malloc] Attempting to allocate more memory than is available (forced by mlxbatch doctor)"
_STEP_LAUNCHES = ("prefill", "decode")  # ``Traffic.fault``'s events that enqueue a step's work


class ForcedFailure:
    """A ``Traffic.fault``: the ``at``-th launch fails for lack of memory, at once (``MemoryError``) or ``late``: the
    launch goes ahead and Metal's error is raised at the next device call of any kind (a synchronisation, a read, an
    evaluation or a launch), as Metal reports a failed allocation. ``forced``: what failed, once it did."""

    def __init__(self, at: int, late: bool) -> None:
        self.at, self.late = at, late
        self.launches = 0
        self.armed = False
        self.forced = ""

    def __call__(self, event: str, arrays: object) -> None:
        if self.armed:
            self.armed = False
            raise RuntimeError(METAL_OOM)
        if event not in _STEP_LAUNCHES or self.forced:
            return
        self.launches += 1
        if self.launches != self.at:
            return
        self.forced = f"launch {self.at} ({event}), {'late' if self.late else 'at once'}"
        if self.late:
            self.armed = True
        else:
            raise MemoryError("forced by mlxbatch doctor")


def _greedy_bits(b: Bench, prompts: list[list[int]], params: SamplingParams, failure: ForcedFailure | None,
                 invariant: bool) -> tuple[list[tuple], int] | None:
    """Each row's tokens and logprobs and the engine's preemptions (None: the engine has no ``Traffic.fault`` seam,
    or the failure was never forced). ``invariant``: the engine runs ``batch_invariant`` (InvalidRequestError where
    this device cannot hold it)."""
    engine = Engine(b.loaded, EngineConfig(warm_up=False, batch_invariant=invariant, max_num_seqs=4, seed=0))
    try:
        if failure is not None:
            traffic = getattr(getattr(engine.core, "runner", None), "traffic", None)
            if not hasattr(traffic, "fault"):
                return None
            traffic.fault = failure
        outs = engine.generate(prompts, params)
        if failure is not None and not failure.forced:
            return None
        preemptions = int(engine.stats()["preemptions"])
    finally:
        engine.close()
    return [(o.token_ids, tuple(lp.logprob for lp in o.logprobs or ())) for o in outs], preemptions


def _same(a: tuple, b: tuple, exact: bool) -> bool:
    """Two rows' (tokens, logprobs) equal: bit for bit, or the same tokens with logprobs within the tolerance."""
    if exact or a[0] != b[0]:
        return a == b
    return len(a[1]) == len(b[1]) and all(abs(x - y) <= LOGPROB_TOLERANCE for x, y in zip(a[1], b[1]))


def forced_oom(b: Bench, rows: int = 12, fail_at: tuple[int, ...] = (3, 9)) -> ForcedOOM:
    """``rows`` greedy rows, four at a time: unforced, then with launch 3 (prefills in flight) and 9 (decodes) failing
    for lack of memory, each at once and late (one run each). Equal tokens and logprobs are what the engine promises
    (README: batch invariance). Where this device cannot hold batch invariance (a CPU whose OpenBLAS kernel rounds a
    row by the rows beside it), the runs go without it: the same tokens, logprobs within ``LOGPROB_TOLERANCE``."""
    rng = random.Random(7)
    prompts = [b.vocab.draw(rng, rng.randint(16, 64)) for _ in range(rows)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    log(f"doctor: {rows} rows unforced, then with step launch {' / '.join(map(str, fail_at))} out of memory, at once "
        "and reported late")
    invariant, why = True, ""
    try:
        ref = _greedy_bits(b, prompts, params, None, invariant)
    except InvalidRequestError as exc:
        if exc.field != "batch_invariant":
            raise
        invariant, why = False, exc.reason
        ref = _greedy_bits(b, prompts, params, None, invariant)
    assert ref is not None
    failures, equal, preempted = [], [], []
    for at in fail_at:
        for late in (False, True):
            failure = ForcedFailure(at, late)
            got = _greedy_bits(b, prompts, params, failure, invariant)
            if got is None:
                return ForcedOOM(rows, tuple(failures), (), (), "no failure could be forced: the engine's runner has "
                                 f"no Traffic.fault seam, or the run had fewer than {at} step launches "
                                 "(mlxbatch/bench/doctor_runs.py needs updating to the engine)", invariant, why)
            failures.append(failure.forced)
            equal.append(sum(_same(x, y, invariant) for x, y in zip(got[0], ref[0])))
            preempted.append(got[1])
    return ForcedOOM(rows, tuple(failures), tuple(equal), tuple(preempted), "", invariant, why)
