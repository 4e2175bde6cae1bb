"""Passes replayed from a compiled graph (``mx.compile``): the host stops rebuilding the same graph each step.

A step of a small model at a few hundred rows is bound by the host (docs/benchmarks.md: on an H200, of an 8.7 ms
decode step at 256 rows, 2.2 ms went to building the forward's graph in Python, ~30 op calls a layer, and the device
waited on nothing; a packed prefill pass builds ~20 a layer). Passes of one shape build the same graph: traced once,
a pass is one call into MLX, which replays the graph in C++ (and fuses its elementwise ops: fewer launches).

What must never be baked into a trace is anything that changes from step to step with the same shapes. So a compiled
pass is planned from arrays only (``decode_pass`` here, ``PackedPass.from_arrays``): where each row's (or token's) new
keys go, its RoPE offsets, how many keys it reads are inputs or computed from them inside the graph. Its writes go
through one scatter per buffer (never a slice at a Python offset). What does vary with shape (rows, tokens, the unit
table's length, buffer capacity) keys the trace. The KV buffers are inputs and the written buffers outputs, which the
slot batch takes in place of the old ones: nothing else holds the old ones, so MLX still writes them in place
(donation), as the uncompiled pass does. A decode pass also returns its rows' offsets plus one: in the next step, where
every row advanced by one, that device array is the pass's offsets, not one made from host data (on CUDA a host-made
array is a unified-memory buffer the host wrote, whose pages the device faults in when a kernel first reads them:
~0.1 ms a step, docs/benchmarks.md).

A shape is compiled the second time it is seen (a shape seen once, e.g. while rows come and go at every step, would
pay a trace for nothing); the last ``keep`` traces are kept.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import mlx.core as mx

from mlxbatch.engine.kv.packed import PackedPass
from mlxbatch.engine.kv.slot_forward import ForwardPass

log = logging.getLogger(__name__)

# a pass's plan from its array arguments and the buffers' capacity, and the extra arrays the pass returns
Plan = Callable[[list[mx.array], int], tuple[ForwardPass | PackedPass, list[mx.array]]]


class _Slots(Protocol):  # what a compiled pass needs of the slot batch
    num_layers: int
    layers: list[Any]  # the layer caches the model is called with

    def swap(self, keys: list[mx.array], values: list[mx.array], fp: ForwardPass | PackedPass | None
             ) -> tuple[list[mx.array], list[mx.array]]: ...


def decode_pass(args: list[mx.array], capacity: int) -> tuple[ForwardPass, list[mx.array]]:
    """The plan of a decode pass over the slot rows ``rows`` (``args``: each row's position ``offsets`` and its slot
    ``rows``, both ``[n]`` int32) from arrays only: writes by one scatter, keys read up to ``capacity`` through an array
    mask (or a per-row kernel). The pass returns ``offsets + 1`` (the next pass's, where every row advances)."""
    offsets, rows = args
    n = offsets.shape[0]
    q_pos = offsets[:, None]  # [n, 1]
    index = (rows[:, None, None], q_pos[:, None, :])
    mask = (mx.arange(capacity)[None, None, :] <= q_pos[:, :, None])[:, None, :, :]  # [n, 1, 1, capacity]
    fp = ForwardPass(0, n, (), 1, capacity, offsets, q_pos, mask, "scatter", index, n, rows, offsets + 1,
                     gather=rows)
    return fp, [offsets + 1]


class CompiledPasses:
    """``run(slots, model, inputs, args, keys, values)``: a pass's outputs from a compiled graph: its last hidden
    states (``[n, dim]``, one a row of ``inputs``), then the extra arrays its plan returns; or None when this shape is
    not compiled (yet): the caller then builds the pass as usual. ``plan`` makes the pass's plan from ``args``."""

    def __init__(self, plan: Plan, after: int = 2, keep: int = 32) -> None:
        self.plan = plan
        self.after = after  # the sighting of a shape that compiles it
        self.keep = keep
        self._seen: dict[tuple[Any, ...], int] = {}
        self._fns: OrderedDict[tuple[Any, ...], Callable[..., list[mx.array]]] = OrderedDict()
        self.traces = 0  # shapes compiled
        self.passes = 0  # passes run from a compiled graph
        self.broken = False  # a trace failed: no compiled passes of this kind in this engine

    def run(self, slots: _Slots, model: Any, inputs: mx.array, args: Sequence[mx.array], keys: list[mx.array],
            values: list[mx.array]) -> list[mx.array] | None:
        """``inputs``: the pass's token ids ``[n, 1]`` int32."""
        if self.broken:
            return None
        shape = (inputs.shape, *(a.shape for a in args), *keys[0].shape)
        fn = self._fns.get(shape)
        if fn is None:
            seen = self._seen[shape] = self._seen.get(shape, 0) + 1
            if seen < self.after:
                return None
            fn = self._fns[shape] = self._compile(slots, model, len(args))
            self.traces += 1
            while len(self._fns) > self.keep:
                self._fns.popitem(last=False)  # its trace goes with it
        else:
            self._fns.move_to_end(shape)
        try:
            outs = fn(inputs, *args, *keys, *values)
        except Exception as exc:  # a primitive MLX cannot trace: this engine builds these passes as before
            log.warning("compiled passes unavailable (%s); building each pass", exc)
            self.broken = True
            self._fns.clear()
            return None
        L = slots.num_layers
        slots.swap(outs[-2 * L : -L], outs[-L:], None)  # the written buffers replace the old ones
        self.passes += 1
        return outs[: -2 * L]

    def _compile(self, slots: _Slots, model: Any, n_args: int) -> Callable[..., list[mx.array]]:
        L, plan = slots.num_layers, self.plan

        def traced(inputs: mx.array, *arrays: mx.array) -> list[mx.array]:
            buffers = arrays[n_args:]
            fp, extras = plan(list(arrays[:n_args]), buffers[0].shape[2])
            saved = slots.swap(list(buffers[:L]), list(buffers[L:]), fp)
            try:
                out = model(inputs, cache=slots.layers)[:, 0, :]
                written = slots.swap(*saved, None)  # the layer caches wrote into the traced buffers
            except BaseException:
                slots.swap(*saved, None)
                raise
            return [out, *extras, *written[0], *written[1]]

        return mx.compile(traced)
