"""Run statistics and the run report (report.json).

Owns what the report says and where each figure comes from:
- **On disk, all runs.** ``rows`` (output / ok / errors), ``errors_by_kind``, ``tokens`` and ``accuracy`` (the
  evaluation figures, ``report.metrics``) are read from the final results.parquet, so they describe the results as
  they are, whichever runs made them (a resume that redid nothing still reports the 26 error rows an earlier run
  wrote). A run stopped by
  ``max_error_rate`` before every row finished counts the current rows checkpointed so far
  (``summarize_checkpointed``) and says why it stopped (``stopped``).
- **This run.** ``this_run``: rows finished and resumed, its errors, tokens, speed and wall time.
- **The last run that did work.** Speed, the engine profile, ``prefix_reuse`` and ``plan`` come from the last run
  that finished rows (``run_figures_from`` says which): re-running a completed job keeps the real run's figures
  instead of writing zeros over them. A run that finished rows keeps its figures in the manifest too
  (``WORK_RUN_META``), once its rows are checkpointed and again with its report: a run killed after that save but
  before report.json still has them for the next run (one killed in the moment between its last shard and the save
  has not: the next run then reports the figures of the run before it, or its own).
"""

from __future__ import annotations

import collections
import json
import platform
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq

from mlxbatch.io import CheckpointStore, ExpectedRow, ResultRecord, finalize
from mlxbatch.job.report.metrics import evaluate
from mlxbatch.job.report.snapshot import job_path, job_snapshot, versions
from mlxbatch.job.spec import JobSpec

_CHECKPOINTED_NAME = ".checkpointed.parquet.tmp"  # summarize_checkpointed's file (a leftover is a temporary file)
WORK_RUN_META = "last_work_run"  # manifest metadata: the figures of the last run that finished rows
_RUN_FIGURES = ("generated_tokens_per_s", "prompt_tokens_per_s", "rows_per_s", "wall_s", "prefix_reuse", "plan",
                "vision_cache", "engine")


@dataclass(frozen=True)
class DiskSummary:
    """What results.parquet holds, whichever runs wrote its rows."""

    rows: int
    errors: int
    errors_by_kind: dict[str, int]
    prompt_tokens: int
    generated_tokens: int
    accuracy: dict[str, Any] | None

    @property
    def ok(self) -> int:
        return self.rows - self.errors


def summarize_results(results: Path, *, with_missing: bool = True) -> DiskSummary:
    """Counts over the final results file, streamed by row group. ``with_missing`` False: rows without a result
    (``error_kind`` "missing", written by ``finalize(allow_missing=True)``) are left out."""
    kinds: collections.Counter[str] = collections.Counter()
    rows = errors = prompt = generated = 0
    with pq.ParquetFile(results) as pf:
        for batch in pf.iter_batches(columns=["error", "error_kind", "prompt_tokens", "generated_tokens"]):
            rows += batch.num_rows
            failed = pc.is_valid(batch.column("error"))
            errors += pc.sum(failed.cast("int64")).as_py() or 0
            for kind in pc.filter(batch.column("error_kind"), failed).to_pylist():
                kinds[kind or "error"] += 1
            prompt += pc.sum(batch.column("prompt_tokens")).as_py() or 0
            generated += pc.sum(batch.column("generated_tokens")).as_py() or 0
    if not with_missing:
        missing = kinds.pop("missing", 0)
        rows, errors = rows - missing, errors - missing
    return DiskSummary(rows, errors, dict(kinds.most_common()), prompt, generated,
                       evaluate(results, with_missing=with_missing))


def summarize_checkpointed(store: CheckpointStore, out_dir: Path, expected: Iterable[ExpectedRow],
                           **columns: Any) -> DiskSummary:
    """The current rows checkpointed so far, all runs (for a run stopped before every row finished): written as
    ``finalize`` writes results (current keys; ``correct`` against the current gold), into a temporary file beside
    the outputs with the rows not run yet marked missing, counted without those, and removed. ``columns``:
    finalize's column arguments."""
    try:
        final = finalize(store, out_dir, expected, allow_missing=True, filename=_CHECKPOINTED_NAME, **columns)
        return summarize_results(final.results_path, with_missing=False)
    finally:
        (out_dir / _CHECKPOINTED_NAME).unlink(missing_ok=True)


