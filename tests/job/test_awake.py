"""Overnight on a Mac (#16): ``mlxbatch run`` holds ``caffeinate -i -w <pid>`` while the job runs and stops it at
the end; nothing elsewhere. macOS is injected (the platform, and a ``caffeinate`` on PATH that records its call)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from jobkit import texts, write_job, write_jsonl

from mlxbatch.cli import main
from mlxbatch.job.run import awake


@pytest.fixture()
def caffeinate(tmp_path, monkeypatch) -> Path:
    """A fake caffeinate first on PATH: writes its arguments and pid, then waits to be stopped."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "caffeinate.calls"
    (bin_dir / "caffeinate").write_text(f'#!/bin/sh\necho "$$ $*" >> {calls}\nexec sleep 600\n')
    (bin_dir / "caffeinate").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(path: Path) -> str:
    import time

    for _ in range(200):
        if path.exists() and path.read_text().endswith("\n"):
            return path.read_text()
        time.sleep(0.01)
    raise AssertionError(f"{path} was never written")


def test_keep_awake_holds_caffeinate_for_the_block_on_macos_only(caffeinate):
    assert awake.keep_awake_command("darwin", 4242, lambda name: f"/usr/bin/{name}") == \
        ["/usr/bin/caffeinate", "-i", "-w", "4242"]
    assert awake.keep_awake_command("linux", 4242) is None and awake.keep_awake_command("win32", 1) is None
    with awake.keep_awake("linux") as proc:
        assert proc is None
    assert not caffeinate.exists()
    with pytest.raises(RuntimeError, match="boom"), awake.keep_awake("darwin") as proc:
        pid, args = wait_for(caffeinate).split(" ", 1)
        assert args.split() == ["-i", "-w", str(os.getpid())] and proc.poll() is None and alive(int(pid))
        raise RuntimeError("boom")  # a failing run still lets the Mac sleep again
    assert proc.poll() is not None and not alive(int(pid))


def test_mlxbatch_run_keeps_a_mac_awake_until_it_exits(tmp_path, tiny_model_path, caffeinate, monkeypatch):
    monkeypatch.setattr(awake, "_platform", lambda: "darwin")
    data = write_jsonl(tmp_path / "rows.jsonl", texts(6))
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", sampling={"temperature": 0, "max_tokens": 3})
    res = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "out" / "_SUCCESS").exists()
    (line,) = caffeinate.read_text().splitlines()  # one assertion for the whole run
    pid, *args = line.split()
    assert args == ["-i", "-w", str(os.getpid())] and not alive(int(pid))


def test_run_job_keeps_a_mac_awake_until_it_returns(tmp_path, tiny_model_path, caffeinate, monkeypatch):
    """The notebook entry point holds the same assertion as the command line: a notebook's overnight job too."""
    import mlxbatch

    monkeypatch.setattr(awake, "_platform", lambda: "darwin")
    data = write_jsonl(tmp_path / "rows.jsonl", texts(6))
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", sampling={"temperature": 0, "max_tokens": 3})
    result = mlxbatch.run_job(job)
    assert result.report["rows"]["output"] == 6
    (line,) = caffeinate.read_text().splitlines()
    pid, *args = line.split()
    assert args == ["-i", "-w", str(os.getpid())] and not alive(int(pid))  # stopped when run_job returned
