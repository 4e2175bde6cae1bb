"""What a model folder's ``config.json`` says about sizes, without loading a weight: the dtype the engine will compute
in on this device, the KV bytes per token, and the bytes per weight (quantized checkpoints at their bits).

For ``mlxbatch plan`` without weights (the ETA's FLOPs estimate, the retained-KV figure). The rules are the loader's
(``engine.model.loader``): an explicit ``model.dtype`` wins; on the CPU everything runs in float32 (quantized
checkpoints dequantized); on a GPU the stored floating dtype is kept (here: the config's ``torch_dtype`` label, since
the weights are not read; bfloat16 when it says nothing) and quantized weights stay quantized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ConfigSizes:
    dtype: str  # the compute (and KV) dtype the engine will use
    kv_bytes_per_token: int  # keys and values of every layer, one position
    weight_bytes_per_param: float  # quantized: bits / 8 plus each group's scale and bias
    quantized_bits: int | None = None


def _quantization(root: dict[str, Any], text: dict[str, Any]) -> dict[str, Any] | None:
    for c in (text, root):
        q = c.get("quantization") or c.get("quantization_config")
        if isinstance(q, dict) and q.get("bits"):
            return q
    return None


def read_config(model_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``config.json`` and its text model's part (a vision-language model's ``text_config``, else the whole)."""
    root = json.loads((Path(model_dir) / "config.json").read_text())
    return root, root.get("text_config", root)


def config_sizes(model_dir: Path, requested_dtype: str = "auto", on_gpu: bool | None = None) -> ConfigSizes:
    """The sizes on this device (``on_gpu`` None: MLX's default device), or on the one ``on_gpu`` names."""
    if on_gpu is None:
        import mlx.core as mx

        on_gpu = mx.default_device() == mx.gpu
    root, cfg = read_config(model_dir)
    if requested_dtype != "auto":
        dtype = requested_dtype
    elif not on_gpu:
        dtype = "float32"
    else:
        label = cfg.get("torch_dtype") or root.get("torch_dtype") or root.get("dtype")
        dtype = label if label in _BYTES else "bfloat16"
    width = _BYTES[dtype]
    heads = int(cfg.get("num_attention_heads", 1))
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 0)) // max(1, heads))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    kv = 2 * int(cfg.get("num_hidden_layers", 0)) * kv_heads * head_dim * width
    q = _quantization(root, cfg)
    if q is not None and on_gpu:  # kept quantized: bits per weight, a scale and a bias per group
        bits, group = int(q["bits"]), int(q.get("group_size", 64))
        return ConfigSizes(dtype, kv, bits / 8 + 2 * width / group, bits)
    return ConfigSizes(dtype, kv, float(width), None)  # dense, or dequantized for the CPU
