"""``mlxbatch bench ray``: the Ray executor against one process, on real runs, and its partitioner at cluster scale.

    mlxbatch bench ray --model smollm2 --rows 240                       # runs (~5 min on 2 cores) + simulation
    mlxbatch bench ray --skip-runs --sim-rows 1000000                   # the simulation only (~1 min)
    python3 -m mlxbatch.bench ray --userjob --model 0.5b --rows 100000 --skip-sim     # a 2-GPU host (issue 51)
    mlxbatch bench ray --userjob --model tiny --rows 400 --gpus 2 --skip-sim   # the same on a CPU (2 fake GPUs)

``--userjob`` (``ray_userjob``): the user-job benchmark's labeling job through ``mlxbatch run``, on one GPU without
Ray, then with ``--ray`` on a ``ray start --head`` cluster of this machine, one engine actor per GPU: rows/s, the
speed-up, each actor's share of the rows and the driver's CPU time. The runs and the simulation below otherwise:

1. **Runs.** One job (``--data tasks``: 8 task preambles of 60-240 words shared by their rows in Zipf-like
   proportions, a short text each, as system + user messages; ``--data reviews``: the user-job benchmark's labeling
   input) through ``mlxbatch.job.api.run_job``, greedy, ``--max-tokens``, under each of ``--configs``: ``local`` (one
   process, no Ray), ``ray-1`` (one actor holding the actors' resources together), ``ray`` (``--actors`` actors,
   prefix-local partitions), ``ray-random`` (the same, random partitions); ``--repeats`` rounds, interleaved. The Ray
   runs share one cluster, started here (``--cpus`` / ``--gpus``) or joined (``--address``). Each: rows/s, prefill
   tokens computed against the plan's floor (the single-process floor, and the sum of the actors' own floors), the
   actors' rows, prefill / floor and busy seconds, whether the results equal the first run's, and the driver's CPU
   milliseconds per row (what bounds one driver's rate).
2. **Simulation.** ``--sim-rows`` planned rows in windows of 10,000, three shapes (one long system prompt;
   Zipf-sized template groups; unique prompts), cut by the executor's own partitioner and handed to 8 and 64
   simulated actors in queue order (each takes the next unit when it frees up; work = prefill + generated tokens).
   Reported: balance (the last actor's finish over the ideal) and the floor ratio (prefill the actors cannot avoid
   over the single-process plan's floor), for prefix-local and random partitions and groups never cut.
"""

from __future__ import annotations

import argparse
import heapq
import logging
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from mlxbatch.bench.harness import Table, log, resolve_model
from mlxbatch.bench.jobdata import INSTRUCTION, write_reviews, write_tasks
from mlxbatch.job.executors.ray.partition import prefix_units, random_units, row_cost

CONFIGS = ("local", "ray-1", "ray", "ray-random")


