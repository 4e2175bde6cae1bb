"""The slot layout of batch-invariant mode: ``InvariantSlots``, a ``SlotBatch`` that runs fixed-shape forwards.

A variant of the slot batch (``kv.slots``) with the two things fixed-shape forwards need (``invariant.forwards``): a
forward over a row range with a given key width and explicit write offsets (padding rows included), and a reordering
of the decode rows (``grouped_order``: only misplaced rows move); and a capacity that is given back only once no row
is left.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import mlx.core as mx

from mlxbatch.engine.kv.slot_forward import plan_forward
from mlxbatch.engine.kv.slots import SlotBatch


def grouped_order(ids: Sequence[str], key: Callable[[str], Hashable]) -> list[str]:
    """``ids`` reordered so that equal keys are contiguous (in sorted key order), leaving every id already inside
    its key's block where it is (row moves copy KV: only misplaced rows move)."""
    keys = {rid: key(rid) for rid in ids}
    blocks: dict[Hashable, tuple[int, int]] = {}
    at = 0
    for k in sorted(set(keys.values())):  # type: ignore[type-var]
        n = sum(1 for v in keys.values() if v == k)
        blocks[k] = (at, at + n)
        at += n
    out: list[str | None] = [None] * len(ids)
    movers: list[str] = []
    for i, rid in enumerate(ids):
        a, b = blocks[keys[rid]]
        if a <= i < b:
            out[i] = rid
        else:
            movers.append(rid)
    free = {k: [i for i in range(a, b) if out[i] is None] for k, (a, b) in blocks.items()}
    for rid in movers:
        out[free[keys[rid]].pop(0)] = rid
    return [rid for rid in out if rid is not None]



class InvariantSlots(SlotBatch):
    """The slot layout with the two things fixed-shape forwards need: a forward over a row range with a given key
    width and explicit write offsets (padding rows included), and a reordering of the decode rows."""

    def forward_fixed(self, model: Any, start: int, tokens: Sequence[Sequence[int]], offsets: Sequence[int],
                      kv_width: int) -> mx.array:
        """Run rows ``[start, start + len(tokens))``, each over ``T`` tokens written from its offset, reading
        ``kv_width`` keys; returns every position's output ``[rows, T, dim]``. Rows past the real ones (padding)
        write at offsets the caller chose where nothing committed lives."""
        n, T = len(tokens), len(tokens[0])
        self.ensure(start + n, max(kv_width, max(o + T for o in offsets)))
        fp = plan_forward(start, offsets, T, self.options.batched_moves, kv_width=kv_width)
        return self.passes.run(model, fp, mx.array([list(t) for t in tokens], dtype=mx.int32))

    def shrink(self) -> None:
        """Give capacity back only once no row is left: forwards run past the last row (padding rows) and read key
        widths past the longest row, so shrinking to the rows and positions in use would regrow (copy every buffer)
        at the next step."""
        if not self.ids:
            super().shrink()

    def frontier(self, row: int) -> int:
        """Where a padding write into ``row`` harms nothing: its committed length (0 past the last row)."""
        return self.lengths[row] if row < len(self.ids) else 0

    def arrange_decode(self, order: Sequence[str]) -> None:
        """Put the decode rows in this order (a permutation of them); rows already in place do not move."""
        self.rows.arrange_decode(order)
