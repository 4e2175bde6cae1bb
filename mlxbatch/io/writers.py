"""The final results of a job: ``results.parquet``, one row per input row, in input order.

Owns the results file's layout: ``finalize`` re-reads the input, recomputes each row's key and streams the
checkpointed results (or an error row for a missing one) into Parquet, with the input columns' own types. Call it
once every row is checkpointed, then ``write_openai_batch_output`` (OpenAI batch inputs only), then the report and
the ``_SUCCESS`` marker (``output_folder``). Written atomically (tmp + fsync + rename); a write that fails (a full
disk) raises ``OutputError`` and leaves no temporary file. Does not own the shards (``checkpoint``) or which
record each row takes (``selection``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mlxbatch.io.atomic import atomic_writer
from mlxbatch.io.checkpoint import CheckpointStore
from mlxbatch.io.columns import ColumnPlanner, InputColumn, build_column, decode_inputs
from mlxbatch.io.errors import IncompleteResultsError, OutputError
from mlxbatch.io.faults import crash, fault_due
from mlxbatch.io.output_folder import RESULTS_NAME, oserror_text
from mlxbatch.io.schema import LOGPROBS_TEXT_TYPE, LOGPROBS_TYPE
from mlxbatch.io.selection import (
    INPUTS_SPOOL,
    ExpectedColumns,
    ExpectedRow,
    InputsSpool,
    Selection,
    inputs_of,
    select_rows,
)
from mlxbatch.io.shard_index import MISSING, ShardIndex

logger = logging.getLogger(__name__)

DEFAULT_ROW_GROUP_SIZE = 10_000
MISSING_ERROR = "no result: the row was not processed"

# Result columns after ``id``, ``key`` and the input columns; logprobs only when some row has them. The records'
# ``extra`` JSON (task results: n > 1 samples, parsed JSON, scores) becomes one typed column per key, at the end
# (keys starting with "_" stay in the shards only).
_HEAD = [pa.field("id", pa.string()), pa.field("key", pa.string())]
_TAIL = [
    pa.field("text", pa.string()), pa.field("finish_reason", pa.string()),
    pa.field("prompt_tokens", pa.int64()), pa.field("generated_tokens", pa.int64()),
    pa.field("logprobs", LOGPROBS_TYPE),
    pa.field("error", pa.string()), pa.field("error_kind", pa.string()),
    pa.field("latency_s", pa.float64()), pa.field("ttft_s", pa.float64()),
    pa.field("model", pa.string()), pa.field("params", pa.string()), pa.field("extra", pa.string()),
]
RESULT_COLUMNS = frozenset(f.name for f in _HEAD + _TAIL)


def input_column_names(names: Sequence[str]) -> list[str]:
    """The input columns of a results file whose columns are ``names`` (the layout ``finalize`` writes): those after
    ``id`` and ``key``, before the first result column (``text``)."""
    names, head, first = list(names), [f.name for f in _HEAD], _TAIL[0].name
    if names[:len(head)] != head or first not in names:
        return []
    return names[len(head):names.index(first)]


def input_planner(keep_columns: Sequence[str] | None, input_types: Mapping[str, pa.DataType] | None) -> ColumnPlanner:
    """The planner of the results' input columns (``finalize``'s, or one an ``ExpectedSpool`` shows the rows to as
    they are read: ``ExpectedColumns.observed``)."""
    return ColumnPlanner(keep_columns, RESULT_COLUMNS, input_types)


@dataclass(frozen=True)
class FinalOutputs:
    """What ``finalize`` wrote."""

    results_path: Path
    rows: int
    ok_rows: int
    error_rows: int  # rows whose error is set (missing rows included)
    missing_rows: int  # expected rows without a checkpointed result (only with allow_missing=True)
    stale_records: int  # checkpointed records not written: older keys of changed rows, or other jobs' rows
    input_columns: tuple[str, ...]  # the expanded input columns, as named in the results file
    has_logprobs: bool


def _chunks(n: int, size: int) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def _with_token_text(logprobs: pa.ChunkedArray, token_text: Callable[[int], str]) -> pa.Array:
    """The shards' logprobs (token ids) with each token's string beside its id."""
    rows = logprobs.to_pylist()
    for row in rows:
        for entry in row or ():
            entry["token"] = token_text(entry["token_id"])
            for alt in entry["top"] or ():
                alt["token"] = token_text(alt["token_id"])
    return pa.array(rows, LOGPROBS_TEXT_TYPE)


Recompute = Mapping[str, Callable[[Mapping[str, Any], Mapping[str, Any]], Any]]  # extra column -> value(inputs, result)


def _recomputed(extra_rows: list[dict[str, Any]], rows: list[dict[str, Any]], columns: dict[str, Any],
                recompute: Recompute) -> None:
    """Set each ``recompute`` column of ``extra_rows`` from the row's current inputs and its result (``text``,
    ``error``, ``finish_reason`` and its other extra values); a missing row's result has ``text`` None."""
    texts, errors = columns["text"].to_pylist(), columns["error"].to_pylist()
    finishes = columns["finish_reason"].to_pylist()
    for extra, inputs, text, error, finish in zip(extra_rows, rows, texts, errors, finishes):
        result = {**extra, "text": text, "error": error, "finish_reason": finish}
        for name, value in recompute.items():
            extra[name] = value(inputs, result)


