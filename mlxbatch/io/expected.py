"""The current job's rows in input order, recorded once as the run reads its input: what ``finalize`` writes from.

Owns ``ExpectedSpool``: an Arrow file beside the results (a ``.tmp`` name: a crash's leftover is removed with the
folder's other temporaries) that takes each row's id, result key, kept input columns (JSON) and, for OpenAI Batch
input, its endpoint, in the order the rows were read; ``rows()`` streams them back as ``ExpectedRow`` and ``urls()``
the endpoints. The run reads its input once: the final Parquet and the OpenAI output come from here, not from a
second pass that renders and keys every row again. Memory stays bounded: rows go to disk in chunks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from mlxbatch.io.atomic import TMP_SUFFIX
from mlxbatch.io.columns import decode_inputs
from mlxbatch.io.schema import encode_json
from mlxbatch.io.selection import ExpectedRow

EXPECTED_SPOOL = ".expected.arrow" + TMP_SUFFIX
_CHUNK = 8192
_SCHEMA = pa.schema([("row_id", pa.string()), ("key", pa.string()), ("inputs", pa.string()), ("url", pa.string())])


class ExpectedSpool:
    """Rows appended in input order by one writer (``add``), complete once ``close`` is called, read back any
    number of times (``rows``, ``urls``), deleted by ``remove``."""

    def __init__(self, out_dir: str | Path) -> None:
        self.path = Path(out_dir) / EXPECTED_SPOOL
        self.path.unlink(missing_ok=True)  # a crashed run's leftover
        self._writer: ipc.RecordBatchFileWriter | None = ipc.new_file(str(self.path), _SCHEMA)
        self._pending: tuple[list[str], list[str], list[str], list[str | None]] = ([], [], [], [])
        self.rows_added = 0
        self.complete = False  # closed after the whole input was read

    def add(self, row_id: str, key: str, inputs: Mapping[str, Any], url: str | None = None) -> None:
        ids, keys, inputs_col, urls = self._pending
        ids.append(row_id)
        keys.append(key)
        inputs_col.append(encode_json(inputs))
        urls.append(url)
        self.rows_added += 1
        if len(ids) >= _CHUNK:
            self._flush()

    def _flush(self) -> None:
        if self._pending[0] and self._writer is not None:
            self._writer.write_batch(pa.record_batch([pa.array(c, pa.string()) for c in self._pending],
                                                     schema=_SCHEMA))
            for column in self._pending:
                column.clear()

    def close(self) -> None:
        """Every row is in: the spool can be read."""
        if self._writer is not None:
            self._flush()
            self._writer.close()
            self._writer = None
            self.complete = True

    def _batches(self, columns: list[str]) -> Iterator[pa.RecordBatch]:
        assert self.complete, "the spool is read only once every row is in"
        with pa.memory_map(str(self.path)) as source:
            reader = ipc.open_file(source)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i).select(columns)

    def rows(self) -> Iterator[ExpectedRow]:
        for batch in self._batches(["row_id", "key", "inputs"]):
            ids, keys, inputs = (batch.column(i).to_pylist() for i in range(3))
            yield from (ExpectedRow(r, k, v) for r, k, v in zip(ids, keys, decode_inputs(inputs)))

    def urls(self) -> Iterator[str | None]:
        for batch in self._batches(["url"]):
            yield from batch.column(0).to_pylist()

    def remove(self) -> None:
        try:
            if self._writer is not None:
                self._writer.close()
        except OSError:
            pass
        self._writer = None
        self.path.unlink(missing_ok=True)
