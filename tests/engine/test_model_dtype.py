"""``dtype: auto`` keeps the weights' stored floating dtype on a GPU, whatever the config's label says (an fp16
checkpoint labelled bf16 is not re-cast, which would double a load's memory); on the CPU it is float32. Each branch
runs on every machine: the GPU branch with the device injected, the CPU branch with MLX's default device set to the
CPU for the load (a Mac's default is its GPU, where the stored dtype is kept)."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxbatch.engine.model import loader
from mlxbatch.engine.model.loader import ModelSpec, load_model
from mlxbatch.models.random_model import build_random_model


@pytest.fixture(scope="module")
def fp16_labelled_bf16(tmp_path_factory):
    src = build_random_model(tmp_path_factory.mktemp("m") / "fp16", "tiny", dtype="float16")
    out = tmp_path_factory.mktemp("m") / "labelled"
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"  # the label lies, as older mlx-community checkpoints' did
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def dtypes(loaded) -> set[str]:
    return {str(p.dtype).rsplit(".", 1)[-1] for _, p in tree_flatten(loaded.model.parameters())}


def test_auto_keeps_the_stored_dtype_on_a_gpu(fp16_labelled_bf16, monkeypatch):
    monkeypatch.setattr(loader, "_on_cpu", lambda: False)
    loaded = load_model(ModelSpec(str(fp16_labelled_bf16)))
    assert loaded.dtype == "float16" and dtypes(loaded) == {"float16"}
    asked = load_model(ModelSpec(str(fp16_labelled_bf16), dtype="bfloat16"))
    assert asked.dtype == "bfloat16" and dtypes(asked) == {"bfloat16"}
    assert loaded.identity != asked.identity  # the dtype is part of every result key


@pytest.fixture()
def on_the_cpu():
    """MLX's default device is the CPU for the test (it is already on a CPU-only machine; a Mac's is its GPU)."""
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(before)


def test_auto_is_float32_on_the_cpu(fp16_labelled_bf16, on_the_cpu):
    loaded = load_model(ModelSpec(str(fp16_labelled_bf16)))
    assert loaded.dtype == "float32" and dtypes(loaded) == {"float32"}


def test_float32_weights_on_a_gpu_are_warned_about_once(tiny_model_path, monkeypatch, caplog):
    """A GPU (Metal or CUDA; the device injected) that would run float32 weights, stored so (``dtype: auto`` keeps
    them) or asked for, gets one warning naming the fix; bfloat16 and the CPU (where float32 is the fast path) none."""
    import logging

    monkeypatch.setattr(loader, "_warned_float32", set())
    monkeypatch.setattr(loader, "_on_cpu", lambda: False)
    with caplog.at_level(logging.WARNING, logger="mlxbatch.engine.model.loader"):
        first = load_model(ModelSpec(str(tiny_model_path)))  # the tiny model is stored as float32
        load_model(ModelSpec(str(tiny_model_path), dtype="float32"))
        load_model(ModelSpec(str(tiny_model_path), dtype="bfloat16"))
    warned = [r.getMessage() for r in caplog.records if "float32" in r.getMessage()]
    assert first.dtype == "float32" and len(warned) == 1
    assert "model.dtype: bfloat16" in warned[0] and "dtype auto keeps" in warned[0]
    caplog.clear()
    monkeypatch.setattr(loader, "_warned_float32", set())
    monkeypatch.setattr(loader, "_on_cpu", lambda: True)
    with caplog.at_level(logging.WARNING, logger="mlxbatch.engine.model.loader"):
        load_model(ModelSpec(str(tiny_model_path)))
    assert not [r for r in caplog.records if "float32" in r.getMessage()]
