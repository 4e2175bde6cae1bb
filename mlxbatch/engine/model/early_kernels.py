"""The attention kernels' compiles begun before a text model's weights load (CUDA).

An engine on the CUDA text path builds its attention kernels (``AttentionKernels.create``: an NVRTC compile and a probe
each: 4-7 s on an H100 host, in every process) after the model has loaded, on the same thread: the start of every GPU
job waited for both in turn (docs/benchmarks.md, `4a0b041`). The engine asks for the model's attention geometry and
dtype, which the checkpoint folder says before anything loads: ``config.json`` (heads, key-value heads, head size, the
architecture: only those whose body the engine runs itself use the kernels, ``own_body``) and the safetensors headers
(the dtype the weights are stored in, the rule of ``loader.stored_dtype``). ``start`` hands them to
``AttentionKernels.build_early`` while the weights load; a folder that says otherwise than the loaded model (a guess
that misses) costs only the compile it started: the engine's ``create`` builds its own as before.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxbatch.engine.attention import AttentionKernels
from mlxbatch.engine.backend import Backend
from mlxbatch.engine.model.own_body import MODEL_TYPES

_FLOATING = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # safetensors' dtype names -> MLX's


def stored_dtype_on_disk(folder: Path) -> str | None:
    """The floating dtype most of a checkpoint's stored elements have (quantized weights' scales included: the
    rule of ``loader.stored_dtype``), from its safetensors headers only (None: no header read)."""
    counts: dict[str, int] = {}
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header: dict[str, Any] = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            return None
        for name, entry in header.items():
            dtype = _FLOATING.get(entry.get("dtype")) if name != "__metadata__" and isinstance(entry, dict) else None
            if dtype is not None:
                counts[dtype] = counts.get(dtype, 0) + _numel(entry.get("shape") or ())
    return max(counts, key=counts.__getitem__) if counts else None


def kernel_geometry(config: dict[str, Any]) -> tuple[int, int, int] | None:
    """(heads, key-value heads, head size) of a text model's attention from its config, where the engine runs the
    model's body itself (``own_body``: only there does it use its kernels); else None."""
    if config.get("model_type") not in MODEL_TYPES:
        return None
    try:
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return heads, kv_heads, head_dim


def start(folder: Path, backend: Backend, dtype: mx.Dtype) -> bool:
    """Begin building the attention kernels the engine will ask for a model in ``folder`` run in ``dtype``: True
    when begun (CUDA, ``build_early``'s rule; a text model whose body the engine runs; ``prefill``: the CUDA text
    path's, as an engine without ``batch_invariant`` asks)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    geometry = kernel_geometry(config) if isinstance(config, dict) else None
    if geometry is None:
        return False
    return AttentionKernels.build_early(backend, *geometry, dtype, prefill=True)


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
