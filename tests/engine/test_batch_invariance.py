"""Same row, same bits: with ``batch_invariant`` a row's tokens and logprobs do not depend on its batch (issue #13).

Every comparison is bitwise (token ids, and the logprob of each chosen token and of its top alternatives). Rows
mix greedy and seeded sampled ones. The tiny random model runs in float32 (OpenBLAS: the case that breaks without the
flag) and bfloat16; SmolLM2 (real weights) in float32.
"""

from __future__ import annotations

import os
import platform
import random
import subprocess
import sys
from pathlib import Path

import pytest

from mlxbatch.engine import Engine, EngineConfig, ModelSpec, load_model
from mlxbatch.engine.invariant.shapes import Shapes
from mlxbatch.engine.invariant.slots import grouped_order
from mlxbatch.errors import InvalidRequestError
from mlxbatch.types import SamplingParams


def _cpu_flags() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.read_text() if cpuinfo.exists() else ""


def rows(n: int, seed: int = 0, shared: int = 0, vocab: int = 1000) -> list[list[int]]:
    """Random token prompts of 4-300 tokens; every third one starts with a common prefix of ``shared`` tokens."""
    rng = random.Random(seed)
    common = [rng.randrange(10, vocab) for _ in range(shared)]
    out = []
    for i in range(n):
        tail = [rng.randrange(10, vocab) for _ in range(rng.randint(4, 300))]
        out.append(common + tail if shared and i % 3 == 0 else tail)
    return out


def params(n: int, max_tokens: int = 10) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=1000 + i, max_tokens=max_tokens, logprobs=2,
                           ignore_eos=True) for i in range(n)]


def bits(outs) -> list[tuple]:
    return [(o.token_ids, tuple((lp.logprob, lp.top) for lp in o.completions[0].logprobs)) for o in outs]


def generate(loaded, prompts, ps, **config) -> list[tuple]:
    config = {"warm_up": False, "batch_invariant": True, **config}
    with Engine(loaded, EngineConfig(**config)) as eng:
        return bits(eng.generate(prompts, ps))


@pytest.fixture(scope="module")
def tiny_bf16(tiny_model_path):
    return load_model(ModelSpec(str(tiny_model_path), "bfloat16"))


# -- the shape rules ---------------------------------------------------------------------------------------------

def test_key_widths_and_row_spans():
    s = Shapes(16, 19, 2, 2, exact=False)
    assert [s.kv_width(n) for n in (1, 256, 257, 1000, 1025, 1537, 2049, 5000)] == \
        [256, 256, 512, 1024, 1536, 2048, 3072, 6144]
    assert s.spans(range(3, 7), 19) == [(3, 22)]  # at least the floor
    assert s.spans([0, 1, 40, 41], 19) == [(0, 19), (40, 59)]  # members far apart: two forwards, gap not run
    exact = Shapes(64, 8, 4, 8, exact=True)
    assert exact.spans(range(0, 20), 8) == [(0, 8), (8, 16), (16, 24)]  # every forward exactly 8 rows
    assert exact.spans([0, 30], 8) == [(0, 8), (30, 38)]


def test_scheduler_aligns_chunks_and_reuse_to_the_slice_and_prefills_prompts_only():
    from mlxbatch.engine.decoding.detok import TextTracker
    from mlxbatch.engine.request import Request
    from mlxbatch.engine.sched.prefix import CachedBlocks, RunningRow
    from mlxbatch.engine.sched.scheduler import Scheduler, SchedulerConfig

    def req(rid: str, n: int) -> Request:
        return Request(rid, rid, 0, list(range(1, n + 1)), SamplingParams(max_tokens=4), 0, frozenset({0}), 4096,
                       TextTracker(None, incremental=False))

    s = Scheduler(SchedulerConfig(max_num_batched_tokens=70, prefill_chunk_size=50, invariant_slice=16),
                  lambda lengths: 0)
    for rid in ("a", "b"):
        s.add(req(rid, 60))
    out = s.schedule()  # budget 70: a gets 48 (50 rounded down to whole slices), b the rest, at least one slice
    assert [(c.request.request_id, c.start, c.end, c.last) for c in out.prefills] == [("a", 0, 48, False),
                                                                                      ("b", 0, 16, False)]
    s.finish_step(out)
    out = s.schedule()
    assert [(c.request.request_id, c.start, c.end, c.last) for c in out.prefills] == [("a", 48, 60, True),
                                                                                      ("b", 16, 60, True)]
    r = req("c", 40)
    r.output_token_ids = [5, 6, 7]  # a preempted sequence: its prefill stops at the prompt (decode replays the rest)
    assert s._chunk(r, 1000).end == 40 and s._chunk(r, 1000).last
    # reused prefixes: whole slices, and never the whole prompt
    assert s._aligned(RunningRow("a", 37), r) == RunningRow("a", 32)
    assert s._aligned(RunningRow("a", 40), r) == RunningRow("a", 32)
    assert s._aligned(RunningRow("a", 12), r) is None
    s.prefix = type("P", (), {"block_size": 16})()
    assert s._aligned(CachedBlocks((1, 2), 32), r) == CachedBlocks((1, 2), 32)


