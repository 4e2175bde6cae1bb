"""Where every checkpointed row lives, and gathering rows from the shards in any order with bounded memory.

Owns the mapping global position -> (shard, row) over the memory-mapped shard tables, key lookup (first
occurrence wins, matching ``CheckpointStore.iter_records``) and gathering. The index holds only the key column
(~40 bytes a row); row data stays in the memory-mapped shards until a chunk of it is gathered. Gathering is done
shard by shard, because pyarrow's ``take`` on a many-chunk table concatenates the whole column first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mlxbatch.io.schema import SHARD_SCHEMA

logger = logging.getLogger(__name__)

MISSING = -1  # the position of a key with no checkpointed row


class ShardIndex:
    """Rows of several ``SHARD_SCHEMA`` tables addressed by one global position (write order)."""

    def __init__(self, tables: Sequence[pa.Table]) -> None:
        self._tables = [t if t.column("key").num_chunks <= 1 else t.combine_chunks() for t in tables]
        lengths = np.array([t.num_rows for t in self._tables], dtype=np.int64)
        self._offsets = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths)])
        key_chunks = [chunk for t in self._tables for chunk in t.column("key").chunks]
        self.keys: pa.Array = pa.chunked_array(key_chunks, type=pa.string()).combine_chunks()
        self._nullable = pa.schema([f.with_nullable(True) for f in SHARD_SCHEMA])

    @property
    def size(self) -> int:
        return int(self._offsets[-1])

    def column_has_values(self, name: str) -> bool:
        """Whether any row (selected or not) has a non-null ``name``: cheap, from null counts."""
        return any(t.column(name).null_count < t.num_rows for t in self._tables)

    def locate(self, keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """The position of each key's first row, ``MISSING`` where the key has none (int64 array)."""
        if len(keys) == 0:
            return np.zeros(0, dtype=np.int64)
        found = pc.index_in(keys, value_set=self.keys).fill_null(MISSING)
        return np.asarray(found.to_numpy(), dtype=np.int64)

    def first_occurrences(self) -> np.ndarray:
        """The position of the first row of every distinct key, in write order."""
        return self.locate(pc.unique(self.keys))

    def gather(self, positions: np.ndarray, columns: Sequence[str]) -> pa.Table:
        """The rows at ``positions`` (in that order) with ``columns``; a ``MISSING`` position gives a null row."""
        schema = pa.schema([self._nullable.field(c) for c in columns])
        if len(positions) == 0:
            return schema.empty_table()
        shard_of = np.searchsorted(self._offsets, positions, side="right") - 1
        shard_of[positions < 0] = MISSING
        order = np.argsort(shard_of, kind="stable")
        groups = np.split(order, np.flatnonzero(np.diff(shard_of[order])) + 1)
        pieces: list[pa.Table] = []
        for group in groups:
            shard = int(shard_of[group[0]])
            if shard == MISSING:
                pieces.append(pa.Table.from_arrays([pa.nulls(len(group), f.type) for f in schema], schema=schema))
                continue
            rows = positions[group] - self._offsets[shard]
            taken = self._tables[shard].select(list(columns)).take(pa.array(rows))
            pieces.append(pa.Table.from_arrays(taken.columns, schema=schema))
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return pa.concat_tables(pieces).take(pa.array(inverse))
