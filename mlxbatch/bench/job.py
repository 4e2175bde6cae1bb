"""The ``job`` section: what the job layer costs on top of the engine.

    .venv/bin/mlxbatch bench job --model tiny

Two parts:

1. **Overhead** (this module). ``--job-rows`` short JSONL rows (id + a text of 20-60 tokens) run as a job in
   process (``validate_job`` + ``JobRunner(spec, progress=False).run()``: read, render, key, engine, checkpoint
   shards, final Parquet, report, ``_SUCCESS``; a fresh output folder each run) and through the engine alone
   (``Engine(loaded, <the job's EngineConfig>).generate(<the same rendered prompts>, <the job's SamplingParams>)``).
   Both use the one model object: the bench acquires the job's own ``ModelSpec`` from ``REGISTRY``, so the job's
   ``REGISTRY.acquire`` shares it. Interleaved repeats, medians; overhead = job time / engine time - 1.
2. **Streaming memory** (``stream`` and ``stream_child``): for each of ``--stream-rows`` (10k, 100k, 1M) a fresh
   process streams that many rows through the reader and the checkpoint store and reports its peak RSS.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

import mlxbatch.job.executors.local as executor
import mlxbatch.job.run.runner as runner
from mlxbatch.bench.harness import MB, Bench, Measured, Run, Table, log, ratio, section
from mlxbatch.bench.jobdata import TEMPLATE, token_rows, write_jsonl
from mlxbatch.bench.stream import stream_memory
from mlxbatch.engine import REGISTRY, Engine, EngineConfig, ModelSpec
from mlxbatch.io.checkpoint import CheckpointStore
from mlxbatch.job.check.validate import validate_job
from mlxbatch.job.rows.prompts import PromptRenderer
from mlxbatch.job.run.runner import JobRunner


# -- part 1: the job against the engine alone --------------------------------------------------------------
class StageTimers:
    """Times the job's stages by wrapping what ``mlxbatch.job.run.runner`` and its local executor call (restored on exit);
    changes nothing."""

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
        saved = [(runner, n, getattr(runner, n)) for n in ("job_rows", "finalize")]
        saved.append((executor, "EngineCore", executor.EngineCore))  # the local executor builds the engine
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

    def __init__(self, b: Bench, tmp: Path) -> None:
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
        REGISTRY.release(self.model_spec, "bench:job")

    def write_job(self, tag: str, data: Path | None = None) -> Path:
        job = {**self.job, "output": str(self.tmp / f"out-{tag}")}
        if data is not None:
            job["input"] = {**job["input"], "path": str(data)}
        path = self.tmp / f"job-{tag}.yaml"
        path.write_text(yaml.safe_dump(job))
        return path

    def run_job(self, data: Path | None = None) -> Run:
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

    def run_engine(self, n: int | None = None) -> Run:
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


def _paired_overheads(job: Measured, eng: Measured, key: Any) -> list[float]:
    return [key(j) / key(e) - 1 for j, e in zip(job.runs, eng.runs)]


def job_overhead(b: Bench, repeats: int) -> list[Table]:
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
    known = (j_run.extra["validate_s"] + st.get("EngineCore", 0) + st.get("job_rows", 0) + jp["total_s"]
             + st.get("append", 0) + st.get("finalize", 0))
    split.rows.append(["job", j_run.wall_s, j_run.extra["validate_s"], st.get("EngineCore"), st.get("job_rows"),
                       jp["total_s"], f"{st.get('append', 0):.3f} ({j_run.extra['calls'].get('append', 0)} shards)",
                       st.get("finalize"), max(0.0, j_run.wall_s - known)])
    split.notes += [
        "engine steps = StepProfile.total_s (every EngineCore.step: scheduling, forwards, sampling, detokenizing). "
        f"Engine: prefill {ep['prefill_s']:.2f} s, decode {ep['decode_s']:.2f} s, {ep['steps']} steps; job: "
        f"prefill {jp['prefill_s']:.2f} s, decode {jp['decode_s']:.2f} s, {jp['steps']} steps.",
        "job stages timed by wrapping EngineCore(...), job_rows (the input's count), CheckpointStore.append (write, fsync, rename, "
        "manifest rewrite) and finalize (re-read + re-render the input for the expected keys, then the Parquet) "
        "for the run; other = wall minus the named stages: reading and preparing rows (render, sampling params, "
        "result key), building records, the report, _SUCCESS. Engine other = generate()'s submission (tokenizing) "
        "and close().",
    ]
    tab.raw = {k: {**m.as_dict(), "median_run": {**m.median.as_dict(), "extra": {
        k2: v for k2, v in m.median.extra.items() if k2 != "texts"}}} for k, m in res.items()}
    return [tab, split]


@section("job")
def job_section(b: Bench) -> list[Table]:
    """mlxbatch run (in process) vs the engine alone on the same rows; streaming memory at 10k-1M rows."""
    a = b.args
    repeats = a.repeats if a.repeats_given else 3
    tables = job_overhead(b, repeats) if a.job_rows else []
    if a.stream_rows.strip():
        tables.append(stream_memory(b))
    return tables
