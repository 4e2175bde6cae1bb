"""Expanding the kept input columns (one JSON string per row in the shards) into typed result columns.

Owns the type decision. A column whose type is known (the input's own Arrow schema, for Parquet and Hugging Face
inputs; a task column's declared type) keeps that type: its values are revived from their JSON form (ISO
timestamps, dates and times, base64 bytes, decimal strings, nested lists and structs of them) and written with it,
so a ``timestamp[us]`` or ``int32`` input comes back as it went in, on every run and after a resume. Other
columns' types are inferred chunk by chunk and the chunks' types unified (int + float -> float, struct fields
merged, null -> anything). A column whose values cannot share one type is written as JSON text. Names that
collide with result columns get an ``input_`` prefix.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from mlxbatch.io.errors import OutputError

logger = logging.getLogger(__name__)

INPUT_PREFIX = "input_"
_CONVERT_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError, TypeError,
                   ValueError)


@dataclass(frozen=True)
class InputColumn:
    """One expanded input column of the results file."""

    name: str  # the key in the row's inputs
    out_name: str  # the column name in the results file
    type: pa.DataType
    as_json: bool = False  # values did not share one type: written as JSON text
    declared: bool = False  # the type was given (input schema, task column): values are revived to it


def decode_inputs(values: Iterable[str | None]) -> list[dict[str, Any]]:
    """JSON objects (the shards' and the spool's ``inputs``/``extra`` text; none or empty: ``{}``), parsed as one JSON
    array: one call into the parser instead of one a row (0.2-0.5 against 1.1-1.3 us a value here)."""
    return json.loads("[" + ",".join(v or "{}" for v in values) + "]")


def _infer(values: list[Any]) -> pa.DataType | None:
    try:
        return pa.array(values).type
    except _CONVERT_ERRORS:
        return None


def _unify(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    if a == b or pa.types.is_null(b):
        return a
    if pa.types.is_null(a):
        return b
    try:
        merged = pa.unify_schemas([pa.schema([("x", a)]), pa.schema([("x", b)])], promote_options="permissive")
    except _CONVERT_ERRORS:
        return None
    return merged.field("x").type


class ColumnPlanner:
    """Sees the decoded inputs chunk by chunk (first pass) and decides the expanded columns."""

    def __init__(self, keep: Sequence[str] | None, reserved: Iterable[str],
                 declared: Mapping[str, pa.DataType] | None = None, always: Sequence[str] = ()) -> None:
        self._fixed = keep is not None
        self._names: list[str] = list(dict.fromkeys(keep)) if keep is not None else []
        self._names += [n for n in always if n not in self._names]  # present even when no row has a value
        self._reserved = set(reserved)
        self._declared = dict(declared or {})
        self._types: dict[str, pa.DataType] = {}
        self._as_json: set[str] = set()

    def observe(self, rows: Sequence[dict[str, Any]]) -> None:
        if not self._fixed:
            known = set(self._names)
            for row in rows:
                for name in row:
                    if name not in known:
                        known.add(name)
                        self._names.append(name)
        for name in self._names:
            if name in self._as_json or name in self._declared:
                continue
            inferred = _infer([row.get(name) for row in rows])
            merged = None if inferred is None else _unify(self._types.get(name, pa.null()), inferred)
            if merged is None:
                logger.warning("input column %r holds values of incompatible types; writing it as JSON text", name)
                self._as_json.add(name)
            else:
                self._types[name] = merged

    def reserve(self, names: Iterable[str]) -> None:
        """More names the columns must not take (another planner's columns)."""
        self._reserved.update(names)

    def columns(self) -> list[InputColumn]:
        out: list[InputColumn] = []
        taken = set(self._reserved)
        for name in self._names:
            out_name = name
            while out_name in taken:
                out_name = INPUT_PREFIX + out_name
            taken.add(out_name)
            if out_name != name:
                logger.info("input column %r is written as %r (the name is a result column)", name, out_name)
            if name in self._declared:
                out.append(InputColumn(name=name, out_name=out_name, type=self._declared[name], declared=True))
                continue
            as_json = name in self._as_json
            dtype = self._types.get(name, pa.null())
            if as_json or pa.types.is_null(dtype):
                dtype = pa.string()  # all-null columns too: a concrete type every reader accepts
            out.append(InputColumn(name=name, out_name=out_name, type=dtype, as_json=as_json))
        return out


def revive(value: Any, dtype: pa.DataType) -> Any:
    """A value as the shards store it (JSON: ISO dates, base64 bytes, ...) back to the Python value of ``dtype``."""
    if value is None:
        return None
    if (pa.types.is_string(dtype) or pa.types.is_large_string(dtype)) and not isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a value the declared type leaves untyped: JSON text
    if pa.types.is_dictionary(dtype):
        return revive(value, dtype.value_type)
    if isinstance(value, str):
        if pa.types.is_timestamp(dtype) or pa.types.is_date(dtype) or pa.types.is_time(dtype):
            kind = dt.datetime if pa.types.is_timestamp(dtype) else dt.date if pa.types.is_date(dtype) else dt.time
            try:
                return kind.fromisoformat(value)
            except ValueError:  # e.g. nanoseconds: let Arrow parse it
                return pa.array([value]).cast(dtype)[0].as_py()
        if pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype) or pa.types.is_fixed_size_binary(dtype):
            return base64.b64decode(value)
        if pa.types.is_decimal(dtype):
            return decimal.Decimal(value)
    if pa.types.is_duration(dtype) and isinstance(value, (int, float)):
        return dt.timedelta(seconds=value)
    if (pa.types.is_list(dtype) or pa.types.is_large_list(dtype) or pa.types.is_fixed_size_list(dtype)) \
            and isinstance(value, list):
        return [revive(v, dtype.value_type) for v in value]
    if pa.types.is_struct(dtype) and isinstance(value, dict):
        return {f.name: revive(value.get(f.name), f.type) for f in dtype}
    if pa.types.is_map(dtype) and isinstance(value, list):
        return [(revive(k, dtype.key_type), revive(v, dtype.item_type)) for k, v in value]
    return value


