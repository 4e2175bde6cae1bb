"""The job loop: read -> prepare -> skip done -> executor -> checkpoint -> final outputs.

Owns one run of a job. The output folder is checked and locked before anything in it changes or a model loads
(``job.check.outdir``). Rows stream in with bounded memory (at most a few batches in flight) to an executor
(``job.executors``: this process's engine, or engine actors on a Ray cluster), finished results are
checkpointed in atomic shards every N rows or T seconds, and only when every row is done (and every shard still
matches its checksum: a shard that does not is set aside and its rows redone) are the final Parquet, the OpenAI
Batch output, the run report and the success marker written, all under the lock. SIGINT/SIGTERM finish the
current shard and stop cleanly (``job.run.stopping``: a second signal exits at once, still safe); past
``max_error_rate`` (``job.run.error_rate``: rows in input order, earlier runs included, and all rows at the end) the job
stops with a clear error, keeping what finished. What the run keeps in the manifest besides rows (the job as parsed,
the first run's plan, batch invariance) is ``job.run.run_meta``'s.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from mlxbatch.errors import MlxbatchError
from mlxbatch.io import (
    CheckpointError,
    CheckpointStore,
    ExpectedRow,
    FinalOutputs,
    InputFormat,
    InputRow,
    OutputError,
    ResultRecord,
    clear_success,
    finalize,
    input_planner,
    input_schema,
    mark_success,
    open_reader,
    resolve_inputs,
    write_dataset_card,
    write_openai_batch_output,
    write_report,
)
from mlxbatch.io.expected import ExpectedSpool
from mlxbatch.job.check.outdir import claim_output, prepare_output, release_unused
from mlxbatch.job.check.validate import input_spec
from mlxbatch.job.executors import open_executor
from mlxbatch.job.executors.base import Executor, ExecutorError, ModelInfo
from mlxbatch.job.executors.interpreter import generating
from mlxbatch.job.executors.placement import job_rows
from mlxbatch.job.report.progress import Progress
from mlxbatch.job.report.report import (
    WORK_RUN_META,
    RunStats,
    earlier_work,
    summarize_checkpointed,
    summarize_results,
    work_of,
)
from mlxbatch.job.report.snapshot import results_metadata
from mlxbatch.job.rows.feed import Resumed, RowFeed
from mlxbatch.job.rows.prepare import PreparedRow, RowPreparer
from mlxbatch.job.rows.tasks import output_columns, prompt_text, record_for
from mlxbatch.job.rows.workers import WORKERS_ENV, feed_workers, spawn, stop
from mlxbatch.job.run.checkpointer import Checkpointer
from mlxbatch.job.run.error_rate import ErrorRate
from mlxbatch.job.run.run_meta import follow_saved_plan, record_invariance, save_job_meta
from mlxbatch.job.run.stopping import StopSignals
from mlxbatch.job.spec import JobSpec
from mlxbatch.types import RequestOutput

log = logging.getLogger(__name__)

REDO_PASSES = 3  # runs over the input after shards failed their checksum at the end


class JobInterrupted(MlxbatchError):
    """Stopped by a signal after checkpointing what had finished; run again to resume."""


class JobFailed(MlxbatchError):
    """Too many rows failed (``max_error_rate``); what finished is checkpointed."""


class _ErrorBudgetSpent(Exception):
    """``max_error_rate`` passed while rows were running: ``run`` writes the report, then raises JobFailed."""

    def __init__(self, message: str, stats: RunStats) -> None:
        super().__init__(message)
        self.message, self.stats = message, stats


class OutputInUse(MlxbatchError):
    """Another run holds the output folder."""


@dataclass(frozen=True)
class RunResult:
    out_dir: str
    report: dict[str, Any]


class JobRunner:
    """One run of a job. ``exit_on_second_signal`` (the command line): a second Ctrl-C leaves at once; off (notebooks,
    ``run_job``), it stops what is in flight, checkpoints what finished and raises JobInterrupted, so the process
    lives on. Off the main thread no signal handler is installed: call ``request_stop`` to stop."""

    def __init__(self, spec: JobSpec, progress: bool | None = None, exit_on_second_signal: bool = True,
                 resume_hint: str = "Run the same command to resume.", engine: Any = None) -> None:
        self.spec = spec
        self._engine = engine  # its engine's process, started already (``placement.early_engine``), or None
        self.resume_hint = resume_hint  # the end of JobInterrupted's message (run_job words it for Python)
        self.progress = sys.stderr.isatty() if progress is None else progress
        self._stop = StopSignals(exit_on_second_signal)
        self._loaded = False  # the executor is up (the model loaded): a failure from here on is no failed start
        self._tokenizer: Any = None
        self._total: int | None = None  # input rows (counted before the model loads)
        # the feed's worker processes, started before the model loads (their imports overlap it) until the first
        # pass's feed adopts them; the rest are stopped when the run ends
        self._spawned: list[Any] = []

    def request_stop(self) -> None:
        """Stop as a first Ctrl-C would: finished rows are checkpointed, then ``run`` raises JobInterrupted."""
        self._stop.request()

    @staticmethod
    def _rows(spec: JobSpec) -> Iterator[InputRow]:
        rows = open_reader(input_spec(spec))
        limit = spec.input.limit
        return itertools.islice(rows, limit) if limit is not None else rows

    def _open_store(self) -> CheckpointStore:
        """The output folder's checkpoint, locked for this run, opened before the model loads."""
        try:
            return CheckpointStore(self.spec.output)
        except CheckpointError as exc:
            if isinstance(exc.__cause__, BlockingIOError):
                raise OutputInUse(f"{exc} (e.g. --output DIR)") from exc
            raise

    # -- run -------------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        spec = self.spec
        with self._stop.installed():
            folder = prepare_output(spec)
            with self._open_store() as store:  # locked first: a refused run changes nothing in the folder
                try:
                    claim_output(spec, store)
                    report = self._run(store)
                except BaseException:
                    if not self._loaded:  # a start that failed: a new folder is left as it was, not claimed
                        release_unused(folder)
                    raise
            return RunResult(str(spec.output), report)

    def _run(self, store: CheckpointStore) -> dict[str, Any]:
        """Load the model, run every row not checkpointed, write the outputs; returns the report written."""
        spec = self.spec
        is_openai = any(r.format is InputFormat.OPENAI_BATCH for r in resolve_inputs(input_spec(spec)))
        earlier = earlier_work(store, spec.output)  # read before this run records its own
        progress = Progress(self.progress, None)
        self._total = job_rows(spec)
        self._spawned = spawn(feed_workers(self._total))
        try:
            return self._load_and_run(store, spec, is_openai, earlier, progress)
        finally:
            stop(self._spawned, at_once=True)  # none adopted (the load failed, or no rows to run): no work

    def _load_and_run(self, store: CheckpointStore, spec: JobSpec, is_openai: bool, earlier: dict[str, Any] | None,
                      progress: Progress) -> dict[str, Any]:
        progress.loading(spec.model.path)
        # an engine here or in its own process, or Ray actors
        with open_executor(spec, self._total, self._engine) as executor:
            self._loaded = True
            clear_success(spec.output)  # loaded: from here on the outputs change (a failed load keeps them)
            model = executor.model
            progress.engine(model.batch)
            save_job_meta(store, spec, model)
            spec = follow_saved_plan(store, spec)  # a resumed run plans the first run's windows
            final, stats = self._rows_to_results(spec, store, executor, is_openai, earlier)
        stats.disk = summarize_results(final.results_path)
        stats.accuracy = stats.disk.accuracy
        limit = ErrorRate(spec.error_limit(is_openai))
        failed = None
        if limit.exceeded_at_end(final.rows, final.error_rows):
            failed = (limit.message(final.rows, final.error_rows, str(spec.output))
                      + f"; results.parquet holds every row (no _SUCCESS). Errors by kind (all runs): "
                      f"{stats.disk.errors_by_kind}")
        report = stats.report(spec, model, earlier, failed=failed)
        write_report(spec.output, report)
        self._keep_work(store, stats, report)
        write_dataset_card(spec.output)
        if failed is not None:
            raise JobFailed(failed)
        mark_success(spec.output)
        return report

    def _rows_to_results(self, spec: JobSpec, store: CheckpointStore, executor: Executor, is_openai: bool,
                         earlier: dict[str, Any] | None) -> tuple[FinalOutputs, RunStats]:
        """Every row not checkpointed yet, run; then results.parquet (and the OpenAI output) written from the rows
        as the first pass read them (``ExpectedSpool``): the input is read once."""
        model = executor.model
        batch_invariant = record_invariance(store, spec)
        columns = dict(keep_columns=spec.input.columns, **output_columns(spec, model.tokenizer, self._input_schema()))
        # (the spool shows the results' input-column planner each chunk of inputs as the feed reads them)
        spool = ExpectedSpool(spec.output, input_planner(columns["keep_columns"], columns["input_types"]))
        try:
            try:
                stats = self._generate(spec, store, executor, is_openai, spool=spool)
                stats.batch_invariant = batch_invariant
                for _ in range(REDO_PASSES):  # shards that no longer match their checksum: redo their rows
                    if not store.verify():
                        break
                    log.warning("checkpoint shards changed on disk were set aside; redoing their rows")
                    self._generate(spec, store, executor, is_openai, stats)
            except _ErrorBudgetSpent as stop:  # the report of what is on disk, then the error
                stats = stop.stats
                stats.batch_invariant = batch_invariant
                stats.disk = summarize_checkpointed(store, spec.output, self._expected(spec, model, is_openai),
                                                    **columns)
                stats.accuracy = stats.disk.accuracy
                message = f"{stop.message}. Errors by kind (all runs): {stats.disk.errors_by_kind}"
                report = stats.report(spec, model, earlier, stopped=message)
                write_report(spec.output, report)
                self._keep_work(store, stats, report)
                raise JobFailed(message) from None
            assert spool.complete, "a pass that ends without an interrupt has read every row"
            stats.rows_done_s = stats.wall_s
            executor.rows_done()  # (an engine in a process of its own exits while the results are written)
            final = finalize(store, spec.output, spool.columns(), **columns,
                             metadata=results_metadata(spec, batch_invariant))
            stats.final_rows = final.rows
            if is_openai:  # each row's endpoint from the input (input.columns may leave `url` out of the results)
                write_openai_batch_output(final.results_path, spec.output, urls=spool.urls())
            return final, stats
        finally:
            spool.remove()

    @staticmethod
    def _keep_work(store: CheckpointStore, stats: RunStats, report: dict[str, Any] | None = None) -> None:
        """A run that finished rows keeps its figures in the manifest (its report's, once written): a later run with
        nothing left to do reports them, even when this one is killed before its report."""
        if stats.finished:
            store.set_meta(WORK_RUN_META, work_of(report) if report is not None else stats.work_figures())

    def _expected(self, spec: JobSpec, model: ModelInfo, is_openai: bool) -> Iterator[ExpectedRow]:
        """The current rows in input order, with their current input columns (the results show those), by reading
        the input again: only where the run stopped before reading all of it (``max_error_rate``)."""
        preparer = _preparer(spec, model, is_openai)
        for row in self._rows(spec):
            prep = preparer.prepare(row)
            yield ExpectedRow(prep.row_id, prep.key, prep.inputs)

    def _input_schema(self) -> Any:
        return input_schema(input_spec(self.spec))

    def _generate(self, spec: JobSpec, store: CheckpointStore, executor: Executor, is_openai: bool,
                  redo_of: RunStats | None = None, spool: ExpectedSpool | None = None) -> RunStats:
        """Run every row whose current key is not checkpointed. ``redo_of``: a second pass adding to those stats
        (its resumed rows were counted by the first). ``spool``: where the pass records every row it reads."""
        model = executor.model
        self._tokenizer = model.tokenizer
        done = store.done_keys()
        workers = feed_workers(self._total)  # processes that prepare rows off this one's GIL (MLXBATCH_FEED_WORKERS)
        spawned, self._spawned = self._spawned, []  # (the first pass's: started before the model loaded)
        feed = RowFeed(self._rows(spec), _preparer(spec, model, is_openai), model.tokenizer, done,
                       window=spec.plan.window, planned=spec.plan.enabled, done_errors=store.error_keys(),
                       min_step_tokens=model.reuse_step, spool=spool, keep_urls=is_openai, background=True,
                       workers=workers, spawned=spawned, ramp=spec.plan.ramp)
        if workers:
            log.info("feed: %d worker process(es) render, tokenize and plan the rows (%s=0: none)", workers,
                     WORKERS_ENV)
        # the interpreter's settings for rows (restored below: the process may be a notebook's), from the warm-up on:
        # it runs beside the feed's thread, and gets the GIL back sooner after each evaluation with a short interval
        settings = ExitStack()
        collector = settings.enter_context(generating())
        feed.start()  # the first window is prepared while the engine warms up (a GPU compiles its kernels)
        try:
            executor.warm_up()
        except BaseException:
            settings.close()
            feed.close()
            raise
        if redo_of is None:  # (the run's clock starts here: after the warm-up, as it did when loading ended with it)
            stats = RunStats(total=self._total, resumed_shards=len(store.shards))
        else:
            stats = redo_of
        stats.feed_workers = workers
        stats.engine_process = executor.engine_process
        errors = ErrorRate(spec.error_limit(is_openai))
        bar = Progress(self.progress and redo_of is None, stats.total)
        bar.start()
        buffer: list[ResultRecord] = []
        last_flush = time.monotonic()
        cpu0 = time.thread_time()

        writer = Checkpointer(store)  # shards are made durable on its thread while the engine steps

        def flush(wait: bool = True) -> None:
            """Hand the finished rows to the writer; ``wait``: until every row handed over is checkpointed."""
            nonlocal last_flush
            writer.put(buffer)
            buffer.clear()
            if wait:
                writer.drain()
            last_flush = time.monotonic()

        def finish(record: ResultRecord, index: int) -> None:
            buffer.append(record)
            stats.add(record)
            errors.finished(index, record.error is not None)
            bar.finished()

        try:
            while True:
                if not feed.finished and self._stop.signum is None:
                    skipped = feed.skipped
                    idle, t0 = not executor.busy, time.monotonic()  # an idle engine waits for the next window
                    for item in executor.take(feed):  # rows go to the engine(s); the feed's other items come back
                        if isinstance(item, Resumed):
                            errors.finished(item.index, item.error)
                        else:
                            finish(self._record(spec, item.prep, None, model.identity, item.error, item.kind),
                                   item.index)
                    if idle:
                        stats.rows_wait_s += time.monotonic() - t0
                    if redo_of is None:
                        stats.skipped += feed.skipped - skipped
                    bar.skipped(feed.skipped - skipped)
                if executor.busy and self._stop.signum is None:
                    for f in executor.poll():
                        finish(self._record(spec, f.prep, f.output, model.identity, f.error, f.error_kind,
                                            f.worker), f.index)
                now = time.monotonic()
                if len(buffer) >= spec.checkpoint.every_rows or now - last_flush >= spec.checkpoint.every_seconds:
                    flush(wait=False)
                bar.show(stats, executor.in_flight, executor)
                if errors.exceeded() and not (feed.finished and not executor.busy):  # all done: judged at the end
                    flush()
                    raise _ErrorBudgetSpent(errors.message(errors.rows, errors.errors, str(spec.output)), stats)
                if self._stop.signum is not None:
                    executor.abort()
                    flush()
                    raise JobInterrupted(f"{self._stop.reason}; {stats.finished} rows "
                                         f"checkpointed in {spec.output}. {self.resume_hint}")
                if feed.finished and not executor.busy:
                    flush()
                    break
        except KeyboardInterrupt:  # a second interrupt without exit_on_second_signal: stop now, keep what finished
            executor.abort()
            flush()
            raise JobInterrupted(f"interrupted again (Ctrl-C): stopped at once; {stats.finished} rows checkpointed "
                                 f"in {spec.output}. {self.resume_hint}") from None
        except (ExecutorError, OutputError):
            flush()  # what finished before the engines were lost (or the disk filled) is kept
            raise
        finally:
            settings.close()
            stats.collector_s += collector.seconds
            stats.run_thread_cpu_s += time.thread_time() - cpu0
            feed.close()
            stats.feed_cpu_s += feed.cpu_s
            bar.show(stats, executor.in_flight, executor, force=True)
            bar.close()
            stats.engine = executor.stats()  # the executor's whole life: every pass
            if redo_of is None:
                stats.plan = feed.stats.as_dict()
            writer.close()  # every row handed over is written (or its write failed) before the store is used again
            self._keep_work(store, stats)  # what finished is checkpointed (interrupted too: it may be every row)
        return stats

    def _record(self, spec: JobSpec, prep: PreparedRow, out: RequestOutput | None, model_identity: str,
                error: str | None = None, error_kind: str | None = None, worker: str | None = None) -> ResultRecord:
        params = prep.params_json
        model = f"{spec.model.path}@{model_identity}"
        prompt = prompt_text(spec, prep, self._tokenizer) if spec.task.keep_prompt else None
        if out is None:
            record = ResultRecord.failed(prep.row_id, prep.key, error or "unknown error", error_kind or "error",
                                         inputs=prep.inputs, model=model, params=params,
                                         extra={"rendered_prompt": prompt} if prompt is not None else {})
        else:
            record = record_for(prep, out, model, spec.task, prompt)
        if worker is not None:  # which engine actor ran it: kept in the shards, never in results.parquet
            record = dataclasses.replace(record, extra={**record.extra, "_worker": worker})
        return record


def _preparer(spec: JobSpec, model: ModelInfo, is_openai: bool) -> RowPreparer:
    """A fresh preparer for one pass over the input (it tracks the ids seen, so each pass needs its own)."""
    return RowPreparer(spec, model.identity, is_openai, model.takes_images, model.context_length)
