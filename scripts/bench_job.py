#!/usr/bin/env python
"""The ``job`` section of ``scripts/bench.py``: what the job layer costs on top of the engine.

    .venv/bin/python scripts/bench.py --section job --model tiny

Two parts:

1. **Overhead.** ``--job-rows`` short JSONL rows (id + a text of 20-60 tokens) run as a job in process
   (``validate_job`` + ``JobRunner(spec, progress=False).run()``: read, render, key, engine, checkpoint shards,
   final Parquet, report, ``_SUCCESS``; a fresh output folder each run) and through the engine alone
   (``Engine(loaded, <the job's EngineConfig>).generate(<the same rendered prompts>, <the job's SamplingParams>)``).
   Both use the one model object: the bench acquires the job's own ``ModelSpec`` from ``REGISTRY``, so the job's
   ``REGISTRY.acquire`` shares it. Interleaved repeats, medians; overhead = job time / engine time - 1.
2. **Streaming memory.** For each of ``--stream-rows`` (10k, 100k, 1M) a fresh subprocess (this file with
   ``--stream-child``) streams that many short JSONL rows through ``open_reader``, builds a ``ResultRecord`` per
   row, appends a checkpoint shard every ``--stream-checkpoint-rows`` rows and ``finalize``s the Parquet against
   the expected rows (the input re-read, keys recomputed, as ``JobRunner`` does); it reports its wall time and
   peak RSS (``VmHWM``: ``getrusage``'s ``ru_maxrss`` would include the parent's RSS, carried across
   fork + exec on Linux). No model. The top-level imports here are stdlib only, so the child's
   RSS is the I/O layer's (``mlxbatch.io``: pyarrow, numpy), not MLX's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MB = 1 << 20
WORDS = ("the a of to and in is it that for on with as was at by an be this from or have not are but which one "
         "all were when we there can more if out so what up about into than them some could time only new may "
         "first also after any like our over such how where most get through back much before good well year "
         "work way even because people small large water number place word light house world river city "
         "summer winter market garden letter report table window school music paper story night answer").split()
TEMPLATE = "Summarise: {{ text }}\n"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- inputs ------------------------------------------------------------------------------------------------
def token_rows(n: int, tokenizer: Any, seed: int, lo: int = 20, hi: int = 60) -> list[dict[str, str]]:
    """``n`` rows whose text is lo..hi tokens long (uniform target, words added until it is reached)."""
    rng = random.Random(f"job-rows-{seed}")
    rows = []
    for i in range(n):
        target, words = rng.randint(lo, hi), []
        while len(tokenizer.encode(" ".join(words))) < target:
            words.append(rng.choice(WORDS))
        rows.append({"id": f"row-{i:06d}", "text": " ".join(words)})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def write_stream_inputs(dirpath: Path, sizes: list[int], seed: int) -> dict[int, Path]:
    """One JSONL file per size (short rows: an id and 4-9 words, ~70 bytes), written in one pass."""
    rng = random.Random(f"stream-{seed}")
    paths = {n: dirpath / f"rows-{n}.jsonl" for n in sizes}
    files = {n: open(p, "w", encoding="ascii") for n, p in paths.items()}  # noqa: SIM115
    try:
        for i in range(max(sizes)):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9)))
            line = f'{{"id": "row-{i:07d}", "text": "{text}"}}\n'
            for n, f in files.items():
                if i < n:
                    f.write(line)
    finally:
        for f in files.values():
            f.close()
    return paths


# -- part 1: the job against the engine alone --------------------------------------------------------------
class StageTimers:
    """Times the job's stages by wrapping what ``mlxbatch.job.runner`` calls (restored on exit); changes nothing."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def _wrap(self, name: str, fn: Any) -> Any:
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
                self.calls[name] = self.calls.get(name, 0) + 1
        return timed

    @contextlib.contextmanager
    def patch(self) -> Iterator[StageTimers]:
        import mlxbatch.job.runner as runner
        from mlxbatch.io.checkpoint import CheckpointStore

        saved = [(runner, n, getattr(runner, n)) for n in ("EngineCore", "count_rows", "finalize")]
        saved.append((CheckpointStore, "append", CheckpointStore.append))
        try:
            for owner, name, fn in saved:
                setattr(owner, name, self._wrap(name, fn))
            yield self
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)


