"""mlxbatch asks MLX's CUDA backend for direct kernel launches when it is imported; a value the user set wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mlxbatch import _cuda

PROBE = "import os, mlxbatch, mlxbatch._cuda as c; print(repr(os.environ.get('MLX_USE_CUDA_GRAPHS')), c.kernel_launch())"


def _run(value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != _cuda.VAR}
    if value is not None:
        env[_cuda.VAR] = value
    res = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return res.stdout.strip()


def test_importing_mlxbatch_turns_cuda_graphs_off():
    assert _run(None) == "'0' direct"


@pytest.mark.parametrize("value, launch", [("1", "cuda graphs"), ("0", "direct"), (" 2x", "cuda graphs"),
                                           ("-1", "cuda graphs"), ("false", "direct"), ("", "direct")])
def test_a_value_the_user_set_wins_and_is_read_as_mlx_reads_it(value, launch):
    assert _run(value) == f"{value!r} {launch}"
