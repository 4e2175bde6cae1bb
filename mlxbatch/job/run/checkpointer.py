"""Checkpoint shards written on a thread beside the run loop, so the engine keeps stepping while a shard is made
durable.

A shard append is mostly waiting on the disk (three fsyncs: the shard, its folder, the manifest; ~30 ms for 256 rows
on a Linux SSD, more with macOS's F_FULLFSYNC), and the run loop that steps the engine would wait with it: at a GPU
job's ~2,500 rows/s a flush every 256 rows was ~10 flushes a second. Here the loop hands its finished rows over and
goes on; one writer thread appends them to the store, in the order handed over. Rows handed over while a write is in
progress are coalesced into the next shard, so slower disks get fewer, larger shards instead of a growing queue.

Exactly-once is unchanged: a row counts as checkpointed only once its shard is in the manifest, which only the writer
thread touches while the loop runs (``drain`` before anything else uses the store). A crash loses the rows not yet
written, which a resume runs again, as it loses the rows still buffered in the loop. A write that fails (a full disk)
is raised in the loop's thread at the next ``put`` or ``drain``; the rows it held are not written.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from mlxbatch.io.checkpoint import CheckpointStore
from mlxbatch.io.records import ResultRecord


class Checkpointer:
    """The one writer of ``store``'s shards during a run loop (a daemon thread, started on the first ``put``)."""

    def __init__(self, store: CheckpointStore) -> None:
        self._store = store
        self._cond = threading.Condition()
        self._pending: list[ResultRecord] = []  # handed over, not yet taken by the writer
        self._writing = False  # a shard is being written
        self._error: BaseException | None = None  # the writer's failure, raised once in the loop's thread
        self._failed = False  # then rows handed over are dropped (a resume runs them again) and nothing waits
        self._closed = False
        self._thread: threading.Thread | None = None
        self.shards = 0  # shards written by this checkpointer

    def put(self, records: Sequence[ResultRecord]) -> None:
        """Hand ``records`` to the writer and return at once (raises the writer's earlier failure, if any)."""
        self._raise_failure()
        if not records or self._failed:
            return
        with self._cond:
            self._pending.extend(records)
            if self._thread is None:
                self._thread = threading.Thread(target=self._write_loop, name="mlxbatch-checkpoint", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every row handed over is in a shard of the manifest (raises the writer's failure, if any)."""
        with self._cond:
            while (self._pending or self._writing) and not self._failed:
                self._cond.wait()
        self._raise_failure()

    def close(self) -> None:
        """Write what was handed over, then stop the writer (raises the writer's failure, if any)."""
        try:
            self.drain()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            if self._thread is not None:
                self._thread.join()

    def _raise_failure(self) -> None:
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                batch, self._pending = self._pending, []
                self._writing = True
            try:
                self._store.append(batch)
                failed = None
            except BaseException as exc:  # noqa: BLE001 - handed to the loop's thread, which raises it
                failed = exc
            with self._cond:
                self._writing = False
                if failed is not None:
                    self._error, self._failed = failed, True
                    self._pending.clear()  # not written: a resume runs them again
                else:
                    self.shards += 1
                self._cond.notify_all()
