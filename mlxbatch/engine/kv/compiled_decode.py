"""Decode passes replayed from a compiled graph (``mx.compile``): the host stops rebuilding the same graph each step.

A decode step of a small model at a few hundred rows is bound by the host (docs/benchmarks.md: on an H200, of an
8.7 ms step at 256 rows, 2.2 ms went to building the forward's graph in Python, ~30 op calls a layer, and the device
waited on nothing). Steps of one shape build the same graph: traced once, a pass is one call into MLX, which replays
the graph in C++.

What must never be baked into a trace is anything that changes from step to step with the same shapes. So a compiled
pass is planned from arrays only (``decode_pass``): the rows' offsets and slots are inputs, and everything per row
(RoPE offsets, where each row's new key goes, how many keys it reads) is computed from them inside the graph. Its writes
go through one scatter per buffer (never a slice at a Python offset), and its keys are read to the buffers' capacity
(through ``attention.decode`` on CUDA, which reads each row's own keys; elsewhere through an array mask). What does
vary with shape (rows, buffer capacity) keys the trace. The KV buffers are inputs and the written buffers outputs,
which the slot batch takes in place of the old ones: nothing else holds the old ones, so MLX still writes them in
place (donation), as the uncompiled pass does. A pass also returns its rows' offsets plus one (``next_offsets``): in
the next step, where every row advanced by one, that device array is the pass's offsets, not one made from host data
(on CUDA a host-made array is a unified-memory buffer the host wrote, whose pages the device faults in when a kernel
first reads them: ~0.1 ms a step, docs/benchmarks.md).

A shape is compiled the second time it is seen (a shape seen once, e.g. while rows come and go at every step, would
pay a trace for nothing); the last ``keep`` traces are kept.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import mlx.core as mx

from mlxbatch.engine.kv.slot_forward import ForwardPass

log = logging.getLogger(__name__)


class _Slots(Protocol):  # what a compiled pass needs of the slot batch
    num_layers: int
    layers: list[Any]  # the layer caches the model is called with
    decode_attention: Any

    def swap(self, keys: list[mx.array], values: list[mx.array], fp: ForwardPass | None
             ) -> tuple[list[mx.array], list[mx.array]]: ...


def decode_pass(offsets: mx.array, rows: mx.array, capacity: int) -> ForwardPass:
    """The plan of a decode pass over the slot rows ``rows`` (``offsets``: each row's position; both ``[n]`` int32)
    from arrays only: writes by one scatter, keys read up to ``capacity`` through an array mask (or a per-row
    kernel)."""
    n = offsets.shape[0]
    q_pos = offsets[:, None]  # [n, 1]
    index = (rows[:, None, None], q_pos[:, None, :])
    mask = (mx.arange(capacity)[None, None, :] <= q_pos[:, :, None])[:, None, :, :]  # [n, 1, 1, capacity]
    return ForwardPass(0, n, (), 1, capacity, offsets, q_pos, mask, "scatter", index, n, rows, offsets + 1,
                       gather=rows)


class CompiledDecode:
    """``run(slots, model, tokens, offsets, rows, keys, values)``: a decode pass's last hidden states (``[n, dim]``)
    from a compiled graph, or None when this shape is not compiled (yet); the caller then builds the pass as usual.
    ``rows``: the rows' slots (``[n]`` int32)."""

    def __init__(self, after: int = 2, keep: int = 32) -> None:
        self.after = after  # the sighting of a shape that compiles it
        self.keep = keep
        self._seen: dict[tuple[int, ...], int] = {}
        self._fns: OrderedDict[tuple[int, ...], Callable[..., list[mx.array]]] = OrderedDict()
        self.traces = 0  # shapes compiled
        self.passes = 0  # passes run from a compiled graph
        self.broken = False  # a trace failed: no compiled passes in this engine
        self.next_offsets: mx.array | None = None  # the last pass's offsets + 1, on the device (None: no pass yet)

    def accepts(self, slots: _Slots, rows: int, kv_heads: int, capacity: int) -> bool:
        """Whether a pass of this shape can run compiled: not where the device's fused kernel would leave it to MLX's
        attention (that reads exactly the keys the rows use; a compiled pass reads to the capacity)."""
        kernel = slots.decode_attention
        return not self.broken and (kernel is None or kernel.worth(rows, kv_heads, capacity))

    def run(self, slots: _Slots, model: Any, tokens: mx.array, offsets: mx.array, rows: mx.array,
            keys: list[mx.array], values: list[mx.array]) -> mx.array | None:
        """``tokens`` ``[n, 1]``, ``offsets`` and ``rows`` ``[n]``, int32."""
        shape = (offsets.shape[0], *keys[0].shape)
        fn = self._fns.get(shape)
        if fn is None:
            seen = self._seen[shape] = self._seen.get(shape, 0) + 1
            if seen < self.after:
                return None
            fn = self._compile(slots, model)
            self._fns[shape] = fn
            self.traces += 1
            while len(self._fns) > self.keep:
                self._fns.popitem(last=False)  # its trace goes with it
        else:
            self._fns.move_to_end(shape)
        try:
            outs = fn(tokens, offsets, rows, *keys, *values)
        except Exception as exc:  # a primitive MLX cannot trace: this engine builds its passes as before
            log.warning("compiled decode passes unavailable (%s); building each pass", exc)
            self.broken = True
            self._fns.clear()
            self.next_offsets = None
            return None
        L = slots.num_layers
        slots.swap(outs[2 : 2 + L], outs[2 + L :], None)  # the written buffers replace the old ones
        self.next_offsets = outs[1]
        self.passes += 1
        return outs[0]

    @staticmethod
    def _compile(slots: _Slots, model: Any) -> Callable[..., list[mx.array]]:
        L = slots.num_layers

        def decode(tokens: mx.array, offsets: mx.array, rows: mx.array, *buffers: mx.array) -> list[mx.array]:
            fp = decode_pass(offsets, rows, buffers[0].shape[2])
            saved = slots.swap(list(buffers[:L]), list(buffers[L:]), fp)
            try:
                out = model(tokens, cache=slots.layers)[:, 0, :]
                written = slots.swap(*saved, None)  # the layer caches wrote into the traced buffers
            except BaseException:
                slots.swap(*saved, None)
                raise
            return [out, offsets + 1, *written[0], *written[1]]

        return mx.compile(decode)