@dataclass
class RunStats:
    total: int | None = None  # input rows (an upper bound for JSONL: blank lines count)
    finished: int = 0  # rows finished in this run (successes and errors)
    skipped: int = 0  # rows already checkpointed by an earlier run
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    resumed_shards: int = 0
    final_rows: int = 0
    started: float = field(default_factory=time.monotonic)
    # where the wall outside the engine's steps goes: the engine idle while the feed's next window was prepared
    # (the run's start, mostly), and the end after the last row was checkpointed (results.parquet, the summary)
    rows_wait_s: float = 0.0
    rows_done_s: float | None = None  # seconds from the start when every row was finished and checkpointed
    collector_s: float = 0.0  # seconds Python's cyclic garbage collector ran while rows were generated (any thread)
    # CPU seconds of the run's thread while rows were generated (the engine's steps and the job layer) and of the
    # feed's thread over the pass (reading, rendering, tokenizing, planning; its first window is prepared during the
    # engine's warm-up): both mostly hold the one GIL
    run_thread_cpu_s: float = 0.0
    feed_cpu_s: float = 0.0
    feed_workers: int = 0  # worker processes that rendered, tokenized and planned the rows (0: the feed's thread)
    engine_process: bool = False  # the engine ran in a process of its own (``job.executors.process``)
    errors_by_kind: collections.Counter[str] = field(default_factory=collections.Counter)
    engine: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    accuracy: dict[str, Any] | None = None  # over every row of the results (all runs)
    disk: DiskSummary | None = None  # the final results file, once written
    batch_invariant: bool = False  # every output row computed with engine.batch_invariant (this run and earlier ones)

    def add(self, record: ResultRecord) -> None:
        self.finished += 1
        if record.error is not None:
            self.errors += 1
            self.errors_by_kind[record.error_kind or "error"] += 1
        self.prompt_tokens += record.prompt_tokens
        self.generated_tokens += record.generated_tokens

    @property
    def wall_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / max(self.wall_s, 1e-9)

    def prefix_reuse(self) -> dict[str, Any]:
        """This run's prefill against the plan: ``saving`` is the measured counterpart of ``mlxbatch plan``'s
        predicted saving; ``window_floor_tokens`` each window's trie floor, summed (a windowed run can compute less:
        the prefix cache outlives a window); ``floor_tokens`` the least prefill any order of these rows can do, given
        only when the rows were planned as one window (None otherwise: no whole-job trie is built)."""
        prof = self.engine.get("profile", {})
        computed = prof.get("prefill_tokens", 0)
        window_floor = self.plan.get("distinct_tokens", 0)
        floor = window_floor if self.plan.get("windows", 0) <= 1 else None
        cached = (self.engine.get("prefix_cache") or {}).get("tokens_reused", 0)
        # prompt_tokens counts each row once (a score row: its context); the engine runs a score row with a
        # multi-token candidate as one sequence per candidate, so its sequences' prompt tokens (computed + cached)
        # can exceed the rows'
        sequences = computed + cached
        return {"prefill_tokens_computed": computed, "prompt_tokens": self.prompt_tokens,
                "sequence_prompt_tokens": sequences, "cached_tokens": cached,
                "saving": round(1 - computed / sequences, 4) if sequences else None,
                "floor_tokens": floor, "floor_ratio": round(computed / floor, 4) if floor else None,
                "window_floor_tokens": window_floor,
                "window_floor_ratio": round(computed / window_floor, 4) if window_floor else None}

    def _this_run(self, wall: float, finished_at: str) -> dict[str, Any]:
        return {"finished": self.finished, "resumed": self.skipped, "ok": self.finished - self.errors,
                "errors": self.errors, "errors_by_kind": dict(self.errors_by_kind.most_common()),
                "tokens": {"prompt": self.prompt_tokens, "generated": self.generated_tokens},
                "generated_tokens_per_s": round(self.generated_tokens / max(wall, 1e-9), 2),
                "prompt_tokens_per_s": round(self.prompt_tokens / max(wall, 1e-9), 2),
                "rows_per_s": round(self.finished / max(wall, 1e-9), 3), "wall_s": round(wall, 3),
                "waiting_for_rows_s": round(self.rows_wait_s, 3),
                "writing_results_s": round(wall - self.rows_done_s, 3) if self.rows_done_s is not None else None,
                "garbage_collector_s": round(self.collector_s, 3),
                "cpu_s": {"run_thread": round(self.run_thread_cpu_s, 3), "feed_thread": round(self.feed_cpu_s, 3)},
                "feed_workers": self.feed_workers, "engine_process": self.engine_process, "finished_at": finished_at}

    def _figures(self, this: dict[str, Any]) -> dict[str, Any]:
        return {**{k: this[k] for k in _RUN_FIGURES if k in this}, "prefix_reuse": self.prefix_reuse(),
                "plan": self.plan, "vision_cache": self.engine.get("vision_cache"), "engine": self.engine}

    def work_figures(self) -> dict[str, Any]:
        """This run's figures as a later run that finishes no rows reports them (``earlier_work``)."""
        this = self._this_run(self.wall_s, time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        return {"last_work_run": this, **self._figures(this)}

    def report(self, spec: JobSpec, loaded: Any, earlier: dict[str, Any] | None = None,
               stopped: str | None = None, failed: str | None = None) -> dict[str, Any]:
        """The report of this run; ``earlier`` is the last run that did work's figures (``earlier_work``: kept
        when this run finished no rows). ``status``: ``stopped`` (``max_error_rate`` passed before every row
        finished; why in ``stopped``), ``failed`` (every row finished, more failed than it allows; why in
        ``failed``), else ``complete`` (``_SUCCESS`` follows)."""
        wall = self.wall_s
        finished_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        this = self._this_run(wall, finished_at)
        figures = self._figures(this)
        work_run, figures_from = this, "this run"
        if self.finished == 0 and earlier is not None:  # nothing ran: keep the figures of the run that did work
            work_run = earlier["last_work_run"]
            figures = {k: earlier[k] for k in _RUN_FIGURES if k in earlier}
            figures_from = f"an earlier run (finished at {work_run.get('finished_at', '?')})"
        disk = self.disk
        rows = {"output": disk.rows if disk else self.final_rows, "ok": disk.ok if disk else self.finished - self.errors,
                "errors": disk.errors if disk else self.errors, "finished_this_run": self.finished,
                "resumed": self.skipped}
        return {
            "status": "stopped" if stopped is not None else "failed" if failed is not None else "complete",
            **({"stopped": stopped} if stopped is not None else {}),
            **({"failed": failed} if failed is not None else {}),
            "job": job_path(spec),
            "trial": list(spec.trial) or None,
            "output": str(spec.output),
            "versions": versions(),
            "job_snapshot": job_snapshot(spec),
            "model": {"path": spec.model.path, "identity": loaded.identity, "dtype": loaded.dtype},
            "device": self.engine.get("device"),
            "batch_invariant": self.batch_invariant,
            "host": platform.node(),
            "rows": rows,
            "errors_by_kind": disk.errors_by_kind if disk else dict(self.errors_by_kind),
            "tokens": {"prompt": disk.prompt_tokens, "generated": disk.generated_tokens} if disk
            else {"prompt": self.prompt_tokens, "generated": self.generated_tokens},
            **({"accuracy": self.accuracy} if self.accuracy is not None else {}),
            "this_run": this,
            "last_work_run": work_run,
            "run_figures_from": figures_from,
            **figures,
            "finished_at": finished_at,
        }


def earlier_work(store: CheckpointStore, out_dir: Path) -> dict[str, Any] | None:
    """The figures of the last run that finished rows (``last_work_run`` and the run figures): the manifest's, else
    (a folder written before the manifest kept them) the earlier report.json's; None when no run did work."""
    saved = store.get_meta(WORK_RUN_META)
    if isinstance(saved, dict) and isinstance(saved.get("last_work_run"), dict):
        return saved
    previous = previous_report(out_dir)
    work = _work_run_of(previous)
    if previous is None or work is None:
        return None
    return {"last_work_run": work, **{k: previous[k] for k in _RUN_FIGURES if k in previous}}


def work_of(report: dict[str, Any]) -> dict[str, Any]:
    """The part of a report that a later run finishing no rows keeps (``WORK_RUN_META``)."""
    return {k: report[k] for k in ("last_work_run", *_RUN_FIGURES) if k in report}


def previous_report(out_dir: Path) -> dict[str, Any] | None:
    """The folder's report.json from an earlier run (None when there is none or it does not read)."""
    try:
        return json.loads((out_dir / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _work_run_of(previous: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``this_run`` figures of the last run that finished rows, from an earlier report (None: none did)."""
    if not previous:
        return None
    if isinstance(previous.get("last_work_run"), dict):
        return previous["last_work_run"] if previous["last_work_run"].get("finished") else None
    rows = previous.get("rows") or {}
    if rows.get("finished_this_run"):  # a report written before this_run existed
        return {"finished": rows["finished_this_run"], "resumed": rows.get("resumed", 0),
                "generated_tokens_per_s": previous.get("generated_tokens_per_s"), "wall_s": previous.get("wall_s"),
                "finished_at": previous.get("finished_at")}
    return None
