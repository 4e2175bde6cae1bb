"""Durable writes (io.atomic) on macOS, injected: F_FULLFSYNC flushes the drive's cache where plain fsync does not."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from io_helpers import make_record

from mlxbatch.io import CheckpointStore, atomic

F_FULLFSYNC = 51  # Darwin's value; Linux's fcntl module has no such constant


class DarwinFcntl:
    """What ``fcntl`` looks like on macOS: F_FULLFSYNC exists; each call is recorded with the file it syncs."""

    F_FULLFSYNC = F_FULLFSYNC

    def __init__(self, refuse: bool = False) -> None:
        self.calls: list[tuple[int, int]] = []  # (inode of the file synced, command)
        self.refuse = refuse

    def fcntl(self, fd: int, cmd: int) -> int:
        self.calls.append((os.fstat(fd).st_ino, cmd))
        if self.refuse:  # e.g. an SMB share
            raise OSError(errno.ENOTSUP, "Operation not supported")
        return 0


def ino(path: Path) -> int:
    return path.stat().st_ino


@pytest.fixture()
def fsyncs(monkeypatch) -> list[int]:
    """The inodes of the files os.fsync is called on (a renamed file keeps its inode)."""
    seen: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (seen.append(os.fstat(fd).st_ino), real(fd))[1])
    return seen


def test_atomic_writes_use_f_fullfsync_on_macos(tmp_path: Path, monkeypatch, fsyncs) -> None:
    darwin = DarwinFcntl()
    monkeypatch.setattr(atomic, "fcntl", darwin)
    target = tmp_path / "manifest.json"
    atomic.atomic_write_json(target, {"shards": []})
    # the temporary file's data (before its rename to manifest.json), then the folder (the rename): F_FULLFSYNC
    assert darwin.calls == [(ino(target), F_FULLFSYNC), (ino(tmp_path), F_FULLFSYNC)]
    assert fsyncs == [] and target.read_text().startswith("{")


def test_fsync_where_f_fullfsync_is_refused_or_missing(tmp_path: Path, monkeypatch, fsyncs) -> None:
    refusing = DarwinFcntl(refuse=True)
    monkeypatch.setattr(atomic, "fcntl", refusing)
    atomic.atomic_write_bytes(tmp_path / "a.bin", b"x")
    assert [c[0] for c in refusing.calls] == fsyncs == [ino(tmp_path / "a.bin"), ino(tmp_path)]
    fsyncs.clear()
    monkeypatch.setattr(atomic, "fcntl", SimpleNamespace(fcntl=None))  # Linux: no F_FULLFSYNC
    atomic.atomic_write_bytes(tmp_path / "b.bin", b"y")
    assert fsyncs == [ino(tmp_path / "b.bin"), ino(tmp_path)] and (tmp_path / "b.bin").read_bytes() == b"y"


def test_checkpoint_shards_are_synced_with_f_fullfsync_on_macos(tmp_path: Path, monkeypatch, fsyncs) -> None:
    """A checkpoint shard is the promise that its rows are done: on macOS its data, its folder and the manifest go
    through F_FULLFSYNC (plain fsync leaves them in the drive's cache, lost with power)."""
    darwin = DarwinFcntl()
    monkeypatch.setattr(atomic, "fcntl", darwin)
    with CheckpointStore(tmp_path / "out") as store:
        shard = store.append([make_record("a"), make_record("b")])
    synced = {inode for inode, cmd in darwin.calls if cmd == F_FULLFSYNC}
    assert ino(shard) in synced and ino(shard.parent) in synced
    assert ino(shard) not in fsyncs  # never a plain fsync for the shard's data
