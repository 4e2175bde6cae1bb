"""Shared fixtures: a tiny random-weight qwen2 model (and tokenizer) built once per machine.

The model is written in Hugging Face layout and loaded through the same code path as a real checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import mlxbatch  # noqa: F401  (preloads OpenBLAS before mlx)

CACHE = Path(os.environ.get("MLXBATCH_TEST_CACHE", Path.home() / ".cache" / "mlxbatch" / "test-models"))


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from mlxbatch.models.random_model import build_random_model

    return build_random_model(CACHE / "tiny-qwen2-v1", "tiny")


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_path: Path):
    from mlxbatch.engine.model.loader import ModelSpec, load_model

    return load_model(ModelSpec(str(tiny_model_path)))


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
def tiny_vlm_loaded(tiny_vlm_path: Path):
    from mlxbatch.engine.model.loader import ModelSpec, load_model

    return load_model(ModelSpec(str(tiny_vlm_path)))
