"""A layer's projections fused: q, k and v as one matmul, gate and up as one (``model.own_body``, on CUDA).

A decode step of a small model at a few hundred rows is bound by the host's kernel launches, not by the device
(docs/benchmarks.md: about 19 kernels a layer, ~17 us each on an H200). Three projections that read the same input
are one matmul over their weights stacked along the output axis, and so are the MLP's gate and up projections: 3 of
a layer's kernels fewer, and larger matmuls. This is what vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear``
do. Where o_proj and down_proj are plain bias-free ``nn.Linear``, the residual adds after them ride in their
matmuls (``mx.addmm``): 2 kernels a layer fewer again.

The stacked weights are the only copy: each original module's parameters become views (row slices) of the stacked
arrays, so the model keeps its memory, and mlx-lm's own forward of the same modules gives what it gave. A module is
fused only where its parts are plain ``nn.Linear`` or ``nn.QuantizedLinear`` of one kind (same quantisation), and a
layer's MLP only where it computes ``down(swiglu(gate(x), up(x)))`` (checked on a probe). ``fuse_layers`` is
idempotent: a second engine on the same model reuses the first one's stacked weights.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu


@dataclass(frozen=True)
class FusedLayer:
    qkv: nn.Module  # x -> [q | k | v] (q: heads x dim features, k and v: kv_heads x dim each)
    gate_up: nn.Module | None  # x -> [gate | up], None where the MLP is kept as it is
    inter: int  # the MLP's hidden size (gate's output features)
    # o_proj's and down_proj's weights transposed (views of the weights), where they are plain bias-free
    # ``nn.Linear``: the residual add then rides in their matmul (``mx.addmm``), 2 kernels a layer fewer
    o_t: mx.array | None = None
    down_t: mx.array | None = None

    def attn_out(self, attn: Any, out: mx.array, h: mx.array) -> mx.array:
        """``h + attn.o_proj(out)``: the residual add in the projection's matmul where it can be."""
        if self.o_t is None:
            return h + attn.o_proj(out)
        return mx.addmm(h, out, self.o_t)

    def mlp(self, layer: Any, x: mx.array, h: mx.array) -> mx.array:
        """``h + layer.mlp(x)`` with gate and up in one matmul (the add in the down projection's matmul where it
        can be)."""
        if self.gate_up is None:
            return h + layer.mlp(x)
        gu = self.gate_up(x)
        act = swiglu(gu[..., : self.inter], gu[..., self.inter :])
        if self.down_t is None:
            return h + layer.mlp.down_proj(act)
        return mx.addmm(h, act, self.down_t)


_KINDS = (nn.Linear, nn.QuantizedLinear)
_QUANT = ("group_size", "bits", "mode")
# layer id -> (the layer, weakly; what was fused; the view each first part holds): a later engine's reuse
_FUSED: dict[int, tuple[weakref.ref, FusedLayer, mx.array]] = {}


def _stackable(parts: list[Any]) -> bool:
    kind = type(parts[0])
    if kind not in _KINDS or any(type(p) is not kind for p in parts):
        return False
    keys = set(parts[0].keys())
    if any(set(p.keys()) != keys for p in parts):  # one has a bias, another not
        return False
    return all(getattr(p, a, None) == getattr(parts[0], a, None) for p in parts for a in _QUANT)


def _stack(parts: list[Any]) -> nn.Module:
    """One module computing the parts' outputs side by side; the parts' parameters become views of its arrays."""
    fused = copy.copy(parts[0])
    for key in parts[0].keys():
        arrays = [p[key] for p in parts]
        if not all(isinstance(a, mx.array) for a in arrays):
            continue
        whole = mx.concatenate(arrays, axis=0)
        mx.eval(whole)
        fused[key] = whole
        start = 0
        for p, a in zip(parts, arrays):
            p[key] = whole[start : start + a.shape[0]]  # a view: the stacked array is the only copy
            start += a.shape[0]
        mx.eval([p[key] for p in parts])
    return fused


def _mlp_is_swiglu(layer: Any, gate_up: nn.Module, inter: int, dims: int, dtype: mx.Dtype) -> bool:
    x = mx.random.normal((2, 3, dims), key=mx.random.key(3)).astype(dtype)
    want = layer.mlp(x).astype(mx.float32)
    gu = gate_up(x)
    got = layer.mlp.down_proj(swiglu(gu[..., :inter], gu[..., inter:])).astype(mx.float32)
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    return want.shape == got.shape and mx.allclose(want, got, atol=tol, rtol=tol).item()


def fuse_layer(layer: Any) -> FusedLayer | None:
    """``layer``'s projections fused (its modules' parameters then views of the stacked ones), or None if they are
    not of a kind this fuses."""
    key = id(layer)
    known = _FUSED.get(key)
    if known is not None and known[0]() is layer and layer.self_attn.q_proj.weight is known[2]:
        return known[1]
    attn, mlp = layer.self_attn, layer.mlp
    qkv_parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    if not _stackable(qkv_parts):
        return None
    qkv = _stack(qkv_parts)
    gate_up, inter = None, 0
    parts = [getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)]
    if hasattr(mlp, "down_proj") and all(p is not None for p in parts) and _stackable(parts):
        inter = int(parts[0].weight.shape[0])
        gate_up = _stack(parts)
        if not _mlp_is_swiglu(layer, gate_up, inter, _in_features(attn.q_proj), _dtype(attn.q_proj)):
            gate_up = None  # the views stay: they are the same numbers as before
    fused = FusedLayer(qkv, gate_up, inter, _transposed(attn.o_proj),
                       _transposed(mlp.down_proj) if gate_up is not None else None)
    _FUSED[key] = (weakref.ref(layer), fused, layer.self_attn.q_proj.weight)
    weakref.finalize(layer, _FUSED.pop, key, None)  # the entry goes with the model (it holds the stacked arrays)
    return fused


def _transposed(linear: Any) -> mx.array | None:
    """A plain bias-free ``nn.Linear``'s weight transposed (an evaluated view: no copy), else None."""
    if type(linear) is not nn.Linear or "bias" in linear:
        return None
    w_t = linear.weight.T
    mx.eval(w_t)
    return w_t


def _in_features(linear: Any) -> int:
    if isinstance(linear, nn.QuantizedLinear):
        return int(linear.weight.shape[1]) * 32 // int(linear.bits)
    return int(linear.weight.shape[1])


def _dtype(linear: Any) -> mx.Dtype:
    return linear.scales.dtype if isinstance(linear, nn.QuantizedLinear) else linear.weight.dtype


def fuse_layers(layers: list[Any]) -> list[FusedLayer] | None:
    """Every layer's fused projections, or None if any layer's are not of a kind this fuses (then none is used)."""
    fused = [fuse_layer(layer) for layer in layers]
    return None if any(f is None for f in fused) else fused  # type: ignore[return-value]
