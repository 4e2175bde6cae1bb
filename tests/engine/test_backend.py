"""The device is decided once (``engine.backend.Backend.detect``) and passed down: nothing else in the engine asks MLX
which device it runs on, so what a component does per device follows the one value (and a test can choose it)."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import pytest

from mlxbatch.engine.backend import CPU, Backend

ENGINE = Path(__file__).resolve().parents[2] / "mlxbatch" / "engine"


def test_detect_names_the_device_mlx_runs_on():
    b = Backend.detect()
    if mx.default_device() == mx.cpu:
        assert b == CPU and not b.gpu
    else:
        assert b.gpu and b.metal == mx.metal.is_available() and b.cuda != b.metal


def test_backend_kinds():
    assert (CPU.gpu, CPU.metal, CPU.cuda) == (False, False, False)
    assert (Backend("metal").gpu, Backend("metal").metal, Backend("cuda").cuda) == (True, True, True)
    with pytest.raises(AssertionError):
        Backend("tpu")


def test_only_the_backend_module_asks_mlx_for_the_device():
    asks = re.compile(r"default_device\(\)\s*[!=]=|mx\.metal\.is_available|mx\.cuda\.is_available")
    found = [f"{p.relative_to(ENGINE)}:{i}" for p in ENGINE.rglob("*.py") if p.name != "backend.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if asks.search(line)]
    assert not found, f"the device is asked again here (pass the engine's Backend instead): {found}"
