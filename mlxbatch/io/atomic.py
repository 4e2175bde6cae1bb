"""Crash-safe file writes: write a temporary sibling, flush and fsync it, rename it over the target, fsync the
folder.

Owns the temporary-name convention (``<name>.tmp``) and what "synced to disk" means (``fsync_file``). A reader
therefore sees either the old file or the whole new one, never a torn one. Single writer per target is assumed
(the checkpoint store holds a lock). On macOS ``fsync`` only hands the data to the drive, whose cache can lose it
on power loss; ``fcntl(F_FULLFSYNC)`` flushes the cache too, so it is used wherever the platform has it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"


def tmp_path_for(path: Path) -> Path:
    return path.with_name(path.name + TMP_SUFFIX)


def fsync_file(fd: int) -> None:
    """Make what was written to ``fd`` durable: ``F_FULLFSYNC`` where the platform has it (macOS: plain fsync
    leaves the data in the drive's cache), ``fsync`` elsewhere or where the filesystem refuses it (e.g. SMB)."""
    full = getattr(fcntl, "F_FULLFSYNC", None)
    if full is not None:
        try:
            fcntl.fcntl(fd, full)
            return
        except OSError as exc:
            logger.debug("F_FULLFSYNC not supported here (%s); using fsync", exc)
    os.fsync(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows
        return
    try:
        fsync_file(fd)
    except OSError:
        logger.debug("fsync of directory %s not supported", path)
    finally:
        os.close(fd)


@contextmanager
def atomic_writer(path: str | Path, *, text: bool = False) -> Iterator[IO[Any]]:
    """Yield a file to write ``path``'s new content into; it replaces ``path`` only if the block succeeds."""
    path = Path(path)
    tmp = tmp_path_for(path)
    f: IO[Any] = open(tmp, "w", encoding="utf-8", newline="\n") if text else open(tmp, "wb")
    try:
        yield f
        f.flush()
        fsync_file(f.fileno())
    except BaseException:
        try:
            f.close()  # flushes what is buffered: fails again on a full disk
        except OSError:
            pass
        tmp.unlink(missing_ok=True)
        raise
    f.close()
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_writer(path) as f:
        f.write(data)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    with atomic_writer(path, text=True) as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