class JobBench:
    """The rows, the job file, the shared model and the two paths of part 1."""

    def __init__(self, b: Any, tmp: Path) -> None:
        import yaml

        from mlxbatch.engine import ModelSpec
        from mlxbatch.engine.model.registry import REGISTRY
        from mlxbatch.job.prompts import PromptRenderer
        from mlxbatch.job.validate import validate_job

        a = b.args
        self.b, self.tmp, self.runs = b, tmp, 0
        self.rows = token_rows(a.job_rows, b.tokenizer, a.seed)
        self.data = write_jsonl(tmp / "rows.jsonl", self.rows)
        self.warm_data = write_jsonl(tmp / "warm.jsonl", self.rows[:16])
        self.job: dict[str, Any] = {
            "model": {"path": b.model_path, "dtype": a.dtype},
            "input": {"path": str(self.data), "id_column": "id"},
            "prompt": {"template": TEMPLATE},
            "sampling": {"temperature": 0.0, "max_tokens": a.job_max_tokens},
            "checkpoint": {"every_rows": a.job_checkpoint_rows, "every_seconds": 3600},
            "engine": {"max_num_seqs": b.concurrency},
            "seed": a.seed,
        }
        self._yaml = yaml
        spec = validate_job(self.write_job("probe"))
        m = spec.model
        self.model_spec = ModelSpec(m.path, m.dtype, m.adapter, m.trust_remote_code)  # exactly as JobRunner builds it
        self.loaded = REGISTRY.acquire(self.model_spec, "bench:job")  # the job's acquire then shares this object
        self.params = spec.sampling.params
        e = spec.engine
        self.engine_kw = {"max_num_seqs": e.max_num_seqs, "max_num_batched_tokens": e.max_num_batched_tokens,
                          "prefill_chunk_size": e.prefill_chunk_size, "kv_memory_fraction": e.kv_memory_fraction,
                          "seed": spec.seed}
        renderer = PromptRenderer(spec.prompt)
        self.prompts = [renderer.render(r).prompt for r in self.rows]
        self.prompt_tokens = [len(self.loaded.tokenizer.encode(p)) for p in self.prompts]

    def close(self) -> None:
        from mlxbatch.engine.model.registry import REGISTRY

        REGISTRY.release(self.model_spec, "bench:job")

    def write_job(self, tag: str, data: Path | None = None) -> Path:
        job = {**self.job, "output": str(self.tmp / f"out-{tag}")}
        if data is not None:
            job["input"] = {**job["input"], "path": str(data)}
        path = self.tmp / f"job-{tag}.yaml"
        path.write_text(self._yaml.safe_dump(job))
        return path

    def run_job(self, data: Path | None = None) -> Any:
        import pyarrow.parquet as pq
        from bench import Run

        from mlxbatch.job.runner import JobRunner
        from mlxbatch.job.validate import validate_job

        self.runs += 1
        path = self.write_job(f"{self.runs:02d}", data)  # a fresh output folder every run
        timers = StageTimers()
        with timers.patch():
            t0 = time.perf_counter()
            spec = validate_job(path)
            t1 = time.perf_counter()
            result = JobRunner(spec, progress=False).run()
            wall = time.perf_counter() - t0
        out = Path(result.out_dir)
        table = pq.read_table(out / "results.parquet", columns=["id", "text", "prompt_tokens", "generated_tokens",
                                                                 "error"])
        shards = list((out / "shards").glob("shard-*.arrow"))
        extra = {"validate_s": t1 - t0, "stages": dict(timers.seconds), "calls": dict(timers.calls),
                 "profile": result.report["engine"]["profile"], "texts": table.column("text").to_pylist(),
                 "errors": table.num_rows - table.column("error").null_count, "shards": len(shards),
                 "shard_bytes": sum(p.stat().st_size for p in shards),
                 "results_bytes": (out / "results.parquet").stat().st_size, "report": result.report}
        return Run("job", wall, table.num_rows, sum(table.column("prompt_tokens").to_pylist()),
                   sum(table.column("generated_tokens").to_pylist()), [], extra)

    def run_engine(self, n: int | None = None) -> Any:
        from bench import Run

        from mlxbatch.engine import Engine, EngineConfig

        prompts = self.prompts[:n] if n else self.prompts
        t0 = time.perf_counter()
        engine = Engine(self.loaded, EngineConfig(**self.engine_kw))
        t1 = time.perf_counter()
        try:
            outs = engine.generate(prompts, self.params)
            t2 = time.perf_counter()
            stats = engine.stats()
        finally:
            engine.close()
        wall = time.perf_counter() - t0
        extra = {"init_s": t1 - t0, "generate_s": t2 - t1, "profile": stats["profile"],
                 "texts": [o.text for o in outs]}
        return Run("engine", wall, len(outs), sum(o.prompt_tokens for o in outs),
                   sum(o.generated_tokens for o in outs), [list(o.token_ids) for o in outs], extra)


