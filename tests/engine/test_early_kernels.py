"""The attention kernels built while a model's weights load (``AttentionKernels.build_early``, ``early_kernels``).

On CUDA an engine's kernels are NVRTC compiles of seconds each, made after the load; a load begins them on a thread of
its own from what the checkpoint folder says, and the engine's ``create`` takes them. What can go wrong is a guess
the engine does not ask for (the build is wasted, the start as slow as before): the guess is checked here against
what an engine built on the loaded model asks for, and the stored dtype against the loader's own rule. This CPU
has no CUDA: a load is told it runs on CUDA (``Backend.detect``, as ``test_model_dtype`` tells the loader), and the
kernels' probes then fail as a driver refusing them would (None kernels, built on the early thread all the same).
"""

from __future__ import annotations

import logging
import shutil
import threading

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.convert import convert

from mlxbatch.engine import EngineConfig, EngineCore
from mlxbatch.engine.attention import AttentionKernels
from mlxbatch.engine.backend import CPU, Backend
from mlxbatch.engine.model import early_kernels, loader
from mlxbatch.engine.model.loader import ModelSpec, load_model, stored_dtype
from mlxbatch.engine.model.split import split_model
from mlxbatch.models.random_model import build_random_model

CUDA = Backend("cuda")
BUILT_EARLY = "built beside the model's load"


def _early_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mlxbatch-attention-kernels"]


@pytest.fixture()
def as_on_cuda(monkeypatch):
    """Loads see a CUDA device (this CPU's MLX computes what they then do)."""
    monkeypatch.setattr(loader.Backend, "detect", staticmethod(lambda: CUDA))


def test_a_cuda_load_builds_what_the_engine_then_asks_for(tiny64_model_path, as_on_cuda, monkeypatch, caplog):
    with caplog.at_level(logging.DEBUG, logger="mlxbatch.engine.attention"):
        loaded = load_model(ModelSpec(str(tiny64_model_path), dtype="bfloat16"))
        for t in _early_threads():
            t.join(60)
        assert "attention kernels built early" in caplog.text  # the load began them on their own thread
        monkeypatch.undo()  # the engine on this CPU, as it is
        core = EngineCore(loaded, EngineConfig(max_num_seqs=4, warm_up=False))
        try:
            split, geometry = split_model(loaded.model), core.worker.geometry
            assert split is not None
            # the arguments the engine's slot layout asks with (``paths.layout_for`` on the CUDA text path)
            args = (split.body.heads, geometry.kv_heads, geometry.head_dim, getattr(mx, geometry.dtype))
            assert args == (2, 1, 64, mx.bfloat16)
            caplog.clear()
            kernels = AttentionKernels.create(CUDA, *args, prefill=True)
            assert BUILT_EARLY in caplog.text  # taken, not built again
            assert kernels.prefill is not None  # the CUDA text path's set (its kernels refused by this CPU)
            caplog.clear()
            AttentionKernels.create(CUDA, *args, prefill=True)  # taken once: a second engine builds its own
            assert BUILT_EARLY not in caplog.text
        finally:
            core.shutdown()


def test_a_guess_the_engine_does_not_ask_for_is_not_taken(caplog):
    assert AttentionKernels.build_early(CUDA, 8, 2, 64, mx.float16, True)
    assert not AttentionKernels.build_early(CUDA, 8, 2, 64, mx.float16, True)  # one build per arguments
    with caplog.at_level(logging.DEBUG, logger="mlxbatch.engine.attention"):
        other = AttentionKernels.create(CUDA, 8, 2, 64, mx.bfloat16, True)  # another dtype: built now
        assert BUILT_EARLY not in caplog.text and other.prefill is not None
        AttentionKernels.create(CUDA, 8, 2, 64, mx.float16, True)  # (the early one, taken: nothing left behind)
        assert BUILT_EARLY in caplog.text


def test_nothing_is_built_early_off_cuda(tiny64_model_path):
    for t in _early_threads():  # (another test's, ending)
        t.join(60)
    threads = len(_early_threads())
    assert not AttentionKernels.build_early(CPU, 2, 1, 64, mx.float32, True)
    assert not early_kernels.start(tiny64_model_path, Backend("metal"), mx.bfloat16)  # (Metal compiles no kernels)
    load_model(ModelSpec(str(tiny64_model_path)))  # this CPU, as it is
    assert len(_early_threads()) == threads


def test_the_geometry_comes_only_for_bodies_the_engine_runs():
    qwen = {"model_type": "qwen2", "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896}
    assert early_kernels.kernel_geometry(qwen) == (14, 2, 64)
    assert early_kernels.kernel_geometry({**qwen, "head_dim": 128}) == (14, 2, 128)  # (Qwen3 says it)
    assert early_kernels.kernel_geometry({**qwen, "num_key_value_heads": None}) == (14, 14, 64)
    assert early_kernels.kernel_geometry({**qwen, "model_type": "gemma3_text"}) is None  # mlx-lm's own body
    assert early_kernels.kernel_geometry({"model_type": "llama"}) is None  # no heads said


@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16", "4-bit"])
def test_the_stored_dtype_read_from_disk_is_the_loaders(kind, tmp_path):
    """The safetensors headers give the dtype ``stored_dtype`` reads off the loaded model: a 4-bit checkpoint's (its
    weights packed in integers) is its scales' and norms'."""
    if kind == "4-bit":
        src = build_random_model(tmp_path / "src", "tiny64", dtype="float16")
        folder = tmp_path / "q4"
        convert(str(src), mlx_path=str(folder), quantize=True, q_bits=4, q_group_size=64)
    else:
        folder = build_random_model(tmp_path / kind, "tiny64", dtype=kind)
    model, _ = mlx_load(str(folder))
    assert early_kernels.stored_dtype_on_disk(folder) == stored_dtype(model) == (
        "float16" if kind == "4-bit" else kind)


def test_a_folder_without_readable_weights_says_nothing(tiny64_model_path, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny64_model_path, folder)
    for f in folder.glob("*.safetensors"):
        f.write_bytes(b"\x00\x01")  # (a cut download)
    assert early_kernels.stored_dtype_on_disk(folder) is None
    (folder / "config.json").write_text("{")
    assert not early_kernels.start(folder, CUDA, mx.bfloat16)
