"""Where a step's host time goes, part by part, without a profiler's overhead (diagnostic, any device)

    python3 scripts/host_step.py --model 0.5b --rows 256
    python3 scripts/host_step.py --model 0.5b --workloads label:2048,label:2048:nocache   # the suite's workloads

The decode table's run (``--rows`` prompts of ``--prompt-len`` tokens, ``--new`` tokens each, all rows decoding
together) after a warm-up run, ``--reps`` times. The engine's parts are wrapped with timers that subtract the parts
nested inside them, so each second is counted once: scheduling, building the forward's graph in Python, drawing,
the commit of the step's books, MLX's encoding and launch (``mx.async_eval``), waits for the device, reading the
drawn tokens into the requests, collecting outputs, finishing the step; "other" is the rest of ``EngineCore.step``.
Prints ms a step (medians over the runs), with the engine's compiled decode passes (``kv.compiled_decode``) off and
on, interleaved in one engine (``--compiled off|on|both``; both by default), and whether both gave the same tokens.
A cProfile of the same run counts Python calls at about twice their cost.

``--workloads name:rows[:nocache],...``: the suite's workloads instead (``nocache``: the prefix cache off), each run
twice in one engine (the second counts: its attention shapes were met), with the prefill's parts too: placing rows and
copying prefixes in (``kv.reuse.admit``), building the prefill passes in Python, the cache stores, the row moves; MLX's
encoding is split by the kind of launch (prefill, decode, draw). Prints ms per step and seconds per run.
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
import mlxbatch.engine.kv.reuse as reuse_mod
from mlxbatch.bench.cli import parse_script_args
from mlxbatch.bench.harness import Bench
from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.engine.core import EngineCore
from mlxbatch.engine.outputs import Traffic
from mlxbatch.engine.kv.slots import SlotBatch
from mlxbatch.engine.runner import ModelRunner
from mlxbatch.engine.sched.scheduler import Scheduler
from mlxbatch.types import SamplingParams

SECONDS: collections.Counter = collections.Counter()
_STACK: list[list[float]] = []  # [start, seconds of nested parts] of each part running


def _timed(name, fn):
    """``fn`` timed under ``name`` (a label, or a function of the call's arguments giving one)."""
    @functools.wraps(fn)
    def wrapper(*a, **k):
        _STACK.append([time.perf_counter(), 0.0])
        try:
            return fn(*a, **k)
        finally:
            start, nested = _STACK.pop()
            total = time.perf_counter() - start
            SECONDS[name if isinstance(name, str) else name(*a, **k)] += total - nested
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


PREFILL_PARTS = [  # the prefill's parts (``--workloads``)
    (reuse_mod, "admit", "prefill: place rows, copy prefixes in (admit)"),
    (ModelRunner, "_forward_packed", "prefill: build the packed pass (Python)"),
    (reuse_mod, "store_blocks", "cache stores (Python)"),
    (SlotBatch, "arrange", "row moves: arrange"),
    (SlotBatch, "promote_many", "row moves: promote"),
    (SlotBatch, "remove_many", "row moves: remove"),
]


def _launch_label(self, kind, *arrays):
    return f"MLX encodes and launches: {kind}"


def workloads(b: Bench, spec: str) -> None:
    """The suite's workloads, each run twice in one engine; the second run's parts, ms a step and s a run."""
    for item in spec.split(","):
        name, rows, *cache = item.split(":")
        if cache not in ([], ["nocache"]):
            raise SystemExit(f"--workloads: {item!r}: the third field may only be 'nocache'")
        w = b.workload(name, int(rows))
        params = SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
        cfg = EngineConfig(seed=0, max_num_seqs=b.concurrency, prefix_cache=not cache)
        with Engine(b.loaded, cfg) as eng:
            for _ in range(2):
                SECONDS.clear()
                steps0 = eng.stats()["profile"]["steps"]
                t0 = time.perf_counter()
                eng.generate(w.prompts, params)
                wall = time.perf_counter() - t0
            steps = eng.stats()["profile"]["steps"] - steps0
        print(f"\n{item}: {steps} steps, wall {wall:.2f} s ({wall / steps * 1e3:.2f} ms a step); seconds a run, ms a step")
        for label, sec in sorted(SECONDS.items(), key=lambda kv: -kv[1]):
            print(f"  {label:50s} {sec:7.3f} s {sec / steps * 1e3:8.3f} ms")
        print(f"  {'(untimed)':50s} {wall - sum(SECONDS.values()):7.3f} s", flush=True)


def main() -> None:
    mine, args = parse_script_args(sys.argv[1:], rows="256", prompt_len="32", new="128", reps="3", compiled="both",
                                   workloads="")
    parts = PARTS + (PREFILL_PARTS if mine.workloads else [])
    for owner, attr, label in parts:
        setattr(owner, attr, _timed(_launch_label if mine.workloads and attr == "launch" else label,
                                    getattr(owner, attr)))
    b = Bench(args)
    if mine.workloads:
        return workloads(b, mine.workloads)
    rows, plen, new = int(mine.rows), int(mine.prompt_len), int(mine.new)
    vocab = b.vocab
    prompts = [[vocab.low + (7 * i + 13 * j) % (vocab.high - vocab.low) for j in range(plen)] for i in range(rows)]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    # decode passes from compiled graphs (``kv.compiled_decode``, where the engine uses them): "on", "off", or "both"
    # (interleaved in one engine: the same process, machine state and shapes)
    modes = ["off", "on"] if mine.compiled == "both" else [mine.compiled]
    runs: dict[str, list[tuple[dict, int, float]]] = {m: [] for m in modes}
    tokens: dict[str, list] = {}
    with Engine(b.loaded, EngineConfig(seed=0, max_num_seqs=rows, max_num_batched_tokens=max(rows * plen, 256))) as eng:
        batch = eng.core.runner.batch
        compiled = batch.compiled_decode
        for mode in modes:  # warm-up: the shapes of this run (and their traces)
            batch.compiled_decode = compiled if mode == "on" else None
            eng.generate(prompts, params)
        for _ in range(int(mine.reps)):
            for mode in modes:
                batch.compiled_decode = compiled if mode == "on" else None
                SECONDS.clear()
                steps0 = eng.stats()["profile"]["steps"]
                t0 = time.perf_counter()
                outs = eng.generate(prompts, params)
                tokens[mode] = [o.completions[0].token_ids for o in outs]
                runs[mode].append((dict(SECONDS), eng.stats()["profile"]["steps"] - steps0, time.perf_counter() - t0))
        stats = eng.stats()["profile"]
    print(f"\ncompiled decode passes {stats.get('decode_compiled_passes', '-')}, traces {stats.get('decode_traces', '-')}"
          + ("" if compiled is not None else " (the engine compiles none on this device)"))
    if len(modes) == 2:
        same = sum(a == b for a, b in zip(tokens["off"], tokens["on"]))
        print(f"greedy tokens equal, compiled on vs off: {same}/{rows} rows")
    for mode in modes:
        _table(runs[mode], f"compiled decode {mode}", rows, plen, new)


def _table(runs: list[tuple[dict, int, float]], title: str, rows: int, plen: int, new: int) -> None:
    steps = statistics.median(s for _, s, _ in runs)
    wall = statistics.median(w for _, _, w in runs)
    print(f"\nhost time a decode step ({title}): {rows} rows, {plen}-token prompts, {new} new tokens, {len(runs)} "
          f"runs, {steps:.0f} steps, wall {wall:.3f} s ({wall / steps * 1e3:.2f} ms a step)")
    print("| part | ms a step | share of the wall |")
    print("|---|---|---|")
    for _, _, label in PARTS:
        ms = statistics.median(r.get(label, 0.0) / s for r, s, _ in runs) * 1e3
        print(f"| {label} | {ms:.3f} | {ms / (wall / steps * 1e3):.0%} |")


if __name__ == "__main__":
    main()