def test_the_engine_refuses_shapes_its_kernels_do_not_honour(tiny_loaded):
    """The start-up check (invariant.shapes.check_rows) catches a model or head whose rows depend on the batch (as
    OpenBLAS's small-matrix kernel, or its Haswell/Zen kernels at any size, make them)."""
    from mlxbatch.engine.invariant.shapes import check_rows
    from mlxbatch.engine.model.split import split_model

    split = split_model(tiny_loaded.model)
    assert check_rows(split.body, split.head, Shapes(16, 19, 2, 19, exact=False)) is None  # 19 x 64 > 1200

    def mixing(x):  # each row's output moves with the batch's mean
        h = split.body(x)
        return h + 1e-3 * h.mean(axis=0, keepdims=True)

    assert "other bits" in check_rows(mixing, split.head, Shapes(16, 19, 2, 19, exact=False))
    assert "LM head" in check_rows(split.body, lambda h: mixing_head(split.head, h), Shapes(16, 19, 2, 19, False))


def mixing_head(head, h):
    out = head(h)
    return out + 1e-3 * out.mean(axis=0, keepdims=True)


def test_grouped_order_moves_only_misplaced_rows():
    ids = ["a", "b", "c", "d", "e"]
    key = {"a": 1, "b": 0, "c": 1, "d": 0, "e": 1}.__getitem__
    out = grouped_order(ids, key)
    assert [key(r) for r in out] == [0, 0, 1, 1, 1] and sorted(out) == ids
    assert out[1] == "b" and out[2] == "c" and out[4] == "e"  # already inside their block: not moved


# -- a row alone, in a batch, shuffled, with other max_num_seqs ---------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_row_alone_equals_row_in_any_batch(tiny_loaded, tiny_bf16, dtype):
    # 32 rows (64 before, half the time): without the flag the chunked run gives float32 rows other bits at both sizes
    loaded = tiny_loaded if dtype == "float32" else tiny_bf16
    n = 32
    prompts, ps = rows(n, seed=1, shared=120), params(n, max_tokens=10 if dtype == "float32" else 5)
    batch = generate(loaded, prompts, ps, max_num_seqs=n)
    order = random.Random(2).sample(range(n), n)
    shuffled = generate(loaded, [prompts[i] for i in order], [ps[i] for i in order], max_num_seqs=n)
    assert [shuffled[order.index(i)] for i in range(n)] == batch
    assert generate(loaded, prompts, ps, max_num_seqs=4) == batch
    assert generate(loaded, prompts, ps, max_num_seqs=n, max_num_batched_tokens=96, prefill_chunk_size=40) == batch
    for i in (0, 5, 20, 31) if dtype == "float32" else (5, 31):  # a row alone, and among 31 random others
        assert generate(loaded, [prompts[i]], [ps[i]], max_num_seqs=1) == [batch[i]], i


