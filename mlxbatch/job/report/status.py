"""``mlxbatch status``: how far a job got and what failed, read from its output folder.

Owns counting *current* records: those whose result key the job asks for now. After a parameter change the
shards still hold the old records (stale: they are never written out); counting them would report 32 rows of a
16-row job. Records of rows the job does not read now (past ``input.limit``, or gone from the input) are counted
apart from stale ones: nothing about them changed. The job is the job file given (``status job.yaml``: against the file as it is now), or the job the
last run recorded in the folder's manifest, command-line changes included (``status OUT``). Keys are recomputed
by preparing every input row, as the run does (no model is loaded; the model identity is the one the last run
recorded). A folder without a recorded job falls back to the newest record of each row id. The job is complete
only when ``_SUCCESS`` is there and results.parquet holds exactly the current rows' results (else: outdated, even
when every current record is checkpointed); a folder whose lock a run holds is running (its pid), one without
``_SUCCESS`` and without a run stopped.

Strictly read-only and takes no lock (whether a run holds the folder is asked without waiting or keeping
anything), so it works while a run is writing the folder: it reads the shard files directly and skips (and
reports) any that do not open as a complete Arrow file; repairing is left to the next run. A distributed run's progress file (``job.executors.ray.progress``) adds a line per engine actor.
"""

from __future__ import annotations

import collections
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mlxbatch.errors import MlxbatchError
from mlxbatch.io import InputFormat, open_reader, resolve_inputs
from mlxbatch.io.lock import lock_holder
from mlxbatch.io.output_folder import RESULTS_NAME
from mlxbatch.job.check.validate import input_spec
from mlxbatch.job.executors.ray.progress import driver_running, progress_lines, read_progress
from mlxbatch.job.report.metrics import summary_line
from mlxbatch.job.rows.prepare import PreparedRow, RowPreparer
from mlxbatch.job.spec import JobSpec, load_job, parse_job

JOB_SPEC_META = "job_spec"  # manifest metadata the runner writes: the job as the last run parsed it



_COLUMNS = ("row_id", "key", "error", "error_kind", "model")
_DETAIL = ("text", "finish_reason", "extra", "inputs")  # what ``show`` prints of a row besides


@dataclass(frozen=True)
class Record:
    """One checkpointed record as read from a shard (``text``, ``finish_reason``, ``extra``, ``inputs``: with
    ``detail``)."""

    row_id: str
    key: str
    error: str | None
    error_kind: str | None
    model: str | None
    text: str | None = None
    finish_reason: str | None = None
    extra: str | None = None  # JSON text
    inputs: str | None = None  # JSON text: the input columns the job keeps


def _read_shard(path: Path, detail: bool = False) -> list[Record] | None:
    names = _COLUMNS + _DETAIL if detail else _COLUMNS
    try:
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_file(source).read_all().select(list(names))
    except (pa.ArrowInvalid, OSError, KeyError):
        return None
    cols = [table.column(n).to_pylist() for n in names]
    return [Record(*values) for values in zip(*cols)]


