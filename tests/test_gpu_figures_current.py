"""docs/benchmarks.md says whether its GPU figures are those of the engine under test.

CPU tables do not show GPU costs (a row copy that scaled with buffer capacity once made the cached GPU path 2.8x
slower while every CPU figure stayed put), so a reader must know whether the GPU figures describe this engine. The
rule, which work without a device can follow:
- docs/benchmarks.md names the commit of its newest GPU figures in exactly one line,
  ``GPU figures measured at commit <sha>``;
- when any file under ``mlxbatch/engine`` differs between that commit and the tree under test (HEAD in a clean
  checkout), it carries exactly one line ``engine changed since the GPU figures at <sha>: <what changed>``, and none
  when nothing changed. The next session with a GPU measures first, then moves the first line and drops the second
  (docs/benchmarks.md, "How to run").
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MEASURED = re.compile(r"^GPU figures measured at commit `?([0-9a-f]{7,40})`?\s*$", re.MULTILINE)
CHANGED = re.compile(r"^engine changed since the GPU figures at `?([0-9a-f]{7,40})`?: *(.*)$", re.MULTILINE)


def _doc() -> str:
    return (ROOT / "docs" / "benchmarks.md").read_text()


def _measured() -> str:
    found = MEASURED.findall(_doc())
    assert len(found) == 1, f"docs/benchmarks.md needs exactly one 'GPU figures measured at commit <sha>' line: {found}"
    return found[0]


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def _engine_changes(sha: str) -> list[str]:
    """Files under mlxbatch/engine that differ between ``sha`` and the tree under test (skips outside a checkout)."""
    if shutil.which("git") is None or _git("rev-parse", "--show-toplevel").returncode != 0:
        pytest.skip("not a git checkout (e.g. the device's copy of the tree)")
    if _git("cat-file", "-e", f"{sha}^{{commit}}").returncode != 0:
        pytest.skip(f"commit {sha} is not in this clone (a shallow clone?)")
    diff = _git("diff", "--name-only", sha, "--", "mlxbatch/engine")
    assert diff.returncode == 0, diff.stderr
    untracked = _git("ls-files", "--others", "--exclude-standard", "--", "mlxbatch/engine").stdout.split()
    return sorted(set(diff.stdout.split()) | set(untracked))


def test_one_commit_is_named():
    assert _measured()


def test_a_changed_engine_is_said_in_one_line():
    sha = _measured()
    changed = _engine_changes(sha)
    lines = CHANGED.findall(_doc())
    if not changed:
        assert not lines, (f"mlxbatch/engine is as it was at {sha}, where the GPU figures were measured: drop the "
                           f"'engine changed since the GPU figures' line from docs/benchmarks.md: {lines}")
        return
    assert len(lines) == 1, (
        f"mlxbatch/engine differs from {sha}, where the GPU figures were measured ({', '.join(changed[:8])}"
        f"{' ...' if len(changed) > 8 else ''}). Measure on a GPU (docs/benchmarks.md, 'How to run') and move the "
        f"'GPU figures measured at commit' line, or add one line 'engine changed since the GPU figures at {sha}: "
        f"<what changed>' to docs/benchmarks.md; found {len(lines)} such lines")
    (at, what), = lines
    assert sha.startswith(at) or at.startswith(sha), f"the line names {at}, the GPU figures were measured at {sha}"
    assert what.strip(), "say what changed after the colon"
