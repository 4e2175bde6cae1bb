"""The slot buffers: one keys and one values buffer per layer, ``[slots, kv_heads, positions, head_dim]``.

Owns the running batch's KV arrays, their capacity, and every copy into or out of them, counted in the shared
``Traffic``: growth (rows double, positions grow by ``POSITION_STEP``) and shrinking, both in slices of at most 256 MiB
(``kv.copies``); one slot's positions copied out and back (a sync for all layers), many slots' at once (one gather, one
sync, one scatter per buffer); blocks read and written by (slot, position); one prefix written into many slots. It
knows slots, not sequences: which sequence holds which slot is the rows' books (``kv.rows``).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from mlxbatch.engine.kv import copies
from mlxbatch.engine.kv.packed import round_up
from mlxbatch.engine.outputs import Traffic

POSITION_STEP = 256  # buffers' positions grow by this much, and bucketed passes read keys in multiples of it
# a shared prefix goes into at most this many runs of neighbouring slots by slice writes (a kernel per buffer each),
# into slots more scattered than that by one scatter per buffer (``SlotBuffers.write_prefix``)
MAX_RUNS = 8


def row_capacity(rows: int) -> int:
    """Rows the buffers hold once ``rows`` sequences were added one by one: 4, then doubling."""
    cap = 4
    while cap < rows:
        cap *= 2
    return cap


def _runs(slots: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted distinct slots as ``[a, b)`` runs of neighbours."""
    out: list[tuple[int, int]] = []
    for r in slots:
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