def test_exact_row_tiles_as_on_a_gpu(tiny_loaded, monkeypatch):
    """The GPU policy (every forward exactly so many rows; 64-token slices, so cached blocks are reused four at a
    time), run on the CPU: rows alone, batched over several decode tiles, and after cache hits agree bitwise."""
    from mlxbatch.engine.invariant.slots import InvariantSlots

    monkeypatch.setenv("MLXBATCH_INVARIANT_SHAPES", "slice=64,decode=12,prefill=3,head=12,exact=1")
    shapes, real = set(), InvariantSlots.forward_fixed

    def recorded(self, model, start, tokens, offsets, kv_width):
        shapes.add((len(tokens), len(tokens[0])))
        return real(self, model, start, tokens, offsets, kv_width)

    monkeypatch.setattr(InvariantSlots, "forward_fixed", recorded)
    prompts, ps = rows(30, seed=8, shared=150), params(30, max_tokens=6)
    batch = generate(tiny_loaded, prompts, ps, max_num_seqs=30)
    assert shapes == {(12, 1), (3, 64)}  # every decode forward 12 rows, every prefill forward 3 slices of 64
    assert generate(tiny_loaded, prompts, ps, max_num_seqs=5, prefix_cache=False) == batch
    for i in (0, 7):
        assert generate(tiny_loaded, [prompts[i]], [ps[i]], max_num_seqs=1) == [batch[i]], i


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_row_alone_equals_row_in_a_batch(dtype):
    from mlxbatch.models.smollm2 import ensure_smollm2

    loaded = load_model(ModelSpec(str(ensure_smollm2()), dtype))
    small = dtype == "bfloat16"  # bfloat16 matmuls are slow on the CPU
    n = 2 if small else 6
    # float32: 32-token prompts, every third one starting with the same 24 (a reused slice and a half)
    prompts = [p[: 12 if small else 32] for p in rows(n, seed=3, shared=8 if small else 24, vocab=4000)]
    ps = params(n, max_tokens=2 if small else 4)
    batch = generate(loaded, prompts, ps, max_num_seqs=n)
    # reversed, n // 2 rows at a time (bfloat16: one, so each row runs alone)
    assert generate(loaded, prompts[::-1], ps[::-1], max_num_seqs=n // 2) == batch[::-1]
    if not small:  # two rows alone, one after the other in one engine (neither shares a prefix with the other)
        alone = [0, n - 2]
        assert generate(loaded, [prompts[i] for i in alone], [ps[i] for i in alone], max_num_seqs=1) == \
            [batch[i] for i in alone]


# -- prefix cache hit vs cold --------------------------------------------------------------------------------------

@pytest.mark.parametrize("shared", [203, 1530])
def test_cache_hit_equals_cold_computation(tiny_loaded, shared):
    """Rows reuse a shared prefix (cached blocks, or a running row's KV) and compute the rest: bitwise what each row
    computes alone with no cache. 1530 shared tokens: a prefix reused to the token would put positions 1530-1535 in
    a slice whose key width is 2048 (OpenBLAS's large kernels) where a cold run reads 1536 keys (small kernels)."""
    rng = random.Random(4)
    prefix = [rng.randrange(10, 1000) for _ in range(shared)]  # not a multiple of the block or the slice
    prompts = [prefix + [rng.randrange(10, 1000) for _ in range(rng.randint(1, 60))] for _ in range(8)]
    ps = params(8, max_tokens=6)
    cold = [generate(tiny_loaded, [p], [q], prefix_cache=False)[0] for p, q in zip(prompts, ps)]
    with Engine(tiny_loaded, EngineConfig(warm_up=False, batch_invariant=True, max_num_seqs=4)) as eng:
        hot = bits(eng.generate(prompts, ps))
        reuse = eng.stats()["prefix_cache"]
    assert reuse["tokens_reused"] > 6 * (shared - 16)  # whole slices of the shared prefix were not recomputed
    assert hot == cold
    # a finished row's blocks reused later (a pure cache hit: nothing runs beside it); no plan, every block kept
    with Engine(tiny_loaded, EngineConfig(warm_up=False, batch_invariant=True)) as eng:
        eng.core.add_request(prompts[0], ps[0])
        eng.core.run_until_done()
        eng.core.add_request(prompts[1], ps[1])
        later = bits(eng.core.run_until_done())
        assert eng.stats()["prefix_cache"]["tokens_reused"] >= 192
    assert later == cold[1:2]


def test_scores_alone_equal_scores_in_a_batch(tiny_loaded):
    """Scoring rows (log-likelihood of candidates) run through the same fixed shapes."""
    rng = random.Random(7)
    items = [([rng.randrange(10, 1000) for _ in range(rng.randint(5, 90))],
              [[rng.randrange(10, 1000) for _ in range(rng.randint(1, 20))] for _ in range(3)]) for _ in range(6)]

    def scores(batch, **config):
        with Engine(tiny_loaded, EngineConfig(warm_up=False, batch_invariant=True, **config)) as eng:
            return [[tuple(lp.logprob for lp in c.logprobs) for c in o.completions] for o in eng.score(batch)]

    together = scores(items, max_num_seqs=16)
    assert [scores([it], max_num_seqs=1)[0] for it in items[:3]] == together[:3]


def test_constrained_rows_alone_equal_constrained_rows_in_a_batch(tiny_loaded):
    from mlxbatch.types import OutputConstraint

    prompts = rows(8, seed=9)
    ps = [SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i, max_tokens=12, logprobs=1,
                         constraint=OutputConstraint.regex("[a-z]{2,8}( [a-z]{2,8})?")) for i in range(8)]
    batch = generate(tiny_loaded, prompts, ps, max_num_seqs=8)
    assert [generate(tiny_loaded, [prompts[i]], [ps[i]], max_num_seqs=1)[0] for i in (0, 3)] == [batch[0], batch[3]]


