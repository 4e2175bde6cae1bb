"""One forward pass over a range of slot rows: where each row's new KV goes, which keys its queries see.

A forward pass runs rows ``[start, stop)`` over ``T`` new tokens each (``T`` = 1 for decode, a chunk for prefill,
right-padded): each row writes at its own offset and a causal mask per row hides the rest. ``ForwardPass`` is that
plan, made once per call; ``SlotLayerCache`` is one layer's view of the slot buffers during it, in mlx-lm's cache
protocol (``offset``, ``update_and_fetch``, ``make_mask``), so mlx-lm's model definitions run on slots unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx

from mlxbatch.engine.attention import unfused
from mlxbatch.engine.kv.packed import PackedPass, bucket, is_run

__all__ = ["ForwardPass", "PackedPass", "SlotLayerCache", "bucket", "bucketed_pass", "is_run", "plan_forward",
           "write_kv"]


@dataclass(frozen=True)
class ForwardPass:
    start: int
    stop: int
    offsets: tuple[int, ...]  # where each row's new tokens start
    width: int  # T: new tokens per row (right-padded)
    t_used: int  # key positions the pass reads: max(offset + T)
    offset_array: mx.array | int  # [rows] RoPE offsets, or one offset when every row starts there (scalar RoPE)
    q_pos: mx.array  # [rows, T] each query's position
    mask: mx.array | str | None  # "causal" when all rows end together (SDPA's fused mode), else an array
    mode: str  # how new KV is written: "slice" (one block), "rows" (a block per row), "scatter" (one scatter)
    index: tuple[mx.array, mx.array] | None  # scatter mode: (rows [n,1,1], positions [n,1,T]) of the written rows
    written: int  # rows that write their KV: the first ``written``; the rest pad the pass to a bucketed shape
    rows: mx.array  # [rows] the pass's slot rows (lazy: built only if a fused decode attention reads it)
    key_lengths: mx.array  # [rows] keys each row's last query sees: offset + T (lazy, as ``rows``)
    fused: bool = True  # a prefill pass: MLX's fused attention, else ``attention.unfused`` (CUDA, new shapes)
    gather: mx.array | None = None  # [rows] the rows' slots where they are not one run (``LayoutOptions.rows_stay``):
    # then ``start``/``stop`` only count the rows, writes scatter and reads gather
    _scatter: dict[int, tuple[mx.array, ...]] = field(default_factory=dict, compare=False, repr=False)

    def scatter_index(self, heads: int) -> tuple[mx.array, ...]:
        """The scatter-mode write's index arrays (rows, heads, positions), each ``[written, heads, T]``, made once a
        pass: every layer's write is then one scatter over them. Built per write, each layer's index arithmetic
        (an ``arange`` of the heads, the broadcasts of three index arrays) was ~10 graph nodes of host work, about
        a sixth of a decode layer's nodes on a GPU, where a step is bound by the host's work per node."""
        got = self._scatter.get(heads)
        if got is None:
            assert self.index is not None
            rows, pos = self.index
            shape = (rows.shape[0], heads, pos.shape[-1])
            got = self._scatter[heads] = (mx.broadcast_to(rows, shape),
                                          mx.broadcast_to(mx.arange(heads, dtype=mx.int32)[None, :, None], shape),
                                          mx.broadcast_to(pos, shape))
        return got

    def array_mask(self) -> mx.array:
        return (mx.arange(self.t_used)[None, None, :] <= self.q_pos[:, :, None])[:, None, :, :]


def plan_forward(start: int, offsets: Sequence[int], width: int, batched_writes: bool,
                 kv_width: int | None = None, written: int | None = None,
                 slots: Sequence[int] | None = None) -> ForwardPass:
    """The plan of one forward pass over rows ``start .. start + len(offsets)``, or over the rows at ``slots`` (one
    a row: ``SlotBatch.rows_stay``). ``kv_width``: the queries read exactly that many key positions, always through
    an array mask (batch-invariant passes, ``engine.invariant``: the attention's shapes then depend on the rows' own
    lengths only; bucketed passes, ``bucketed_pass``: a few shapes recur). ``written``: only the first that many rows
    write their KV (the others pad the pass's rows)."""
    n, T = len(offsets), width
    w = n if written is None else written
    gather = None
    if slots is not None:
        assert len(slots) == n
        if is_run(slots):  # one run of slots: slices, as rows ``start ..``
            start = slots[0]
        else:  # writes by one scatter; where MLX's attention reads the keys (not the engine's kernels), a gather
            start, gather = 0, mx.array(list(slots), dtype=mx.int32)
    off = mx.array(list(offsets), dtype=mx.int32)
    q_pos = off[:, None] + mx.arange(T)[None, :]  # [n, T]
    aligned = len(set(offsets[:w])) == 1  # the rows that write start together
    same_end = aligned and len(set(offsets)) == 1  # and so do the padding rows: every query is among the last T keys
    t_used = kv_width if kv_width is not None else max(o + T for o in offsets)
    if gather is not None:
        mode = "scatter"
    elif aligned:
        mode = "slice"  # one contiguous block: a slice update, far cheaper than a scatter
    elif T > 1 and not batched_writes:
        mode = "rows"  # prefill chunks at different offsets: one block per row (CPU: memcpy)
    else:  # GPU prefill at different offsets (one scatter per buffer instead of a launch per row), or decode
        mode = "scatter"
    rows = gather if gather is not None else mx.arange(start, start + n, dtype=mx.int32)
    index = ((rows if w == n else rows[:w])[:, None, None], q_pos[:w, None, :]) if mode == "scatter" else None
    key_lengths = off + T
    fp = ForwardPass(start, start + n, tuple(offsets), T, t_used, off, q_pos, None, mode, index, w, rows, key_lengths,
                     gather=gather)
    if kv_width is not None or not same_end:
        mask: mx.array | str | None = fp.array_mask()
    else:  # all rows end together: the queries are the last T keys, which SDPA's fused causal mode handles
        mask = "causal" if T > 1 else None  # without materialising a mask (about 2x faster prefill on CPU)
    # every row at one offset: RoPE takes it as a number, as mlx-lm's own cache gives it (not with fixed key widths:
    # batch-invariant passes keep one RoPE path whatever the batch)
    rope: mx.array | int = offsets[0] if same_end and kv_width is None else off
    return ForwardPass(start, start + n, tuple(offsets), T, t_used, rope, q_pos, mask, mode, index, w, rows,
                       key_lengths, gather=gather)



def bucketed_pass(start: int, offsets: Sequence[int], width: int, row_room: int, kv_step: int,
                  slots: Sequence[int] | None = None) -> ForwardPass:
    """A prefill pass padded to a recurring shape (GPU, batched writes): rows and tokens rounded up by ``bucket``
    (rows at most ``row_room``: the slots past ``start``; tokens at most what keeps every row's end within the exact
    pass's end rounded up to ``kv_step``), keys to a multiple of ``kv_step``.

    MLX's CUDA attention builds a cuDNN graph for each new (rows, tokens, keys) shape, ~55 ms each (up to 1 s), and
    keeps 256. Exact shapes are new at nearly every prefill step (a 2048-row label run: 71 of 75), so a long job
    paid a build at every step. Padding rows read whatever their slots hold and write nothing; their outputs are
    dropped. Rows that all start at one offset keep the causal mode (measured on the H200: a mask instead made chat's
    prefill 1.6x slower once its graphs were built); others read keys through an array mask, so their shape does
    not depend on where the rows start. With ``slots`` (each row's), padding rows read the slots after the last row's
    (``row_room``: the buffers' rows), wrapping round."""
    n = len(offsets)
    rows = max(n, min(bucket(n), row_room))
    if slots is not None:
        slots = list(slots) + [(slots[-1] + 1 + j) % row_room for j in range(rows - n)]
    # padding never needs more positions than the exact pass (its end rounded up to ``kv_step``): the slots'
    # positions stay what admission charged for
    end = -(-max(o + width for o in offsets) // kv_step) * kv_step
    T = min(bucket(width), end - max(offsets))
    padded = list(offsets) + [offsets[0]] * (rows - n)
    # the causal mode (keys = offset + T): cheaper in cuDNN than a mask, and the offset recurs (0, a shared prefix, a
    # chunk boundary)
    if len(set(offsets)) == 1:
        return plan_forward(start, padded, T, True, written=n, slots=slots)
    kv = -(-max(o + T for o in offsets) // kv_step) * kv_step
    return plan_forward(start, padded, T, True, kv_width=kv, written=n, slots=slots)


def write_kv(k_buf: mx.array, v_buf: mx.array, fp: ForwardPass, keys: mx.array, values: mx.array
             ) -> tuple[mx.array, mx.array]:
    """Write one layer's new keys/values in place; returns the keys/values the pass's queries read."""
    a, b, T, w = fp.start, fp.stop, fp.width, fp.written
    if w < b - a:  # padding rows write nothing
        keys, values = keys[:w], values[:w]
    if fp.mode == "slice":
        o = fp.offsets[0]
        k_buf[a : a + w, :, o : o + T, :] = keys
        v_buf[a : a + w, :, o : o + T, :] = values
    elif fp.mode == "rows":
        for i, o in enumerate(fp.offsets[:w]):
            k_buf[a + i, :, o : o + T, :] = keys[i]
            v_buf[a + i, :, o : o + T, :] = values[i]
    else:
        rows, heads, pos = fp.scatter_index(keys.shape[1])
        k_buf[rows, heads, pos] = keys
        v_buf[rows, heads, pos] = values
    t = fp.t_used
    if fp.gather is not None:
        return k_buf[fp.gather, :, :t, :], v_buf[fp.gather, :, :t, :]
    return k_buf[a:b, :, :t, :], v_buf[a:b, :, :t, :]


class _Buffers(Protocol):  # what a layer view needs of the slot batch
    decode_attention: Any  # ``attention.DecodeAttention`` where the device runs it, else None

    def current_pass(self) -> ForwardPass | PackedPass: ...

    def write_layer(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]: ...

    def layer_buffers(self, layer: int) -> tuple[mx.array, mx.array]: ...


class SlotLayerCache:
    """One layer's view of the slot buffers during a forward pass (mlx-lm cache protocol)."""

    def __init__(self, owner: _Buffers, layer: int) -> None:
        self._owner = owner
        self._layer = layer

    @property
    def offset(self) -> mx.array | int:  # per-row position of each row's first new token (RoPE offsets)
        return self._owner.current_pass().offset_array

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array | str | None:
        assert window_size is None, "sliding-window attention is not supported by slot caches"
        fp = self._owner.current_pass()
        if isinstance(fp, PackedPass):  # one-token rows: attention regroups them itself (``attend``)
            return None
        if return_array and not isinstance(fp.mask, mx.array):
            return fp.array_mask()
        return fp.mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._owner.write_layer(self._layer, keys, values)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
        """Write this layer's new keys/values, then attend (``model.own_body``): a decode pass through the fused
        per-row kernel where the slot batch has one (CUDA) and it serves the pass (``DecodeAttention.serves``), a prefill
        pass whose shape is new (CUDA: ``attention.prefill``) through MLX's unfused ops, anything else through
        MLX's attention over the keys the pass reads, with its mask (what mlx-lm's attention does)."""
        fp = self._owner.current_pass()
        if isinstance(fp, PackedPass):  # a packed prefill pass (``kv.packed``): its own writes and attention
            k_buf, v_buf = self._owner.layer_buffers(self._layer)
            fp.write(k_buf, v_buf, keys, values)
            return fp.attend(queries, k_buf, v_buf, scale)
        k, v = self.update_and_fetch(keys, values)
        kernel = self._owner.decode_attention
        rows = fp.stop - fp.start
        if kernel is not None and fp.width == 1 and fp.written == rows:
            k_buf, v_buf = self._owner.layer_buffers(self._layer)
            if kernel.serves(rows, keys.shape[1], fp.t_used, k_buf.shape[2]):
                return kernel(queries, k_buf, v_buf, fp.rows, fp.key_lengths, scale)
        if not fp.fused:
            return unfused(queries, k, v, scale, mask)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)

    @property
    def state(self) -> Any:
        return self._owner.layer_buffers(self._layer)
