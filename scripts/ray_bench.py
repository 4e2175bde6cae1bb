#!/usr/bin/env python
"""The Ray executor (issue #14): real runs on this machine, and the partitioner simulated at cluster scale.

    .venv/bin/python scripts/ray_bench.py --model smollm2 --rows 240        # runs (~5 min on 2 cores) + simulation
    .venv/bin/python scripts/ray_bench.py --skip-runs --sim-rows 1000000    # the simulation only (~1 min)

1. **Runs.** One labeling-style job (``--rows`` rows: 8 task preambles of 60-240 words, shared by their rows in
   Zipf-like proportions, and a short unique text per row; greedy, ``--max-tokens``) through ``JobRunner``:
   single machine (no Ray), and on a local Ray cluster started once here: 1 actor holding both cores
   (``num_cpus=2``), 2 actors of one core each with prefix-local partitions, and the same with random
   partitions; ``--repeats`` rounds, the four interleaved. Each: rows/s (after the actors loaded the model), prefill tokens computed against the plan's floor
   (the single-machine floor, and the sum of the actors' own floors), whether the results equal the single-machine
   run's, and the driver's CPU seconds per row (what bounds one driver's rate).
2. **Simulation.** ``--sim-rows`` planned rows in windows of 10,000, three shapes (one long system prompt;
   Zipf-sized template groups; unique prompts), cut by ``mlxbatch.job.executors.ray.partition`` exactly as the executor cuts
   them, then handed to 8 and 64 simulated actors in queue order (each takes the next unit when it frees up, as
   the executor does; work = prefill tokens + generated tokens). Reported: balance (the last actor's finish time
   over the ideal, total work / actors) and the floor ratio (prefill the actors cannot avoid over the
   single-machine plan's floor), for prefix-local and random partitions.
"""

from __future__ import annotations

import argparse
import heapq
import json
import logging
import random
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import mlxbatch  # noqa: F401  (OpenBLAS before mlx)
from mlxbatch.job.executors.ray.partition import prefix_units, random_units, row_cost

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community").split()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- 1. runs -----------------------------------------------------------------------------------------------
def write_input(path: Path, rows: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    tasks = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 240))) for _ in range(8)]
    weights = [1 / (k + 1) for k in range(8)]
    with open(path, "w") as f:
        for i in range(rows):
            task = rng.choices(range(8), weights)[0]
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 20)))
            f.write(json.dumps({"id": f"r{i:05d}", "task": f"Task {task}: {tasks[task]}", "text": text}) + "\n")


def job_file(root: Path, name: str, model: str, data: Path, max_tokens: int, executor: dict[str, Any]) -> Path:
    import yaml

    job = {"model": model, "input": {"path": str(data), "id_column": "id"},
           "prompt": {"messages": [{"role": "system", "content": "{{ task }}"}, {"role": "user", "content": "{{ text }}"}]},
           "sampling": {"temperature": 0, "max_tokens": max_tokens}, "output": str(root / name),
           "checkpoint": {"every_rows": 64}, "engine": {"max_num_seqs": 32}, "executor": executor}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def one_run(root: Path, name: str, model: str, data: Path, max_tokens: int, executor: dict[str, Any]) -> dict:
    import pyarrow.parquet as pq

    from mlxbatch.job.check.validate import validate_job
    from mlxbatch.job.run.runner import JobRunner

    spec = validate_job(job_file(root, name, model, data, max_tokens, executor))
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    r = JobRunner(spec, progress=False).run().report
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    driver_cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    ex = r["engine"].get("executor")
    results = pq.read_table(root / name / "results.parquet", columns=["id", "text"]).to_pylist()
    return {"name": name, "rows": r["rows"]["output"], "wall_s": round(time.perf_counter() - t0, 2),
            "rows_per_s": r["rows_per_s"], "prefill": r["prefix_reuse"]["prefill_tokens_computed"],
            "plan_floor": r["plan"]["distinct_tokens"], "prompt_tokens": r["prefix_reuse"]["prompt_tokens"],
            "actor_floor": ex["floor_tokens"] if ex else r["plan"]["distinct_tokens"],
            "actors": [{k: a[k] for k in ("name", "rows", "prefill_tokens", "floor_tokens", "busy_s")}
                       for a in (ex["actors"] if ex else [])],
            "driver_cpu_ms_per_row": None if ex is None else round(1000 * driver_cpu / max(1, r["rows"]["output"]), 2),
            "results": {x["id"]: x["text"] for x in results}}


