"""One forward pass over a range of slot rows: where each row's new KV goes, which keys its queries see.

A forward pass runs rows ``[start, stop)`` over ``T`` new tokens each (``T`` = 1 for decode, a chunk for prefill,
right-padded): each row writes at its own offset and a causal mask per row hides the rest. ``ForwardPass`` is that
plan, made once per call; ``SlotLayerCache`` is one layer's view of the slot buffers during it, in mlx-lm's cache
protocol (``offset``, ``update_and_fetch``, ``make_mask``), so mlx-lm's model definitions run on slots unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx


@dataclass(frozen=True)
class ForwardPass:
    start: int
    stop: int
    offsets: tuple[int, ...]  # where each row's new tokens start
    width: int  # T: new tokens per row (right-padded)
    t_used: int  # key positions the pass reads: max(offset + T)
    offset_array: mx.array  # [rows] RoPE offsets
    q_pos: mx.array  # [rows, T] each query's position
    mask: mx.array | str | None  # "causal" when all rows end together (SDPA's fused mode), else an array
    mode: str  # how new KV is written: "slice" (one block), "rows" (a block per row), "scatter" (one scatter)
    index: tuple[mx.array, mx.array] | None  # scatter mode: (rows [n,1,1], positions [n,1,T])

    def array_mask(self) -> mx.array:
        return (mx.arange(self.t_used)[None, None, :] <= self.q_pos[:, :, None])[:, None, :, :]


def plan_forward(start: int, offsets: Sequence[int], width: int, batched_writes: bool,
                 kv_width: int | None = None) -> ForwardPass:
    """The plan of one forward pass. ``kv_width`` (batch-invariant passes, ``kv.invariant``): the queries read
    exactly that many key positions, always through an array mask, so the attention's shapes and kernel depend on
    the rows' own lengths only, never on the longest row beside them."""
    n, T = len(offsets), width
    off = mx.array(list(offsets), dtype=mx.int32)
    q_pos = off[:, None] + mx.arange(T)[None, :]  # [n, T]
    if kv_width is not None:
        fp = ForwardPass(start, start + n, tuple(offsets), T, kv_width, off, q_pos, None, "scatter", None)
        mode = "slice" if len(set(offsets)) == 1 else "rows" if T > 1 and not batched_writes else "scatter"
        index = (mx.arange(start, start + n)[:, None, None], q_pos[:, None, :]) if mode == "scatter" else None
        return ForwardPass(start, start + n, tuple(offsets), T, kv_width, off, q_pos, fp.array_mask(), mode, index)
    t_used = max(o + T for o in offsets)
    aligned = len(set(offsets)) == 1
    index = None
    if aligned:
        mode = "slice"  # one contiguous block: a slice update, far cheaper than a scatter
    elif T > 1 and not batched_writes:
        mode = "rows"  # prefill chunks at different offsets: one block per row (CPU: memcpy)
    else:  # GPU prefill at different offsets (one scatter per buffer instead of a launch per row), or decode
        mode = "scatter"
        index = (mx.arange(start, start + n)[:, None, None], q_pos[:, None, :])
    fp = ForwardPass(start, start + n, tuple(offsets), T, t_used, off, q_pos, None, mode, index)
    # all rows end together: the queries are the last T keys, which SDPA's fused causal mode handles without
    # materialising a mask (about 2x faster prefill on CPU)
    mask = ("causal" if T > 1 else None) if aligned else fp.array_mask()
    return ForwardPass(start, start + n, tuple(offsets), T, t_used, off, q_pos, mask, mode, index)


def write_kv(k_buf: mx.array, v_buf: mx.array, fp: ForwardPass, keys: mx.array, values: mx.array
             ) -> tuple[mx.array, mx.array]:
    """Write one layer's new keys/values in place; returns the keys/values the pass's queries read."""
    a, b, T = fp.start, fp.stop, fp.width
    if fp.mode == "slice":
        o = fp.offsets[0]
        k_buf[a:b, :, o : o + T, :] = keys
        v_buf[a:b, :, o : o + T, :] = values
    elif fp.mode == "rows":
        for i, o in enumerate(fp.offsets):
            k_buf[a + i, :, o : o + T, :] = keys[i]
            v_buf[a + i, :, o : o + T, :] = values[i]
    else:
        assert fp.index is not None
        rows, pos = fp.index
        heads = mx.arange(keys.shape[1])[None, :, None]
        k_buf[rows, heads, pos] = keys
        v_buf[rows, heads, pos] = values
    t = fp.t_used
    return k_buf[a:b, :, :t, :], v_buf[a:b, :, :t, :]


class _Buffers(Protocol):  # what a layer view needs of the slot batch
    def current_pass(self) -> ForwardPass: ...

    def write_layer(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]: ...

    def layer_buffers(self, layer: int) -> tuple[mx.array, mx.array]: ...


class SlotLayerCache:
    """One layer's view of the slot buffers during a forward pass (mlx-lm cache protocol)."""

    def __init__(self, owner: _Buffers, layer: int) -> None:
        self._owner = owner
        self._layer = layer

    @property
    def offset(self) -> mx.array:  # per-row position of each row's first new token (RoPE offsets)
        return self._owner.current_pass().offset_array

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array | str | None:
        assert window_size is None, "sliding-window attention is not supported by slot caches"
        fp = self._owner.current_pass()
        if return_array and not isinstance(fp.mask, mx.array):
            return fp.array_mask()
        return fp.mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._owner.write_layer(self._layer, keys, values)

    @property
    def state(self) -> Any:
        return self._owner.layer_buffers(self._layer)
