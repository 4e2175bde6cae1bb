"""Task sections of the benchmark: n > 1 samples from one prefill, and log-likelihood scoring.

    .venv/bin/mlxbatch bench nsample --model tiny
    .venv/bin/mlxbatch bench score --model tiny

``nsample``: R prompts with n=8 samples each (one request per prompt) vs the same prompts submitted as 8 separate
rows (8R requests), prefix cache off for both, then the separate rows with the prefix cache on; prefill work is
the engine's computed prefill tokens. ``score``: multiple-choice rows (a few-shot context shared by all rows,
a question, 4 candidates of 1-6 tokens, then 4 one-token ones) scored by ``Engine.score`` vs the direct way
without an engine (one full forward of context + candidate at a time, log-softmax, gather: what an mlx-lm loop
does).
"""

from __future__ import annotations

import random
import time

import mlx.core as mx

from mlxbatch.bench import workloads as wl
from mlxbatch.bench.harness import Bench, Table, log, ratio, section
from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.types import SamplingParams


def _engine_run(b: Bench, submit, **config) -> tuple[float, dict]:
    eng = Engine(b.loaded, EngineConfig(seed=0, **config))
    try:
        t0 = time.perf_counter()
        submit(eng)
        wall = time.perf_counter() - t0
        return wall, eng.stats()
    finally:
        eng.close()


@section("nsample")
def nsample_section(b: Bench) -> list[Table]:
    a = b.args
    rows = a.rows or (64 if b.on_gpu else 16)
    n, new = 8, a.max_tokens or 32
    rng = random.Random(a.seed)
    prompts = [b.vocab.draw(rng, rng.randint(128, 512)) for _ in range(rows)]
    C = b.concurrency
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=new, ignore_eos=True, seed=1)
    paths = {
        "n=8 (one request per prompt)": lambda e: e.generate(prompts, SamplingParams(
            temperature=0.8, top_p=0.95, max_tokens=new, ignore_eos=True, seed=1, n=n)),
        "8 separate rows, cache off": lambda e: e.generate([p for p in prompts for _ in range(n)], sampled),
        "8 separate rows, cache on": lambda e: e.generate([p for p in prompts for _ in range(n)], sampled),
    }
    _engine_run(b, lambda e: e.generate(prompts[:2], sampled), max_num_seqs=C)  # warm-up
    res = {}
    for name, fn in paths.items():
        walls, stats = [], None
        for _ in range(a.repeats):
            w, stats = _engine_run(b, fn, max_num_seqs=C, prefix_cache=name.endswith("cache on"))
            walls.append(w)
            log(f"  {name}: {w:.2f} s")
        res[name] = (sorted(walls)[len(walls) // 2], stats["profile"]["prefill_tokens"])
    base_wall, base_prefill = res["8 separate rows, cache off"]
    tab = Table(f"n={n} samples from one prefill: {rows} prompts of 128-512 tokens, {new} new tokens each, "
                f"concurrency {C}",
                ["path", "sequences", "wall s", "samples/s", "x separate", "prefill tok", "prefill x separate"])
    for name, (wall, pre) in res.items():
        tab.rows.append([name, rows * n, wall, rows * n / wall, ratio(base_wall, wall), pre, ratio(pre, base_prefill)])
    tab.notes.append(f"median of {a.repeats} run(s); target: n=8 prefill work <= 0.3x of 8 separate rows'.")
    return [tab]


def _direct_scores(b: Bench, items) -> list[list[float]]:
    out = []
    for ctx, cands in items:
        row = []
        for cand in cands:
            logits = b.model(mx.array([ctx + cand]))[0].astype(mx.float32)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            pos = mx.arange(len(ctx) - 1, len(ctx) + len(cand) - 1)
            row.append(mx.sum(lp[pos, mx.array(cand)]).item())
        out.append(row)
    return out


@section("score")
def score_section(b: Bench) -> list[Table]:
    a = b.args
    rows = a.rows or (256 if b.on_gpu else 48)
    rng = random.Random(a.seed)
    shots = b.vocab.draw(rng, 400)  # a few-shot context every row shares
    contexts = [shots + b.vocab.draw(rng, rng.randint(20, 60)) for _ in range(rows)]
    forms = {  # candidates of several tokens: one sequence each; one-token candidates (letters): one per row
        "4 candidates of 1-6 tokens": [(c, [b.vocab.draw(rng, rng.randint(1, 6)) for _ in range(4)]) for c in contexts],
        "4 one-token candidates": [(c, [b.vocab.draw(rng, 1) for _ in range(4)]) for c in contexts],
    }
    return [_score_table(b, rows, form, items) for form, items in forms.items()]


def _score_table(b: Bench, rows: int, form: str, items) -> Table:
    a, C = b.args, b.concurrency
    _direct_scores(b, items[:2])
    t0 = time.perf_counter()
    ref = _direct_scores(b, items)
    direct = time.perf_counter() - t0
    log(f"  {form}, direct: {direct:.2f} s")
    _engine_run(b, lambda e: e.score(items[:2]), max_num_seqs=C)
    results = {}
    for cache in (True, False):
        walls, stats, outs = [], None, None
        for _ in range(a.repeats):
            box = {}
            w, stats = _engine_run(b, lambda e, box=box: box.setdefault("o", e.score(items)), max_num_seqs=C,
                                   prefix_cache=cache)
            walls.append(w)
            outs = box["o"]
            log(f"  {form}, engine cache={'on' if cache else 'off'}: {w:.2f} s")
        err = max(abs(c.cumulative_logprob - r) for o, rr in zip(outs, ref) for c, r in zip(o.completions, rr))
        results[cache] = (sorted(walls)[len(walls) // 2], stats["profile"]["prefill_tokens"], err)
    total = sum(len(c) + len(x) for c, xs in items for x in xs)
    tab = Table(f"log-likelihood scoring: {rows} rows, a 400-token context shared by all, {form}",
                ["path", "wall s", "rows/s", "x direct", "prefill tok", "max |diff| vs direct"])
    tab.rows.append(["direct (one forward per candidate)", direct, rows / direct, 1.0, total, 0.0])
    for cache, (wall, pre, err) in results.items():
        tab.rows.append([f"Engine.score, cache {'on' if cache else 'off'}", wall, rows / wall, ratio(direct, wall),
                         pre, err])
    one_token = all(len(x) == 1 for _, xs in items for x in xs)
    seqs = [c for c, _ in items] if one_token else [c + x for c, xs in items for x in xs]
    alone = " (the contexts alone: one-token candidates need no more)" if one_token else ""
    tab.notes.append(f"median of {a.repeats} engine run(s), direct run once; floor of distinct tokens "
                     f"{wl.distinct_trie_tokens(seqs)}{alone}.")
    return tab
