"""The Arrow schema of checkpoint shards and the conversions ``ResultRecord`` <-> Arrow.

Owns ``SHARD_SCHEMA`` (one row per ``ResultRecord``; the kept input columns travel as one JSON string column
``inputs`` so shards of one job never disagree on a schema), the JSON encoding of inputs, and opening a shard
file (memory-mapped). Does not own where shards live (``checkpoint``) or the final Parquet layout (``writers``).
"""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from mlxbatch.io.records import ResultRecord
from mlxbatch.types import TokenLogprob

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1

TOP_LOGPROB_TYPE = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64())])
LOGPROBS_TYPE = pa.list_(pa.struct([
    ("token_id", pa.int64()),
    ("logprob", pa.float64()),
    ("top", pa.list_(TOP_LOGPROB_TYPE)),
]))

# results.parquet's logprobs: as in the shards, with each token's text beside its id
LOGPROBS_TEXT_TYPE = pa.list_(pa.struct([
    ("token_id", pa.int64()),
    ("token", pa.string()),
    ("logprob", pa.float64()),
    ("top", pa.list_(pa.struct([("token_id", pa.int64()), ("token", pa.string()), ("logprob", pa.float64())]))),
]))

SHARD_SCHEMA = pa.schema(
    [
        pa.field("row_id", pa.string(), nullable=False),
        pa.field("key", pa.string(), nullable=False),
        pa.field("inputs", pa.string()),  # JSON object of the kept input columns
        pa.field("text", pa.string()),
        pa.field("finish_reason", pa.string()),
        pa.field("prompt_tokens", pa.int64()),
        pa.field("generated_tokens", pa.int64()),
        pa.field("logprobs", LOGPROBS_TYPE),
        pa.field("error", pa.string()),
        pa.field("error_kind", pa.string()),
        pa.field("latency_s", pa.float64()),
        pa.field("ttft_s", pa.float64()),
        pa.field("model", pa.string()),
        pa.field("params", pa.string()),  # canonical JSON of the sampling parameters
        pa.field("extra", pa.string()),  # JSON object, null when empty
    ],
    metadata={b"mlxbatch.shard_schema": str(SCHEMA_VERSION).encode()},
)


class ShardFormatError(ValueError):
    """A file that is not a complete shard of this schema (truncated, foreign, or another schema version)."""


def _json_default(obj: Any) -> Any:
    # Input rows from Parquet / HF can hold values JSON cannot: store them as readable strings.
    if isinstance(obj, (_dt.datetime, _dt.date, _dt.time)):
        return obj.isoformat()
    if isinstance(obj, _dt.timedelta):
        return obj.total_seconds()
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(obj)).decode("ascii")
    if isinstance(obj, decimal.Decimal):
        return str(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    if hasattr(obj, "tolist"):  # numpy arrays
        return obj.tolist()
    return str(obj)


# one encoder for every call (``json.dumps`` with options builds one a call: ~40% of encoding a row's inputs, which
# the checkpoint's thread does for every row it writes, sharing the GIL with the engine's)
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=_json_default)


def encode_json(obj: Mapping[str, Any]) -> str:
    return _ENCODER.encode(obj)


def _logprobs_to_py(logprobs: Sequence[TokenLogprob] | None) -> list[dict[str, Any]] | None:
    if logprobs is None:
        return None
    return [{"token_id": lp.token_id, "logprob": lp.logprob,
             "top": [{"token_id": t, "logprob": p} for t, p in lp.top]} for lp in logprobs]


def _logprobs_from_py(value: list[dict[str, Any]] | None) -> tuple[TokenLogprob, ...] | None:
    if value is None:
        return None
    return tuple(TokenLogprob(token_id=e["token_id"], logprob=e["logprob"],
                              top=tuple((t["token_id"], t["logprob"]) for t in (e["top"] or ())))
                 for e in value)


def to_arrow(records: Sequence[ResultRecord]) -> pa.Table:
    """Records -> a table of ``SHARD_SCHEMA`` (one record batch)."""
    columns: dict[str, list[Any]] = {
        "row_id": [r.row_id for r in records],
        "key": [r.key for r in records],
        "inputs": [encode_json(r.inputs) for r in records],
        "text": [r.text for r in records],
        "finish_reason": [r.finish_reason for r in records],
        "prompt_tokens": [r.prompt_tokens for r in records],
        "generated_tokens": [r.generated_tokens for r in records],
        "logprobs": [_logprobs_to_py(r.logprobs) for r in records],
        "error": [r.error for r in records],
        "error_kind": [r.error_kind for r in records],
        "latency_s": [r.latency_s for r in records],
        "ttft_s": [r.ttft_s for r in records],
        "model": [r.model for r in records],
        "params": [r.params for r in records],
        "extra": [encode_json(r.extra) if r.extra else None for r in records],
    }
    return pa.Table.from_pydict(columns, schema=SHARD_SCHEMA)


def from_arrow(data: pa.Table | pa.RecordBatch) -> Iterator[ResultRecord]:
    """A ``SHARD_SCHEMA`` table -> records, in row order (converted one record batch at a time)."""
    batches = data.to_batches() if isinstance(data, pa.Table) else [data]
    for batch in batches:
        for row in batch.to_pylist():
            yield ResultRecord(
                row_id=row["row_id"], key=row["key"],
                inputs=json.loads(row["inputs"]) if row["inputs"] else {},
                text=row["text"], finish_reason=row["finish_reason"],
                prompt_tokens=row["prompt_tokens"] or 0, generated_tokens=row["generated_tokens"] or 0,
                logprobs=_logprobs_from_py(row["logprobs"]),
                error=row["error"], error_kind=row["error_kind"],
                latency_s=row["latency_s"], ttft_s=row["ttft_s"],
                model=row["model"] or "", params=row["params"] or "{}",
                extra=json.loads(row["extra"]) if row["extra"] else {},
            )


def serialize_shard(table: pa.Table) -> pa.Buffer:
    """A table of ``SHARD_SCHEMA`` as the bytes of an Arrow IPC *file* (its footer makes truncation detectable)."""
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, SHARD_SCHEMA) as writer:
        writer.write_table(table)
    return sink.getvalue()


def read_shard(path: str | Path, *, full: bool = False) -> pa.Table:
    """Open a shard memory-mapped (the file handle is closed; the mapping lives as long as the table).

    Raises ``ShardFormatError`` when the file is not a complete IPC file of ``SHARD_SCHEMA``. ``full=True`` also
    validates every buffer (use it for files whose integrity nothing else vouches for).
    """
    try:
        with pa.memory_map(str(path)) as source:
            reader = ipc.open_file(source)
            if not reader.schema.equals(SHARD_SCHEMA, check_metadata=False):
                raise ShardFormatError(f"{path}: not a shard of schema version {SCHEMA_VERSION}")
            table = reader.read_all()
    except (pa.ArrowException, OSError) as exc:
        raise ShardFormatError(f"{path}: not a complete Arrow IPC file ({exc})") from exc
    if full:
        try:
            table.validate(full=True)
        except pa.ArrowException as exc:
            raise ShardFormatError(f"{path}: invalid data ({exc})") from exc
    return table
