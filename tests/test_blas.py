"""OpenBLAS is loaded before MLX on Linux, and its absence is reported once, with the fix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

PROBE = ("import warnings; warnings.simplefilter('always'); import mlxbatch, mlxbatch._blas as b; "
         "import mlx.core as mx; print('loaded=' + repr(b.loaded_path))")


def _run(env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("MLXBATCH_OPENBLAS", "MLXBATCH_NO_OPENBLAS")}
    return subprocess.run([sys.executable, "-c", PROBE], env={**env, **env_extra}, capture_output=True, text=True)


def test_openblas_is_loaded_into_the_process():
    res = _run({})
    assert res.returncode == 0, res.stderr
    assert "loaded='libopenblas.so.0'" in res.stdout or "openblas" in res.stdout
    pid_maps = subprocess.run([sys.executable, "-c", "import mlxbatch, os; print(open('/proc/self/maps').read())"],
                              capture_output=True, text=True).stdout
    assert "libopenblas" in pid_maps


def test_a_missing_openblas_warns_once_with_the_fix():
    res = _run({"MLXBATCH_OPENBLAS": "/nonexistent/libopenblas.so.0"})
    assert res.returncode == 0 and "loaded=''" in res.stdout
    assert res.stderr.count("OpenBLAS not found") == 1 and "apt-get install libopenblas0-pthread" in res.stderr