# -- preemption ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fail_at", [3, 9])
def test_preempted_rows_recompute_the_same_bits(tiny_loaded, fail_at, fail_launch_at):
    """An out-of-memory step sends the newest rows back; their prompt is prefilled again and their generated tokens
    are replayed by decode steps, so every later token and logprob is unchanged."""
    prompts, ps = rows(10, seed=5), params(10, max_tokens=16)
    expected = generate(tiny_loaded, prompts, ps, max_num_seqs=10)
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False, batch_invariant=True, max_num_seqs=10))
    fail_launch_at(eng.core.runner, fail_at)
    try:
        got = bits(eng.generate(prompts, ps))
    finally:
        eng.close()
    assert eng.core.scheduler.num_preemptions == 1
    assert got == expected


# -- what holds without the flag (README: "Batch invariance") ------------------------------------------------------

def test_without_the_flag_a_rerun_is_identical_but_a_row_moves_with_its_batch(tiny_loaded, tiny_bf16):
    import mlx.core as mx

    prompts, ps = rows(24, seed=6), params(24)
    default = dict(batch_invariant=False, max_num_seqs=24)
    batch = generate(tiny_loaded, prompts, ps, **default)
    assert generate(tiny_loaded, prompts, ps, **default) == batch  # same input, same settings: same bits
    alone = [generate(tiny_loaded, [p], [q], **default)[0] for p, q in zip(prompts[:6], ps[:6])]
    if _rows_move(mx.float32):  # whether they do depends on the float32 kernel (no guarantee without the flag)
        assert alone != batch[:6]  # logprobs move with the batch
    if mx.default_device() != mx.cpu:
        return
    # bfloat16 on CPU: MLX's own kernels reduce in a fixed order, so rows happen not to move (measured, not promised)
    batch16 = generate(tiny_bf16, prompts, ps, **default)
    assert [generate(tiny_bf16, [p], [q], **default)[0] for p, q in zip(prompts[:6], ps[:6])] == batch16[:6]


def _rows_move(dtype) -> bool:
    """Whether this device's matmul gives a row other bits alone than among other rows (the tiny model's widths)."""
    import mlx.core as mx

    x = mx.random.normal((24, 128), key=mx.random.key(0)).astype(dtype)
    w = mx.random.normal((128, 1024), key=mx.random.key(1)).astype(dtype)
    return not mx.array_equal((x @ w)[:1], x[:1] @ w).item()


def test_flag_is_refused_for_vision_language_models(tiny_vlm_loaded):
    with pytest.raises(InvalidRequestError, match="batch_invariant"):
        Engine(tiny_vlm_loaded, EngineConfig(warm_up=False, batch_invariant=True))


def test_gpu_warm_up_fits_batch_invariant_rows(tiny_loaded, monkeypatch, caplog):
    """The warm-up a GPU engine takes at construction (run here on the CPU with the GPU's exact row tiles): its budget
    holds several rows as batch-invariant forwards charge them (their padding rows too), so no warm-up request runs
    alone with a warning (the H200 run logged one per warm-up request)."""
    import logging

    from mlxbatch.engine import EngineCore

    monkeypatch.setenv("MLXBATCH_INVARIANT_SHAPES", "slice=64,decode=64,prefill=8,head=64,exact=1")
    core = EngineCore(tiny_loaded, EngineConfig(batch_invariant=True, warm_up=False))
    with caplog.at_level(logging.WARNING, logger="mlxbatch"):
        report = core.warm_up_paths()
    assert report.steps > 3
    assert not [r for r in caplog.records if "running it alone" in r.getMessage()]


_START = """
import mlxbatch
from mlxbatch.engine import Engine, EngineConfig, ModelSpec, load_model
from mlxbatch.errors import InvalidRequestError
try:
    Engine(load_model(ModelSpec({path!r})), EngineConfig(batch_invariant=True, warm_up=False)).close()
    print("started")
except InvalidRequestError as e:
    print("refused:", e)
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or "avx2" not in _cpu_flags(),
                    reason="OpenBLAS's Haswell kernel needs an x86-64 CPU with AVX2")
def test_the_refusal_names_a_kernel_that_passes_and_that_kernel_does(tiny_model_path):
    """OpenBLAS's Haswell kernel (the default on AVX2 CPUs without AVX-512) fails the start-up check; the refusal
    names OPENBLAS_CORETYPE=Nehalem, and an engine started with it passes the check."""
    def start(core_type: str) -> str:
        env = {**os.environ, "OPENBLAS_CORETYPE": core_type}
        res = subprocess.run([sys.executable, "-c", _START.format(path=str(tiny_model_path))], env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        return res.stdout

    refused = start("Haswell")
    assert "refused:" in refused and "OPENBLAS_CORETYPE=Nehalem" in refused, refused
    assert "started" in start("Nehalem")
