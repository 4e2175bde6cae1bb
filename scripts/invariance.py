"""What batch invariance costs and what it buys: ``EngineConfig(batch_invariant=True)`` against the same engine without.

Two measurements on one model (a random-weight shape from ``mlxbatch.models.random_model`` or a model folder):
- **throughput**: the same workload through ``Engine.generate`` with and without the flag, runs interleaved
  (A B A B ...), median wall time of each; the cost is ``flag wall / default wall - 1``;
- **agreement**: every row's generated tokens and logprobs against the same row run alone (a fresh engine, one
  row), bitwise; with the flag every row must agree, without it the figure says how often rows move today.

Workloads (token ids, the shapes of ``scripts/bench_workloads.py``, drawn here so this script stands alone):
``label`` = one 800-token instruction + a 60-150-token item per row, 32 new tokens; ``unique`` = unrelated prompts
of 32-512 tokens, 64 new tokens. Rows are greedy except every fourth (temperature 0.8, seeded), all with logprobs.

    .venv/bin/python scripts/invariance.py --model tiny --workload label --workload unique --rows 64
    .venv/bin/python scripts/invariance.py --model 0.5b --dtype bfloat16 --rows 256 --json out.json   # H200

``run(...)`` is the same as a function (returns a dict), for other harnesses.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlxbatch  # noqa: F401  (OpenBLAS before mlx)
from mlxbatch.engine import Engine, EngineConfig, ModelSpec, load_model
from mlxbatch.types import SamplingParams

CACHE = Path.home() / ".cache" / "mlxbatch" / "bench"


def workload(name: str, rows: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], int]:
    """(prompts, max_tokens) of a workload; ids drawn from [16, vocab) (the random models' specials are below)."""
    rng = random.Random(f"{name}-{seed}")

    def draw(n: int) -> list[int]:
        return [rng.randrange(16, vocab) for _ in range(n)]

    if name == "label":
        prefix = draw(800)
        prompts = [prefix + draw(rng.randint(60, 150)) for _ in range(rows)]
        rng.shuffle(prompts)
        return prompts, 32
    if name == "unique":
        return [draw(rng.randint(32, 512)) for _ in range(rows)], 64
    raise SystemExit(f"unknown workload {name!r} (label, unique)")


def params_for(rows: int, max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.8 if i % 4 == 3 else 0.0, seed=i, max_tokens=max_tokens, logprobs=1,
                           ignore_eos=True) for i in range(rows)]


def _generate(loaded: Any, prompts: list[list[int]], params: list[SamplingParams], flag: bool,
              **config: Any) -> tuple[tuple[float, float], list[tuple]]:
    """((wall seconds, CPU seconds of this process), each row's (token ids, logprobs))."""
    engine = Engine(loaded, EngineConfig(seed=0, batch_invariant=flag, **config))
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.generate(prompts, params)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        engine.close()
    return (wall, cpu), [(o.completions[0].token_ids, tuple(lp.logprob for lp in o.completions[0].logprobs))
                  for o in outs]


def run(loaded: Any, workloads: list[str], rows: int, repeats: int = 3, solo_rows: int | None = None,
        max_num_seqs: int = 32) -> dict[str, Any]:
    """Throughput of the flag against the default engine, and every row's agreement with its solo run."""
    vocab = min(loaded.config.get("vocab_size", 1024), 32000)
    report: dict[str, Any] = {}
    for name in workloads:
        prompts, max_tokens = workload(name, rows, vocab)
        params = params_for(rows, max_tokens)
        _generate(loaded, prompts[:4], params[:4], True, max_num_seqs=max_num_seqs)  # warm-up, both paths
        _generate(loaded, prompts[:4], params[:4], False, max_num_seqs=max_num_seqs)
        walls: dict[bool, list[float]] = {False: [], True: []}
        cpus: dict[bool, list[float]] = {False: [], True: []}
        results: dict[bool, list[tuple]] = {}
        for _ in range(repeats):
            for flag in (False, True):
                (wall, cpu), res = _generate(loaded, prompts, params, flag, max_num_seqs=max_num_seqs)
                walls[flag].append(wall)
                cpus[flag].append(cpu)
                results[flag] = res
        n_solo = rows if solo_rows is None else min(rows, solo_rows)
        agree: dict[bool, int] = {}
        for flag in (False, True):
            same = 0
            for i in range(n_solo):
                _, solo = _generate(loaded, [prompts[i]], [params[i]], flag, max_num_seqs=max_num_seqs)
                same += solo[0] == results[flag][i]
            agree[flag] = same
        tokens = rows * max_tokens
        base, inv = statistics.median(walls[False]), statistics.median(walls[True])
        report[name] = {
            "rows": rows, "new_tokens": tokens, "repeats": repeats,
            "default_wall_s": round(base, 3), "invariant_wall_s": round(inv, 3),
            "default_tok_s": round(tokens / base, 1), "invariant_tok_s": round(tokens / inv, 1),
            "cost": round(inv / base - 1, 4),  # medians
            "cost_best": round(min(walls[True]) / min(walls[False]) - 1, 4),  # fastest runs (a busy machine)
            # CPU seconds of this process (steadier than wall time when other work shares the machine)
            "cost_cpu": round(statistics.median(cpus[True]) / statistics.median(cpus[False]) - 1, 4),
            "solo_rows": n_solo, "agree_default": agree[False], "agree_invariant": agree[True],
            "same_tokens_default_vs_invariant": sum(a[0] == b[0] for a, b in zip(results[False], results[True])),
        }
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny|small|0.5b (random-weight qwen2) or a model folder")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--workload", action="append", help="label and/or unique (default both)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--solo-rows", type=int, default=None, help="rows compared with their solo run (default all)")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--json", help="also write the report here")
    a = ap.parse_args(argv)
    path = a.model
    if a.model in ("tiny", "small", "0.5b"):
        from mlxbatch.models.random_model import build_random_model

        path = str(build_random_model(CACHE / a.model, a.model))
    loaded = load_model(ModelSpec(path, a.dtype))
    started = time.perf_counter()
    report = run(loaded, a.workload or ["label", "unique"], a.rows, a.repeats, a.solo_rows, a.max_num_seqs)
    import mlx.core as mx  # after mlxbatch (OpenBLAS)

    device = "cpu" if mx.default_device() == mx.cpu else "gpu"
    print(f"## batch invariance: {a.model} ({loaded.dtype}, {device}), max_num_seqs {a.max_num_seqs}, "
          f"median of {a.repeats}\n")
    print("| workload | rows | default tok/s | invariant tok/s | cost (median) | cost (fastest) | cost (CPU s) | "
          "solo agreement default | solo agreement invariant | same tokens default vs invariant |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in report.items():
        print(f"| {name} | {r['rows']} | {r['default_tok_s']} | {r['invariant_tok_s']} | {r['cost']:+.1%} | "
              f"{r['cost_best']:+.1%} | {r['cost_cpu']:+.1%} | "
              f"{r['agree_default']}/{r['solo_rows']} | {r['agree_invariant']}/{r['solo_rows']} | "
              f"{r['same_tokens_default_vs_invariant']}/{r['rows']} |")
    print(f"\n(total {time.perf_counter() - started:.0f} s; agreement = generated tokens and logprobs bitwise equal to "
          "the row run alone)")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "dtype": loaded.dtype, "device": device,
                                            "report": report}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
