"""Running a bench module in a fresh Python process (``python -m mlxbatch.bench.<module> ...``).

Children are started by module name, never by file path, with the folder that holds this ``mlxbatch`` package
first on ``PYTHONPATH``: they import the same code as the parent whether it is installed, editable or a bare copy
of the tree. Pure stdlib.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def package_root() -> str:
    """The folder that holds the ``mlxbatch`` package this process imported (``<root>/mlxbatch/bench/procs.py``)."""
    return str(Path(__file__).resolve().parents[2])


def child_env() -> dict[str, str]:
    """This process's environment with :func:`package_root` first on ``PYTHONPATH``."""
    env = dict(os.environ)
    root = package_root()
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    env["PYTHONPATH"] = os.pathsep.join([root, *rest])
    return env


def run_module(module: str, args: list[str], timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m module *args`` in a fresh process; stdout and stderr captured as text."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env=child_env())
