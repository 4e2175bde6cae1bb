"""Part 2 of the ``job`` section: streaming memory of the reader + checkpoint path at 10k-1M rows.

For each of ``--stream-rows`` a fresh ``python -m mlxbatch.bench.stream_child`` process streams that many short
JSONL rows through the I/O layer (see ``stream_child``) and reports its wall time and peak RSS; this module writes
the inputs, runs the children and builds the table.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from mlxbatch.bench.harness import MB, Bench, Table, log
from mlxbatch.bench.jobdata import write_stream_inputs
from mlxbatch.bench.procs import run_module


def _mb(v: int | None) -> float | None:
    return None if v is None else v / MB


def stream_memory(b: Bench) -> Table:
    a = b.args
    sizes = sorted({int(x) for x in a.stream_rows.split(",") if x.strip()})
    tracked = sorted({int(x) for x in a.stream_track_ids.split(",") if x.strip()} & set(sizes))
    with tempfile.TemporaryDirectory(prefix="mlxbatch-bench-stream-") as tmp_s:
        tmp = Path(tmp_s)
        t0 = time.perf_counter()
        inputs = write_stream_inputs(tmp, sizes, a.seed)
        log(f"stream: wrote inputs for {sizes} rows in {time.perf_counter() - t0:.1f} s "
            f"({inputs[max(sizes)].stat().st_size / MB:.0f} MB for {max(sizes):,})")
        results = []
        for n, track in [(n, False) for n in sizes] + [(n, True) for n in tracked]:
            out = tmp / f"out-{n}{'-ids' if track else ''}"
            args = [str(inputs[n]), str(out), "--every", str(a.stream_checkpoint_rows)]
            log(f"stream: {n:,} rows{' + id tracker' if track else ''} in a fresh process")
            try:
                proc = run_module("mlxbatch.bench.stream_child", args + (["--track-ids"] if track else []),
                                  timeout=a.stream_timeout)
            except subprocess.TimeoutExpired:
                log(f"  timed out after {a.stream_timeout} s")
                results.append({"rows": n, "track_ids": track, "timeout": a.stream_timeout})
                continue
            if proc.returncode != 0:
                raise RuntimeError(f"stream child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["input_bytes"] = inputs[n].stat().st_size
            log(f"  {r['wall_s']:.1f} s, {n / r['wall_s']:,.0f} rows/s, peak RSS {r['maxrss'] / MB:.0f} MB")
            results.append(r)
            shutil.rmtree(out, ignore_errors=True)
    tab = Table(
        f"streaming memory: short JSONL rows -> reader -> ResultRecord -> checkpoint shard every "
        f"{a.stream_checkpoint_rows} rows -> finalize (Parquet), one fresh process per size",
        ["rows", "input MB", "wall s", "rows/s", "stream s", "finalize s", "shards", "shards MB", "results MB",
         "RSS after imports MB", "peak RSS streaming MB", "peak RSS MB", "peak anon RSS MB", "peak x smallest"],
    )
    base = next((r["maxrss"] for r in results if "maxrss" in r), None)
    for r in results:
        label = f"{r['rows']:,}" + (" + id tracker" if r["track_ids"] else "")
        if "timeout" in r:
            tab.rows.append([label] + [None] * 13)
            tab.notes.append(f"{label}: did not finish within {r['timeout']} s")
            continue
        tab.rows.append([label, r["input_bytes"] / MB, r["wall_s"], r["rows"] / r["wall_s"], r["stream_s"],
                         r["finalize_s"], r["shards"], r["shard_bytes"] / MB, r["results_bytes"] / MB,
                         r["rss_imports"] / MB, r["maxrss_stream"] / MB, r["maxrss"] / MB,
                         _mb(r["anon_peak"]), r["maxrss"] / base if base else None])
    tab.notes += [
        "each size runs in its own `python -m mlxbatch.bench.stream_child` process (imports mlxbatch.io only: "
        "pyarrow, numpy; no MLX), so its peak RSS is that size's alone: VmHWM from /proc/self/status (which counts "
        "touched pages of the memory-mapped shards too; getrusage's ru_maxrss is not used because Linux carries "
        "the parent's RSS into it across fork + exec; without /proc, on macOS, ru_maxrss it is); 'peak anon' = "
        "the highest RssAnon sampled every 20 ms (heap only, no file pages; '-' without /proc).",
        "stream = open_reader(InputSpec(path, id_column='id')) -> per row a result_key (sha256, as the job keys "
        "rows) and a ResultRecord (the row's text as input column, a ~10-word output text, token counts, "
        "timings, model, canonical params) -> CheckpointStore.append every N rows (Arrow IPC shard, fsync, "
        "rename, manifest rewrite); finalize = finalize(store, out, expected rows (the input re-read, keys "
        "recomputed, as JobRunner does)) -> results.parquet (zstd). 'peak RSS streaming' is VmHWM just "
        "before finalize.",
        "'+ id tracker' adds the DuplicateIdTracker (a set of every row id) that JobRunner's row preparer keeps "
        "during the run and again while listing the expected rows.",
    ]
    tab.raw = {"results": results}
    return tab
