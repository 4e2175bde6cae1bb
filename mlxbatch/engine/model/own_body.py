"""A decoder-only text model's body run layer by layer, with attention asked of the KV cache.

mlx-lm's attention modules call MLX's attention themselves, so a cache can choose what keys a query sees (the mask)
but not how attention runs. The engine's slot cache can do better at decode on CUDA (``kv.decode_attention``: each
row's own keys, fused, where MLX falls back to unfused masked attention), so for the common architectures
(Llama, Mistral, Qwen2, Qwen3: pre-norm blocks of attention and MLP) this body runs the model's own modules in
mlx-lm's order and hands the attention itself to the cache (``cache.attend``); a cache without ``attend`` gets
mlx-lm's calls (``update_and_fetch`` then MLX's attention), so the body is the model's on any cache.

Used only when it gives the model's own output on a probe (``own_body``); any other model keeps mlx-lm's body.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask

from mlxbatch.engine.model.add_norm import AddNorm
from mlxbatch.engine.model.add_norm import reference as add_norm_reference
from mlxbatch.engine.model.fused import FusedLayer, fuse_layers

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads", "scale")
_LAYER = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


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


def attention(attn: Any, x: mx.array, mask: Any, cache: Any, fused: FusedLayer | None = None) -> mx.array:
    """``attn``'s forward (mlx-lm's Llama / Qwen2 / Qwen3 attention), its attention asked of ``cache``; with
    ``fused``, its projections as one matmul and RoPE as one call for queries and keys."""
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
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class OwnBody:
    """``body(inputs, cache=None)``: the model body's forward (embeddings, blocks, final norm)."""

    def __init__(self, body: Any) -> None:
        self.body = body
        self.fused: list[FusedLayer] | None = None  # each layer's fused projections (``fuse``), else None
        self.add_norm: Any = None  # ``AddNorm`` (CUDA) for decode passes, else MLX's add and norm

    def fuse(self) -> bool:
        """Run decode passes fused (``model.fused``): each layer's projections as two matmuls fewer, and on CUDA
        each residual add with the norm after it as one kernel (``model.add_norm``). The same weights. Returns
        whether the projections fuse (every layer's are of a kind that does)."""
        self.fused = fuse_layers(list(self.body.layers))
        if self.fused is not None:
            norms = self._norms()
            dtype = norms[0].weight.dtype if hasattr(norms[0], "weight") else None
            if dtype is not None and AddNorm.applies(norms, dtype):
                self.add_norm = AddNorm.create(norms[0], dtype)
        return self.fused is not None

    def _norms(self) -> list[Any]:
        """The norms a residual add feeds: each layer's two, and the final one."""
        return [n for layer in self.body.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)] + [
            self.body.norm]

    @property
    def heads(self) -> int:  # query heads
        return int(self.body.layers[0].self_attn.n_heads)

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        body = self.body
        h = body.embed_tokens(inputs)
        layers = body.layers
        caches = cache if cache is not None else [None] * len(layers)
        mask = create_attention_mask(h, caches[0])
        # decode passes (one token a row) fused, where launches bind; a prefill pass keeps its projections apart:
        # its activations are large, and separate outputs are freed (donated) as they are consumed
        if self.fused and inputs.shape[1] == 1:
            return self._decode(h, caches, mask, self.fused)
        for layer, c in zip(layers, caches):
            h = h + attention(layer.self_attn, layer.input_layernorm(h), mask, c)
            x = layer.post_attention_layernorm(h)
            h = h + layer.mlp(x)
        return body.norm(h)

    def _decode(self, h: mx.array, caches: Any, mask: Any, fused: list[FusedLayer]) -> mx.array:
        """A decode pass, fused: projections, and each residual add with the norm that reads its sum."""
        layers, add_norm = self.body.layers, self.add_norm or add_norm_reference
        x = layers[0].input_layernorm(h)
        norms = self._norms()[1:]  # after each add: the layer's second norm, the next layer's first, the final one
        for i, (layer, c, f) in enumerate(zip(layers, caches, fused)):
            h, x = add_norm(h, attention(layer.self_attn, x, mask, c, f), norms[2 * i])
            h, x = add_norm(h, f.mlp(layer, x), norms[2 * i + 1])
        return x


def _shaped(model: Any, body: Any) -> bool:
    if getattr(model, "model_type", None) not in _MODEL_TYPES:
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
