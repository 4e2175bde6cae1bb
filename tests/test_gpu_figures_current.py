"""The GPU figures in docs/benchmarks.md are those of the engine on main.

A change on the engine's path is done only when the GPU suite was run at the commit that lands (CPU tables do not
show GPU costs: a regression once made the cached GPU path 2.8x slower and no check noticed). docs/benchmarks.md
names that commit in exactly one line, ``GPU figures measured at commit <sha>``; no file under ``mlxbatch/engine``
may differ between it and the tree under test. After an engine change: commit it, run
``python3 scripts/bench.py --section gpu --model 0.5b --commit <sha>`` on a GPU at that commit, record the tables and
move the line to that commit (see docs/benchmarks.md, "How to run").
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^GPU figures measured at commit ([0-9a-f]{7,40})\s*$", re.MULTILINE)


def _measured() -> str:
    found = LINE.findall((ROOT / "docs" / "benchmarks.md").read_text())
    assert len(found) == 1, f"docs/benchmarks.md needs exactly one 'GPU figures measured at commit <sha>' line: {found}"
    return found[0]


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def test_one_commit_is_named():
    assert _measured()


def test_the_engine_is_the_one_measured():
    sha = _measured()
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (e.g. the device's copy of the tree)")
    if _git("cat-file", "-e", f"{sha}^{{commit}}").returncode != 0:
        pytest.skip(f"commit {sha} is not in this clone (a shallow clone?)")
    diff = _git("diff", "--name-only", sha, "--", "mlxbatch/engine")
    assert diff.returncode == 0, diff.stderr
    changed = diff.stdout.split()
    assert not changed, (f"mlxbatch/engine differs from {sha}, where the GPU figures were measured: {changed}. "
                         "Run the GPU suite at the commit that changes the engine and name it in docs/benchmarks.md.")
