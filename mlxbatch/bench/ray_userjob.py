"""``mlxbatch bench ray --userjob``: the user's labeling job on a Ray cluster of this machine's GPUs, against one GPU.

In one call: the user-job benchmark's job (``userjob.job_file``: ``--rows`` reviews, no ``engine:`` section, greedy)
runs as ``mlxbatch run job.yaml`` in a child process on one GPU without Ray (``CUDA_VISIBLE_DEVICES=0``); then
``ray start --head`` starts a cluster on this machine (``--gpus`` GPUs, default the ones ``nvidia-smi -L`` lists; its
files under a fresh temporary folder, its GCS on a free port) and the same job runs with ``--ray ADDRESS``: one
engine actor per GPU, each seeing its own GPU. The cluster is stopped afterwards by the pids of its processes (never
``ray stop``, which stops every cluster of the user on the machine).

Printed: each run's rows/s (report.json's, and over the child process's wall with its start and model loads), the
speed-up over the one-GPU run, each actor's GPU, share of the rows, prefill over its rows' floor, busy and idle
seconds (idle: holding unfinished rows between two calls, waiting for the driver), the driver's CPU seconds
(report.json's ``driver_cpu_s``, from the executor's start: reading, tokenizing, planning, sending, checkpointing)
and the child process's CPU, whether every id came back once with the one-GPU run's text, and the driver's feed
alone on the job's first rows (read, render, tokenize, plan in one thread): the most rows/s one driver hands out.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mlxbatch.bench.harness import Table, log
from mlxbatch.bench.jobdata import write_reviews
from mlxbatch.bench.procs import child_env
from mlxbatch.bench.userjob import job_file, run_cli


def gpus_here() -> int:
    """GPUs ``nvidia-smi -L`` lists (0 where it is missing or fails)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def ray_env(temp: Path) -> dict[str, str]:
    """The environment of the cluster's commands: its files under ``temp``; token authentication on (a driver given
    an address enables it only when ``RAY_AUTH_MODE=token`` says so; the token is ``~/.ray/auth_token``)."""
    env = {**child_env(), "RAY_TMPDIR": str(temp), "RAY_AUTH_MODE": "token"}
    env.pop("RAY_ADDRESS", None)
    return env


