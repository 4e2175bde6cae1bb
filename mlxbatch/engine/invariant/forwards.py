"""One step's forwards in batch-invariant mode: the scheduler's decodes and prefill chunks as fixed-shape passes.

Owns the plan of those passes (which rows run together, where padding rows write) and nothing else: the KV is the
layout's (``invariant.slots.InvariantSlots``), the shape rules ``invariant.shapes.Shapes``', sampling the runner's.
``start`` makes them for an engine, once the start-up check passed (``invariant.shapes.check_rows``).
- **Decode.** Decode rows are grouped by key width (``kv_width(length + 1)``) and kept contiguous in that order;
  each group runs in row spans of the fixed row count; a replaying row (preempted, recomputing its generated tokens
  one decode step at a time, so their KV is bitwise what decode made) feeds its next known token and is not due.
- **Prefill.** Each chunk runs in slices of ``slice_tokens`` (chunks start at multiples of it: the scheduler's
  alignment), one slice per row per round; in a round, the rows of one key width run together.
- **Padding rows.** A span may hold rows that are not in its group (other groups' rows between them, or rows past
  them up to the row count). They run on pad tokens and write at their frontier (where their own next write goes,
  or past what they wrote this step), which nothing reads before it is overwritten; their outputs are dropped.
- **LM head.** Due rows' hidden states (and scored positions') go through the head in tiles of ``head_rows``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlxbatch.engine.invariant.shapes import Shapes, check_rows, shapes_for, smallest_linear_out
from mlxbatch.engine.invariant.slots import InvariantSlots, grouped_order
from mlxbatch.engine.outputs import StepProfile
from mlxbatch.engine.request import Request
from mlxbatch.engine.sched.step import PrefillChunk
from mlxbatch.errors import InvalidRequestError


@dataclass
class FixedStep:
    """What a step's fixed-shape forwards produced: due rows with their hidden states (row order), and the
    positions scoring rows score (owner, target token, hidden state)."""

    due: list[Request] = field(default_factory=list)
    hidden: list[mx.array] = field(default_factory=list)
    score_owners: list[str] = field(default_factory=list)
    score_targets: list[int] = field(default_factory=list)
    score_hidden: list[mx.array] = field(default_factory=list)


class FixedForwards:
    def __init__(self, slots: InvariantSlots, shapes: Shapes, body: Any, head: Any, profile: StepProfile) -> None:
        self.slots = slots
        self.shapes = shapes
        self.body = body  # tokens -> hidden states (or logits when there is no separate head)
        self.head = head  # hidden -> logits, or None
        self.profile = profile
        self.pad_rows = 0  # padding rows computed (decode + prefill), for the cost of the mode

    # -- decode ------------------------------------------------------------------------------------------
    def decode(self, decodes: Sequence[Request], step: FixedStep) -> None:
        slots, shapes = self.slots, self.shapes
        by_id = {r.request_id: r for r in decodes}
        width = {rid: shapes.kv_width(slots.committed(rid) + 1) for rid in by_id}
        slots.arrange_decode(grouped_order(slots.ids[: slots.n_decode], width.__getitem__))
        ids = slots.ids[: slots.n_decode]
        a = 0
        while a < len(ids):
            b = a
            while b < len(ids) and width[ids[b]] == width[ids[a]]:
                b += 1
            for lo, hi in shapes.spans(range(a, b), shapes.decode_rows):
                toks, offs = [], []
                for row in range(lo, hi):
                    if row < b:
                        r, at = by_id[ids[row]], slots.committed(ids[row])
                        toks.append(r.tokens(at, at + 1))
                        offs.append(at)
                    else:
                        toks.append([0])
                        offs.append(slots.frontier(row))
                out = slots.forward_fixed(self.body, lo, toks, offs, width[ids[a]])
                self.pad_rows += (hi - lo) - (min(hi, b) - lo)
                got = []
                for row in range(lo, min(hi, b)):
                    r = by_id[ids[row]]
                    if slots.committed(r.request_id) == r.num_tokens - 1:  # else replaying a known token
                        step.due.append(r)
                        step.hidden.append(out[row - lo, 0])
                        got.append(step.hidden[-1])
                slots.traffic.evaluate(got, slots.kv_arrays())
            a = b

    # -- prefill -----------------------------------------------------------------------------------------
    def prefill(self, chunks: Sequence[PrefillChunk], step: FixedStep, admit: Any) -> None:
        slots, shapes, C = self.slots, self.shapes, self.shapes.slice_tokens
        for c in chunks:
            assert c.start % C == 0, "batch-invariant prefill chunks start at multiples of the slice"
        n_slices = {c.request.request_id: -(-(c.end - c.start) // C) for c in chunks}
        first = {c.request.request_id: shapes.kv_width(c.start + C) for c in chunks}
        ordered = sorted(chunks, key=lambda c: (first[c.request.request_id], -n_slices[c.request.request_id]))
        admit([c.request.request_id for c in ordered])  # new rows placed in this order, then their copy-ins
        base = slots.n_decode
        frontier = [c.start for c in ordered]  # per chunk row: where its next write goes
        for j in range(max(n_slices.values(), default=0)):
            active = [i for i, c in enumerate(ordered) if n_slices[c.request.request_id] > j]
            widths = {i: shapes.kv_width(ordered[i].start + (j + 1) * C) for i in active}
            for w in sorted(set(widths.values())):
                members = [i for i in active if widths[i] == w]
                for lo, hi in shapes.spans(members, shapes.prefill_rows):
                    self._slice(ordered, set(members), lo, hi, j, w, base, frontier, step)
                for i in members:
                    frontier[i] = ordered[i].start + (j + 1) * C

    def _slice(self, ordered: Sequence[PrefillChunk], members: set[int], lo: int, hi: int, j: int, width: int,
               base: int, frontier: list[int], step: FixedStep) -> None:
        """One forward: slice ``j`` of the member rows among chunk rows ``[lo, hi)`` (others pad)."""
        slots, C = self.slots, self.shapes.slice_tokens
        toks, offs = [], []
        for i in range(lo, hi):
            if i in members:
                c = ordered[i]
                p0 = c.start + j * C
                t = c.request.tokens(p0, min(p0 + C, c.end))
                toks.append(t + [0] * (C - len(t)))
                offs.append(p0)
            else:
                toks.append([0] * C)
                offs.append(frontier[i] if i < len(ordered) else slots.frontier(base + i))
        out = slots.forward_fixed(self.body, base + lo, toks, offs, width)
        self.pad_rows += sum(1 for i in range(lo, hi) if i not in members)
        got: list[mx.array] = []
        for i in range(lo, hi):
            if i not in members:
                continue
            c, p0 = ordered[i], ordered[i].start + j * C
            r = c.request
            if r.score_from is not None:  # position p's logits score the token paired with it
                for p, t in r.unscored_targets():
                    if p0 <= p < min(p0 + C, c.end):
                        step.score_owners.append(r.request_id)
                        step.score_targets.append(t)
                        step.score_hidden.append(out[i - lo, p - p0])
                        got.append(step.score_hidden[-1])
            elif c.last and c.end == r.num_tokens and p0 + C >= c.end:  # its last slice: the next token is due
                step.due.append(r)
                step.hidden.append(out[i - lo, c.end - 1 - p0])
                got.append(step.hidden[-1])
        slots.traffic.evaluate(got, slots.kv_arrays())

    # -- LM head -----------------------------------------------------------------------------------------
    def logits(self, hidden: Sequence[mx.array]) -> mx.array:
        """The head over these hidden states in fixed row tiles: ``[len(hidden), vocab]``."""
        h = mx.stack(list(hidden))
        if self.head is None:
            return h
        parts = []
        for a, b in self.shapes.spans(range(len(hidden)), self.shapes.head_rows):
            tile = h[a:b]
            if tile.shape[0] < b - a:
                tile = mx.concatenate([tile, mx.zeros((b - a - tile.shape[0], *tile.shape[1:]), tile.dtype)])
            parts.append(self.head(tile))
        out = mx.concatenate(parts) if len(parts) > 1 else parts[0]
        return out[: len(hidden)]

    def run(self, decodes: Sequence[Request], prefills: Sequence[PrefillChunk], admit: Any) -> FixedStep:
        """Decode, then prefill; ``admit(order)`` places the new rows (and the other prefilling rows) in the prefill
        passes' order and copies their prefixes in (``kv.reuse.admit``). Times them into the profile."""
        step = FixedStep()
        prof = self.profile
        if decodes:
            t0 = time.perf_counter()
            self.decode(decodes, step)
            prof.decode_build_s += time.perf_counter() - t0
            prof.decode_tokens += len(decodes)
        if prefills:
            t0 = time.perf_counter()
            self.prefill(prefills, step, admit)
            prof.prefill_build_s += time.perf_counter() - t0
            prof.prefill_tokens += sum(c.end - c.start for c in prefills)
        return step


def start(slots: InvariantSlots, model: Any, body: Any, head: Any, dtype: str, device: str,
          profile: StepProfile) -> FixedForwards:
    """The fixed-shape forwards of ``model`` (``body``: tokens -> hidden, ``head``: hidden -> logits or None) on
    ``device`` ("cpu" or "gpu"); the flag is refused (``InvalidRequestError``) where the start-up check finds a row's
    bits depend on the rows beside it."""
    shapes = shapes_for(device, dtype, smallest_linear_out(model))
    failed = check_rows(body, head, shapes)
    if failed:
        hint = ("; OpenBLAS's float32 kernel for this CPU is not row-invariant: OPENBLAS_CORETYPE=Nehalem "
                "(x86-64) selects one that is" if device == "cpu" and dtype == "float32" else "")
        raise InvalidRequestError("batch_invariant", True, f"cannot hold on this device: {failed}{hint}")
    return FixedForwards(slots, shapes, body, head, profile)