def _manifest_meta(out_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((out_dir / "manifest.json").read_text(encoding="utf-8")).get("meta") or {}
    except (OSError, ValueError):
        return {}


def _recorded_job(meta: dict[str, Any]) -> JobSpec | None:
    """The job the last run used (as it parsed it), or None when the folder does not record one."""
    job = meta.get(JOB_SPEC_META)
    if not isinstance(job, dict) or not isinstance(job.get("raw"), dict):
        return None
    try:
        return parse_job(job["raw"], source=str(job.get("source", "<job>")), base_dir=Path(job["base_dir"]))
    except (MlxbatchError, KeyError, TypeError):
        return None  # the job's files moved or no longer parse: count by row id


def prepared_rows(spec: JobSpec, identity: str, recorded: dict[str, Any]) -> Iterator[PreparedRow]:
    """The current rows, prepared as the last run prepared them (its model's image support and context, as it
    recorded them: they decide an image row's key and a prompt-too-long row's)."""
    ispec = input_spec(spec)
    openai = any(r.format is InputFormat.OPENAI_BATCH for r in resolve_inputs(ispec))
    context = recorded.get("context_length")
    preparer = RowPreparer(spec, identity, openai, takes_images=bool(recorded.get("takes_images")),
                           context_length=context if isinstance(context, int) else None)
    rows = open_reader(ispec)
    if spec.input.limit is not None:
        rows = itertools.islice(rows, spec.input.limit)
    return map(preparer.prepare, rows)


def recorded_job(out_dir: Path) -> tuple[JobSpec | None, dict[str, Any]]:
    """The job the folder's last run used, as it parsed it (None when not recorded), and what it recorded with it
    (model identity, context length, ...)."""
    meta = _manifest_meta(out_dir)
    recorded = meta.get(JOB_SPEC_META)
    return _recorded_job(meta), recorded if isinstance(recorded, dict) else {}


def _expected_keys(spec: JobSpec, identity: str, recorded: dict[str, Any]) -> list[tuple[str, str]]:
    return [(prep.row_id, prep.key) for prep in prepared_rows(spec, identity, recorded)]


@dataclass(frozen=True)
class CurrentRecords:
    """An output folder's checkpointed records, sorted against the job: ``current`` (the first record of each
    current key, in input order; with no recorded job, the newest record of each row id), and the counts around
    them."""

    out_dir: Path
    spec: JobSpec | None  # the job counted against (None: the folder records none)
    against: str
    current: list[Record]
    records: int  # distinct keys in the shards
    outside: int  # records of rows the job does not read now
    total: int | None  # current rows (None: not known without the job)
    keys: list[str] | None  # the current rows' keys, in input order
    shards: int
    unreadable: list[str]


def current_records(target: Path, detail: bool = False) -> CurrentRecords:
    """The current records of an output folder, or of the output folder of a job file (counted against that file);
    ``detail``: with their text, finish reason and extra values (for ``show``)."""
    spec: JobSpec | None = None
    if target.is_file():
        spec = load_job(target)
        out_dir, against = spec.output, f"the job file {target}"
    else:
        out_dir = target
    shards_dir = out_dir / "shards"
    meta = _manifest_meta(out_dir)
    if spec is None:
        if not (out_dir / "manifest.json").exists() and not shards_dir.exists():
            raise MlxbatchError(f"{out_dir}: no mlxbatch run here (no manifest.json)")
        spec = _recorded_job(meta)
        against = f"the job of the last run ({spec.source})" if spec is not None else "the newest record of each row"
    records: list[Record] = []
    shards, unreadable = 0, []
    for path in sorted(shards_dir.glob("shard-*.arrow")) if shards_dir.exists() else []:
        got = _read_shard(path, detail)
        if got is None:
            unreadable.append(path.name)
            continue
        shards += 1
        records += got
    by_key: dict[str, Record] = {}
    for r in records:
        by_key.setdefault(r.key, r)  # a key written twice: its first record (as the run reads it)
    if spec is None:
        newest: dict[str, Record] = {}
        for r in records:
            newest[r.row_id] = r
        return CurrentRecords(out_dir, None, against, list(newest.values()), len(by_key), 0, None, None, shards,
                              unreadable)
    recorded = meta.get(JOB_SPEC_META) if isinstance(meta.get(JOB_SPEC_META), dict) else {}
    identity = recorded.get("model_identity") or next(
        (r.model.rsplit("@", 1)[-1] for r in reversed(records) if r.model), "")
    expected = _expected_keys(spec, identity, recorded)
    keys = [k for _, k in expected]
    current = [by_key[k] for k in dict.fromkeys(keys) if k in by_key]
    # a record not current is stale when its row is a current row (an earlier key of it); else its row is not
    # among the rows the job reads now: past input.limit (--limit), or no longer in the input
    ids = {row_id for row_id, _ in expected}
    outside = sum(1 for r in by_key.values() if r.row_id not in ids)
    return CurrentRecords(out_dir, spec, against, current, len(by_key), outside, len(expected), keys, shards,
                          unreadable)


def read_status(target: Path) -> dict[str, Any]:
    """The status of an output folder, or of the output folder of a job file (counted against that file)."""
    c = current_records(target)
    limit = c.spec.input.limit if c.spec is not None else None
    published = _published_current(c.out_dir, c.keys) if c.keys is not None else None
    return _summary(c.out_dir, c.current, c.records - len(c.current) - c.outside, c.outside, limit, c.total,
                    published, c.shards, c.unreadable, c.against)


def _published_current(out_dir: Path, keys: list[str]) -> bool:
    """Whether results.parquet holds exactly the current rows' results (their keys, in input order): every current
    record can be checkpointed while the file published holds another version of the job's rows."""
    try:
        published = pq.read_table(out_dir / RESULTS_NAME, columns=["key"]).column("key").to_pylist()
    except (OSError, pa.ArrowInvalid, KeyError):
        return False
    return published == keys


def _summary(out_dir: Path, current: list[Record], stale: int, outside: int, limit: int | None, total: int | None,
             published: bool | None, shards: int, unreadable: list[str], against: str) -> dict[str, Any]:
    kinds: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}
    for r in current:
        if r.error is not None:
            kinds[r.error_kind or "error"] += 1
            examples.setdefault(r.error_kind or "error", r.error)
    report_path = out_dir / "report.json"
    try:
        report = json.loads(report_path.read_text()) if report_path.exists() else None
    except ValueError:
        report = None
    finished = (out_dir / "_SUCCESS").exists()  # a run finished, but perhaps under other keys than the current
    errors, done = sum(kinds.values()), len(current)
    complete = finished and (total is None or done == total) and published is not False
    percent = round(100 * done / total, 1) if total else None
    holder = lock_holder(out_dir) if not finished else None  # a run holds the folder now
    if complete:
        state = "complete"
    elif finished and total is not None and done == total:
        state = (f"outdated: results.parquet was written under other parameters or input; all {total} current "
                 "rows are checkpointed (run the job to write them out: nothing is recomputed)")
    elif finished:
        state = (f"outdated: finished under other parameters or input; {done} of {total} current rows done "
                 f"(run the job to update it)")
    elif holder is not None:
        state = f"running (pid {holder})" if holder.isdigit() else "running"
    elif total and done == total:
        why = ("more rows failed than max_error_rate allows (raise it to accept them), or it stopped while writing "
               "the results") if errors else "it stopped while writing the results (killed, a full disk, ...)"
        state = f"not complete: every current row is done, but the last run did not finish: {why}; run the job again"
    else:
        state = "incomplete: the last run stopped before it finished (killed, or it failed); run the job again to " \
                "resume"
    lines = [f"{out_dir}: {state}",
             f"  rows done: {done}" + (f" of {total}" if total is not None else "")
             + (f" ({percent}%)" if percent is not None else "")
             + f"; errors: {errors}; counted against {against}"]
    lines += [f"    {k}: {n}  e.g. {examples[k][:160]}" for k, n in kinds.most_common()]
    if stale:
        lines.append(f"  stale records (earlier keys of current rows: changed parameters, prompts or model) not "
                     f"counted: {stale}")
    if outside:
        where = f"past its limit of {limit} rows, or no longer in it" if limit is not None else "no longer in it"
        lines.append(f"  records of rows outside the current input ({where}) not counted: {outside}")
    lines.append(f"  shards: {shards}")
    if unreadable:
        lines.append(f"  shards that do not open (cut short by a crash; the next run redoes their rows): "
                     f"{', '.join(unreadable)}")
    progress = read_progress(out_dir)  # a distributed run: per engine actor
    if progress is not None and not complete:
        lines += progress_lines(progress, running=driver_running(out_dir, progress))
    if report and finished:
        work = report.get("last_work_run") or {}
        lines.append(f"  last run that did work: {work.get('finished', report['rows'].get('finished_this_run'))} "
                     f"rows, {report.get('generated_tokens_per_s')} tok/s, {report.get('wall_s')} s "
                     f"(finished at {work.get('finished_at', report.get('finished_at'))})")
        if (report.get("accuracy") or {}).get("rows"):  # the figures of the results on disk, as `run` printed them
            lines.append(f"  {summary_line(report['accuracy'])}")
    return {"complete": complete, "outdated": finished and not complete, "running": holder is not None,
            "rows_done": done, "total_rows": total, "percent": percent,
            "checkpointed_rows": done, "stale_records": stale, "records_outside_input": outside, "shards": shards,
            "errors": errors,
            "errors_by_kind": dict(kinds), "unreadable_shards": unreadable, "counted_against": against,
            "report": report, "progress": progress, "summary": "\n".join(lines)}