class SlotBuffers:
    """Every layer's keys and values buffers, ``rows_cap`` slots of ``pos_cap`` positions each."""

    def __init__(self, num_layers: int, traffic: Traffic) -> None:
        self.num_layers = num_layers
        self.traffic = traffic  # bytes copied and syncs (shared with the runner's step profile)
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self.rows_cap = 0
        self.pos_cap = 0
        self.position_bytes = 0  # bytes of one position of one slot, keys and values of every layer

    def arrays(self) -> list[mx.array]:
        return self.keys + self.values

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))

    def layer(self, i: int) -> tuple[mx.array, mx.array]:
        return self.keys[i], self.values[i]

    def swap(self, keys: list[mx.array], values: list[mx.array]) -> tuple[list[mx.array], list[mx.array]]:
        """Put these buffers in place of the current ones (a compiled pass returns its written buffers, and a trace
        runs over its own: ``kv.compiled``); returns the buffers they replace."""
        old = self.keys, self.values
        self.keys, self.values = keys, values
        return old

    # -- capacity ------------------------------------------------------------------------------
    def allocate(self, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> None:
        """Create the (empty) buffers; called once, before the first row is added."""
        if self.keys:
            return
        self.rows_cap, self.pos_cap = 4, POSITION_STEP
        shape = (self.rows_cap, kv_heads, self.pos_cap, head_dim)
        self.keys = [mx.zeros(shape, dtype) for _ in range(self.num_layers)]
        self.values = [mx.zeros(shape, dtype) for _ in range(self.num_layers)]
        self.position_bytes = 2 * self.num_layers * kv_heads * head_dim * dtype.size
        self.traffic.evaluate(self.keys, self.values)  # nothing lazy may outlive the thread (and stream) that made it

    def ensure(self, rows: int, positions: int) -> None:
        """Room for ``rows`` slots of ``positions`` positions. Rows grow to the capacity ``row_capacity`` charges (a
        power of two), however many join at once: 220 rows admitted together grow to 256, not to 220 and then 440."""
        new_rows = self.rows_cap if rows <= self.rows_cap else row_capacity(rows)
        new_pos = self.pos_cap if positions <= self.pos_cap else round_up(positions, POSITION_STEP)
        if (new_rows, new_pos) == (self.rows_cap, self.pos_cap):
            return
        self.traffic.grown_bytes += self.nbytes
        self.traffic.resizes += 1

        def grown(old: mx.array) -> mx.array:
            R, H, P, D = old.shape
            g = mx.zeros((new_rows, H, new_pos, D), old.dtype)
            g[:R, :, :P, :] = old
            return g

        copies.replace_each((self.keys, self.values), grown, self.traffic)
        self.rows_cap, self.pos_cap = new_rows, new_pos

    def shrink_to(self, rows: int, positions: int) -> None:
        """Keep slots ``0 .. rows`` and positions ``0 .. positions`` only (what lies past them is no row's)."""
        copies.replace_each((self.keys, self.values), lambda old: mx.contiguous(old[:rows, :, :positions, :]),
                            self.traffic)
        self.traffic.grown_bytes += self.nbytes
        self.traffic.resizes += 1
        self.rows_cap, self.pos_cap = rows, positions

    # -- slots' positions ----------------------------------------------------------------------
    def write_row(self, slot: int, kv: Sequence[tuple[mx.array, mx.array]], length: int) -> None:
        """Positions ``0 .. length`` of a slot from ``kv`` (per layer, ``[1, H, >= length, D]``)."""
        if kv:
            self.traffic.moved_bytes += length * self.position_bytes
        for i, (k, v) in enumerate(kv):
            self.keys[i][slot, :, :length, :] = k[0, :, :length, :]
            self.values[i][slot, :, :length, :] = v[0, :, :length, :]

    def row_copies(self, slot: int, n: int) -> list[mx.array]:
        """Evaluated copies of one slot's first ``n`` positions, every layer's keys then values, in one sync.

        A lazy slice would keep the buffer referenced, and the update that follows would then copy the whole
        buffer instead of writing in place (measured on CPU: 67 ms vs 0.1 ms); one eval for all layers keeps
        a row move to a single device sync (on a GPU, one per layer cost ~10 ms a move).
        """
        out = [mx.contiguous(buf[slot, :, :n, :]) for buf in (*self.keys, *self.values)]
        self.traffic.evaluate(out)
        return out

    def put_row(self, slot: int, n: int, copies: list[mx.array]) -> None:
        """A row move's write (the CPU path): one slot's positions ``0..n-1`` from ``copies``."""
        self.traffic.moved_bytes += n * self.position_bytes
        self.traffic.row_moved_bytes += n * self.position_bytes
        for buf, arr in zip((*self.keys, *self.values), copies):
            buf[slot, :, :n, :] = arr

    def copy_rows(self, src: Sequence[int], dst: Sequence[int], n: int) -> None:
        """Positions ``0..n-1`` of slots ``src`` into slots ``dst``, all at once: one gather per buffer, one sync,
        one scatter per buffer."""
        take = mx.array(src, dtype=mx.int32)
        copies = [mx.take(buf[:, :, :n, :], take, axis=0) for buf in (*self.keys, *self.values)]
        self.traffic.evaluate(copies)  # nothing lazy may reference the buffers while they are written in place
        self.put_rows(dst, n, copies)

    def put_rows(self, dst: Sequence[int], n: int, copies: list[mx.array]) -> None:
        """Slots ``dst``'s positions ``0..n-1`` from ``copies`` (every layer's keys then values, ``[rows, H, n, D]``,
        evaluated): one scatter per buffer."""
        put = mx.array(dst, dtype=mx.int32)
        self.traffic.moved_bytes += len(dst) * n * self.position_bytes
        for i, c in enumerate(copies):
            target = self.keys if i < self.num_layers else self.values
            target[i % self.num_layers][put, :, :n, :] = c

    def read_prefix(self, slot: int, n: int) -> list[mx.array]:
        """One slot's first ``n`` positions, every layer's keys then values (lazy: evaluate before a write)."""
        return [mx.contiguous(buf[slot, :, :n, :]) for buf in (*self.keys, *self.values)]

    def gather(self, slots: Sequence[int], n: int) -> list[mx.array]:
        """Slots' first ``n`` positions, every layer's keys then values, ``[rows, H, n, D]`` (lazy)."""
        take = mx.array(list(slots), dtype=mx.int32)
        return [mx.take(buf[:, :, :n, :], take, axis=0) for buf in (*self.keys, *self.values)]

    def write_prefix(self, slots: Sequence[int], kv: Sequence[mx.array], scatter: bool) -> None:
        """One prefix into slots (sorted): ``kv`` holds every layer's keys then values, each ``[H, n, D]``
        (evaluated, or lazy reads of anything but these buffers), for positions ``0 .. n``. A broadcast slice write per
        buffer for each run of neighbouring slots; slots in more than ``MAX_RUNS`` runs take one scatter per buffer
        instead where ``scatter`` (a GPU: a CPU's scatter goes element by element)."""
        n = kv[0].shape[1]
        self.traffic.moved_bytes += len(slots) * n * self.position_bytes
        runs = _runs(slots)
        put = mx.array(list(slots), dtype=mx.int32) if scatter and len(runs) > MAX_RUNS else None
        for i, src in enumerate(kv):
            buf = (self.keys if i < self.num_layers else self.values)[i % self.num_layers]
            if put is not None:
                buf[put, :, :n, :] = src[None]
                continue
            for a, b in runs:
                buf[a:b, :, :n, :] = src[None]

    def view(self, slot: int, n: int) -> list[tuple[mx.array, mx.array]]:
        """Lazy slices of one slot's first ``n`` positions, per layer ``[1, H, n, D]``."""
        return [(k[slot : slot + 1, :, :n, :], v[slot : slot + 1, :, :n, :]) for k, v in zip(self.keys, self.values)]

    # -- blocks --------------------------------------------------------------------------------
    def _block_index(self, blocks: Sequence[tuple[int, int]], block_size: int) -> tuple[mx.array, mx.array, mx.array]:
        """Index arrays (slots ``[n,1,1]``, heads ``[1,H,1]``, positions ``[n,1,B]``) of blocks given as (slot, first
        position): ``buf[slots, heads, pos]`` is ``[n, H, B, D]``."""
        rows = mx.array([s for s, _ in blocks], dtype=mx.int32)[:, None, None]
        starts = mx.array([p for _, p in blocks], dtype=mx.int32)
        pos = (starts[:, None] + mx.arange(block_size, dtype=mx.int32)[None, :])[:, None, :]
        heads = mx.arange(self.keys[0].shape[1], dtype=mx.int32)[None, :, None]
        return rows, heads, pos

    def write_blocks(self, targets: Sequence[tuple[int, int]], keys: Sequence[mx.array], values: Sequence[mx.array],
                     block_size: int) -> None:
        """Block ``b`` (``keys[layer][b]``, ``[H, block_size, D]``) into slot ``targets[b][0]`` at positions
        ``targets[b][1] .. + block_size``: one scatter per buffer."""
        self.traffic.moved_bytes += len(targets) * block_size * self.position_bytes
        rows, heads, pos = self._block_index(targets, block_size)
        for i in range(self.num_layers):
            self.keys[i][rows, heads, pos] = keys[i]
            self.values[i][rows, heads, pos] = values[i]

    def read_blocks(self, sources: Sequence[tuple[int, int]], block_size: int) -> tuple[list[mx.array], list[mx.array]]:
        """Blocks of slots, lazily, per layer ``[n, H, block_size, D]``: one gather per buffer (the inverse of
        ``write_blocks``)."""
        rows, heads, pos = self._block_index(sources, block_size)
        return [k[rows, heads, pos] for k in self.keys], [v[rows, heads, pos] for v in self.values]
