"""The running batch's KV: fixed slots, one row per sequence, each with its own length.

Owns the KV buffers of every admitted sequence. A slot of every layer holds one sequence's keys and values at
positions ``0..length-1``. A forward pass runs over a range of rows with ``T`` new tokens per row (``T`` = 1 for
decode, a chunk for prefill, right-padded): each row writes at its own offset and a causal mask per row hides the rest
(``kv.slot_forward``); on CUDA a step's prefill rows run as one packed pass instead (``forward_packed``, ``kv.packed``:
their tokens end to end). The passes are its base ``SlotPasses`` (``kv.slot_passes``), the row moves its base
``RowMoves`` (``kv.row_moves``). Decoding rows come first in the batch's order, prefilling rows after them.
- **Rows move** (the CPU): row ``i`` is slot ``i``, so both kinds of step read a contiguous slice of the buffers, and
  admitting, promoting or retiring a sequence moves at most two rows' KV (``kv.row_moves``).
- **Rows stay** (``rows_stay``: CUDA, whose passes read and write each row's own slot through the engine's kernels):
  the order is a book entry. A row's KV never moves from the slot it was admitted to, a retired row's slot goes to
  the next admitted one (the lowest free first), and only a shrink moves the rows held past its smaller capacity.
Nothing copies the whole batch except buffer growth (amortised: rows double, positions grow by 256), unlike a
left-padded dense cache that is rebuilt at every admission and finish.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import mlx.core as mx

from mlxbatch.engine.attention import DecodeAttention
from mlxbatch.engine.kv import LayoutOptions, copies
from mlxbatch.engine.kv.compiled_decode import CompiledDecode
from mlxbatch.engine.kv.packed import PackedPass, round_up
from mlxbatch.engine.kv.row_moves import RowMoves
from mlxbatch.engine.kv.slot_forward import ForwardPass, SlotLayerCache
from mlxbatch.engine.kv.slot_passes import POSITION_STEP, SlotPasses
from mlxbatch.engine.outputs import Traffic

SHRINK_CALLS = 32  # ``SlotBatch.shrink_if_settled``: calls in a row with oversized buffers before they shrink


def row_capacity(rows: int) -> int:
    """Rows the buffers hold once ``rows`` sequences were added one by one: 4, then doubling."""
    cap = 4
    while cap < rows:
        cap *= 2
    return cap


class SlotBatch(RowMoves, SlotPasses):
    """KV for every admitted sequence; rows ``[0, n_decode)`` decode, rows ``[n_decode, n)`` prefill (rows of the
    batch's order: where ``rows_stay``, row ``i``'s KV is in slot ``slot_of(ids[i])``, else in slot ``i``)."""

    def __init__(self, num_layers: int, traffic: Traffic | None = None,
                 options: LayoutOptions | None = None) -> None:
        self.num_layers = num_layers
        self.options = options or LayoutOptions()  # (default: the plain path, rows by slice copies)
        self.traffic = traffic if traffic is not None else Traffic()  # bytes copied and syncs, for the step profile
        self._pos_bytes = 0  # bytes of one position of one row, keys and values of every layer
        self.ids: list[str] = []  # request id per row (read only outside: moves keep ``_row`` in step)
        self._row: dict[str, int] = {}  # request id -> its row
        self.lengths: list[int] = []  # KV positions filled per row
        self._slot: list[int] = []  # where ``rows_stay``: each row's slot in the buffers (else row i is slot i)
        self._free_slots: list[int] = []  # where ``rows_stay``: slots below ``_span`` no row holds (a heap)
        self._span = 0  # where ``rows_stay``: slots handed out (the highest used + 1, or more)
        self.n_decode = 0
        self._keys: list[mx.array] = []
        self._values: list[mx.array] = []
        self._rows_cap = 0
        self._pos_cap = 0
        self._oversized_calls = 0  # ``shrink_if_settled``'s count
        self._pass: ForwardPass | PackedPass | None = None  # the forward pass in progress
        self.layers = [SlotLayerCache(self, i) for i in range(num_layers)]
        # decode passes replayed from compiled graphs (its traces and counts: this layout's own)
        self.compiled_decode = CompiledDecode() if self.options.compiled_decode else None
        self._decode_key: tuple[int, ...] | int | None = None  # ``_decode_slots``' last rows, and their array
        self._decode_rows: mx.array | None = None
        # the last compiled decode pass's offsets + 1: as host ints, and the device array (``_compiled_decode``)
        self._next_offsets: tuple[list[int], mx.array] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._row

    @property
    def decode_attention(self) -> DecodeAttention | None:
        """The fused decode kernel the layer caches attend with, where the device runs it."""
        return self.options.attention.decode

    def row_of(self, request_id: str) -> int:
        """The sequence's row in the batch's order."""
        return self._row[request_id]

    def slot_of(self, request_id: str) -> int:
        """The sequence's slot in the buffers."""
        row = self._row[request_id]
        return self._slot[row] if self.options.rows_stay else row

    def slots(self, start: int, stop: int) -> list[int] | None:
        """The slots of rows ``[start, stop)`` where rows stay, else None (they are slots ``start ..``)."""
        return self._slot[start:stop] if self.options.rows_stay else None

    def _reindex(self) -> None:
        self._row = {rid: i for i, rid in enumerate(self.ids)}

    @staticmethod
    def cost_positions(lengths: Sequence[int]) -> int:
        """KV positions the buffers hold for sequences of these (reserved) lengths: the row capacity that many rows
        grow the buffers to (rows double) x the longest, padded. What is charged is what is allocated."""
        if not lengths:
            return 0
        return row_capacity(len(lengths)) * round_up(max(lengths), POSITION_STEP)

    def kv_arrays(self) -> list[mx.array]:
        return self._keys + self._values

    @property
    def position_bytes(self) -> int:
        return self._pos_bytes

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self._keys, self._values))

    # -- capacity ------------------------------------------------------------------------------
    def allocate(self, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> None:
        """Create the (empty) buffers; called once, before the first row is added."""
        if self._keys:
            return
        self._rows_cap, self._pos_cap = 4, POSITION_STEP
        shape = (self._rows_cap, kv_heads, self._pos_cap, head_dim)
        self._keys = [mx.zeros(shape, dtype) for _ in range(self.num_layers)]
        self._values = [mx.zeros(shape, dtype) for _ in range(self.num_layers)]
        self._pos_bytes = 2 * self.num_layers * kv_heads * head_dim * dtype.size
        self.traffic.evaluate(self._keys, self._values)  # nothing lazy may outlive the thread (and stream) that made it

    def _ensure(self, rows: int, positions: int) -> None:
        # rows grow to the capacity ``cost_positions`` charges (a power of two), however many join at once: 220 rows
        # admitted together then grow to 256, not to 220 and then 440
        rows = max(rows, self._span)
        new_rows = self._rows_cap if rows <= self._rows_cap else row_capacity(rows)
        new_pos = self._pos_cap if positions <= self._pos_cap else round_up(positions, POSITION_STEP)
        if (new_rows, new_pos) == (self._rows_cap, self._pos_cap):
            return
        self.traffic.grown_bytes += self.nbytes
        self.traffic.resizes += 1

        def grown(old: mx.array) -> mx.array:
            R, H, P, D = old.shape
            g = mx.zeros((new_rows, H, new_pos, D), old.dtype)
            g[:R, :, :P, :] = old
            return g

        copies.replace_each((self._keys, self._values), grown, self.traffic)
        self._rows_cap, self._pos_cap = new_rows, new_pos

    def _oversized(self) -> tuple[int, int] | None:
        """(rows, positions) needed now, if the buffers hold 4x the rows or 2x the positions of that."""
        need_rows = max(4, len(self.ids))
        need_pos = round_up(max(self.lengths, default=0) + 1, POSITION_STEP)
        if not self._keys or (need_rows * 4 > self._rows_cap and need_pos * 2 > self._pos_cap):
            return None
        return need_rows, need_pos

    def shrink_if_settled(self) -> None:
        """``shrink`` once the buffers have been oversized for ``SHRINK_CALLS`` calls in a row (the runner calls it
        each step that retired rows). A batch that drops to a few rows and fills again the next step (a wave of rows
        finishing together; prefill-only rows, as one-token labels and scoring, leaving every step) shrank and grew
        back: two copies of every buffer a step (271 resizes in the 55 steps of a one-token label run)."""
        self._oversized_calls = self._oversized_calls + 1 if self._oversized() is not None else 0
        if self._oversized_calls >= SHRINK_CALLS:
            self._oversized_calls = 0
            self.shrink()

    def shrink(self) -> None:
        """Give back rows and positions no longer needed (after many sequences finished)."""
        need = self._oversized()
        if need is None:
            return
        need_rows, need_pos = need
        rows, pos = min(self._rows_cap, row_capacity(2 * need_rows)), min(self._pos_cap, need_pos)
        if self.options.rows_stay:
            self._compact(rows)
        copies.replace_each((self._keys, self._values), lambda old: mx.contiguous(old[:rows, :, :pos, :]), self.traffic)
        self.traffic.grown_bytes += self.nbytes
        self.traffic.resizes += 1
        self._rows_cap, self._pos_cap = rows, pos

    def _compact(self, rows: int) -> None:
        """Rows held in slots ``rows ..`` move to free slots below it (before the buffers shrink to ``rows``)."""
        used = set(self._slot)
        high = [i for i, s in enumerate(self._slot) if s >= rows]
        low = [s for s in range(rows) if s not in used][: len(high)]
        if high:
            n = max(self.lengths[i] for i in high)
            if n:
                self._copy_rows([self._slot[i] for i in high], low, n)
                self.traffic.row_moved_bytes += len(high) * n * self._pos_bytes
            for i, s in zip(high, low):
                self._slot[i] = s
        used = set(self._slot)
        self._span = max(used, default=-1) + 1
        self._free_slots = [s for s in range(self._span) if s not in used]  # sorted: a heap

    # -- rows ----------------------------------------------------------------------------------
    def add(self, request_id: str, kv: Sequence[tuple[mx.array, mx.array]] = (), length: int = 0) -> None:
        """Admit a sequence as a prefilling row (the last in the order), optionally starting from ``length`` positions
        of ``kv``. Where rows stay, it takes the lowest free slot."""
        assert request_id not in self._row and self._keys, "allocate() first; ids are unique"
        slot = len(self.ids)
        if self.options.rows_stay:
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
            else:
                slot, self._span = self._span, self._span + 1
            self._slot.append(slot)
        self._ensure(slot + 1, length + 1)
        if kv:
            self.traffic.moved_bytes += length * self._pos_bytes
        for i, (k, v) in enumerate(kv):
            self._keys[i][slot, :, :length, :] = k[0, :, :length, :]
            self._values[i][slot, :, :length, :] = v[0, :, :length, :]
        self._row[request_id] = len(self.ids)
        self.ids.append(request_id)
        self.lengths.append(length)

    def write_blocks(self, targets: Sequence[tuple[str, int]], keys: Sequence[mx.array], values: Sequence[mx.array],
                     block_size: int) -> None:
        """Write cached blocks into rows: block ``b`` (``keys[layer][b]``, ``[H, block_size, D]``) goes to row
        ``targets[b][0]`` at positions ``targets[b][1] .. + block_size``. One scatter per buffer for all rows (the GPU
        path for prefixes that few rows share: ``write_prefix`` writes a shared one into many rows at once)."""
        if not targets:
            return
        self._ensure(len(self.ids), max(p for _, p in targets) + block_size + 1)
        self.traffic.moved_bytes += len(targets) * block_size * self._pos_bytes
        rows, heads, pos = self._block_index(targets, block_size)
        for i in range(self.num_layers):
            self._keys[i][rows, heads, pos] = keys[i]
            self._values[i][rows, heads, pos] = values[i]

    def read_blocks(self, sources: Sequence[tuple[str, int]], block_size: int) -> tuple[list[mx.array], list[mx.array]]:
        """Blocks of rows, lazily, per layer ``[n, H, block_size, D]``: block ``b`` is row ``sources[b][0]``'s positions
        ``sources[b][1] .. + block_size`` (past the row's length: whatever is there). One gather per buffer for all
        rows (the inverse of ``write_blocks``); evaluate before any row is written or moved again."""
        rows, heads, pos = self._block_index(sources, block_size)
        return [k[rows, heads, pos] for k in self._keys], [v[rows, heads, pos] for v in self._values]

    def _block_index(self, blocks: Sequence[tuple[str, int]], block_size: int) -> tuple[mx.array, mx.array, mx.array]:
        """Index arrays (rows ``[n,1,1]``, heads ``[1,H,1]``, positions ``[n,1,B]``) of blocks given as (row id,
        first position): ``buf[rows, heads, pos]`` is ``[n, H, B, D]``."""
        rows = mx.array([self.slot_of(rid) for rid, _ in blocks], dtype=mx.int32)[:, None, None]
        starts = mx.array([p for _, p in blocks], dtype=mx.int32)
        pos = (starts[:, None] + mx.arange(block_size, dtype=mx.int32)[None, :])[:, None, :]
        heads = mx.arange(self._keys[0].shape[1], dtype=mx.int32)[None, :, None]
        return rows, heads, pos

    def extract(self, request_id: str) -> list[tuple[mx.array, mx.array]]:
        """A copy of one row's KV, per layer ``[1, H, length, D]``."""
        n = self.lengths[self.row_of(request_id)]
        copies = self._row_copies(self.slot_of(request_id), n)
        layers = len(self._keys)
        return [(copies[i][None], copies[layers + i][None]) for i in range(layers)]

    def row_view(self, request_id: str) -> list[tuple[mx.array, mx.array]]:
        """Lazy slices of one row's KV, per layer ``[1, H, length, D]``: evaluate them before the next forward
        (a pending slice keeps the buffer referenced, so the forward's in-place write would copy it whole)."""
        n, s = self.lengths[self.row_of(request_id)], self.slot_of(request_id)
        return [(k[s : s + 1, :, :n, :], v[s : s + 1, :, :n, :]) for k, v in zip(self._keys, self._values)]

    def check_integrity(self) -> None:
        """Assert the row books agree (tests call it after every operation)."""
        assert self._row == {rid: i for i, rid in enumerate(self.ids)}, "row index out of step with the rows"
        assert len(self.lengths) == len(self.ids) and 0 <= self.n_decode <= len(self.ids)
        assert all(0 <= n <= self._pos_cap for n in self.lengths) and len(self.ids) <= max(self._rows_cap, 0)
        if self.options.rows_stay:
            assert len(self._slot) == len(self.ids) and len(set(self._slot)) == len(self._slot), "slots held twice"
            assert sorted(self._slot + self._free_slots) == list(range(self._span)), "slots lost or made up"
            assert self._span <= self._rows_cap

    def committed(self, request_id: str) -> int:
        return self.lengths[self.row_of(request_id)]

    def advance(self, request_id: str, count: int) -> None:
        """Commit ``count`` new positions of one row (after the step that wrote them succeeded)."""
        self.lengths[self.row_of(request_id)] += count