def _output_table(gathered: pa.Table, sel: Selection, part: slice, inputs: list[InputColumn],
                  extras: list[InputColumn], schema: pa.Schema,
                  token_text: Callable[[int], str] | None = None, recompute: Recompute | None = None) -> pa.Table:
    missing = pa.array(sel.positions[part] == MISSING)
    ids = sel.row_ids[part] if sel.row_ids is not None else gathered.column("row_id")
    keys = sel.keys[part] if sel.keys is not None else gathered.column("key")
    rows = inputs_of(gathered, sel, part)
    columns: dict[str, Any] = {"id": ids, "key": keys}
    for column in inputs:
        columns[column.out_name] = build_column(rows, column)
    extra_rows = decode_inputs(gathered.column("extra").to_pylist()) if extras else []
    for name in schema.names[len(columns):len(schema.names) - len(extras)]:
        columns[name] = gathered.column(name)
    if token_text is not None and "logprobs" in columns:
        columns["logprobs"] = _with_token_text(columns["logprobs"], token_text)
    if recompute:
        _recomputed(extra_rows, rows, columns, recompute)
    for column in extras:
        columns[column.out_name] = build_column(extra_rows, column)
    columns["error"] = pc.if_else(missing, pa.scalar(MISSING_ERROR), columns["error"])
    columns["error_kind"] = pc.if_else(missing, pa.scalar("missing"), columns["error_kind"])
    return pa.Table.from_pydict(columns, schema=schema)


def finalize(store: CheckpointStore, out_dir: str | Path, expected: Iterable[ExpectedRow] | ExpectedColumns | None,
             keep_columns: Sequence[str] | None = None, *, row_group_size: int = DEFAULT_ROW_GROUP_SIZE,
             include_logprobs: bool | None = None, allow_missing: bool = False,
             filename: str = RESULTS_NAME, input_types: Mapping[str, pa.DataType] | None = None,
             extra_types: Mapping[str, pa.DataType] | None = None,
             token_text: Callable[[int], str] | None = None,
             metadata: Mapping[str, str] | None = None, recompute: Recompute | None = None) -> FinalOutputs:
    """Write ``results.parquet``: one row per expected row, in the order given, streamed from the shards.

    ``expected`` is the current job's rows in input order as ``ExpectedRow(row_id, key)``; pass a generator
    (e.g. re-read the input and recompute each row's key), or the columns the run recorded as it read them
    (``ExpectedColumns``, from ``expected.ExpectedSpool``). Only
    records whose key is expected are written, so results of changed parameters never leak in. None writes every
    distinct checkpointed key in write order (only right when the folder holds one job's keys). ``keep_columns``
    picks and orders the expanded input columns (None: all kept by the records, in first-seen order).
    Rows without a result raise ``IncompleteResultsError`` before anything is written, unless ``allow_missing``,
    which writes them with ``error_kind == "missing"``. ``include_logprobs`` None: when any record has them.
    ``input_types`` are the input's own Arrow types by column name (kept as they are); ``extra_types`` declare task
    columns (e.g. ``parsed``) that are written with that type, even when no row has a value. ``token_text`` adds
    each logprob's token string next to its id.
    Memory: ~50 bytes per expected row plus one row group; shards (and the expected rows' inputs, spooled to a
    temporary Arrow file) stay memory-mapped. A write that fails raises ``OutputError`` and leaves no file behind.
    ``metadata`` goes into the Parquet schema's key-value metadata (e.g. ``mlxbatch.batch_invariant``).
    ``ExpectedColumns.observed`` (the run's spool showed it every row's inputs) is taken as the input columns'
    planner: the run made it with ``input_planner`` from this call's ``keep_columns`` and ``input_types``.
    ``recompute`` names extra columns (declared in ``extra_types``) whose values are computed again for every row
    from its current inputs and its checkpointed result, ``value(inputs, result)`` with ``result`` the row's
    ``text``, ``error``, ``finish_reason`` and extra values: values that depend on input columns outside the key
    (e.g. ``correct`` against a gold column edited since the row ran).
    """
    out = Path(out_dir)
    spool = InputsSpool(out / INPUTS_SPOOL)
    try:
        return _finalize(store, out, expected, keep_columns, row_group_size, include_logprobs, allow_missing,
                         filename, spool, input_types=input_types, extra_types=extra_types, token_text=token_text,
                         metadata=metadata, recompute=recompute)
    except OSError as exc:
        raise OutputError(f"could not write {out / filename}: {oserror_text(exc)}. Nothing was left behind and the "
                          "checkpoint is intact: free some space and run the job again") from exc
    finally:
        spool.remove()


