"""The random-weight test models: the head-dim-64 one reaches the fused attention kernels of Metal and CUDA."""

from __future__ import annotations

import json

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxbatch.models.random_model import SHAPES

# Head dims with a fused kernel in MLX 0.32's mx.fast.scaled_dot_product_attention: one query token (decode,
# ``sdpa_vector``: Metal and CUDA) and many (prefill, Metal's ``sdpa_full``). Other head dims (the tiny model's 32)
# take the unfused fallback: matmul, softmax, matmul.
FUSED_DECODE = {64, 96, 128, 256}
FUSED_PREFILL_METAL = {64, 80, 128}


def test_the_tiny64_model_has_head_dim_64_and_stays_small(tiny64_model_path, tiny64_loaded):
    cfg = json.loads((tiny64_model_path / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    assert head_dim in FUSED_DECODE & FUSED_PREFILL_METAL
    tiny = SHAPES["tiny"]
    assert tiny.hidden_size // tiny.num_attention_heads not in FUSED_DECODE  # why the tiny model is not enough
    cache = make_prompt_cache(tiny64_loaded.model)
    tiny64_loaded.model(mx.array([[1, 2, 3]]), cache=cache)
    assert cache[0].keys.shape[-1] == 64  # what the attention really sees
    assert cfg["hidden_size"] <= 128 and cfg["num_hidden_layers"] <= 2  # as fast on a CPU as the tiny model
