"""Prefill attention on CUDA: unfused for a new shape, MLX's fused attention (cuDNN) once the shape has recurred.

MLX's CUDA attention builds a cuDNN graph for every new (shape, strides, mask) of a prefill pass, ~55-110 ms each,
and keeps 256 of them. Measured on the H200 (docs/benchmarks.md): the same 2048-row label workload spent 4.52 s in
prefill on its first run and 2.60 s once its graphs were built, and 3.05 / 2.79 s with cuDNN off. The graphs pay
for themselves only over many passes of one shape: a built graph made a pass about 10% faster. So a pass runs
MLX's own unfused attention (``unfused``: the ops of MLX's fallback) until its shape has run ``after`` times, and
the fused attention from then on, when the graph build has a long job's recurring passes to pay for it. Passes too
large to materialise their scores (``max_scores``) always run fused.

``PrefillAttention.fused(...)`` is asked once per prefill pass. Only the slot batch's own layer view
(``SlotLayerCache.attend``) applies it, so only models the engine runs through ``model.own_body``. The passes are
counted per process, as MLX keeps its graphs: a later engine in the process (a notebook's next job, the bench's
next run) runs a shape fused at once if an earlier one made it recur.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import mlx.core as mx


def causal_mask(queries: int, keys: int) -> mx.array:
    """``[queries, keys]``, True where a query (the last ``queries`` keys, in order) may see a key."""
    return mx.arange(keys - queries, keys)[:, None] >= mx.arange(keys)[None, :]


def unfused(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """Attention as MLX computes it when no fused kernel applies (``mlx/fast.cpp``'s fallback): scores, mask,
    a float32-precise softmax, values. ``mask`` is None, ``"causal"`` (the queries are the last keys) or an
    array (bool, or added to the scores). Queries ``[B, heads, T, D]``, keys and values ``[B, kv_heads, S, D]``.

    The query heads of one KV head go as one matrix (``[rep * T, D]``), so each product is one strided batch over
    (row, KV head). MLX's own fallback broadcasts the keys over the query heads instead (a batch dimension of stride
    0): its CUDA matmul cannot fold that into one strided batch and runs it as a pointer-array batch, a kernel more
    and a cuBLAS heuristic query for every new shape (measured on the H200: a packed pass's attention cost the host
    about twice its encoding with new shapes). Scale and fill are Python numbers: no array made per call."""
    B, heads, T, D = queries.shape
    kv_heads, S = keys.shape[1], keys.shape[2]
    rep = heads // kv_heads
    q = queries * scale
    if rep > 1:
        q = q.reshape(B, kv_heads, rep * T, D)
    scores = q @ keys.swapaxes(-1, -2)  # [B, kv_heads, rep * T, S]
    if isinstance(mask, str):
        assert mask == "causal", mask
        mask = causal_mask(T, S)
    if rep > 1:
        scores = scores.reshape(B, kv_heads, rep, T, S)
        if mask is not None and mask.ndim >= 3:
            mask = mx.expand_dims(mask, -3) if mask.shape[-3] == 1 else mask.reshape(
                *mask.shape[:-3], kv_heads, rep, *mask.shape[-2:])
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    probs = mx.softmax(scores, axis=-1, precise=True)
    if rep > 1:
        probs = probs.reshape(B, kv_heads, rep * T, S)
    return (probs @ values).reshape(B, heads, T, D)


_SEEN: Counter[tuple[Any, ...]] = Counter()  # passes per shape in this process (MLX's graph cache is per process)


class PrefillAttention:
    """Counts each prefill shape's passes; says which run fused."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype, after: int = 16,
                 max_scores: int = 1 << 27, seen: Counter[tuple[Any, ...]] | None = None) -> None:
        self.heads = heads
        self._model = (heads, kv_heads, head_dim, str(dtype))  # the rest of the attention's shapes
        # a built graph saves ~10% of a ~30 ms pass and costs ~55-110 ms: it pays after ~25 passes, so a shape
        # that has run 16 times is likely a recurring one (a long job's steady state)
        self.after = after
        self.max_scores = max_scores  # scores the unfused path may materialise: 2^27 (512 MiB in float32)
        self.seen = _SEEN if seen is None else seen
        self.unfused_passes = 0

    def fused(self, rows: int, width: int, keys: int, capacity: int, mask: Any) -> bool:
        """Whether a prefill pass of ``rows`` x ``width`` queries over ``keys`` keys, read from slot buffers of
        ``capacity`` positions (the graph's key holds the keys' strides), runs the fused attention."""
        if rows * self.heads * width * keys > self.max_scores:
            return True
        kind = mask if isinstance(mask, str) or mask is None else tuple(mask.shape)
        shape = (*self._model, rows, width, keys, capacity, kind)
        self.seen[shape] += 1
        if self.seen[shape] > self.after:
            return True
        self.unfused_passes += 1
        return False
