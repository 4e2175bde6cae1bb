"""Exactly-once checkpointing of finished rows: immutable Arrow IPC shards plus a manifest, in one folder.

Layout of ``out_dir``::

    manifest.json              shards (name, rows, bytes, sha256) in write order + job metadata ("meta")
    shards/shard-000001.arrow  one append() each; written as .tmp, fsynced, renamed, never rewritten
    shards/corrupt/            shards found truncated or unreadable, moved aside (their rows are redone)
    .lock                      held (flock) while a CheckpointStore is open: one writer per folder (holds its pid;
                               ``lock``)

Owns the shard files, the manifest and recovery after a crash or a lying disk. A crash can leave: a ``.tmp``
(deleted on open), a renamed shard the manifest does not list yet (validated fully and adopted), a truncated file
(moved to ``corrupt/``). Every listed shard's size and sha256 are checked when the store opens and by ``verify``
(before the final outputs are written); a shard that fails is moved to ``corrupt/`` and its rows are redone. A
manifest that is empty, cut short or not JSON is moved aside and rebuilt from the shards. Does not own what a key
means (``keys``) or the final outputs (``writers``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from mlxbatch.io.atomic import TMP_SUFFIX, atomic_write_json, fsync_dir, fsync_file, tmp_path_for
from mlxbatch.io.errors import CheckpointError
from mlxbatch.io.faults import crash, fault_due
from mlxbatch.io.lock import acquire_lock
from mlxbatch.io.records import ResultRecord
from mlxbatch.io.schema import ShardFormatError, from_arrow, read_shard, serialize_shard, to_arrow

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "mlxbatch-checkpoint"
MANIFEST_VERSION = 1
SHARDS_DIR = "shards"
CORRUPT_DIR = "corrupt"
_SHARD_RE = re.compile(r"^shard-(\d+)\.arrow$")
_SEQ_RE = re.compile(r"^shard-(\d+)\.arrow")  # also matches .tmp leftovers and renamed casualties


@dataclass(frozen=True)
class ShardInfo:
    """One completed shard as the manifest lists it."""

    name: str
    rows: int
    bytes: int
    sha256: str

    @property
    def seq(self) -> int:
        match = _SHARD_RE.match(self.name)
        assert match, self.name
        return int(match.group(1))


@dataclass(frozen=True)
class RecoveryReport:
    """What opening the store had to repair (names of files)."""

    removed_tmp: tuple[str, ...] = ()
    adopted: tuple[str, ...] = ()  # complete shards the manifest did not list yet
    corrupt: tuple[str, ...] = ()  # moved to shards/corrupt/; their rows will be redone
    missing: tuple[str, ...] = ()  # listed in the manifest but gone from disk; their rows will be redone


def _seq_of(name: str) -> int | None:
    match = _SEQ_RE.match(name)
    return int(match.group(1)) if match else None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


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
            self._shards, self._meta = self._load_manifest()
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
    def _load_manifest(self) -> tuple[list[ShardInfo], dict[str, Any]]:
        """The manifest's shards and metadata; an empty, cut or garbled manifest is set aside and rebuilt."""
        if not self.manifest_path.exists():
            return [], {}
        try:
            data = json.loads(self.manifest_path.read_bytes().decode("utf-8"))
        except ValueError as exc:
            return self._rebuild(f"not valid JSON ({exc})")
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise CheckpointError(f"{self.manifest_path}: not an mlxbatch checkpoint manifest")
        if data.get("version") != MANIFEST_VERSION:
            raise CheckpointError(f"{self.manifest_path}: manifest version {data.get('version')!r} is not "
                                  f"{MANIFEST_VERSION}; use a new output folder")
        try:
            shards = [ShardInfo(**entry) for entry in data["shards"]]
            return shards, dict(data.get("meta", {}))
        except (ValueError, KeyError, TypeError) as exc:
            return self._rebuild(f"malformed ({type(exc).__name__}: {exc})")

    def _rebuild(self, why: str) -> tuple[list[ShardInfo], dict[str, Any]]:
        """Set a broken manifest aside; recovery then adopts every complete shard on disk (metadata is lost)."""
        self.corrupt_dir.mkdir(exist_ok=True)
        aside = self.corrupt_dir / f"{MANIFEST_NAME}.{len(list(self.corrupt_dir.glob(MANIFEST_NAME + '*'))) + 1}"
        os.replace(self.manifest_path, aside)
        logger.warning("%s is %s; moved to %s and rebuilt from the shards on disk", self.manifest_path, why, aside)
        return [], {}

    def _save_manifest(self) -> None:
        data = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "shards": [asdict(s) for s in self._shards],
                "meta": self._meta}
        self._manifest_saves += 1
        if fault_due("mid-manifest", self._manifest_saves):
            text = json.dumps(data).encode()
            tmp_path_for(self.manifest_path).write_bytes(text[: len(text) // 2])
            crash()
        atomic_write_json(self.manifest_path, data)

    # -- recovery ----------------------------------------------------------------------------------------------
    def _move_aside(self, path: Path) -> str:
        self.corrupt_dir.mkdir(exist_ok=True)
        target = self.corrupt_dir / path.name
        n = 0
        while target.exists():  # never overwrite an earlier casualty
            n += 1
            target = self.corrupt_dir / f"{path.name}.{n}"
        os.replace(path, target)
        logger.warning("checkpoint shard %s is incomplete or unreadable; moved to %s (its rows will be redone)",
                       path, target)
        return path.name

    def _recover(self) -> RecoveryReport:
        removed_tmp, adopted, corrupt, missing = [], [], [], []
        for leftover in [*self.shards_dir.glob("*" + TMP_SUFFIX), tmp_path_for(self.manifest_path)]:
            if leftover.exists():
                leftover.unlink()
                removed_tmp.append(leftover.name)
                logger.info("removed leftover temporary file %s (an interrupted write)", leftover)
        kept: list[ShardInfo] = []
        for info in self._shards:
            path = self.shards_dir / info.name
            if not path.exists():
                missing.append(info.name)
                logger.error("checkpoint shard %s listed in the manifest is missing; its rows will be redone", path)
                continue
            try:
                if path.stat().st_size != info.bytes:
                    raise ShardFormatError(f"{path}: size {path.stat().st_size} != manifest {info.bytes}")
                if _sha256_file(path) != info.sha256:
                    raise ShardFormatError(f"{path}: its sha256 does not match the manifest (the file changed)")
                read_shard(path)
            except ShardFormatError as exc:
                logger.error("%s", exc)
                corrupt.append(self._move_aside(path))
                continue
            kept.append(info)
        listed = {info.name for info in self._shards}
        on_disk = sorted((p for p in self.shards_dir.iterdir() if _SHARD_RE.match(p.name)),
                         key=lambda p: _seq_of(p.name) or 0)
        for path in on_disk:
            if path.name in listed:
                continue
            try:
                table = read_shard(path, full=True)
            except ShardFormatError as exc:
                logger.error("%s", exc)
                corrupt.append(self._move_aside(path))
                continue
            data = path.read_bytes()
            kept.append(ShardInfo(path.name, table.num_rows, len(data), hashlib.sha256(data).hexdigest()))
            adopted.append(path.name)
            logger.info("adopted complete shard %s that the manifest did not list yet", path.name)
        kept.sort(key=lambda s: s.seq)
        report = RecoveryReport(tuple(removed_tmp), tuple(adopted), tuple(corrupt), tuple(missing))
        changed = bool(adopted or corrupt or missing)
        self._shards = kept
        # Never reuse a sequence number that names a file anywhere, casualties included.
        seqs = [s.seq for s in kept] + [_seq_of(p.name) or 0 for p in self.corrupt_dir.glob("shard-*")]
        self._next_seq = max(seqs, default=0) + 1
        if changed:
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
        bad: list[str] = []
        for info in list(self._shards):
            path = self.shard_path(info)
            if not path.exists():
                logger.error("checkpoint shard %s listed in the manifest is missing; its rows will be redone", path)
                bad.append(info.name)
            elif _sha256_file(path) != info.sha256:
                logger.error("checkpoint shard %s does not match its sha256 in the manifest", path)
                bad.append(self._move_aside(path))
            else:
                continue
            self._shards.remove(info)
        if bad:
            self._save_manifest()
        return tuple(bad)

    def reset(self) -> None:
        """Drop every shard, casualty and piece of metadata (``overwrite``): the folder starts empty. Keeps the lock."""
        shutil.rmtree(self.shards_dir)
        self.shards_dir.mkdir()
        self._shards, self._meta, self._next_seq = [], {}, 1
        self._save_manifest()

    @staticmethod
    def peek_meta(out_dir: str | Path) -> dict[str, Any]:
        """The metadata of a folder's manifest, read without the lock ({} when there is none or it is unreadable)."""
        try:
            data = json.loads((Path(out_dir) / MANIFEST_NAME).read_bytes().decode("utf-8"))
            meta = data.get("meta") if isinstance(data, dict) else None
        except (OSError, ValueError):
            return {}
        return dict(meta) if isinstance(meta, dict) else {}

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
