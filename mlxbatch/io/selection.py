"""Which checkpointed record each row of ``results.parquet`` takes: the expected rows, matched by key.

Owns ``ExpectedRow`` (one input row of the current job, in input order) and the selection ``finalize`` writes from:
the shard-index position of each expected row's result (``MISSING`` when it has none), the rows' ids and keys as
compact Arrow copies, and their current inputs (JSON) spooled to a temporary Arrow file beside the results and
memory-mapped back, so memory stays bounded however large the input is. Without expected rows, every distinct
checkpointed key in write order. Does not own the results file's layout (``writers``) or the index (``shard_index``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from mlxbatch.io.atomic import TMP_SUFFIX
from mlxbatch.io.columns import ColumnPlanner, decode_inputs
from mlxbatch.io.schema import encode_json
from mlxbatch.io.shard_index import ShardIndex

_EXPECTED_CHUNK = 65_536
INPUTS_SPOOL = ".inputs.arrow" + TMP_SUFFIX  # the current input columns while results.parquet is written


@dataclass(frozen=True)
class ExpectedRow:
    """One input row of the current job, in input order: its id, its current result key and (optionally) its
    input columns as they are now. With ``inputs`` the results show the current values of columns that are not
    part of the key (an edited column the prompt does not use); None: the values checkpointed with the result."""

    row_id: str
    key: str
    inputs: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ExpectedColumns:
    """The expected rows as columns already on disk (``expected.ExpectedSpool``): ids, keys and current inputs
    (JSON), memory-mapped, taken as they are."""

    row_ids: pa.ChunkedArray
    keys: pa.ChunkedArray
    inputs: pa.ChunkedArray
    # the input columns' planner, which has seen every one of these rows' inputs (``finalize``'s first pass over them,
    # done as they were spooled); None: ``finalize`` reads them for it
    observed: ColumnPlanner | None = None


@dataclass(frozen=True)
class Selection:
    """The rows ``finalize`` writes, in order: where each one's result is, and its id, key and current inputs."""

    positions: np.ndarray  # shard-index position of each output row, MISSING when absent
    row_ids: pa.ChunkedArray | None  # None: take the ids from the records
    keys: pa.ChunkedArray | None
    inputs: pa.ChunkedArray | None = None  # the current inputs (JSON), memory-mapped; None: the checkpointed ones


class InputsSpool:
    """The expected rows' current inputs as JSON, spooled to an Arrow file beside the results (memory stays
    bounded however large the input is) and memory-mapped back."""

    _SCHEMA = pa.schema([("inputs", pa.string())])

    def __init__(self, path: Path) -> None:
        self.path = path
        self._writer: ipc.RecordBatchFileWriter | None = None
        self._pending: list[str] = []

    def add(self, inputs: Mapping[str, Any]) -> None:
        self._pending.append(encode_json(inputs))
        if len(self._pending) >= _EXPECTED_CHUNK:
            self.flush()

    def flush(self) -> None:
        if self._writer is None:
            self._writer = ipc.new_file(str(self.path), self._SCHEMA)
        self._writer.write_batch(pa.record_batch([pa.array(self._pending, pa.string())], schema=self._SCHEMA))
        self._pending.clear()

    def column(self) -> pa.ChunkedArray:
        self.flush()
        assert self._writer is not None
        self._writer.close()
        with pa.memory_map(str(self.path)) as source:
            return ipc.open_file(source).read_all().column("inputs")

    def remove(self) -> None:
        try:
            if self._writer is not None:
                self._writer.close()  # a no-op when column() closed it; fails again on a full disk
        except OSError:
            pass
        self.path.unlink(missing_ok=True)


def select_rows(index: ShardIndex, expected: Iterable[ExpectedRow] | ExpectedColumns | None,
                spool: InputsSpool) -> Selection:
    if expected is None:
        return Selection(index.first_occurrences(), None, None)
    if isinstance(expected, ExpectedColumns):
        return Selection(index.locate(expected.keys), expected.row_ids, expected.keys, expected.inputs)
    id_chunks: list[pa.Array] = []
    key_chunks: list[pa.Array] = []
    ids: list[str] = []
    keys: list[str] = []
    with_inputs: bool | None = None

    def flush() -> None:
        id_chunks.append(pa.array(ids, pa.string()))
        key_chunks.append(pa.array(keys, pa.string()))
        ids.clear()
        keys.clear()

    for row in expected:  # a stream: only the compact Arrow copies of ids and keys are kept
        if with_inputs is None:
            with_inputs = row.inputs is not None
        elif with_inputs != (row.inputs is not None):
            raise ValueError("finalize: give inputs for every expected row or for none")
        ids.append(row.row_id)
        keys.append(row.key)
        if row.inputs is not None:
            spool.add(row.inputs)
        if len(ids) >= _EXPECTED_CHUNK:
            flush()
    flush()
    key_array = pa.chunked_array(key_chunks, pa.string())
    return Selection(index.locate(key_array), pa.chunked_array(id_chunks, pa.string()), key_array,
                     spool.column() if with_inputs else None)


def inputs_of(gathered: pa.Table, sel: Selection, part: slice) -> list[dict[str, Any]]:
    column = sel.inputs[part] if sel.inputs is not None else gathered.column("inputs")
    return decode_inputs(column.to_pylist())