def _paired_overheads(job: Any, eng: Any, key: Any) -> list[float]:
    return [key(j) / key(e) - 1 for j, e in zip(job.runs, eng.runs)]


def job_overhead(b: Any, repeats: int) -> list[Any]:
    from bench import Table, ratio

    a = b.args
    with tempfile.TemporaryDirectory(prefix="mlxbatch-bench-job-") as tmp:
        jb = JobBench(b, Path(tmp))
        try:
            log(f"job: {a.job_rows} rows ({min(jb.prompt_tokens)}-{max(jb.prompt_tokens)} prompt tokens), "
                f"max_tokens {a.job_max_tokens}, checkpoint every {a.job_checkpoint_rows} rows, concurrency "
                f"{b.concurrency}; warming up")
            jb.run_job(jb.warm_data)
            jb.run_engine(16)
            res = b.measure({"engine": jb.run_engine, "job": jb.run_job}, repeats)
        finally:
            jb.close()
    eng, job = res["engine"], res["job"]
    ref = eng.median.extra["texts"]
    same = sum(1 for x, y in zip(job.median.extra["texts"], ref) if x == y)
    gen_only = statistics.median(r.extra["generate_s"] for r in eng.runs)
    over = job.wall_s / eng.wall_s - 1
    over_gen = job.wall_s / gen_only - 1
    paired = _paired_overheads(job, eng, lambda r: r.wall_s)
    n = job.median.rows
    tab = Table(
        f"job vs engine alone: {n} rows ({min(jb.prompt_tokens)}-{max(jb.prompt_tokens)} prompt tokens, "
        f"{sum(jb.prompt_tokens)} in all), greedy, max_tokens {a.job_max_tokens}, checkpoint every "
        f"{a.job_checkpoint_rows} rows, concurrency {b.concurrency}",
        ["path", "rows", "wall s", "rows/s", "gen tok/s", "x engine", "overhead", "MLX peak MB", "RSS peak MB",
         "same text as engine"],
    )
    e_run, j_run = eng.median, job.median
    tab.rows.append(["engine (build + generate + close)", e_run.rows, eng.wall_s, eng.rows_per_s, eng.gen_tps,
                     1.0, None, e_run.mlx_peak / MB, e_run.rss_peak / MB, f"{len(ref)}/{len(ref)}"])
    tab.rows.append(["engine (generate only)", e_run.rows, gen_only, e_run.rows / gen_only,
                     e_run.gen_tokens / gen_only, ratio(e_run.rows / gen_only, eng.rows_per_s), None, None, None,
                     None])
    tab.rows.append(["job (validate + run)", j_run.rows, job.wall_s, job.rows_per_s, job.gen_tps,
                     ratio(job.rows_per_s, eng.rows_per_s), f"{over:+.1%}", j_run.mlx_peak / MB, j_run.rss_peak / MB,
                     f"{same}/{n} ({same / n:.0%})"])
    tab.notes += [
        f"median of {repeats} interleaved runs per path; overhead = job wall / engine wall - 1 = {over:+.1%} "
        f"against build + generate + close (target <= +5%); {over_gen:+.1%} against generate() alone. "
        f"Per-repeat paired overheads: {', '.join(f'{p:+.1%}' for p in paired)}.",
        "job = validate_job(job.yaml) + JobRunner(spec, progress=False).run() in process (model already loaded: "
        "the bench holds the job's own ModelSpec in REGISTRY, so the job shares that object); a fresh output "
        f"folder each run ({j_run.extra['shards']} shards, {j_run.extra['shard_bytes'] / 1024:,.0f} KiB; "
        f"results.parquet {j_run.extra['results_bytes'] / 1024:,.0f} KiB). Not timed: the CLI's process start "
        "and model load.",
        "engine = Engine(loaded, EngineConfig(<the job's engine section>, seed)) on the same rendered prompts "
        "with the job's SamplingParams (greedy: a seed could not change the output); EngineCore "
        "construction (with its warm-up) is inside both paths.",
        f"generated tokens: engine {e_run.gen_tokens}, job {j_run.gen_tokens} of {n * a.job_max_tokens} at most "
        f"(EOS is on in both); job error rows: {j_run.extra['errors']}.",
    ]

    split = Table("job vs engine alone: where the time goes (median run, seconds)",
                  ["path", "wall", "validate", "engine build", "count rows", "engine steps", "checkpoint appends",
                   "finalize (Parquet)", "other (host)"])
    ep = e_run.extra["profile"]
    split.rows.append(["engine", e_run.wall_s, None, e_run.extra["init_s"], None, ep["total_s"], None, None,
                       max(0.0, e_run.wall_s - e_run.extra["init_s"] - ep["total_s"])])
    st, jp = j_run.extra["stages"], j_run.extra["profile"]
    known = (j_run.extra["validate_s"] + st.get("EngineCore", 0) + st.get("count_rows", 0) + jp["total_s"]
             + st.get("append", 0) + st.get("finalize", 0))
    split.rows.append(["job", j_run.wall_s, j_run.extra["validate_s"], st.get("EngineCore"), st.get("count_rows"),
                       jp["total_s"], f"{st.get('append', 0):.3f} ({j_run.extra['calls'].get('append', 0)} shards)",
                       st.get("finalize"), max(0.0, j_run.wall_s - known)])
    split.notes += [
        "engine steps = StepProfile.total_s (every EngineCore.step: scheduling, forwards, sampling, detokenizing). "
        f"Engine: prefill {ep['prefill_s']:.2f} s, decode {ep['decode_s']:.2f} s, {ep['steps']} steps; job: "
        f"prefill {jp['prefill_s']:.2f} s, decode {jp['decode_s']:.2f} s, {jp['steps']} steps.",
        "job stages timed by wrapping EngineCore(...), count_rows, CheckpointStore.append (write, fsync, rename, "
        "manifest rewrite) and finalize (re-read + re-render the input for the expected keys, then the Parquet) "
        "for the run; other = wall minus the named stages: reading and preparing rows (render, sampling params, "
        "result key), building records, the report, _SUCCESS. Engine other = generate()'s submission (tokenizing) "
        "and close().",
    ]
    tab.raw = {k: {**m.as_dict(), "median_run": {**m.median.as_dict(), "extra": {
        k2: v for k2, v in m.median.extra.items() if k2 != "texts"}}} for k, m in res.items()}
    return [tab, split]


