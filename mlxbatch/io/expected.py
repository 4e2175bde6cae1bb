"""The current job's rows in input order, recorded once as the run reads its input: what ``finalize`` writes from.

Owns ``ExpectedSpool``: an Arrow file beside the results (a ``.tmp`` name: a crash's leftover is removed with the
folder's other temporaries) that takes each row's id, result key, kept input columns (JSON) and, for OpenAI Batch
input, its endpoint, in the order the rows were read. ``columns()`` hands them to ``finalize`` memory-mapped, as
they are (``ExpectedColumns``), and ``urls()`` streams the endpoints: the run reads its input once, and the final
Parquet and the OpenAI output come from here, not from a second pass that renders and keys every row again. Memory
stays bounded: rows go to disk in chunks. A write that fails (a full disk) raises ``OutputError`` naming the file.
Given the results' input-column planner (``writers.input_planner``), each chunk's inputs, as they are read back, are
shown to it when the chunk is written: ``finalize``'s first pass over them (their columns' types), done on the thread
that reads the input while rows run instead of after the last one (0.2-0.3 s of a 100k-row job's results).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from mlxbatch.io.atomic import TMP_SUFFIX
from mlxbatch.io.columns import ColumnPlanner, decode_inputs
from mlxbatch.io.errors import OutputError
from mlxbatch.io.output_folder import RESULTS_NAME, oserror_text
from mlxbatch.io.schema import encode_json
from mlxbatch.io.selection import ExpectedColumns

EXPECTED_SPOOL = ".expected.arrow" + TMP_SUFFIX
_CHUNK = 8192
_SCHEMA = pa.schema([("row_id", pa.string()), ("key", pa.string()), ("inputs", pa.string()), ("url", pa.string())])


class ExpectedSpool:
    """Rows appended in input order by one writer (``add``), complete once ``close`` is called, read back any
    number of times (``columns``, ``urls``), deleted by ``remove``."""

    def __init__(self, out_dir: str | Path, planner: ColumnPlanner | None = None) -> None:
        self.path = Path(out_dir) / EXPECTED_SPOOL
        self._planner = planner  # (see the module's docstring; None: finalize observes the inputs itself)
        self._writer: ipc.RecordBatchFileWriter | None = None
        self._pending: tuple[list[str], list[str], list[str], list[str | None]] = ([], [], [], [])
        self.complete = False  # closed after the whole input was read
        with _writing(self.path):
            self.path.unlink(missing_ok=True)  # a crashed run's leftover
            self._writer = ipc.new_file(str(self.path), _SCHEMA)

    def add(self, row_id: str, key: str, inputs: Mapping[str, Any], url: str | None = None) -> None:
        ids, keys, inputs_col, urls = self._pending
        ids.append(row_id)
        keys.append(key)
        inputs_col.append(encode_json(inputs))
        urls.append(url)
        if len(ids) >= _CHUNK:
            self._flush()

    def _flush(self) -> None:
        if self._pending[0] and self._writer is not None:
            with _writing(self.path):
                self._writer.write_batch(pa.record_batch([pa.array(c, pa.string()) for c in self._pending],
                                                         schema=_SCHEMA))
            if self._planner is not None:  # the inputs as finalize reads them back: their JSON decoded
                self._planner.observe(decode_inputs(self._pending[2]))
            for column in self._pending:
                column.clear()

    def close(self) -> None:
        """Every row is in: the spool can be read."""
        if self._writer is not None:
            self._flush()
            with _writing(self.path):
                self._writer.close()
            self._writer = None
            self.complete = True

    def _table(self, columns: list[str]) -> pa.Table:
        assert self.complete, "the spool is read only once every row is in"
        with pa.memory_map(str(self.path)) as source:
            return ipc.open_file(source).read_all().select(columns)

    def columns(self) -> ExpectedColumns:
        table = self._table(["row_id", "key", "inputs"])
        return ExpectedColumns(table.column("row_id"), table.column("key"), table.column("inputs"), self._planner)

    def urls(self) -> Iterator[str | None]:
        for chunk in self._table(["url"]).column("url").chunks:
            yield from chunk.to_pylist()

    def remove(self) -> None:
        try:
            if self._writer is not None:
                self._writer.close()
        except OSError:
            pass
        self._writer = None
        self.path.unlink(missing_ok=True)


@contextmanager
def _writing(path: Path) -> Iterator[None]:
    """An ``OSError`` while the spool is written (a full disk) as the ``OutputError`` a user reads."""
    try:
        yield
    except OSError as exc:
        raise OutputError(f"could not write {path} (the rows {RESULTS_NAME} is written from): {oserror_text(exc)}. "
                          "The checkpoint is intact: free some space and run the job again") from exc
