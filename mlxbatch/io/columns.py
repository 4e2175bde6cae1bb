"""Expanding the kept input columns (one JSON string per row in the shards) into typed result columns.

Owns the type decision: each column's Arrow type is inferred chunk by chunk and the chunks' types unified
(int + float -> float, struct fields merged, null -> anything). A column whose values cannot share one type is
written as JSON text. Names that collide with result columns get an ``input_`` prefix.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
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


def decode_inputs(values: Iterable[str | None]) -> list[dict[str, Any]]:
    return [json.loads(v) if v else {} for v in values]


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

    def __init__(self, keep: Sequence[str] | None, reserved: Iterable[str]) -> None:
        self._fixed = keep is not None
        self._names: list[str] = list(dict.fromkeys(keep)) if keep is not None else []
        self._reserved = set(reserved)
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
            if name in self._as_json:
                continue
            inferred = _infer([row.get(name) for row in rows])
            merged = None if inferred is None else _unify(self._types.get(name, pa.null()), inferred)
            if merged is None:
                logger.warning("input column %r holds values of incompatible types; writing it as JSON text", name)
                self._as_json.add(name)
            else:
                self._types[name] = merged

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
            as_json = name in self._as_json
            dtype = self._types.get(name, pa.null())
            if as_json or pa.types.is_null(dtype):
                dtype = pa.string()  # all-null columns too: a concrete type every reader accepts
            out.append(InputColumn(name=name, out_name=out_name, type=dtype, as_json=as_json))
        return out


def build_column(rows: Sequence[dict[str, Any]], column: InputColumn) -> pa.Array:
    values = [row.get(column.name) for row in rows]
    if column.as_json:
        return pa.array([None if v is None else json.dumps(v, ensure_ascii=False) for v in values], pa.string())
    try:
        return pa.array(values, type=column.type)
    except _CONVERT_ERRORS:
        try:
            return pa.array(values).cast(column.type)
        except _CONVERT_ERRORS as exc:
            raise OutputError(f"input column {column.name!r}: values do not fit type {column.type} ({exc})") from exc