def runs(args: argparse.Namespace) -> list[dict]:
    import ray

    root = Path(tempfile.mkdtemp(prefix="ray-bench-"))
    data = root / "in.jsonl"
    write_input(data, args.rows)
    configs = (("local", {"kind": "local"}), ("ray-1x2cpu", {"kind": "ray", "actors": 1, "num_cpus": 2}),
               ("ray-2x1cpu", {"kind": "ray", "actors": 2, "num_cpus": 1}),
               ("ray-2x1cpu-random", {"kind": "ray", "actors": 2, "num_cpus": 1, "partition": "random"}))
    out = []
    ray.init(num_cpus=2, _temp_dir=str(root / "ray"), include_dashboard=False, logging_level=logging.WARNING)
    try:
        for rep in range(args.repeats):  # interleaved: the machine's load drifts
            for name, ex in configs:
                out.append(one_run(root, f"{name}-{rep}", args.model, data, args.max_tokens, ex))
                log(f"{name}: {out[-1]['rows_per_s']} rows/s, prefill {out[-1]['prefill']}")
    finally:
        ray.shutdown()
    same = all(r["results"] == out[0]["results"] for r in out)
    print(f"\n### Runs: {args.rows} rows, model {args.model}, max_tokens {args.max_tokens} "
          f"(results equal to the single-machine run's: {same})\n")
    print("| run | rows/s | prefill tokens | plan floor | actors' floors | prefill / plan floor | per actor: rows, "
          "prefill/floor, busy s | driver CPU ms/row |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out:
        per = "; ".join(f"{a['rows']}, {a['prefill_tokens'] / max(1, a['floor_tokens']):.2f}, {a['busy_s']:.0f}"
                        for a in r["actors"]) or "-"
        print(f"| {r['name']} | {r['rows_per_s']:.2f} | {r['prefill']} | {r['plan_floor']} | {r['actor_floor']} | "
              f"{r['prefill'] / max(1, r['plan_floor']):.2f} | {per} | {r['driver_cpu_ms_per_row'] or '-'} |")
    return out


# -- 2. simulation -------------------------------------------------------------------------------------------
def synthetic_window(shape: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, links) of one planned window: links[i] = tokens row i shares with row i+1 (trie order)."""
    if shape == "unique":
        return rng.integers(100, 600, n), np.zeros(n, dtype=np.int64)
    if shape == "system":  # one 600-token system prompt, a unique 40-120 token row each
        lengths = 600 + rng.integers(40, 120, n)
        links = np.full(n, 600)
        links[-1] = 0
        return lengths, links
    # templates: groups of Zipf sizes (a few larger than a share), each a 200-1500 token prefix
    sizes = []
    while sum(sizes) < n:
        sizes.append(int(min(n - sum(sizes), rng.zipf(1.6))))
    lengths, links = [], []
    for g in sizes:
        prefix = int(rng.integers(200, 1500))
        lengths += list(prefix + rng.integers(20, 80, g))
        links += [prefix] * (g - 1) + [0]
    return np.array(lengths), np.array(links)


def simulate(shape: str, rows: int, actors: int, partition: str, window: int = 10_000, decode: int = 64) -> dict:
    rng = np.random.default_rng(7)
    free = [(0.0, a) for a in range(actors)]
    floor = single = work = 0
    t0 = time.perf_counter()
    for w0 in range(0, rows, window):
        n = min(window, rows - w0)
        lengths, links = synthetic_window(shape, n, rng)
        prev = np.concatenate([[0], links[:-1]])
        single += int((lengths - prev).sum())
        costs = [row_cost(int(ln), int(p), decode) for ln, p in zip(lengths, prev)]
        if partition == "prefix":
            units = prefix_units(links.tolist(), costs, actors)
        elif partition == "whole-groups":  # groups never cut (a share as large as the window): what cuts buy
            units = prefix_units(links.tolist(), costs, 1)
        else:
            units = random_units([f"{w0 + i}" for i in range(n)], costs, actors)
        cum_len = np.concatenate([[0], np.cumsum(lengths)])
        cum_link = np.concatenate([[0], np.cumsum(links)])
        for u in units:
            s, e = u.rows[0], u.rows[-1] + 1
            if e - s == len(u.rows):  # contiguous: each row shares its link with the next
                unit_floor = int(cum_len[e] - cum_len[s] - (cum_link[e - 1] - cum_link[s]))
            else:  # a row shares with the unit's previous row the smallest link between them (trie order)
                idx = np.array(u.rows)
                unit_floor = int(lengths[idx].sum() - np.minimum.reduceat(links, idx)[:-1].sum())
            unit_work = unit_floor + decode * len(u.rows)
            floor += unit_floor
            work += unit_work
            t, a = heapq.heappop(free)  # the actor that frees up first takes the next unit
            heapq.heappush(free, (t + unit_work, a))
    makespan = max(t for t, _ in free)
    return {"shape": shape, "actors": actors, "partition": partition, "balance": makespan / (work / actors),
            "floor_ratio": floor / single, "seconds": time.perf_counter() - t0}


def simulation(args: argparse.Namespace) -> None:
    print(f"\n### Partitioner simulation: {args.sim_rows:,} planned rows, windows of 10,000, 64 generated tokens a row\n")
    print("| shape | actors | prefix-local: balance | floor ratio | random: balance | floor ratio | "
          "groups never cut: balance | floor ratio | prefix-local: simulation s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in ("system", "templates", "unique"):
        for actors in (8, 64):
            p, r, w = (simulate(shape, args.sim_rows, actors, part) for part in ("prefix", "random", "whole-groups"))
            print(f"| {shape} | {actors} | {p['balance']:.3f} | {p['floor_ratio']:.3f} | {r['balance']:.3f} | "
                  f"{r['floor_ratio']:.3f} | {w['balance']:.2f} | {w['floor_ratio']:.3f} | {p['seconds']:.1f} |",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", type=int, default=240)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--sim-rows", type=int, default=1_000_000)
    ap.add_argument("--skip-runs", action="store_true")
    ap.add_argument("--skip-sim", action="store_true")
    args = ap.parse_args()
    if not args.skip_runs:
        runs(args)
    if not args.skip_sim:
        simulation(args)


if __name__ == "__main__":
    main()
