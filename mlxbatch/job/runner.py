"""The job loop: read -> prepare -> skip done -> engine -> checkpoint -> final outputs.

Owns one run of a job. The output folder is checked and locked before anything in it changes or a model loads
(``job.outdir``). Rows stream in with bounded memory (at most a few batches in flight), finished results are
checkpointed in atomic shards every N rows or T seconds, and only when every row is done (and every shard still
matches its checksum: a shard that does not is set aside and its rows redone) are the final Parquet, the OpenAI
Batch output, the run report and the success marker written, all under the lock. SIGINT/SIGTERM finish the
current shard and stop cleanly (a second signal exits at once, still safe); past ``max_error_rate``
(``job.error_rate``: rows in input order, earlier runs included, and all rows at the end) the job stops with a
clear error, keeping what finished.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

from tqdm import tqdm

from mlxbatch.config import EngineConfig
from mlxbatch.engine import REGISTRY, EngineCore, ModelSpec
from mlxbatch.errors import InvalidRequestError, MlxbatchError
from mlxbatch.io import (
    CheckpointStore,
    ExpectedRow,
    InputFormat,
    InputSpec,
    ResultRecord,
    clear_success,
    count_rows,
    finalize,
    mark_success,
    open_reader,
    resolve_inputs,
    write_openai_batch_output,
    write_report,
)
from mlxbatch.job.error_rate import ErrorRate
from mlxbatch.job.feed import Failed, Resumed, RowFeed
from mlxbatch.job.media import ImageError
from mlxbatch.job.outdir import claim_output, prepare_output
from mlxbatch.job.prepare import PreparedRow, RowPreparer
from mlxbatch.job.report import RunStats, accuracy
from mlxbatch.job.spec import JobSpec
from mlxbatch.job.tasks import record_for, submit
from mlxbatch.types import RequestOutput

log = logging.getLogger(__name__)

REDO_PASSES = 3  # runs over the input after shards failed their checksum at the end


class JobInterrupted(MlxbatchError):
    """Stopped by a signal after checkpointing what had finished; run again to resume."""


class JobFailed(MlxbatchError):
    """Too many rows failed (``max_error_rate``); what finished is checkpointed."""


@dataclass(frozen=True)
class RunResult:
    out_dir: str
    report: dict[str, Any]


class JobRunner:
    def __init__(self, spec: JobSpec, progress: bool | None = None) -> None:
        self.spec = spec
        self.progress = sys.stderr.isatty() if progress is None else progress
        self._stop_signal: int | None = None

    # -- signals -------------------------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self._stop_signal is not None:
            os._exit(128 + signum)  # second signal: leave now; shards are atomic, nothing is corrupted
        self._stop_signal = signum
        log.warning("signal %d: finishing the current shard, then stopping (again to exit at once)", signum)

    def _input_spec(self) -> InputSpec:
        i = self.spec.input
        return InputSpec(i.path, format=i.format, id_column=i.id_column, split=i.split)

    # -- run -------------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        spec = self.spec
        is_openai = any(r.format is InputFormat.OPENAI_BATCH for r in resolve_inputs(self._input_spec()))
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        model_spec = ModelSpec(spec.model.path, spec.model.dtype, spec.model.adapter, spec.model.trust_remote_code)
        user = f"job:{spec.output}"
        try:
            prepare_output(spec)
            with CheckpointStore(spec.output) as store:  # locked first: a refused run changes nothing in the folder
                claim_output(spec, store)
                clear_success(spec.output)
                loaded = REGISTRY.acquire(model_spec, user)
                try:
                    stats = self._generate(store, loaded, is_openai)
                    for _ in range(REDO_PASSES):  # shards that no longer match their checksum: redo their rows
                        if not store.verify():
                            break
                        log.warning("checkpoint shards changed on disk were set aside; redoing their rows")
                        self._generate(store, loaded, is_openai, stats)
                    preparer = RowPreparer(spec, loaded.identity, is_openai, loaded.vlm is not None,
                                           loaded.context_length)
                    final = finalize(store, spec.output, self._expected(preparer), keep_columns=spec.input.columns,
                                     metadata={"mlxbatch.batch_invariant": str(stats.batch_invariant).lower()})
                    stats.final_rows = final.rows
                    stats.accuracy = accuracy(final.results_path)
                finally:
                    REGISTRY.release(model_spec, user)
                if is_openai:
                    write_openai_batch_output(final.results_path, spec.output)
                report = stats.report(spec, loaded)
                write_report(spec.output, report)
                limit = ErrorRate(spec.max_error_rate)
                if limit.exceeded_at_end(final.rows, final.error_rows):
                    raise JobFailed(limit.message(final.rows, final.error_rows, str(spec.output))
                                    + "; results.parquet holds every row (no _SUCCESS)")
                mark_success(spec.output)
            return RunResult(str(spec.output), report)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    def _expected(self, preparer: RowPreparer) -> Iterator[ExpectedRow]:
        """The current rows in input order, with their current input columns (the results show those)."""
        for row in open_reader(self._input_spec()):
            prep = preparer.prepare(row)
            yield ExpectedRow(prep.row_id, prep.key, prep.inputs)

    def _generate(self, store: CheckpointStore, loaded: Any, is_openai: bool,
                  redo_of: RunStats | None = None) -> RunStats:
        """Run every row whose current key is not checkpointed. ``redo_of``: a second pass adding to those stats
        (its resumed rows were counted by the first)."""
        spec = self.spec
        e = spec.engine
        core = EngineCore(loaded, EngineConfig(max_num_seqs=e.max_num_seqs,
                                               max_num_batched_tokens=e.max_num_batched_tokens,
                                               prefill_chunk_size=e.prefill_chunk_size,
                                               kv_memory_fraction=e.kv_memory_fraction,
                                               prefix_cache=e.prefix_cache, batch_invariant=e.batch_invariant,
                                               seed=spec.seed))
        preparer = RowPreparer(spec, loaded.identity, is_openai, loaded.vlm is not None, loaded.context_length)
        done = store.done_keys()
        stats = redo_of or RunStats(total=count_rows(self._input_spec()), resumed_shards=len(store.shards))
        errors = ErrorRate(spec.max_error_rate)
        bar = tqdm(total=stats.total, disable=not self.progress or redo_of is not None, unit="row",
                   dynamic_ncols=True)
        pending: dict[str, PreparedRow] = {}
        order: dict[str, int] = {}  # key -> input position of the rows in flight
        buffer: list[ResultRecord] = []
        last_flush = last_log = time.monotonic()
        self._save_plan_params(store)
        stats.batch_invariant = self._record_invariance(store)
        feed = RowFeed(open_reader(self._input_spec()), preparer, loaded.tokenizer, done,
                       window=self.spec.plan.window, planned=self.spec.plan.enabled, done_errors=store.error_keys())
        max_inflight = 4 * e.max_num_seqs

        def flush() -> None:
            nonlocal last_flush
            if buffer:
                store.append(buffer)
                buffer.clear()
            last_flush = time.monotonic()

        def finish(record: ResultRecord, index: int) -> None:
            buffer.append(record)
            stats.add(record)
            errors.finished(index, record.error is not None)
            bar.update(1)

        try:
            while True:
                if len(pending) <= max_inflight // 2 and not feed.finished and self._stop_signal is None:
                    skipped = feed.skipped
                    for item in feed.take(max_inflight - len(pending)):
                        if isinstance(item, Resumed):
                            errors.finished(item.index, item.error)
                            continue
                        if isinstance(item, Failed):
                            finish(self._record(item.prep, None, loaded.identity, item.error, item.kind), item.index)
                            continue
                        prep = item.prep
                        try:
                            submit(core, prep, item.token_ids, item.cache_tokens)
                        except InvalidRequestError as exc:
                            kind = "constraint" if exc.field == "constraint" else "request"
                            finish(self._record(prep, None, loaded.identity, f"{prep.row_id}: {exc}", kind),
                                   item.index)
                            continue
                        except ImageError as exc:
                            finish(self._record(prep, None, loaded.identity, f"{prep.row_id}: {exc}", "image"),
                                   item.index)
                            continue
                        pending[prep.key] = prep
                        order[prep.key] = item.index
                    if redo_of is None:
                        stats.skipped += feed.skipped - skipped
                    bar.update(feed.skipped - skipped)
                if pending and self._stop_signal is None:
                    for delta in core.step():
                        if delta.output is not None and delta.request_id in pending:
                            finish(self._record(pending.pop(delta.request_id), delta.output, loaded.identity),
                                   order.pop(delta.request_id))
                now = time.monotonic()
                if len(buffer) >= spec.checkpoint.every_rows or now - last_flush >= spec.checkpoint.every_seconds:
                    flush()
                if self.progress:
                    bar.set_postfix(tok_s=f"{stats.tokens_per_second:.0f}", errors=stats.errors, refresh=False)
                elif now - last_log >= 30:
                    last_log = now
                    log.info("%d/%s rows, %.0f tok/s, %d errors", stats.finished + stats.skipped,
                             stats.total if stats.total is not None else "?", stats.tokens_per_second, stats.errors)
                if errors.exceeded():
                    flush()
                    raise JobFailed(f"{errors.message(errors.rows, errors.errors, str(spec.output))}. Errors by kind "
                                    f"this run: {dict(stats.errors_by_kind)}")
                if self._stop_signal is not None:
                    for key in list(pending):
                        core.abort(key)
                    flush()
                    raise JobInterrupted(f"stopped by signal {self._stop_signal}; {stats.finished} rows "
                                         f"checkpointed in {spec.output}. Run the same command to resume.")
                if feed.finished and not pending:
                    flush()
                    break
        finally:
            bar.close()
            if redo_of is None:
                stats.engine = core.stats()
                stats.plan = feed.stats.as_dict()
            core.shutdown()
        return stats

    def _save_plan_params(self, store: CheckpointStore) -> None:
        """The plan's parameters go into the manifest on the first run; a resumed run plans with the saved ones
        (the same windows, hence the same order), whatever the job file says now."""
        saved = store.get_meta("plan")
        current = {"window": self.spec.plan.window, "enabled": self.spec.plan.enabled, "order": "trie-v1"}
        if saved is None:
            store.set_meta("plan", current)
        elif saved != current:
            log.warning("resuming with the plan of the first run %s (the job file now says %s)", saved, current)
            self.spec = dataclasses.replace(self.spec, plan=dataclasses.replace(
                self.spec.plan, window=int(saved["window"]), enabled=bool(saved["enabled"])))

    def _record_invariance(self, store: CheckpointStore) -> bool:
        """Whether every row of the output is computed batch-invariant: this run has ``engine.batch_invariant`` and
        so had every earlier run that checkpointed rows here (kept in the manifest)."""
        flag = self.spec.engine.batch_invariant
        prior = store.get_meta("batch_invariant")
        now = flag and (prior if prior is not None else not store.shards)
        if prior != now:
            store.set_meta("batch_invariant", now)
        if flag and not now:
            log.warning("engine.batch_invariant: rows checkpointed by an earlier run without it keep their results, "
                        "so the output as a whole is not batch-invariant (output.overwrite: true recomputes them)")
        return now

    def _record(self, prep: PreparedRow, out: RequestOutput | None, model_identity: str,
                error: str | None = None, error_kind: str | None = None) -> ResultRecord:
        params = prep.params_json
        model = f"{self.spec.model.path}@{model_identity}"
        if out is None:
            return ResultRecord.failed(prep.row_id, prep.key, error or "unknown error", error_kind or "error",
                                       inputs=prep.inputs, model=model, params=params)
        return record_for(prep, out, model)
