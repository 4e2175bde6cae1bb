"""A step's prefill rows as one packed forward pass: every token its own row of one, attention regrouped per pass group.

A prefill step runs rows whose chunks differ in length (a label row's item is 60-150 tokens). Run as padded passes,
each group of similar lengths is one forward: its rows right-padded to the longest, and every pass costs the host its
graph build, its ~1,000 kernels' encoding and a wait for the pass before (on the H200 a 2048-row label run kept the
device busy a third of its prefill: 2.4 passes a step, 1.23x the tokens computed in group padding alone). Packed, the
step's chunks are one forward over their tokens laid end to end (``[tokens, 1]``: the model's norms, projections and
MLP see each token once, no padding, as a decode pass sees its rows), and only attention regroups them: each group's
queries are gathered into ``[rows, heads, width, dim]`` (right-padded to the group's width, as before), attend to their
rows' keys in the slot buffers, and are gathered back into token order. Where the device runs
``attention.packed`` (CUDA), there are no groups: one kernel a layer attends every token over its row's keys up to
its own position, from a table of work units made once a pass. Each token writes its keys and values at its own (row,
position) by one scatter a buffer. RoPE takes each token's position as its row's offset.

``PackedPass.plan`` makes the plan once a step; ``SlotLayerCache`` asks it to write and attend for each layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbatch.engine import attention
from mlxbatch.engine.attention import causal_mask, unfused

TOKEN_STEP = 128  # a packed pass runs a multiple of this many tokens (the projections' GEMM shapes recur)


def round_up(n: int, step: int) -> int:
    """``n`` rounded up to a multiple of ``step``."""
    return -(-n // step) * step


def bucket(x: int) -> int:
    """``x`` rounded up to one of four sizes per octave (1 .. 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ...): at most
    25% more."""
    if x <= 8:
        return x
    step = 1 << ((x - 1).bit_length() - 3)
    return -(-x // step) * step


def host_arrays(*parts: Sequence[int] | np.ndarray) -> list[mx.array]:
    """Lists (or int32 arrays) of ints as int32 views of one array made from host data. On CUDA such an array is a
    unified-memory buffer, which MLX's allocator later frees with a synchronous ``cudaFree`` (a wait for the whole
    device) when it trims its cache: one buffer a pass, not one a list (docs/benchmarks.md). An array part keeps its
    shape (flattened inside the buffer)."""
    if all(not isinstance(p, np.ndarray) for p in parts):
        whole = mx.array([x for p in parts for x in p], dtype=mx.int32)
    else:
        whole = mx.array(np.concatenate([np.asarray(p, np.int32).reshape(-1) for p in parts]))
    out, at = [], 0
    for p in parts:
        size = p.size if isinstance(p, np.ndarray) else len(p)
        view = whole[at : at + size]
        out.append(view.reshape(p.shape) if isinstance(p, np.ndarray) and p.ndim > 1 else view)
        at += size
    return out


def is_run(slots: Sequence[int]) -> bool:
    """Whether these slots are consecutive, in order (a pass over them reads and writes slices)."""
    return all(s == slots[0] + i for i, s in enumerate(slots))


@dataclass(frozen=True)
class AttentionGroup:
    """One pass group's attention: slot rows ``[start, start + rows)`` (or the slots in ``gather``), ``width`` query
    slots a row (right-padded), reading ``keys`` key positions."""

    start: int
    rows: int
    width: int
    keys: int
    q_index: mx.array  # [rows * width] the packed token behind each query slot (a padding slot: its row's last)
    out_rows: mx.array  # [tokens of the group] each token's row in the group (padding tokens of the pass: row 0)
    out_pos: mx.array  # [tokens of the group] and its query slot there (padding tokens: slot 0)
    mask: mx.array | str | None  # "causal" when the group's rows start at one offset (run unfused: that mask made
    # once, ``[width, keys]``), else a bool array
    fused: bool = True  # MLX's fused attention, else ``attention.unfused`` (CUDA: a shape not seen enough)
    gather: mx.array | None = None  # [rows] the rows' slots where they are not one run (``LayoutOptions.rows_stay``)


@dataclass(frozen=True)
class PackedPass:
    """The plan of one packed prefill pass over slot rows ``[start, stop)`` (or the slots given to ``plan``: then
    ``start``/``stop`` count the rows): ``tokens`` real tokens (row by row, in order) padded to ``padded``."""

    start: int
    stop: int
    tokens: int
    padded: int
    offset_array: mx.array  # [padded] each token's position (RoPE offsets: a token is a row of one)
    write_rows: mx.array  # [tokens, 1] the slot row each real token writes
    write_pos: mx.array  # [tokens, 1] and its position there
    groups: tuple[AttentionGroup, ...]  # their tokens are consecutive, in order (the last group's: the padding too)
    last: tuple[int, ...]  # each row's last token (its index among the packed tokens)
    keys: int  # the longest row's keys (its end)
    kernel: Any = None  # ``attention.PackedAttention``: attention in one launch a layer (then no groups)
    units: mx.array | None = None  # [units, 5] the kernel's work units
    mask: None = None  # (mlx-lm's cache protocol: a pass of one-token rows asks for no mask)
    _index: dict[int, tuple[mx.array, ...]] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def plan(start: int, offsets: Sequence[int], lengths: Sequence[int], sizes: Sequence[int], kv_step: int,
             policy: Any = None, capacity: int = 0, kernel: Any = None, slots: Sequence[int] | None = None
             ) -> PackedPass:
        """Rows ``start ..`` (``offsets``: their committed lengths; ``lengths``: their new tokens) in pass groups of
        ``sizes`` rows. A group's width is its longest row rounded up by ``bucket``; it reads keys up to its rows'
        end rounded up to ``kv_step`` through a mask, or causally when its rows start together (then its width stays
        within that end). ``policy`` (``attention.PrefillAttention``, CUDA) says which groups run fused.
        With ``kernel`` (``attention.PackedAttention``) the pass has its work units instead of groups.
        ``slots``: each row's slot in the buffers where they are not rows ``start ..`` (``LayoutOptions.rows_stay``)."""
        assert sum(sizes) == len(offsets) == len(lengths) and all(n > 0 for n in lengths)
        first = [0]
        for n in lengths:
            first.append(first[-1] + n)
        n_tok = first[-1]
        padded = round_up(n_tok, TOKEN_STEP)
        if slots is None:
            slots = range(start, start + len(offsets))
        else:
            start = 0
        rows: list[int] = []
        pos: list[int] = []
        for slot, o, n in zip(slots, offsets, lengths):
            rows += [slot] * n
            pos += range(o, o + n)
        groups: list[AttentionGroup] = []
        flat_units: list[int] = []
        if kernel is not None:
            flat_units = attention.units(slots, offsets, lengths, kernel.rep)
            sizes = ()
        r0 = 0
        for size in sizes:
            offs, lens = offsets[r0 : r0 + size], lengths[r0 : r0 + size]
            end = round_up(max(o + n for o, n in zip(offs, lens)), kv_step)
            width = bucket(max(lens))
            if len(set(offs)) == 1:  # causal: the keys end with the queries (within the rows' positions)
                width = min(width, end - offs[0])
            idx: list[int] = []
            out_rows: list[int] = []
            out_pos: list[int] = []
            for i, n in enumerate(lens):
                f = first[r0 + i]
                idx += range(f, f + n)
                idx += [f + n - 1] * (width - n)  # padding slots: the row's last token again (their output unread)
                out_rows += [i] * n
                out_pos += range(n)
            if r0 + size == len(lengths):  # the pass's padding tokens come after the last group's
                out_rows += [0] * (padded - n_tok)
                out_pos += [0] * (padded - n_tok)
            q_index = mx.array(idx, dtype=mx.int32)
            if len(set(offs)) == 1:  # every query among the last ``width`` keys
                mask: mx.array | str = "causal"
                keys = offs[0] + width
            else:
                keys = end
                q_pos = mx.array(list(offs), dtype=mx.int32)[:, None] + mx.arange(width, dtype=mx.int32)[None, :]
                mask = (mx.arange(keys, dtype=mx.int32)[None, None, :] <= q_pos[:, :, None])[:, None, :, :]
            fused = policy.fused(size, width, keys, capacity, mask) if policy is not None else True
            if not fused and isinstance(mask, str):  # unfused: the causal mask made once a pass, not once a layer
                mask = causal_mask(width, keys)
            run = slots[r0 : r0 + size]
            gather = None if is_run(run) else mx.array(list(run), dtype=mx.int32)
            groups.append(AttentionGroup(run[0], size, width, keys, q_index, mx.array(out_rows, dtype=mx.int32),
                                         mx.array(out_pos, dtype=mx.int32), mask, fused, gather))
            r0 += size
        positions, write_rows, table = host_arrays(pos + [0] * (padded - n_tok), rows, flat_units)
        return PackedPass(start, start + len(offsets), n_tok, padded, positions, write_rows[:, None],
                          positions[:n_tok, None], tuple(groups), tuple(f - 1 for f in first[1:]),
                          max(o + n for o, n in zip(offsets, lengths)), kernel,
                          table.reshape(-1, attention.FIELDS) if kernel is not None else None)

    @staticmethod
    def from_arrays(args: list[mx.array], capacity: int, kernel: Any) -> tuple[PackedPass, list[mx.array]]:
        """The plan of a packed pass through ``kernel`` from arrays only (``kv.compiled``): ``args`` are each token's
        position, its slot row and the unit table (``PackedPass.table``); every token writes, the padding tokens at
        a scratch position (``PackedPass.table``). No extra outputs."""
        positions, rows, units = args
        padded = positions.shape[0]
        return PackedPass(0, 0, padded, padded, positions, rows[:, None], positions[:, None], (), (), capacity,
                          kernel, units), []

    @staticmethod
    def table(slots: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], rep: int, capacity: int
              ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """A packed pass through the kernel in a shape that recurs (``from_arrays``): its padded token count, each
        token's position and slot row (padding tokens: the first row's last position, ``capacity - 1``, which no
        token of the pass reaches: a scratch), and the unit table (``attention.units``' rows, ``[units, FIELDS]``)
        padded to ``bucket`` units (empty units read no keys: offset -1). Made by array ops (a step's tables are
        ~4,000 tokens and ~500 units: Python lists of them were ~0.5 ms a step)."""
        slot = np.asarray(slots, np.int32)
        off = np.asarray(offsets, np.int32)
        n = np.asarray(lengths, np.int32)
        first = np.cumsum(n, dtype=np.int32) - n
        n_tok = int(first[-1] + n[-1])
        padded = round_up(n_tok, TOKEN_STEP)
        assert capacity > int((off + n).max()), "the scratch position is past every row"
        rows = np.full(padded, slot[0], np.int32)
        rows[:n_tok] = np.repeat(slot, n)
        pos = np.full(padded, capacity - 1, np.int32)
        pos[:n_tok] = np.repeat(off - first, n) + np.arange(n_tok, dtype=np.int32)
        table = attention.unit_rows(slot, off, n, rep)
        units = np.empty((bucket(len(table)), attention.FIELDS), np.int32)
        units[: len(table)] = table
        units[len(table) :] = (slot[0], n_tok, 0, 0, -1)
        return padded, pos, rows, units

    def _write_index(self, heads: int) -> tuple[mx.array, ...]:
        """The writes' index arrays (rows, heads, positions), each ``[tokens, heads]``, made once a pass."""
        got = self._index.get(heads)
        if got is None:
            shape = (self.tokens, heads)
            got = self._index[heads] = (mx.broadcast_to(self.write_rows, shape),
                                        mx.broadcast_to(mx.arange(heads, dtype=mx.int32)[None, :], shape),
                                        mx.broadcast_to(self.write_pos, shape))
        return got

    def write(self, k_buf: mx.array, v_buf: mx.array, keys: mx.array, values: mx.array) -> None:
        """One layer's new keys and values (``[padded, kv_heads, 1, dim]``) into their rows and positions, in place."""
        rows, heads, pos = self._write_index(keys.shape[1])
        k_buf[rows, heads, pos] = keys[: self.tokens, :, 0, :]
        v_buf[rows, heads, pos] = values[: self.tokens, :, 0, :]

    def attend(self, queries: mx.array, k_buf: mx.array, v_buf: mx.array, scale: float) -> mx.array:
        """Every token's attention over its row's keys (``queries``: ``[padded, heads, 1, dim]``), group by group
        over the slot buffers (or in one launch: ``kernel``); returns ``[padded, heads, 1, dim]``."""
        if self.kernel is not None:
            return self.kernel(queries, k_buf, v_buf, self.units, scale)
        _, heads, _, dim = queries.shape
        outs = []
        for g in self.groups:  # a gather of the group's queries, its attention, a gather of its tokens' outputs
            qg = queries[g.q_index].reshape(g.rows, g.width, heads, dim).transpose(0, 2, 1, 3)
            if g.gather is not None:
                k, v = k_buf[g.gather, :, : g.keys, :], v_buf[g.gather, :, : g.keys, :]
            else:
                k = k_buf[g.start : g.start + g.rows, :, : g.keys, :]
                v = v_buf[g.start : g.start + g.rows, :, : g.keys, :]
            if g.fused:
                o = mx.fast.scaled_dot_product_attention(qg, k, v, scale=scale, mask=g.mask)
            else:
                o = unfused(qg, k, v, scale, g.mask)
            outs.append(o[g.out_rows, :, g.out_pos, :])  # [tokens of the group, heads, dim]
        every = mx.concatenate(outs) if len(outs) > 1 else outs[0]
        return every[:, :, None, :]