# -- 1. runs -----------------------------------------------------------------------------------------------
def job_for(a: argparse.Namespace, data: Path, out: Path, name: str) -> dict[str, Any]:
    if a.data == "reviews":
        messages = [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": "{{ review }}"}]
    else:
        messages = [{"role": "system", "content": "{{ task }}"}, {"role": "user", "content": "{{ text }}"}]
    if name == "local":
        executor: dict[str, Any] = {"kind": "local"}
    elif name == "ray-1":
        executor = {"kind": "ray", "actors": 1, "num_cpus": a.actor_cpus * a.actors,
                    "num_gpus": a.actor_gpus * a.actors}
    else:
        executor = {"kind": "ray", "actors": a.actors, "num_cpus": a.actor_cpus, "num_gpus": a.actor_gpus,
                    "partition": "random" if name == "ray-random" else "prefix"}
    if a.address:
        executor["address"] = a.address
    job = {"model": {"path": a.model_path, "dtype": a.dtype}, "input": {"path": str(data), "id_column": "id"},
           "prompt": {"messages": messages}, "sampling": {"temperature": 0, "max_tokens": a.max_tokens},
           "output": str(out), "checkpoint": {"every_rows": max(64, a.rows // 20)}, "executor": executor}
    if a.max_num_seqs:
        job["engine"] = {"max_num_seqs": a.max_num_seqs}
    return job


def one_run(a: argparse.Namespace, root: Path, data: Path, name: str, tag: str) -> dict[str, Any]:
    from mlxbatch.job.api import run_job

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    res = run_job(job_for(a, data, root / tag, name))
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    r = res.report
    ex = r["engine"].get("executor")
    rows = r["rows"]["output"]
    table = res.table().select(["id", "text"]).to_pylist()
    return {"name": name, "rows": rows, "wall_s": wall, "rows_per_s": r["rows_per_s"],
            "prefill": r["prefix_reuse"]["prefill_tokens_computed"], "plan_floor": r["plan"]["distinct_tokens"],
            "actor_floor": ex["floor_tokens"] if ex else r["plan"]["distinct_tokens"],
            "actors": [{k: x[k] for k in ("name", "rows", "prefill_tokens", "floor_tokens", "busy_s")}
                       for x in (ex["actors"] if ex else [])],
            "driver_cpu_ms_per_row": 1000 * ((cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime))
            / max(1, rows),
            "results": {x["id"]: x["text"] for x in table}}


def runs(a: argparse.Namespace) -> Table:
    root = Path(tempfile.mkdtemp(prefix="mlxbatch-ray-bench-"))
    data = root / "in.jsonl"
    (write_reviews if a.data == "reviews" else write_tasks)(data, a.rows, a.seed)
    configs = [c for c in a.configs.split(",") if c]
    out: list[dict[str, Any]] = []
    uses_ray = any(c != "local" for c in configs)
    if uses_ray:
        import ray

        if a.address:
            ray.init(address=a.address, logging_level=logging.WARNING)
        else:
            ray.init(num_cpus=a.cpus or os.cpu_count(), num_gpus=a.gpus,  # None: the GPUs Ray finds
                     _temp_dir=str(root / "ray"), include_dashboard=False, logging_level=logging.WARNING)
    try:
        for rep in range(a.repeats):  # interleaved: the machine's load drifts
            for name in configs:
                out.append(one_run(a, root, data, name, f"{name}-{rep}"))
                log(f"{name}: {out[-1]['rows_per_s']:.1f} rows/s, prefill {out[-1]['prefill']}")
    finally:
        if uses_ray:
            ray.shutdown()
    same = all(r["results"] == out[0]["results"] for r in out)
    tab = Table(f"Ray runs: {a.rows} rows ({a.data}), model {a.model}, max_tokens {a.max_tokens}, {a.actors} "
                f"actor(s) of {a.actor_cpus:g} CPU / {a.actor_gpus:g} GPU",
                ["run", "rows/s", "wall s", "prefill tokens", "plan floor", "actors' floors", "prefill / plan floor",
                 "per actor: rows, prefill/floor, busy s", "driver CPU ms/row"])
    for r in out:
        per = "; ".join(f"{x['rows']}, {x['prefill_tokens'] / max(1, x['floor_tokens']):.2f}, {x['busy_s']:.0f}"
                        for x in r["actors"]) or None
        tab.rows.append([r["name"], r["rows_per_s"], r["wall_s"], r["prefill"], r["plan_floor"], r["actor_floor"],
                         r["prefill"] / max(1, r["plan_floor"]), per,
                         r["driver_cpu_ms_per_row"] if r["actors"] else None])
    tab.notes.append(f"results equal to the first run's in every run: {same}. rows/s: the report's (after the "
                     "actors loaded the model); wall: the whole run_job call")
    tab.raw = {"same_results": same, "runs": [{k: v for k, v in r.items() if k != "results"} for r in out]}
    return tab


# -- 2. simulation -------------------------------------------------------------------------------------------
def synthetic_window(shape: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, links) of one planned window: links[i] = tokens row i shares with row i+1 (trie order)."""
    if shape == "unique":
        return rng.integers(100, 600, n), np.zeros(n, dtype=np.int64)
    if shape == "system":  # one 600-token system prompt, a unique 40-120 token row each
        links = np.full(n, 600)
        links[-1] = 0
        return 600 + rng.integers(40, 120, n), links
    sizes: list[int] = []  # templates: groups of Zipf sizes, each a 200-1500 token prefix
    while sum(sizes) < n:
        sizes.append(int(min(n - sum(sizes), rng.zipf(1.6))))
    lengths: list[int] = []
    links_: list[int] = []
    for g in sizes:
        prefix = int(rng.integers(200, 1500))
        lengths += list(prefix + rng.integers(20, 80, g))
        links_ += [prefix] * (g - 1) + [0]
    return np.array(lengths), np.array(links_)


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
            floor += unit_floor
            work += unit_floor + decode * len(u.rows)
            t, actor = heapq.heappop(free)  # the actor that frees up first takes the next unit
            heapq.heappush(free, (t + unit_floor + decode * len(u.rows), actor))
    makespan = max(t for t, _ in free)
    return {"balance": makespan / (work / actors), "floor_ratio": floor / single, "seconds": time.perf_counter() - t0}


def simulation(sim_rows: int) -> Table:
    tab = Table(f"Partitioner simulation: {sim_rows:,} planned rows, windows of 10,000, 64 generated tokens a row",
                ["shape", "actors", "prefix-local: balance", "floor ratio", "random: balance", "floor ratio",
                 "groups never cut: balance", "floor ratio", "prefix-local: simulation s"])
    for shape in ("system", "templates", "unique"):
        for actors in (8, 64):
            p, r, w = (simulate(shape, sim_rows, actors, part) for part in ("prefix", "random", "whole-groups"))
            tab.rows.append([shape, actors, p["balance"], p["floor_ratio"], r["balance"], r["floor_ratio"],
                             w["balance"], w["floor_ratio"], p["seconds"]])
            log(f"simulated {shape} over {actors} actors")
    return tab


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mlxbatch bench ray", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="tiny|small|0.5b (random weights), smollm2 or a model path")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--cache-dir", default="~/.cache/mlxbatch/bench", help="where random models are built")
    ap.add_argument("--data", default="tasks", choices=["tasks", "reviews"])
    ap.add_argument("--rows", type=int, default=240)
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens a row (default 16; --userjob 8)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the job's engine.max_num_seqs (0: no engine section; default 32, --userjob 0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"runs among {', '.join(CONFIGS)} (default all)")
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--actor-cpus", type=float, default=1.0)
    ap.add_argument("--actor-gpus", type=float, default=0.0, help="GPUs per actor (1 on a CUDA host: one each)")
    ap.add_argument("--cpus", type=int, default=0, help="logical CPUs of the local cluster (default: the machine's)")
    ap.add_argument("--gpus", type=int, default=None,
                    help="GPUs of the cluster started here (default: the machine's; give 2 on a CPU to fake two)")
    ap.add_argument("--userjob", action="store_true",
                    help="the user's labeling job via `mlxbatch run`, one GPU against --ray on `ray start --head`")
    ap.add_argument("--timeout", type=float, default=3600.0, help="--userjob: seconds a run may take")
    ap.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--sim-rows", type=int, default=1_000_000)
    ap.add_argument("--skip-runs", action="store_true")
    ap.add_argument("--skip-sim", action="store_true")
    ap.add_argument("--json", dest="json_path", default=None, help="also write the tables here")
    a = ap.parse_args(argv)
    bad = [c for c in a.configs.split(",") if c and c not in CONFIGS]
    if bad:
        ap.error(f"--configs: unknown {', '.join(bad)}; choose from {', '.join(CONFIGS)}")
    if a.max_tokens is None:
        a.max_tokens = 8 if a.userjob else 16
    if a.max_num_seqs is None:
        a.max_num_seqs = 0 if a.userjob else 32
    tables = []
    if not a.skip_runs:
        a.model_path = resolve_model(a.model, Path(a.cache_dir).expanduser())
        if a.userjob:
            from mlxbatch.bench.ray_userjob import compare

            tables.append(compare(a))
        else:
            tables.append(runs(a))
    if not a.skip_sim:
        tables.append(simulation(a.sim_rows))
    for t in tables:
        print(t.render(), flush=True)
    if a.json_path:
        import json

        Path(a.json_path).write_text(json.dumps({"args": vars(a), "tables": [t.as_dict() for t in tables]},
                                                indent=2, default=str))
    return 0