def _kept(dtype: pa.DataType) -> bool:
    """Whether ``revive`` gives back every value of this type as it is (equal): numbers, booleans, nulls, and lists of
    them."""
    if pa.types.is_list(dtype) or pa.types.is_large_list(dtype) or pa.types.is_fixed_size_list(dtype):
        return _kept(dtype.value_type)
    return pa.types.is_integer(dtype) or pa.types.is_floating(dtype) or pa.types.is_boolean(dtype) or \
        pa.types.is_null(dtype)


def _as_they_are(values: list[Any], dtype: pa.DataType) -> bool:
    """Whether ``revive`` leaves every value as it is: those of ``_kept`` types always; strings when every value is one
    (a declared string column's other values become JSON text). Most declared columns (a Parquet input's numbers,
    strings and lists of numbers, the task's counts) skip ``revive``, ~2 us a value on a CPU (the 100k-row job's
    ``cached_tokens`` alone took 0.2 s of its results)."""
    if _kept(dtype):
        return True
    return (pa.types.is_string(dtype) or pa.types.is_large_string(dtype)) and \
        all(v is None or isinstance(v, str) for v in values)


def _declared_array(values: list[Any], column: InputColumn) -> pa.Array:
    """Values revived to the declared type; a value that does not fit becomes null (with a warning), so the
    column keeps its type whatever one row holds."""
    revived = values if _as_they_are(values, column.type) else [revive(v, column.type) for v in values]
    try:
        return pa.array(revived, type=column.type)
    except _CONVERT_ERRORS:
        pass
    out = []
    for v in revived:
        try:
            out.append(pa.array([v], type=column.type)[0].as_py())
        except _CONVERT_ERRORS as exc:
            logger.warning("column %r: a value does not fit type %s; written as null (%s)", column.name,
                           column.type, exc)
            out.append(None)
    return pa.array(out, type=column.type)


def build_column(rows: Sequence[dict[str, Any]], column: InputColumn) -> pa.Array:
    values = [row.get(column.name) for row in rows]
    if column.declared:
        return _declared_array(values, column)
    if column.as_json:
        return pa.array([None if v is None else json.dumps(v, ensure_ascii=False) for v in values], pa.string())
    try:
        return pa.array(values, type=column.type)
    except _CONVERT_ERRORS:
        try:
            return pa.array(values).cast(column.type)
        except _CONVERT_ERRORS as exc:
            raise OutputError(f"input column {column.name!r}: values do not fit type {column.type} ({exc})") from exc
