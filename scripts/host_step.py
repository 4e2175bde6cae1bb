"""Where a decode step's host time goes, part by part, without a profiler's overhead (diagnostic, any device)

    python3 scripts/host_step.py --model 0.5b --rows 256

The decode table's run (``--rows`` prompts of ``--prompt-len`` tokens, ``--new`` tokens each, all rows decoding
together) after a warm-up run, ``--reps`` times. The engine's parts are wrapped with timers that subtract the parts
nested inside them, so each second is counted once: scheduling, building the forward's graph in Python, drawing,
the commit of the step's books, MLX's encoding and launch (``mx.async_eval``), waits for the device, reading the
drawn tokens into the requests, collecting outputs, finishing the step; "other" is the rest of ``EngineCore.step``.
Prints ms a step (medians over the runs). A cProfile of the same run counts Python calls at about twice their cost.
"""

# ruff: isort: skip_file
from __future__ import annotations

import collections
import functools
import statistics
import sys
import time

import mlxbatch  # noqa: F401  (first: it sets up MLX's BLAS on Linux CPUs)
import mlxbatch.engine.commit as commit_mod
from mlxbatch.bench.cli import parse_script_args
from mlxbatch.bench.harness import Bench
from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.engine.core import EngineCore
from mlxbatch.engine.outputs import Traffic
from mlxbatch.engine.runner import ModelRunner
from mlxbatch.engine.sched.scheduler import Scheduler
from mlxbatch.types import SamplingParams

SECONDS: collections.Counter = collections.Counter()
_STACK: list[list[float]] = []  # [start, seconds of nested parts] of each part running


def _timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        _STACK.append([time.perf_counter(), 0.0])
        try:
            return fn(*a, **k)
        finally:
            start, nested = _STACK.pop()
            total = time.perf_counter() - start
            SECONDS[name] += total - nested
            if _STACK:
                _STACK[-1][1] += total
    return wrapper


PARTS = [  # (owner, attribute, label)
    (EngineCore, "step", "other (EngineCore.step itself)"),
    (Scheduler, "schedule", "schedule"),
    (ModelRunner, "_forward", "build the forward (Python)"),
    (commit_mod, "draw_greedy", "draw (greedy)"),
    (commit_mod, "draw", "draw (sampled)"),
    (ModelRunner, "_commit", "commit the books"),
    (Traffic, "launch", "MLX encodes and launches (mx.async_eval)"),
    (Traffic, "settle", "wait for the device"),
    (Traffic, "evaluate", "evaluate (sync)"),
    (EngineCore, "_read", "read drawn tokens into requests"),
    (EngineCore, "_collect", "collect outputs"),
    (Scheduler, "finish_step", "finish the step"),
]


def main() -> None:
    mine, args = parse_script_args(sys.argv[1:], rows="256", prompt_len="32", new="128", reps="3")
    for owner, attr, label in PARTS:
        setattr(owner, attr, _timed(label, getattr(owner, attr)))
    b = Bench(args)
    rows, plen, new = int(mine.rows), int(mine.prompt_len), int(mine.new)
    vocab = b.vocab
    prompts = [[vocab.low + (7 * i + 13 * j) % (vocab.high - vocab.low) for j in range(plen)] for i in range(rows)]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    runs: list[tuple[dict, int, float]] = []
    with Engine(b.loaded, EngineConfig(seed=0, max_num_seqs=rows, max_num_batched_tokens=max(rows * plen, 256))) as eng:
        eng.generate(prompts, params)  # warm-up: the shapes of this run
        for _ in range(int(mine.reps)):
            SECONDS.clear()
            steps0 = eng.stats()["profile"]["steps"]
            t0 = time.perf_counter()
            eng.generate(prompts, params)
            runs.append((dict(SECONDS), eng.stats()["profile"]["steps"] - steps0, time.perf_counter() - t0))
    steps = statistics.median(s for _, s, _ in runs)
    wall = statistics.median(w for _, _, w in runs)
    print(f"\nhost time a decode step: {rows} rows, {plen}-token prompts, {new} new tokens, {len(runs)} runs, "
          f"{steps:.0f} steps, wall {wall:.3f} s ({wall / steps * 1e3:.2f} ms a step)")
    print("| part | ms a step | share of the wall |")
    print("|---|---|---|")
    for _, _, label in PARTS:
        ms = statistics.median(r.get(label, 0.0) / s for r, s, _ in runs) * 1e3
        print(f"| {label} | {ms:.3f} | {ms / (wall / steps * 1e3):.0%} |")


if __name__ == "__main__":
    main()