def _finalize(store: CheckpointStore, out: Path, expected: Iterable[ExpectedRow] | ExpectedColumns | None,
              keep_columns: Sequence[str] | None, row_group_size: int, include_logprobs: bool | None,
              allow_missing: bool, filename: str, spool: InputsSpool, *,
              input_types: Mapping[str, pa.DataType] | None, extra_types: Mapping[str, pa.DataType] | None,
              token_text: Callable[[int], str] | None, metadata: Mapping[str, str] | None = None,
              recompute: Recompute | None = None) -> FinalOutputs:
    index = ShardIndex(list(store.iter_tables()))
    sel = select_rows(index, expected, spool)
    n = len(sel.positions)
    missing_rows = int(np.count_nonzero(sel.positions == MISSING))
    if missing_rows and not allow_missing:
        where = np.flatnonzero(sel.positions == MISSING)[:5]
        ids = sel.row_ids.take(pa.array(where)).to_pylist() if sel.row_ids is not None else []
        raise IncompleteResultsError(missing_rows, ids)

    observed = expected.observed if isinstance(expected, ExpectedColumns) else None
    planner = observed if observed is not None else input_planner(keep_columns, input_types)
    has_extra = index.column_has_values("extra") or bool(extra_types)
    extra_planner = ColumnPlanner(None, RESULT_COLUMNS, extra_types, always=list(extra_types or ()))
    first_pass = (["inputs"] if observed is None else []) + (["extra"] if has_extra else [])
    for part in _chunks(n, row_group_size) if first_pass else ():
        # first pass: the expanded columns' names and types (the inputs' seen already where the spool showed them)
        got = index.gather(sel.positions[part], first_pass)
        if observed is None:
            planner.observe(inputs_of(got, sel, part))
        if has_extra:  # keys starting with "_" are checkpoint bookkeeping (e.g. the engine actor): not output
            extra_planner.observe([{k: v for k, v in d.items() if not k.startswith("_")}
                                   for d in decode_inputs(got.column("extra").to_pylist())])
    # task results (n > 1 samples, parsed JSON, scores, ...) become typed columns at the end, named by their key;
    # an input column of the same name is the one renamed (input_<name>)
    extras = extra_planner.columns() if has_extra else []
    planner.reserve(c.out_name for c in extras)
    inputs = planner.columns()
    has_logprobs = index.column_has_values("logprobs") if include_logprobs is None else include_logprobs
    tail = [f for f in _TAIL if (f.name != "logprobs" or has_logprobs) and f.name != "extra"]
    if token_text is not None:
        tail = [pa.field("logprobs", LOGPROBS_TEXT_TYPE) if f.name == "logprobs" else f for f in tail]
    schema = pa.schema(_HEAD + [pa.field(c.out_name, c.type) for c in inputs] + tail
                       + [pa.field(c.out_name, c.type) for c in extras], metadata=dict(metadata or {}))
    needed = ["row_id", "key", "inputs"] + [f.name for f in tail] + (["extra"] if extras else [])

    error_rows = 0
    path = out / filename
    with atomic_writer(path) as f, pq.ParquetWriter(f, schema, compression="zstd") as writer:
        for part in _chunks(n, row_group_size):
            table = _output_table(index.gather(sel.positions[part], needed), sel, part, inputs, extras, schema,
                                  token_text, recompute)
            error_rows += table.num_rows - table.column("error").null_count
            writer.write_table(table, row_group_size=row_group_size)
            if fault_due("mid-results", 1):
                f.flush()
                crash()
        if n == 0:
            writer.write_table(schema.empty_table())
    selected = np.unique(sel.positions[sel.positions != MISSING]).size
    result = FinalOutputs(results_path=path, rows=n, ok_rows=n - error_rows, error_rows=error_rows,
                          missing_rows=missing_rows, stale_records=index.size - selected,
                          input_columns=tuple(c.out_name for c in inputs), has_logprobs=has_logprobs)
    logger.info("wrote %s: %d rows (%d errors, %d missing), %d stale records skipped", path, n, error_rows,
                missing_rows, result.stale_records)
    return result
