"""Recovery of a checkpoint folder after a crash or a lying disk, and re-verification of its shards.

Owns what opening a ``CheckpointStore`` repairs (``recover``, reported as a ``RecoveryReport``): a ``.tmp`` (deleted),
a renamed shard the manifest does not list yet (validated fully and adopted), a listed shard that is missing, or
truncated, unreadable or changed (size or sha256 against the manifest; moved to ``shards/corrupt/``, its rows are
redone), and the next free shard number (never one that names a file, casualties included). ``verify_shards``
re-hashes every listed shard before the final outputs are written. Does not own the manifest (``manifest``) or
writing shards (``checkpoint``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from mlxbatch.io.atomic import TMP_SUFFIX, tmp_path_for
from mlxbatch.io.manifest import SHARD_RE, ShardInfo
from mlxbatch.io.schema import ShardFormatError, read_shard

logger = logging.getLogger(__name__)

_SEQ_RE = re.compile(r"^shard-(\d+)\.arrow")  # also matches .tmp leftovers and renamed casualties


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


def _move_aside(path: Path, corrupt_dir: Path) -> str:
    corrupt_dir.mkdir(exist_ok=True)
    target = corrupt_dir / path.name
    n = 0
    while target.exists():  # never overwrite an earlier casualty
        n += 1
        target = corrupt_dir / f"{path.name}.{n}"
    os.replace(path, target)
    logger.warning("checkpoint shard %s is incomplete or unreadable; moved to %s (its rows will be redone)",
                   path, target)
    return path.name


def recover(shards_dir: Path, corrupt_dir: Path, manifest_path: Path,
            shards: list[ShardInfo]) -> tuple[list[ShardInfo], int, RecoveryReport]:
    """Repair the folder against the manifest's ``shards``. Returns the valid shards in write order, the next shard
    number and what was repaired; the caller saves the manifest when a shard was adopted, moved aside or missing."""
    removed_tmp, adopted, corrupt, missing = [], [], [], []
    for leftover in [*shards_dir.glob("*" + TMP_SUFFIX), tmp_path_for(manifest_path)]:
        if leftover.exists():
            leftover.unlink()
            removed_tmp.append(leftover.name)
            logger.info("removed leftover temporary file %s (an interrupted write)", leftover)
    kept: list[ShardInfo] = []
    for info in shards:
        path = shards_dir / info.name
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
            corrupt.append(_move_aside(path, corrupt_dir))
            continue
        kept.append(info)
    listed = {info.name for info in shards}
    on_disk = sorted((p for p in shards_dir.iterdir() if SHARD_RE.match(p.name)),
                     key=lambda p: _seq_of(p.name) or 0)
    for path in on_disk:
        if path.name in listed:
            continue
        try:
            table = read_shard(path, full=True)
        except ShardFormatError as exc:
            logger.error("%s", exc)
            corrupt.append(_move_aside(path, corrupt_dir))
            continue
        data = path.read_bytes()
        kept.append(ShardInfo(path.name, table.num_rows, len(data), hashlib.sha256(data).hexdigest()))
        adopted.append(path.name)
        logger.info("adopted complete shard %s that the manifest did not list yet", path.name)
    kept.sort(key=lambda s: s.seq)
    report = RecoveryReport(tuple(removed_tmp), tuple(adopted), tuple(corrupt), tuple(missing))
    # Never reuse a sequence number that names a file anywhere, casualties included.
    seqs = [s.seq for s in kept] + [_seq_of(p.name) or 0 for p in corrupt_dir.glob("shard-*")]
    return kept, max(seqs, default=0) + 1, report


def verify_shards(shards_dir: Path, corrupt_dir: Path, shards: list[ShardInfo]) -> tuple[str, ...]:
    """Re-hash every shard against the manifest; move mismatches aside and remove them, and missing shards, from
    ``shards`` (their rows must be redone). Returns their names (reads every shard)."""
    bad: list[str] = []
    for info in list(shards):
        path = shards_dir / info.name
        if not path.exists():
            logger.error("checkpoint shard %s listed in the manifest is missing; its rows will be redone", path)
            bad.append(info.name)
        elif _sha256_file(path) != info.sha256:
            logger.error("checkpoint shard %s does not match its sha256 in the manifest", path)
            bad.append(_move_aside(path, corrupt_dir))
        else:
            continue
        shards.remove(info)
    return tuple(bad)
