"""The output folder's lock: one mlxbatch run writes a folder at a time.

Owns ``<out_dir>/.lock``: a ``CheckpointStore`` holds an exclusive ``flock`` on it while it is open and writes its
pid into it, so a second run is refused with a message naming the holder (``in_use_message``). ``lock_holder``
asks whether another process holds it without taking it or writing anything (for ``mlxbatch validate``). A
filesystem without advisory locks (an SMB share) is refused: two runs could write the folder at once.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from mlxbatch.io.errors import CheckpointError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory lock
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".lock"
_NO_LOCKS = {errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.ENOLCK}


def in_use_message(out_dir: Path, holder: str) -> str:
    """What a run (or validate) says of a folder another run holds; ``holder`` is the pid written in the lock."""
    who = f" (pid {holder})" if holder.isdigit() else ""
    return (f"{out_dir} is in use by another mlxbatch run{who}: wait for it to finish or stop it, or use another "
            "output folder")


def _holder(lock: Path) -> str:
    try:
        return lock.read_text(errors="replace").strip()
    except OSError:
        return ""


def acquire_lock(out_dir: Path) -> int | None:
    """Take the folder's lock (held until the returned descriptor is closed) and record this process's pid."""
    lock = out_dir / LOCK_NAME
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    if fcntl is None:
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in _NO_LOCKS:
            raise CheckpointError(
                f"{out_dir}: the filesystem does not support file locking ({exc.strerror}), so two runs "
                "could write this folder at once; use an output folder on a local disk") from exc
        raise CheckpointError(in_use_message(out_dir, _holder(lock))) from exc
    try:  # who holds it, for the message another run prints
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except OSError:
        pass
    return fd


def lock_holder(out_dir: Path) -> str | None:
    """The pid (as written, "" if unknown) of another process holding the folder's lock, or None when no process
    holds it (or the folder has no lock file, or the filesystem has no locks). Read-only: creates and writes
    nothing, and holds nothing after it returns."""
    lock = out_dir / LOCK_NAME
    if fcntl is None or not lock.is_file():
        return None
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # compatible with readers, refused while a run holds it
    except OSError as exc:
        return None if exc.errno in _NO_LOCKS else _holder(lock)
    finally:
        os.close(fd)  # releases the shared lock if it was taken
    return None
