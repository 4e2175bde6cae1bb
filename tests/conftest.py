"""Shared fixtures: a tiny random-weight qwen2 model (and tokenizer) built once per machine.

The model is written in Hugging Face layout and loaded through the same code path as a real checkpoint.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest

# OpenBLAS picks its float32 GEMM kernel by CPU. The Haswell and Zen kernels (AVX2 machines without AVX-512) give a
# row different bits at different positions in the batch (rows 6-11 of every 12 take another path), so outputs
# depend on the batch a row ran in: tests that compare a row across batches (batch invariance, resumed or
# redistributed runs against an unbroken one) would fail there for that reason alone. The tests run with the Nehalem
# kernel (SSE), the same code and the same bits on every x86-64 CPU, set before OpenBLAS is loaded (their
# subprocesses inherit it). Set, not defaulted: a machine whose shell already exports another kernel (a CI image
# exported OPENBLAS_CORETYPE=Haswell, and 13 tests failed there) must not choose the suite's kernel. Not Sandybridge: after its first matmul every CPU op of MLX ran ~50x slower on an Intel
# Xeon (likely the AVX registers' upper halves left dirty) (the suite took twice as long; ``tests/test_blas.py`` guards it).
# A user on such a CPU gets the engine's refusal of ``batch_invariant``, with this hint.
if platform.machine() in ("x86_64", "AMD64"):
    os.environ["OPENBLAS_CORETYPE"] = "Nehalem"
# Under pytest-xdist (``scripts/test.sh`` runs two workers) each worker's OpenBLAS gets one thread, so that workers
# do not oversubscribe the cores (OpenBLAS threads spin while they wait). GEMM threads split the output, not the
# sums, so the bits do not change.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
# Ray starts its worker processes (the engine actors, the tasks) at nice 15: beside the suite's other worker, at nice
# 0, they got a sliver of the CPU (a node probe's task waited 33-45 s for its worker to start; the Ray module's first
# test took 88-150 s instead of 12-20). The clusters the tests start (ray.init, `ray start`, `mlxbatch run --ray`)
# inherit this.
os.environ["RAY_worker_niceness"] = "0"

import mlxbatch  # noqa: E402, F401  (preloads OpenBLAS before mlx)


def pytest_configure(config: pytest.Config) -> None:
    import ctrl_c  # tests/ctrl_c.py (tests/ is on sys.path): one Ctrl-C stops the whole suite

    config.pluginmanager.register(ctrl_c, "mlxbatch-ctrl-c")


CACHE = Path(os.environ.get("MLXBATCH_TEST_CACHE", Path.home() / ".cache" / "mlxbatch" / "test-models"))


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from mlxbatch.models.random_model import build_random_model

    return build_random_model(CACHE / "tiny-qwen2-v1", "tiny")


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_path: Path):
    from mlxbatch.engine.model.loader import ModelSpec, load_model

    return load_model(ModelSpec(str(tiny_model_path)))


@pytest.fixture(scope="session")
def tiny64_model_path() -> Path:
    """The tiny model with head dim 64 (the tiny one's is 32): the head dim of most real models, for which Metal and
    CUDA run MLX's fused attention kernels. As fast on a CPU."""
    from mlxbatch.models.random_model import build_random_model

    return build_random_model(CACHE / "tiny64-qwen2-v1", "tiny64")


@pytest.fixture(scope="session")
def tiny64_loaded(tiny64_model_path: Path):
    from mlxbatch.engine.model.loader import ModelSpec, load_model

    return load_model(ModelSpec(str(tiny64_model_path)))


@pytest.fixture()
def engine(tiny_loaded):
    from mlxbatch.engine import Engine, EngineConfig

    eng = Engine(tiny_loaded, EngineConfig(max_num_seqs=16, prefill_chunk_size=64, max_num_batched_tokens=256))
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def tiny_vlm_path() -> Path:
    """A tiny random-weight Qwen2-VL in Hugging Face layout, loadable by ``mlx_vlm.load``."""
    pytest.importorskip("mlx_vlm", reason="the vlm extra is not installed: pip install -e .[vlm]")
    from mlxbatch.models.random_vlm import build_random_vlm

    return build_random_vlm(CACHE / "tiny-qwen2-vl-v2")


@pytest.fixture(scope="session")
def tiny_vl25_path() -> Path:
    """A tiny random-weight Qwen2.5-VL (window attention in its vision tower), loadable by ``mlx_vlm.load``."""
    pytest.importorskip("mlx_vlm", reason="the vlm extra is not installed: pip install -e .[vlm]")
    from mlxbatch.models.random_vlm import build_random_vlm

    return build_random_vlm(CACHE / "tiny-qwen2.5-vl", model_type="qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_vl3_path() -> Path:
    """A tiny random-weight Qwen3-VL (deepstack features, interleaved multimodal RoPE), loadable by ``mlx_vlm.load``."""
    pytest.importorskip("mlx_vlm", reason="the vlm extra is not installed: pip install -e .[vlm]")
    from mlxbatch.models.random_vlm import build_random_vlm

    return build_random_vlm(CACHE / "tiny-qwen3-vl", model_type="qwen3_vl")


@pytest.fixture(scope="session")
def tiny_vl3moe_path() -> Path:
    """A tiny random-weight Qwen3-VL-MoE (Qwen3-VL with mixture-of-experts text layers), loadable by ``mlx_vlm.load``."""
    pytest.importorskip("mlx_vlm", reason="the vlm extra is not installed: pip install -e .[vlm]")
    from mlxbatch.models.random_vlm import build_random_vlm

    return build_random_vlm(CACHE / "tiny-qwen3-vl-moe", model_type="qwen3_vl_moe")


@pytest.fixture(scope="session")
def tiny_vlm_loaded(tiny_vlm_path: Path):
    from mlxbatch.engine.model.loader import ModelSpec, load_model

    return load_model(ModelSpec(str(tiny_vlm_path)))


@pytest.fixture()
def fail_launch_at():
    """``fail_launch_at(runner, at)``: the runner's ``at``-th step launch fails as if memory ran out
    (``MemoryError``); the others run as usual."""

    def arm(runner, at: int) -> None:
        real, calls = runner._launch, {"n": 0}

        def flaky(out):
            calls["n"] += 1
            if calls["n"] == at:
                raise MemoryError("simulated")
            return real(out)

        runner._launch = flaky

    return arm


@pytest.fixture(params=["engine thread", "launch thread"])
def either_launch_thread(request, monkeypatch):
    """Every engine the test makes launches its steps on its own thread, or from a thread of its own
    (``engine.launcher``) whatever the backend and ``overlap_steps``: a module that uses this runs each test both ways."""
    on = request.param == "launch thread"
    monkeypatch.setattr("mlxbatch.engine.core.uses_launch_thread", lambda backend, config, vision: on)
    return on
