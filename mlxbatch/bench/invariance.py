"""``mlxbatch bench invariance``: what ``EngineConfig(batch_invariant=True)`` costs and what it buys.

    mlxbatch bench invariance --model tiny --rows 64                        # ~1-2 min on 2 CPU cores
    python3 -m mlxbatch.bench invariance --model 0.5b --rows 256 --json out.json   # the GPU machine (bf16)

Two measurements on one model, per workload (``--workloads``: the bench's ``label`` and ``unique``):
- **throughput**: the same rows through ``Engine.generate`` with and without the flag, interleaved (A B A B ...),
  ``--repeats`` times (default 3); the cost is ``flag wall / default wall - 1`` (medians; also of the fastest runs
  and of this process's CPU seconds, steadier on a shared machine);
- **agreement**: every row's generated tokens and logprobs against the same row run alone (a fresh engine, one row),
  bitwise; with the flag every row must agree, without it the figure says how often rows move.
Rows are greedy except every fourth (temperature 0.8, seeded), all with logprobs.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from mlxbatch.bench.harness import Bench, Table, log
from mlxbatch.bench.meta import emit
from mlxbatch.bench.options import parse_script_args
from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.types import SamplingParams

Result = tuple[tuple[int, ...], tuple[float, ...]]  # a row's token ids and their logprobs


def params_for(rows: int, max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.8 if i % 4 == 3 else 0.0, seed=i, max_tokens=max_tokens, logprobs=1,
                           ignore_eos=True) for i in range(rows)]


def generate(b: Bench, prompts: list[list[int]], params: list[SamplingParams], flag: bool,
             max_num_seqs: int) -> tuple[float, float, list[Result]]:
    """(wall seconds, CPU seconds of this process, each row's result)."""
    with Engine(b.loaded, EngineConfig(seed=0, batch_invariant=flag, max_num_seqs=max_num_seqs)) as engine:
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.generate(prompts, params)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, cpu, [(tuple(o.completions[0].token_ids), tuple(lp.logprob for lp in o.completions[0].logprobs))
                       for o in outs]


def measure(b: Bench, name: str, rows: int, repeats: int, solo_rows: int | None) -> dict[str, Any]:
    C = b.concurrency
    w = b.workload(name, rows)
    prompts, params = w.prompts, params_for(rows, w.max_tokens)
    for flag in (True, False):  # warm-up, both paths
        generate(b, prompts[:4], params[:4], flag, C)
    walls: dict[bool, list[float]] = {False: [], True: []}
    cpus: dict[bool, list[float]] = {False: [], True: []}
    results: dict[bool, list[Result]] = {}
    for _ in range(repeats):
        for flag in (False, True):
            wall, cpu, res = generate(b, prompts, params, flag, C)
            walls[flag].append(wall)
            cpus[flag].append(cpu)
            results[flag] = res
    n_solo = rows if solo_rows is None else min(rows, solo_rows)
    agree = {flag: sum(generate(b, [prompts[i]], [params[i]], flag, C)[2][0] == results[flag][i]
                       for i in range(n_solo)) for flag in (False, True)}
    base, inv = statistics.median(walls[False]), statistics.median(walls[True])
    tokens = rows * w.max_tokens
    log(f"{name}: default {base:.2f} s, invariant {inv:.2f} s")
    return {
        "rows": rows, "new_tokens": tokens, "repeats": repeats,
        "default_tok_s": tokens / base, "invariant_tok_s": tokens / inv,
        "cost": inv / base - 1, "cost_best": min(walls[True]) / min(walls[False]) - 1,
        "cost_cpu": statistics.median(cpus[True]) / statistics.median(cpus[False]) - 1,
        "solo_rows": n_solo, "agree_default": agree[False], "agree_invariant": agree[True],
        "same_tokens": sum(a[0] == c[0] for a, c in zip(results[False], results[True])),
    }


def invariance(b: Bench, workloads: list[str], rows: int, repeats: int, solo_rows: int | None) -> Table:
    tab = Table(f"batch invariance: max_num_seqs {b.concurrency}, median of {repeats}",
                ["workload", "rows", "default tok/s", "invariant tok/s", "cost (median)", "cost (fastest)",
                 "cost (CPU s)", "solo agreement default", "solo agreement invariant",
                 "same tokens default vs invariant"])
    for name in workloads:
        r = measure(b, name, rows, repeats, solo_rows)
        tab.rows.append([name, rows, r["default_tok_s"], r["invariant_tok_s"], f"{r['cost']:+.1%}",
                         f"{r['cost_best']:+.1%}", f"{r['cost_cpu']:+.1%}",
                         f"{r['agree_default']}/{r['solo_rows']}", f"{r['agree_invariant']}/{r['solo_rows']}",
                         f"{r['same_tokens']}/{rows}"])
        tab.raw[name] = r
    tab.notes.append("agreement = generated tokens and logprobs bitwise equal to the row run alone; with the flag "
                     "every row must agree")
    return tab


def main(argv: list[str] | None = None) -> int:
    mine, args = parse_script_args(
        list(sys.argv[1:] if argv is None else argv), "invariance", __doc__, {"rows": 64, "repeats": 3},
        workloads=("label,unique", "bench workloads to run (default label,unique)"),
        solo_rows=(0, "rows compared with their solo run (default 0: all)"))
    b = Bench(args)
    tab = invariance(b, [x for x in mine.workloads.split(",") if x], args.rows, args.repeats,
                     mine.solo_rows or None)
    emit(b, [tab])
    return 0
