"""Exactly-once checkpointing of finished rows: immutable Arrow IPC shards plus a manifest, in one folder.

Layout of ``out_dir``::

    manifest.json              shards (name, rows, bytes, sha256) in write order + job metadata ("meta")
    shards/shard-000001.arrow  one append() each; written as .tmp, fsynced, renamed, never rewritten
    shards/corrupt/            shards found truncated or unreadable, moved aside (their rows are redone)
    .lock                      held (flock) while a CheckpointStore is open: one writer per folder (holds its pid;
                               ``lock``)

Owns the folder's layout and ``CheckpointStore``: opening it (the lock, the manifest, recovery), writing shards
(``append``, exactly once: a finished shard is never rewritten), reading the checkpointed rows back, ``verify``,
``reset`` and the job metadata. Every listed shard's size and sha256 are checked when the store opens and by
``verify`` (before the final outputs are written); a shard that fails is moved to ``corrupt/`` and its rows are
redone. Does not own the manifest's format, reading and writing (``manifest``), what a crash can leave and how it
is repaired (``recovery``), what a key means (``keys``) or the final outputs (``writers``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from mlxbatch.io.atomic import fsync_dir, fsync_file, tmp_path_for
from mlxbatch.io.errors import CheckpointError
from mlxbatch.io.faults import crash, fault_due
from mlxbatch.io.lock import acquire_lock
from mlxbatch.io.manifest import MANIFEST_NAME, ShardInfo, load_manifest, peek_meta, save_manifest
from mlxbatch.io.records import ResultRecord
from mlxbatch.io.recovery import RecoveryReport, recover, verify_shards
from mlxbatch.io.schema import from_arrow, read_shard, serialize_shard, to_arrow

logger = logging.getLogger(__name__)

SHARDS_DIR = "shards"
CORRUPT_DIR = "corrupt"


class CheckpointStore:
    """The checkpoint folder of one job output. Use as a context manager (or call ``close``) to release the lock."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self.shards_dir = self.out_dir / SHARDS_DIR
        self.corrupt_dir = self.shards_dir / CORRUPT_DIR
        self.manifest_path = self.out_dir / MANIFEST_NAME
        self.shards_dir.mkdir(parents=True, exist_ok=True)
        self._appends = 0  # appends by this process (crash-test hooks count them)
        self._manifest_saves = 0
        self._lock_fd: int | None = acquire_lock(self.out_dir)
        try:
            self._shards, self._meta = load_manifest(self.manifest_path, self.corrupt_dir)
            self.recovery = self._recover()
        except BaseException:
            self.close()
            raise

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- manifest ----------------------------------------------------------------------------------------------
    def _save_manifest(self) -> None:
        self._manifest_saves += 1
        save_manifest(self.manifest_path, self._shards, self._meta, self._manifest_saves)

    # -- recovery ----------------------------------------------------------------------------------------------
    def _recover(self) -> RecoveryReport:
        self._shards, self._next_seq, report = recover(self.shards_dir, self.corrupt_dir, self.manifest_path,
                                                       self._shards)
        if report.adopted or report.corrupt or report.missing:
            self._save_manifest()
        return report

    # -- reading -----------------------------------------------------------------------------------------------
    @property
    def shards(self) -> tuple[ShardInfo, ...]:
        return tuple(self._shards)

    @property
    def num_records(self) -> int:
        """Rows in all valid shards (a key written twice counts twice)."""
        return sum(s.rows for s in self._shards)

    def shard_path(self, info: ShardInfo) -> Path:
        return self.shards_dir / info.name

    def iter_tables(self) -> Iterator[pa.Table]:
        """Each valid shard as a memory-mapped table of ``SHARD_SCHEMA``, in write order (duplicates not removed)."""
        for info in self._shards:
            yield read_shard(self.shard_path(info))

    def done_keys(self) -> set[str]:
        """Keys of all checkpointed rows (a new set, owned by the caller)."""
        keys: set[str] = set()
        for table in self.iter_tables():
            keys.update(table.column("key").to_pylist())
        return keys

    def error_keys(self) -> set[str]:
        """Keys of the checkpointed rows whose result is an error row (a new set, owned by the caller)."""
        keys: set[str] = set()
        for table in self.iter_tables():
            failed = table.filter(table.column("error").is_valid())
            keys.update(failed.column("key").to_pylist())
        return keys

    def iter_records(self) -> Iterator[ResultRecord]:
        """All checkpointed records in write order; a key written twice yields only its first record."""
        seen: set[str] = set()
        for table in self.iter_tables():
            for record in from_arrow(table):
                if record.key not in seen:
                    seen.add(record.key)
                    yield record

    def verify(self) -> tuple[str, ...]:
        """Re-hash every shard against the manifest; move mismatches aside (their rows are then missing and must
        be redone). Returns their names (reads every shard)."""
        bad = verify_shards(self.shards_dir, self.corrupt_dir, self._shards)
        if bad:
            self._save_manifest()
        return bad

    def reset(self) -> None:
        """Drop every shard, casualty and piece of metadata (``overwrite``): the folder starts empty. Keeps the lock."""
        shutil.rmtree(self.shards_dir)
        self.shards_dir.mkdir()
        self._shards, self._meta, self._next_seq = [], {}, 1
        self._save_manifest()

    @staticmethod
    def peek_meta(out_dir: str | Path) -> dict[str, Any]:
        """The metadata of a folder's manifest, read without the lock ({} when there is none or it is unreadable)."""
        return peek_meta(out_dir)

    # -- writing -----------------------------------------------------------------------------------------------
    def append(self, records: Sequence[ResultRecord]) -> Path:
        """Write ``records`` as one new shard, durably, then list it in the manifest. Returns the shard's path.

        Write rows in batches (hundreds to thousands, or every few seconds): every call also rewrites the manifest.
        """
        if not records:
            raise ValueError("append() needs at least one record")
        if self._lock_fd is None:
            raise CheckpointError(f"{self.out_dir}: store is closed")
        data = serialize_shard(to_arrow(records))
        name = f"shard-{self._next_seq:06d}.arrow"
        final = self.shards_dir / name
        if final.exists():  # exactly-once: finished results are never rewritten
            raise CheckpointError(f"{final} already exists; refusing to overwrite a finished shard")
        tmp = tmp_path_for(final)
        self._appends += 1
        try:
            with open(tmp, "wb") as f:
                if fault_due("mid-shard", self._appends):
                    f.write(memoryview(data)[: data.size // 2])
                    f.flush()
                    crash()
                f.write(memoryview(data))
                f.flush()
                fsync_file(f.fileno())  # F_FULLFSYNC on macOS: a shard is a promise that its rows are done
            os.replace(tmp, final)
            if fault_due("after-rename", self._appends):
                crash()
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"could not write checkpoint shard {final}: {exc}") from exc
        fsync_dir(self.shards_dir)
        self._next_seq += 1
        self._shards.append(ShardInfo(name, len(records), data.size, hashlib.sha256(memoryview(data)).hexdigest()))
        self._save_manifest()
        logger.debug("checkpointed %d rows in %s", len(records), name)
        return final

    # -- job metadata ------------------------------------------------------------------------------------------
    def set_meta(self, key: str, value: Any) -> None:
        """Store a JSON-serialisable value (e.g. the job hash, the run plan) in the manifest, durably."""
        json.dumps(value)  # fail here, not halfway through a manifest write
        self._meta[key] = value
        self._save_manifest()

    def get_meta(self, key: str, default: Any = None) -> Any:
        return self._meta.get(key, default)

    @property
    def meta(self) -> dict[str, Any]:
        return json.loads(json.dumps(self._meta))  # a deep copy: the store owns its metadata
