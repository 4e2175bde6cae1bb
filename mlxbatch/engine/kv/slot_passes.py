"""The slot batch's forward passes: a pass over rows of the batch, a step's prefill rows as one packed pass, and
decode passes replayed from compiled graphs.

Owns the pass in progress, the layer caches (``SlotLayerCache``: one layer's view of the buffers in mlx-lm's cache
protocol), and the compiled decode passes' traces and carried offsets. A pass plans its rows' writes and reads
(``kv.slot_forward``, ``kv.packed``) from the rows' books (``kv.rows``: offsets, slots), sets the plan as the pass in
progress, and calls the model with the layer caches, which ask for the pass and their layer's buffers
(``kv.buffers``). What a pass does follows the layout's options: recurring shapes, the engine's attention kernels,
compiled decode passes.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbatch.engine.attention import DecodeAttention
from mlxbatch.engine.kv import LayoutOptions
from mlxbatch.engine.kv.buffers import POSITION_STEP, SlotBuffers
from mlxbatch.engine.kv.compiled import CompiledPasses, decode_pass
from mlxbatch.engine.kv.packed import PackedPass, host_arrays, round_up
from mlxbatch.engine.kv.rows import SlotRows
from mlxbatch.engine.kv.slot_forward import ForwardPass, SlotLayerCache, bucketed_pass, plan_forward, write_kv


class SlotPasses:
    """The forward passes over the rows of a slot batch, and the hooks its layer caches call during one."""

    def __init__(self, rows: SlotRows, buffers: SlotBuffers, options: LayoutOptions) -> None:
        self._rows = rows
        self._buffers = buffers
        self.options = options
        self.num_layers = buffers.num_layers
        self._pass: ForwardPass | PackedPass | None = None  # the forward pass in progress (or the last one)
        self.layers = [SlotLayerCache(self, i) for i in range(buffers.num_layers)]
        # decode passes, and packed prefill passes through the kernel, replayed from compiled graphs (their traces
        # and counts: this layout's own)
        self.compiled_decode = CompiledPasses(decode_pass) if options.compiled_decode else None
        packed = options.attention.packed
        self.compiled_prefill = CompiledPasses(lambda args, cap: PackedPass.from_arrays(args, cap, packed), keep=64) \
            if options.compiled_prefill and packed is not None else None
        self._decode_key: tuple[int, ...] | int | None = None  # ``_decode_slots``' last rows, and their array
        self._decode_rows: mx.array | None = None
        # the last compiled decode pass's offsets + 1: as host ints, and the device array (``_compiled_decode``)
        self._next_offsets: tuple[list[int], mx.array] | None = None

    @property
    def decode_attention(self) -> DecodeAttention | None:
        """The fused decode kernel the layer caches attend with, where the device runs it."""
        return self.options.attention.decode

    @property
    def last_pass(self) -> ForwardPass | PackedPass | None:
        """The pass in progress, or the last one built (None after a compiled decode pass)."""
        return self._pass

    def forward(self, model: Any, start: int, tokens: Sequence[Sequence[int]] | mx.array, full: bool = False,
                offsets: Sequence[int] | None = None) -> mx.array:
        """Run rows ``[start, start+len(tokens))`` over their new tokens; returns each row's last output
        (``[rows, dim]``), or every position's (``[rows, T, dim]``) with ``full``.

        ``model`` maps ``(inputs, cache=...)`` to per-position outputs (logits, or hidden states when the
        caller applies the LM head itself to the last positions only).

        Rows with fewer tokens than the longest are right-padded; padding writes land past the row's
        length, where later tokens overwrite them, and no real query can see them (causal mask). ``tokens`` may be
        an array ``[rows, 1]`` (a decode pass fed the ids the step before drew, still on the device).
        """
        if isinstance(tokens, mx.array):
            assert tokens.ndim == 2 and tokens.shape[1] == 1, "an array of tokens feeds a decode pass"
        n = len(tokens)
        T = 1 if isinstance(tokens, mx.array) else max(len(t) for t in tokens)
        # where each row's new tokens start: its committed length, unless an earlier forward of the same step
        # (not committed yet) already wrote some
        explicit = offsets is not None
        offsets = list(offsets) if offsets is not None else self._rows.lengths[start : start + n]
        if T == 1 and start == 0 and not explicit and not full and self.compiled_decode is not None:
            out = self._compiled_decode(model, tokens, offsets)
            if out is not None:
                return out
        slots = self._rows.slots(start, start + n)
        if self.options.shape_buckets and T > 1:
            self._rows.ensure(start + n, round_up(max(o + T for o in offsets), POSITION_STEP))  # as an exact pass
            cap = self._buffers.rows_cap
            room = cap if self.options.rows_stay else cap - start  # padding rows' slots (read only)
            fp = bucketed_pass(start, offsets, T, room, POSITION_STEP, slots)
        else:
            self._rows.ensure(start + n, max(o + T for o in offsets))
            fp = plan_forward(start, offsets, T, self.options.batched_moves, slots=slots)
        policy = self.options.attention.prefill
        if T > 1 and policy is not None:  # CUDA: a new shape's attention unfused, no cuDNN build
            fused = policy.fused(fp.stop - fp.start, fp.width, fp.t_used, self._buffers.pos_cap, fp.mask)
            fp = dataclasses.replace(fp, fused=fused)
        rows, width = fp.stop - fp.start, fp.width
        if isinstance(tokens, mx.array):
            assert (rows, width) == (n, 1)
            inputs = tokens
        else:
            pad = tokens if rows == n and width == 1 else \
                [list(t) + [0] * (width - len(t)) for t in tokens] + [[0] * width] * (rows - n)
            inputs = mx.array(pad, dtype=mx.int32)
        out = self.run(model, fp, inputs)
        if rows > n:
            out = out[:n]
        if full:
            return out[:, :T] if width > T else out
        if T == 1:
            return out[:, 0, :]
        last = mx.array([len(t) - 1 for t in tokens], dtype=mx.int32)
        return mx.take_along_axis(out, last[:, None, None], axis=1)[:, 0, :]

    def run(self, model: Any, fp: ForwardPass | PackedPass, inputs: mx.array) -> mx.array:
        """Call the model on ``inputs`` with ``fp`` as the pass in progress (its layer caches read it)."""
        self._pass = fp
        return model(inputs, cache=self.layers)

    def forward_packed(self, model: Any, start: int, tokens: Sequence[Sequence[int]], sizes: Sequence[int],
                       rows: Sequence[int], lead: mx.array | None = None) -> mx.array:
        """Rows ``[start, start+len(tokens))`` over their new tokens in one packed pass (``kv.packed``: the
        tokens end to end, attention in pass groups of ``sizes`` rows); returns the last output of each row in
        ``rows`` (``[len(rows), dim]``). ``model`` must attend through the layer caches (``model.own_body``).
        ``lead``: the first rows' one token each, still on the device (``[n, 1]``: a step's decode rows fed the step
        before's draw); their entries in ``tokens`` hold one token each, not read."""
        offsets = self._rows.lengths[start : start + len(tokens)]
        end = max(o + len(t) for o, t in zip(offsets, tokens))
        if self.compiled_prefill is not None:  # a position past every row's end: the padding tokens' scratch
            self._rows.ensure(start + len(tokens), round_up(end + 1, POSITION_STEP))
            out = self._compiled_packed(model, start, tokens, offsets, rows, lead)
            if out is not None:
                return out
        else:
            self._rows.ensure(start + len(tokens), round_up(end, POSITION_STEP))
        kernels = self.options.attention
        plan = PackedPass.plan(start, offsets, [len(t) for t in tokens], sizes, POSITION_STEP, kernels.prefill,
                               self._buffers.pos_cap, kernels.packed, self._rows.slots(start, start + len(tokens)))
        flat = [t for row in tokens for t in row]
        inputs, last = host_arrays(flat + [0] * (plan.padded - plan.tokens), [plan.last[r] for r in rows])
        out = self.run(model, plan, _with_lead(inputs, lead)[:, None])  # [padded, 1, dim]
        return out[last, 0, :]

    def _compiled_packed(self, model: Any, start: int, tokens: Sequence[Sequence[int]], offsets: list[int],
                         rows: Sequence[int], lead: mx.array | None) -> mx.array | None:
        """A packed pass through the kernel from a compiled graph (``PackedPass.table``), if its shape is compiled."""
        compiled, kernel = self.compiled_prefill, self.options.attention.packed
        assert compiled is not None and kernel is not None
        slots = self._rows.slots(start, start + len(tokens)) or range(start, start + len(tokens))
        lengths = [len(t) for t in tokens]
        padded, pos, at, table = PackedPass.table(slots, offsets, lengths, kernel.rep, self._buffers.pos_cap)
        ids = np.zeros(padded, np.int32)
        ids[: sum(lengths)] = np.fromiter(itertools.chain.from_iterable(tokens), np.int32, sum(lengths))
        last = np.cumsum(lengths) - 1
        ids_a, positions, slot_rows, units, picked = host_arrays(ids, pos, at, table, last[list(rows)])
        buffers = self._buffers
        outs = compiled.run(self, model, _with_lead(ids_a, lead)[:, None], [positions, slot_rows, units],
                            buffers.keys, buffers.values)
        return outs[0][picked] if outs is not None else None

    def _compiled_decode(self, model: Any, tokens: Sequence[Sequence[int]] | mx.array, offsets: list[int]
                         ) -> mx.array | None:
        """A decode pass over rows ``0 .. len(offsets)`` from a compiled graph, if its shape is compiled."""
        compiled = self.compiled_decode
        assert compiled is not None
        n = len(offsets)
        self._rows.ensure(n, max(offsets) + 1)
        buffers = self._buffers
        kernel = self.decode_attention  # not where the kernel would leave it to MLX's attention: that reads exactly
        # the keys the rows use, a compiled pass reads to the capacity
        if compiled.broken or (kernel is not None and
                               not kernel.serves(n, buffers.keys[0].shape[1], buffers.pos_cap, buffers.pos_cap)):
            return None
        carried = self._next_offsets
        if carried is not None and carried[0] == offsets:  # every row advanced by one: the last pass's offsets + 1
            off = carried[1]
            inputs = tokens.astype(mx.int32) if isinstance(tokens, mx.array) else \
                host_arrays([t for row in tokens for t in row])[0][:, None]
        elif isinstance(tokens, mx.array):
            inputs, off = tokens.astype(mx.int32), host_arrays(offsets)[0]
        else:  # the tokens and offsets in one host-made array (``kv.packed.host_arrays``)
            ids, off = host_arrays([t for row in tokens for t in row], offsets)
            inputs = ids[:, None]
        self._next_offsets = None
        outs = compiled.run(self, model, inputs, [off, self._decode_slots(n)], buffers.keys, buffers.values)
        if outs is None:
            return None
        self._next_offsets = ([o + 1 for o in offsets], outs[1])  # the device's offsets + 1, for the next pass if
        return outs[0]  # its rows all advanced by one

    def _decode_slots(self, n: int) -> mx.array:
        """The slots of rows ``0 .. n`` as an array, made again only when they changed."""
        slots = self._rows.slots(0, n)
        key = tuple(slots) if slots is not None else n
        if self._decode_key != key:
            self._decode_key = key
            self._decode_rows = mx.array(list(key), dtype=mx.int32) if slots is not None else \
                mx.arange(n, dtype=mx.int32)
        assert self._decode_rows is not None
        return self._decode_rows

    def swap(self, keys: list[mx.array], values: list[mx.array], fp: ForwardPass | None
             ) -> tuple[list[mx.array], list[mx.array]]:
        """Put ``keys``/``values`` in place of the buffers and ``fp`` as the pass in progress; returns the buffers
        they replace (``kv.compiled``: a trace runs the layer caches over its own buffers, and the written
        buffers a compiled pass returns replace the old ones)."""
        old = self._buffers.swap(keys, values)
        self._pass = fp
        return old

    # -- the layer caches' hooks ------------------------------------------------------------------
    def current_pass(self) -> ForwardPass | PackedPass:
        assert self._pass is not None, "layer caches are read during a forward pass only"
        return self._pass

    def write_layer(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        fp = self.current_pass()
        assert isinstance(fp, ForwardPass), "a packed pass writes through ``SlotLayerCache.attend``"
        k_buf, v_buf = self._buffers.layer(layer)
        return write_kv(k_buf, v_buf, fp, keys, values)

    def layer_buffers(self, layer: int) -> tuple[mx.array, mx.array]:
        return self._buffers.layer(layer)


def _with_lead(ids: mx.array, lead: mx.array | None) -> mx.array:
    """A packed pass's token ids with its first ``len(lead)`` taken from ``lead`` (``[n, 1]``, on the device)."""
    if lead is None:
        return ids
    return mx.concatenate([lead.reshape(-1).astype(mx.int32), ids[lead.shape[0] :]])