# -- part 2: streaming memory (parent side) ----------------------------------------------------------------
def stream_memory(b: Any) -> Any:
    from bench import Table

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
            cmd = [sys.executable, str(Path(__file__).resolve()), "--stream-child", str(inputs[n]), str(out),
                   "--every", str(a.stream_checkpoint_rows)] + (["--track-ids"] if track else [])
            log(f"stream: {n:,} rows{' + id tracker' if track else ''} in a fresh process")
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.stream_timeout)
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
                         r["anon_peak"] / MB, r["maxrss"] / base if base else None])
    tab.notes += [
        "each size runs in its own `python scripts/bench_job.py --stream-child` process (imports mlxbatch.io only: "
        "pyarrow, numpy; no MLX), so its peak RSS is that size's alone: VmHWM from /proc/self/status (which counts "
        "touched pages of the memory-mapped shards too; getrusage's ru_maxrss is not used because Linux carries "
        "the parent's RSS into it across fork + exec); 'peak anon' = the highest RssAnon sampled every 20 ms "
        "(heap only, no file pages).",
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


def job_section(b: Any) -> list[Any]:
    a = b.args
    repeats = a.repeats if a.repeats_given else 3
    tables = job_overhead(b, repeats) if a.job_rows else []
    if a.stream_rows.strip():
        tables.append(stream_memory(b))
    return tables


# -- part 2: streaming memory (the child process) ----------------------------------------------------------
def _status_kb(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _maxrss() -> int:
    """Peak RSS of this process: VmHWM (the high-water mark of this process image's memory).

    Not getrusage's ru_maxrss here: on Linux it keeps the parent's RSS across fork + exec (the bench parent
    holds a model), so a child started from a big process reports at least the parent's size.
    """
    hwm = _status_kb("VmHWM")
    return hwm * 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def stream_child(inp: str, out: str, every: int, track_ids: bool) -> dict[str, Any]:
    import mlxbatch.io as mio
    from mlxbatch.types import SamplingParams

    rss_imports = _maxrss()
    anon_peak = [_status_kb("RssAnon") * 1024]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            anon_peak[0] = max(anon_peak[0], _status_kb("RssAnon") * 1024)

    threading.Thread(target=sample, daemon=True).start()
    params = mio.canonical_params(SamplingParams(temperature=0.0, max_tokens=16))
    identity = "0123456789abcdef"
    model = f"/models/bench@{identity}"
    spec = mio.InputSpec(inp, id_column="id")

    def key_of(row: Any) -> str:
        return mio.result_key(row.row_id, f"Summarise: {row.fields.get('text')}\n", identity, params, None)

    t0 = time.perf_counter()
    rows = 0
    with mio.CheckpointStore(out) as store:
        ids = mio.DuplicateIdTracker() if track_ids else None
        buf: list[Any] = []
        for row in mio.open_reader(spec):
            if ids is not None:
                ids.add(row.row_id)
            text = row.fields.get("text") or ""
            fake = " ".join(WORDS[(rows * 7 + k) % len(WORDS)] for k in range(10))
            buf.append(mio.ResultRecord(
                row_id=row.row_id, key=key_of(row), inputs={k: v for k, v in row.fields.items() if k != "id"},
                text=fake, finish_reason="length", prompt_tokens=len(text) // 4 + 3, generated_tokens=16,
                latency_s=0.25, ttft_s=0.05, model=model, params=params))
            rows += 1
            if len(buf) >= every:
                store.append(buf)
                buf = []
        if buf:
            store.append(buf)
        ids = None
        t1 = time.perf_counter()
        maxrss_stream = _maxrss()

        def expected() -> Iterator[Any]:
            seen = mio.DuplicateIdTracker() if track_ids else None
            for row in mio.open_reader(spec):
                if seen is not None:
                    seen.add(row.row_id)
                yield mio.ExpectedRow(row.row_id, key_of(row))

        final = mio.finalize(store, out, expected())
        t2 = time.perf_counter()
        shards = store.shards
    stop.set()
    anon_peak[0] = max(anon_peak[0], _status_kb("RssAnon") * 1024)
    assert final.rows == rows and final.ok_rows == rows, (final, rows)
    return {"rows": rows, "track_ids": track_ids, "wall_s": t2 - t0, "stream_s": t1 - t0, "finalize_s": t2 - t1,
            "shards": len(shards), "shard_bytes": sum(s.bytes for s in shards),
            "results_bytes": final.results_path.stat().st_size, "rss_imports": rss_imports,
            "maxrss_stream": maxrss_stream, "maxrss": _maxrss(), "anon_peak": anon_peak[0],
            "rss_file_end": _status_kb("RssFile") * 1024,
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="internal: the streaming-memory child of `bench.py --section job`")
    ap.add_argument("--stream-child", nargs=2, metavar=("INPUT", "OUT_DIR"), required=True)
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--track-ids", action="store_true")
    args = ap.parse_args(argv)
    print(json.dumps(stream_child(*args.stream_child, args.every, args.track_ids)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
