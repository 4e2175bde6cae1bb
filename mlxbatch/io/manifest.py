"""The checkpoint folder's manifest: ``manifest.json``, the completed shards in write order plus job metadata.

Owns the manifest's format and version, its entries (``ShardInfo``: a shard's name, rows, bytes and sha256) and the
shard file names they match, reading it, writing it atomically (``mid-manifest`` crash-test hook) and reading its
metadata without the lock (``peek_meta``). A manifest that is empty, cut short or not JSON is moved to
``shards/corrupt/`` and read as empty, so that recovery rebuilds it from the shards on disk (the metadata is lost).
Does not own the shard files or recovery (``checkpoint``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxbatch.io.atomic import atomic_write_bytes, tmp_path_for
from mlxbatch.io.errors import CheckpointError
from mlxbatch.io.faults import crash, fault_due

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "mlxbatch-checkpoint"
MANIFEST_VERSION = 1
SHARD_RE = re.compile(r"^shard-(\d+)\.arrow$")


@dataclass(frozen=True)
class ShardInfo:
    """One completed shard as the manifest lists it."""

    name: str
    rows: int
    bytes: int
    sha256: str

    def entry(self) -> dict[str, Any]:
        """Its entry in the manifest (by hand: ``dataclasses.asdict`` copies deeply)."""
        return {"name": self.name, "rows": self.rows, "bytes": self.bytes, "sha256": self.sha256}

    @functools.cached_property
    def entry_json(self) -> str:
        """Its entry as JSON, encoded once: the manifest is rewritten with every shard (on the checkpoint's thread,
        which shares the GIL with the engine's), and encoding every entry each time made a run's manifest writes
        grow with the square of its shards (16 ms a write at 5,000 shards)."""
        return json.dumps(self.entry(), ensure_ascii=False)

    @property
    def seq(self) -> int:
        match = SHARD_RE.match(self.name)
        assert match, self.name
        return int(match.group(1))


def load_manifest(manifest_path: Path, corrupt_dir: Path) -> tuple[list[ShardInfo], dict[str, Any]]:
    """The manifest's shards and metadata; an empty, cut or garbled manifest is set aside and rebuilt."""
    if not manifest_path.exists():
        return [], {}
    try:
        data = json.loads(manifest_path.read_bytes().decode("utf-8"))
    except ValueError as exc:
        return _rebuild(manifest_path, corrupt_dir, f"not valid JSON ({exc})")
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{manifest_path}: not an mlxbatch checkpoint manifest")
    if data.get("version") != MANIFEST_VERSION:
        raise CheckpointError(f"{manifest_path}: manifest version {data.get('version')!r} is not "
                              f"{MANIFEST_VERSION}; use a new output folder")
    try:
        shards = [ShardInfo(**entry) for entry in data["shards"]]
        return shards, dict(data.get("meta", {}))
    except (ValueError, KeyError, TypeError) as exc:
        return _rebuild(manifest_path, corrupt_dir, f"malformed ({type(exc).__name__}: {exc})")


def _rebuild(manifest_path: Path, corrupt_dir: Path, why: str) -> tuple[list[ShardInfo], dict[str, Any]]:
    """Set a broken manifest aside; recovery then adopts every complete shard on disk (metadata is lost)."""
    corrupt_dir.mkdir(exist_ok=True)
    aside = corrupt_dir / f"{MANIFEST_NAME}.{len(list(corrupt_dir.glob(MANIFEST_NAME + '*'))) + 1}"
    os.replace(manifest_path, aside)
    logger.warning("%s is %s; moved to %s and rebuilt from the shards on disk", manifest_path, why, aside)
    return [], {}


def save_manifest(manifest_path: Path, shards: Sequence[ShardInfo], meta: dict[str, Any], save_count: int) -> None:
    """Write the manifest atomically; ``save_count`` is this process's count of saves (crash-test hook)."""
    text = manifest_text(shards, meta).encode()
    if fault_due("mid-manifest", save_count):
        tmp_path_for(manifest_path).write_bytes(text[: len(text) // 2])
        crash()
    atomic_write_bytes(manifest_path, text)


def manifest_text(shards: Sequence[ShardInfo], meta: dict[str, Any]) -> str:
    """The manifest as JSON: its header and metadata, then a shard a line (each entry encoded once: ``entry_json``)."""
    head = json.dumps({"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "meta": meta}, ensure_ascii=False)
    return head[:-1] + ',\n "shards": [' + ",".join("\n  " + s.entry_json for s in shards) + "\n]}\n"


def peek_meta(out_dir: str | Path) -> dict[str, Any]:
    """The metadata of a folder's manifest, read without the lock ({} when there is none or it is unreadable)."""
    try:
        data = json.loads((Path(out_dir) / MANIFEST_NAME).read_bytes().decode("utf-8"))
        meta = data.get("meta") if isinstance(data, dict) else None
    except (OSError, ValueError):
        return {}
    return dict(meta) if isinstance(meta, dict) else {}
