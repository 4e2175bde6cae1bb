"""A decoder-only text model's body run layer by layer, with attention asked of the KV cache.

mlx-lm's attention modules call MLX's attention themselves, so a cache can choose what keys a query sees (the mask)
but not how attention runs. The engine's slot cache can do better at decode on CUDA (``attention.decode``: each
row's own keys, fused, where MLX falls back to unfused masked attention), so for the common architectures
(Llama, Mistral, Qwen2, Qwen3: pre-norm blocks of attention and MLP) this body runs the model's own modules in
mlx-lm's order and hands the attention itself to the cache (``cache.attend``); a cache without ``attend`` gets
mlx-lm's calls (``update_and_fetch`` then MLX's attention), so the body is the model's on any cache.

Used only when it gives the model's own output on a probe (``own_body``); any other model keeps mlx-lm's body.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask

from mlxbatch.engine.model.fused import FusedLayer, fuse_layers

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads", "scale")
_LAYER = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}  # the architectures (config `model_type`) it knows


def _projected(attn: Any, x: mx.array, fused: FusedLayer | None) -> tuple[mx.array, mx.array, mx.array, bool]:
    """Queries, keys and values ``[B, heads, L, dim]`` before RoPE, and whether queries and keys are adjacent heads
    of one array (fused, no per-head norms: RoPE then rotates both in one call)."""
    B, L, _ = x.shape
    H, K = attn.n_heads, attn.n_kv_heads
    if fused is not None:
        qkv = fused.qkv(x).reshape(B, L, H + 2 * K, -1)
        queries, keys, values = qkv[:, :, :H], qkv[:, :, H : H + K], qkv[:, :, H + K :]
    else:
        queries = attn.q_proj(x).reshape(B, L, H, -1)
        keys = attn.k_proj(x).reshape(B, L, K, -1)
        values = attn.v_proj(x).reshape(B, L, K, -1)
    joint = fused is not None and not hasattr(attn, "q_norm")
    if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before RoPE
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    if joint:
        return qkv[:, :, : H + K].transpose(0, 2, 1, 3), keys, values.transpose(0, 2, 1, 3), True
    return queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3), False


def attention(attn: Any, x: mx.array, mask: Any, cache: Any, fused: FusedLayer | None,
              residual: mx.array) -> mx.array:
    """``residual`` plus ``attn``'s forward (mlx-lm's Llama / Qwen2 / Qwen3 attention), its attention asked of
    ``cache``; with ``fused``, its projections as one matmul, RoPE as one call for queries and keys and the add in
    the output projection's matmul where it can be."""
    B, L, _ = x.shape
    queries, keys, values, joint = _projected(attn, x, fused)
    offset = 0 if cache is None else cache.offset
    if joint:  # ``queries`` holds the query heads then the key heads: one rotation for both
        both = attn.rope(queries, offset=offset)
        queries, keys = both[:, : attn.n_heads], both[:, attn.n_heads :]
    else:
        queries, keys = attn.rope(queries, offset=offset), attn.rope(keys, offset=offset)
    if cache is None:
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=attn.scale, mask=mask)
    elif hasattr(cache, "attend"):
        out = cache.attend(queries, keys, values, attn.scale, mask)
    else:
        keys, values = cache.update_and_fetch(keys, values)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=attn.scale, mask=mask)
    out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
    if fused is None:
        return residual + attn.o_proj(out)
    return fused.attn_out(attn, out, residual)


class OwnBody:
    """``body(inputs, cache=None)``: the model body's forward (embeddings, blocks, final norm)."""

    def __init__(self, body: Any) -> None:
        self.body = body
        self.fused: list[FusedLayer] | None = None  # each layer's fused projections (``fuse``), else None

    def fuse(self, residual_in_matmul: bool = True) -> bool:
        """Run each layer's projections fused in decode passes (``model.fused``): fewer kernels a layer, the same
        weights; with ``residual_in_matmul``, the residual adds in the o and down projections' matmuls where those
        are plain bias-free linears (on bf16 that rounds once where the add apart rounded twice). Returns whether
        it does (every layer's projections are of a kind that fuses)."""
        fused = fuse_layers(list(self.body.layers))
        if fused is not None and not residual_in_matmul:
            fused = [dataclasses.replace(f, o_t=None, down_t=None) for f in fused]
        self.fused = fused
        return self.fused is not None

    @property
    def heads(self) -> int:  # query heads
        return int(self.body.layers[0].self_attn.n_heads)

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        body = self.body
        h = body.embed_tokens(inputs)
        layers = body.layers
        caches = cache if cache is not None else [None] * len(layers)
        mask = create_attention_mask(h, caches[0])
        # fused projections for decode passes (one token a row), where launches bind; a prefill pass keeps them
        # apart: its activations are large, and separate outputs are freed (donated) as they are consumed
        fused = self.fused if self.fused and inputs.shape[1] == 1 else [None] * len(layers)
        for layer, c, f in zip(layers, caches, fused):
            h = attention(layer.self_attn, layer.input_layernorm(h), mask, c, f, residual=h)
            x = layer.post_attention_layernorm(h)
            h = (h + layer.mlp(x)) if f is None else f.mlp(layer, x, h)
        return body.norm(h)


def _shaped(model: Any, body: Any) -> bool:
    if getattr(model, "model_type", None) not in MODEL_TYPES:
        return False
    if not all(hasattr(body, a) for a in ("embed_tokens", "layers", "norm")) or not body.layers:
        return False
    if getattr(body, "pipeline_size", 1) != 1:  # pipeline-parallel bodies send and receive between layers
        return False
    for layer in body.layers:
        if not all(hasattr(layer, a) for a in _LAYER) or getattr(layer, "use_sliding", False):
            return False
        if not all(hasattr(layer.self_attn, a) for a in _ATTENTION):
            return False
    return True


def own_body(model: Any, body: Any) -> OwnBody | None:
    """This body for ``model`` (mlx-lm model, its ``body``), if the architecture is one it knows and it gives
    ``body``'s own output on a probe; else None."""
    if not _shaped(model, body):
        return None
    own = OwnBody(body)
    probe = mx.array([[1, 2, 3, 4, 5]], dtype=mx.int32)
    try:
        want, got = body(probe), own(probe)
        same = want.shape == got.shape and mx.array_equal(want, got).item()
    except Exception:
        return None
    return own if same else None
