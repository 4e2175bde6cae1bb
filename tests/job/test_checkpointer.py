"""The run loop's checkpoint writer: shards are made durable on a thread while the loop goes on, in order, rows
handed over during a write coalesced into the next shard; a failed write is raised in the loop's thread."""

from __future__ import annotations

import threading
import time

import pytest

from mlxbatch.io.checkpoint import CheckpointStore
from mlxbatch.io.errors import CheckpointError
from mlxbatch.io.records import ResultRecord
from mlxbatch.job.run.checkpointer import Checkpointer


def _records(prefix: str, n: int) -> list[ResultRecord]:
    return [ResultRecord(row_id=f"{prefix}{i}", key=f"key-{prefix}{i}", text="t") for i in range(n)]


class _HeldStore(CheckpointStore):
    """A real store whose first append waits until the test lets it go (a slow disk, held still)."""

    def __init__(self, out_dir, release: threading.Event) -> None:
        super().__init__(out_dir)
        self.release, self.writing = release, threading.Event()

    def append(self, records):
        self.writing.set()
        self.release.wait(timeout=30)
        return super().append(records)


def test_the_loop_goes_on_while_a_shard_is_written_and_later_rows_share_the_next_shard(tmp_path):
    release = threading.Event()
    with _HeldStore(tmp_path / "out", release) as store:
        writer = Checkpointer(store)
        writer.put(_records("a", 3))
        assert store.writing.wait(timeout=10)  # the first shard is being written, held
        t0 = time.monotonic()
        writer.put(_records("b", 2))
        writer.put(_records("c", 4))
        assert time.monotonic() - t0 < 5  # handed over without waiting for the disk
        assert store.done_keys() == set()  # nothing counts as checkpointed before its shard is in the manifest
        release.set()
        writer.close()
        assert [s.rows for s in store.shards] == [3, 6] and writer.shards == 2  # in order; b and c coalesced
        assert store.done_keys() == {r.key for r in _records("a", 3) + _records("b", 2) + _records("c", 4)}


class _FullStore(CheckpointStore):
    def append(self, records):
        raise CheckpointError(f"could not write checkpoint shard {self.shards_dir}/shard-000000.arrow: disk full")


def test_a_failed_write_is_raised_once_in_the_loop_and_nothing_after_it_is_written(tmp_path):
    with _FullStore(tmp_path / "out") as store:
        writer = Checkpointer(store)
        writer.put(_records("a", 2))
        with pytest.raises(CheckpointError, match="disk full"):
            writer.drain()
        writer.put(_records("b", 2))  # the loop's own flush on its way out: dropped (a resume runs them again)
        writer.close()
        assert store.shards == () and store.done_keys() == set()