def start_head(temp: Path, gpus: int, cpus: int) -> str:
    """``ray start --head`` with its files under ``temp`` (a token made first where none is); the address to join."""
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]  # the `ray` command of this Python, wherever it lives
    env = ray_env(temp)
    subprocess.run([*ray_cli, "get-auth-token", "--generate"], env=env, capture_output=True, timeout=120, check=True)
    args = [*ray_cli, "start", "--head", "--port=0", f"--num-gpus={gpus}", "--include-dashboard=false",
            "--disable-usage-stats"]
    if cpus:
        args.append(f"--num-cpus={cpus}")
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    found = re.search(r"ray start --address='([^']+)'", proc.stdout + proc.stderr)
    if proc.returncode != 0 or found is None:
        raise SystemExit(f"ray start --head failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return found.group(1)


def processes_under(temp: Path) -> list[int]:
    """Pids whose command line names ``temp`` (the cluster's processes; Linux /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and str(temp) in (d / "cmdline").read_bytes().decode(errors="replace"):
                out.append(int(d.name))
        except OSError:
            continue
    return out


def stop_head(temp: Path) -> None:
    """SIGTERM, then SIGKILL after a grace, for the processes of the cluster ``start_head`` started."""
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        for pid in processes_under(temp):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while processes_under(temp) and time.monotonic() < deadline:
            time.sleep(0.2)


def timed_run(job: Path, timeout: float, extra: tuple[str, ...], env: dict[str, str]) -> dict[str, Any]:
    """One ``mlxbatch run``: its report, wall and CPU seconds (the child process: the driver's, under Ray)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall, report = run_cli(job, timeout, extra, env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"report": report, "process_s": wall, "process_cpu_s": cpu}


def feed_rate(job: Path, rows: int) -> dict[str, Any]:
    """The driver's feed alone on the job's first ``rows`` rows (read, render, tokenize, plan, window by window, with
    the feed workers a run of that many rows starts): what one driver can hand out at most. ``cpu_s``: this
    process's (what holds the driver's GIL), ``workers_cpu_s``: the feed workers'."""
    from itertools import islice

    from mlxbatch.io import open_reader
    from mlxbatch.job.check.validate import input_spec, validate_job
    from mlxbatch.job.executors.base import driver_tokenizer
    from mlxbatch.job.rows.feed import RowFeed, Submit
    from mlxbatch.job.rows.prepare import RowPreparer
    from mlxbatch.job.rows.workers import feed_workers

    spec = validate_job(job, writes_output=False)
    tokenizer = driver_tokenizer(spec)
    workers = feed_workers()
    feed = RowFeed(islice(open_reader(input_spec(spec)), rows), RowPreparer(spec, "feed-rate"), tokenizer, set(),
                   window=spec.plan.window, workers=workers)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu0, t0, n = time.process_time(), time.perf_counter(), 0
    while not feed.finished:
        n += sum(isinstance(item, Submit) for item in feed.take_window())
    feed.close()  # the workers exit: their CPU is counted
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"rows": n, "wall_s": wall, "cpu_s": cpu, "rows_per_s": n / max(wall, 1e-9), "workers": workers,
            "workers_cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)}


def results(out: Path) -> tuple[dict[str, str | None], int]:
    """(id -> text, rows) of a finished job's results.parquet."""
    import pyarrow.parquet as pq

    rows = pq.read_table(out / "results.parquet", columns=["id", "text"]).to_pylist()
    return {r["id"]: r["text"] for r in rows}, len(rows)


def _seqs(max_num_seqs: int | None) -> dict[str, Any] | None:
    """The engine section of ``--max-num-seqs`` (None or 0: none, the defaults)."""
    return {"max_num_seqs": max_num_seqs} if max_num_seqs else None


def compare(a: argparse.Namespace) -> Table:
    import mlx.core as mx

    folder = Path(tempfile.mkdtemp(prefix="mlxbatch-ray-userjob-"))
    dtype = a.dtype if a.dtype != "auto" else ("bfloat16" if mx.default_device() == mx.gpu else "float32")
    data = write_reviews(folder / "reviews.jsonl", a.rows, a.seed)
    gpus = a.gpus if a.gpus is not None else gpus_here()
    env = child_env()
    runs: dict[str, dict[str, Any]] = {}
    job = job_file(folder, "one", a.model_path, dtype, data, a.max_tokens, _seqs(a.max_num_seqs))
    log(f"ray userjob: {a.rows:,} rows on one {'GPU' if gpus else 'process'}, no Ray")
    runs["one GPU, no Ray" if gpus else "one process, no Ray"] = {
        **timed_run(job, a.timeout, (), {**env, "CUDA_VISIBLE_DEVICES": "0"} if gpus else env),
        "out": folder / "out-one"}
    temp = Path(tempfile.mkdtemp(prefix="rb-", dir="/tmp"))  # short: Ray's socket paths live under it
    try:
        address = start_head(temp, gpus, a.cpus)
        log(f"ray userjob: ray start --head at {address} ({gpus} GPU(s)); the same job with --ray")
        job = job_file(folder, "ray", a.model_path, dtype, data, a.max_tokens, _seqs(a.max_num_seqs))
        runs["--ray, one actor per GPU" if gpus else "--ray"] = {
            **timed_run(job, a.timeout, ("--ray", address), ray_env(temp)),
            "out": folder / "out-ray"}
    finally:
        stop_head(temp)
        shutil.rmtree(temp, ignore_errors=True)
    feed = feed_rate(job, min(a.rows, 20_000))
    log(f"ray userjob: the driver's feed alone: {feed['rows_per_s']:,.0f} rows/s")
    return table(a, runs, gpus, dtype, folder, feed)


def table(a: argparse.Namespace, runs: dict[str, dict[str, Any]], gpus: int, dtype: str, folder: Path,
          feed: dict[str, Any]) -> Table:
    base_tag, ray_tag = list(runs)
    base, ray = runs[base_tag], runs[ray_tag]
    want, _ = results(base["out"])
    got, n = results(ray["out"])
    same = sum(got.get(k) == v for k, v in want.items())
    tab = Table(f"the user's job on Ray: {a.rows:,} rows, model {a.model} ({dtype}), {gpus} GPU(s), "
                f"max_tokens {a.max_tokens}",
                ["run", "rows/s", "speed-up", "wall s", "process s", "rows/s over the process", "driver CPU s",
                 "process CPU s", "per actor: GPU, rows (share), prefill / floor, busy s, idle s"])
    for tag, r in runs.items():
        rep = r["report"]
        ex = rep["engine"].get("executor")
        per = None
        if ex:
            done = max(1, sum(x["rows"] for x in ex["actors"]))
            per = "; ".join(f"{x['name']}: GPU {x.get('gpus')}, {x['rows']} ({x['rows'] / done:.0%}), "
                            f"{x['prefill_over_floor']}, {x['busy_s']:.1f}, {x.get('idle_s', 0):.1f}"
                            for x in ex["actors"])
        tab.rows.append([tag, rep["rows_per_s"], rep["rows_per_s"] / base["report"]["rows_per_s"], rep["wall_s"],
                         r["process_s"], a.rows / r["process_s"], ex.get("driver_cpu_s") if ex else None,
                         r["process_cpu_s"], per])
    tab.notes += [
        f"--ray: {n:,} result rows, {len(got):,} distinct ids of the {len(want):,} the one-GPU run has; "
        f"{same:,} with its text (greedy).",
        f"the driver's feed alone (read, render, tokenize, plan; {feed['workers']} feed worker(s), as a run of that "
        f"many rows) on the first {feed['rows']:,} rows: {feed['rows_per_s']:,.0f} rows/s, "
        f"{1e6 * feed['cpu_s'] / max(1, feed['rows']):,.0f} us CPU a row in the driver's process (its GIL), "
        f"{1e6 * feed['workers_cpu_s'] / max(1, feed['rows']):,.0f} in its workers; a --ray run near it is bound by "
        f"the driver, not by its GPUs.",
        f"speed-up: rows/s (report.json's: the run's wall after the model loaded, or the actors did) over the "
        f"first run's; process s: the whole `mlxbatch run`, its start and model load(s) included. driver CPU s: "
        f"report.json's engine.executor.driver_cpu_s; process CPU s: the `mlxbatch run` process's (under Ray: the "
        f"driver alone, the actors are the cluster's processes). Job files and outputs in {folder}."]
    tab.raw = {"runs": {t: {"report": r["report"], "process_s": r["process_s"], "process_cpu_s": r["process_cpu_s"]}
                        for t, r in runs.items()},
               "same_text": same, "feed": feed, "distinct_ids": len(got), "result_rows": n, "rows": len(want)}
    return tab
