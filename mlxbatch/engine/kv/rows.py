"""The slot batch's rows: their order, slots and committed lengths, and how they move.

Owns the books of the running batch (``SlotRows``): each sequence's row in the batch's order (decoding rows first,
``[0, n_decode)``, prefilling rows after them), its slot in the buffers and its committed length, and every operation
that changes them: admitting, promoting, arranging and retiring rows, and copying prefixes from row to row. The KV
copies these need are the buffers' (``kv.buffers``).
- **Rows move** (the CPU, and GPU paths without the engine's kernels): row ``i`` is slot ``i``, so promoting,
  arranging or retiring one sequence moves at most two rows' KV; with batched moves (a GPU) all the rows a call
  moves go at once, in one gather, one sync and one scatter per buffer; on the CPU row by row (slice copies).
- **Rows stay** (``LayoutOptions.rows_stay``: CUDA, whose passes read and write each row's own slot): the same calls
  change the books only (the order and each row's slot). A retired row's slot goes to the next admitted one (the
  lowest free first), and only a shrink moves the rows held past its smaller capacity (``compact``).
A running row's prefix is copied into a new row's slot by a gather and a scatter (``copy_prefixes``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import mlx.core as mx

from mlxbatch.engine.kv import LayoutOptions
from mlxbatch.engine.kv.buffers import SlotBuffers

# on a GPU, new rows that share a prefix are written by broadcast from this many (``SlotRows.broadcast_rows``)
BROADCAST_ROWS = 8


def _fill(kept: Sequence[int], lo: int, hi: int) -> list[tuple[int, int]]:
    """Moves (from, to) that bring the rows ``kept`` (sorted) into ``[lo, hi)`` (as many places as rows): those
    already inside stay, those past ``hi`` fill the places left free, in order."""
    inside = {r for r in kept if lo <= r < hi}
    return list(zip([r for r in kept if r >= hi], [p for p in range(lo, hi) if p not in inside]))


class SlotRows:
    """Rows ``[0, n_decode)`` decode, rows ``[n_decode, n)`` prefill; where rows stay, row ``i``'s KV is in slot
    ``slot_of(ids[i])``, else in slot ``i``."""

    def __init__(self, buffers: SlotBuffers, options: LayoutOptions) -> None:
        self.buffers = buffers
        self.options = options
        self.ids: list[str] = []  # request id per row (read only outside: moves keep ``_row`` in step)
        self._row: dict[str, int] = {}  # request id -> its row
        self.lengths: list[int] = []  # KV positions committed per row (read only outside)
        self._slot: list[int] = []  # where rows stay: each row's slot in the buffers (else row i is slot i)
        self._free_slots: list[int] = []  # where rows stay: slots below ``_span`` no row holds (a heap)
        self._span = 0  # where rows stay: slots handed out (the highest used + 1, or more)
        self.n_decode = 0

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._row

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

    def ensure(self, rows: int, positions: int) -> None:
        """Buffers for rows ``0 .. rows`` (and every slot handed out) of ``positions`` positions. The decode kernel
        probes the layout of a capacity it has not seen (once; the buffers' growth evaluated them: nothing in flight)."""
        self.buffers.ensure(max(rows, self._span), positions)
        if self.options.attention.decode is not None:
            self.options.attention.decode.probe(self.buffers.pos_cap)

    def _reindex(self) -> None:
        self._row = {rid: i for i, rid in enumerate(self.ids)}

    # -- admitting and committing ---------------------------------------------------------------
    def add(self, request_id: str, kv: Sequence[tuple[mx.array, mx.array]] = (), length: int = 0) -> None:
        """Admit a sequence as a prefilling row (the last in the order), optionally starting from ``length`` positions
        of ``kv``. Where rows stay, it takes the lowest free slot."""
        assert request_id not in self._row and self.buffers.keys, "allocate() first; ids are unique"
        slot = len(self.ids)
        if self.options.rows_stay:
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
            else:
                slot, self._span = self._span, self._span + 1
            self._slot.append(slot)
        self.ensure(slot + 1, length + 1)
        self.buffers.write_row(slot, kv, length)
        self._row[request_id] = len(self.ids)
        self.ids.append(request_id)
        self.lengths.append(length)

    def committed(self, request_id: str) -> int:
        return self.lengths[self.row_of(request_id)]

    def advance(self, request_id: str, count: int) -> None:
        """Commit ``count`` new positions of one row (after the step that wrote them succeeded)."""
        self.lengths[self.row_of(request_id)] += count

    def advance_decodes(self) -> None:
        """Commit one new position of every decode row (the first ``n_decode`` rows)."""
        n = self.n_decode
        self.lengths[:n] = [length + 1 for length in self.lengths[:n]]

    # -- moves -----------------------------------------------------------------------------------
    def _copy_row(self, src: int, dst: int) -> None:
        if src == dst:
            return
        n = self.lengths[src]
        if n:
            self.buffers.put_row(dst, n, self.buffers.row_copies(src, n))
        self.ids[dst], self.lengths[dst] = self.ids[src], self.lengths[src]
        self._row[self.ids[dst]] = dst

    def _swap(self, a: int, b: int) -> None:
        if a == b:
            return
        if self.options.rows_stay:
            self._move_rows([(a, b), (b, a)])
            return
        na, nb = self.lengths[a], self.lengths[b]  # a row without KV (just admitted) moves by its books alone
        ra = self.buffers.row_copies(a, na) if na else None
        rb = self.buffers.row_copies(b, nb) if nb else None
        if rb is not None:
            self.buffers.put_row(a, nb, rb)
        if ra is not None:
            self.buffers.put_row(b, na, ra)
        self.ids[a], self.ids[b] = self.ids[b], self.ids[a]
        self._row[self.ids[a]], self._row[self.ids[b]] = a, b
        self.lengths[a], self.lengths[b] = self.lengths[b], self.lengths[a]

    def promote(self, request_id: str) -> None:
        """A prefilling row finished its prefill: it joins the decode region."""
        row = self.row_of(request_id)
        assert row >= self.n_decode
        self._swap(row, self.n_decode)
        self.n_decode += 1

    def promote_many(self, request_ids: Sequence[str]) -> None:
        """Prefilling rows that finished their prefill join the decode region, in this order (their row order).

        With batched moves all of them move at once: one gather, one sync and one scatter per buffer (a swap per
        row costs two syncs each, which is a GPU pipeline drain apiece: ~16 a step when 8 rows a step finish).
        """
        if not self.options.batched_moves and not self.options.rows_stay:
            for rid in request_ids:
                self.promote(rid)
            return
        rows = [self.row_of(rid) for rid in request_ids]
        assert all(r >= self.n_decode for r in rows) and len(set(rows)) == len(rows)
        targets = list(range(self.n_decode, self.n_decode + len(rows)))
        moving, target_set = set(rows), set(targets)
        # the rows now at the targets that are not promoted take the places the promoted rows leave
        displaced = [t for t in targets if t not in moving]
        vacated = [r for r in rows if r not in target_set]
        self._move_rows([(r, t) for r, t in zip(rows, targets) if r != t] + list(zip(displaced, vacated)))
        self.n_decode += len(rows)

    def arrange(self, request_ids: Sequence[str]) -> None:
        """Make these prefilling rows contiguous, in this order, right after the decode region.

        One permutation of the prefill region: every moved row is copied out in one sync, then written back at its
        place with one scatter per buffer (a swap per row would cost a device sync each: ~200 a step on a GPU).
        """
        assert all(self.row_of(rid) >= self.n_decode for rid in request_ids)
        if not self.options.batched_moves and not self.options.rows_stay:
            for j, rid in enumerate(request_ids):
                self._swap(self.row_of(rid), self.n_decode + j)
            return
        first = set(request_ids)
        order = list(request_ids) + [rid for rid in self.ids[self.n_decode :] if rid not in first]
        src = [self.row_of(rid) for rid in order]
        dst = list(range(self.n_decode, self.n_decode + len(order)))
        self._move_rows([(s, d) for s, d in zip(src, dst) if s != d])

    def arrange_decode(self, order: Sequence[str]) -> None:
        """Put the decode rows in this order (a permutation of them); rows already in place do not move."""
        assert sorted(order) == sorted(self.ids[: self.n_decode])
        if not self.options.batched_moves:
            for j, rid in enumerate(order):
                self._swap(self.row_of(rid), j)
            return
        self._move_rows([(s, d) for d, s in enumerate(self.row_of(rid) for rid in order) if s != d])

    def _move_rows(self, moves: Sequence[tuple[int, int]]) -> None:
        """Rows ``src -> dst`` at once (a permutation of the rows involved), KV and books; a row without KV (just
        admitted, its prefix not copied in yet) moves by its books alone, and so does every row where rows stay."""
        if not moves:
            return
        ids, lengths, slots = list(self.ids), list(self.lengths), list(self._slot)
        for s, d in moves:
            self.ids[d], self.lengths[d] = ids[s], lengths[s]
            self._row[ids[s]] = d
            if self.options.rows_stay:
                self._slot[d] = slots[s]
        if self.options.rows_stay:
            return
        held = [(s, d) for s, d in moves if lengths[s]]
        if not held:
            return
        if not self.options.batched_moves:  # the CPU: row by row, in order (``remove_many``'s moves read no row
            for s, d in held:  # written before)
                self.buffers.put_row(d, lengths[s], self.buffers.row_copies(s, lengths[s]))
            return
        n = max(lengths[s] for s, _ in held)
        self.buffers.copy_rows([s for s, _ in held], [d for _, d in held], n)
        self.buffers.traffic.row_moved_bytes += len(held) * n * self.buffers.position_bytes

    # -- prefix copies ---------------------------------------------------------------------------
    @property
    def broadcast_rows(self) -> int:
        """New rows that must share a prefix for it to be read once and written into them all at once
        (``write_prefix``). On a GPU a broadcast write costs a kernel per buffer for each prefix, where the rows of
        prefixes shared by fewer go together in one gather and one scatter per buffer (chat's admissions: each row
        its own conversation; a write per prefix made its prefill 2x slower on the H200). On the CPU every copy is a
        slice write anyway."""
        return BROADCAST_ROWS if self.options.batched_moves else 1

    def copy_prefixes(self, copies: Sequence[tuple[str, str, int]]) -> None:
        """(destination, source, n): each destination row (admitted, empty) gets the source row's first ``n``
        positions (its length becomes ``n``). A prefix that ``broadcast_rows`` or more of them share is read once and
        written into all of them at once (``write_prefix``); the others go in one gather and one scatter per buffer,
        each row at the longest of them. One sync for all."""
        if not copies:
            return
        groups: dict[tuple[str, int], list[str]] = {}
        for d, s, k in copies:
            assert k <= self.lengths[self.row_of(s)], "only committed positions can be copied"
            if k:
                groups.setdefault((s, k), []).append(d)
        if groups:
            self.ensure(len(self.ids), max(k for _, k in groups) + 1)
            wide = {key: dsts for key, dsts in groups.items() if len(dsts) >= self.broadcast_rows}
            rest = [(d, s, k) for (s, k), dsts in groups.items() if (s, k) not in wide for d in dsts]
            reads = [self.buffers.read_prefix(self.slot_of(s), k) for s, k in wide]
            n = max((k for _, _, k in rest), default=0)
            gathered = self.buffers.gather([self.slot_of(s) for _, s, _ in rest], n) if rest else []
            self.buffers.traffic.evaluate(reads, gathered)  # nothing lazy may reference the buffers while written
            for dsts, kv in zip(wide.values(), reads):
                self.write_prefix(dsts, kv)
            if rest:
                self.buffers.put_rows([self.slot_of(d) for d, _, _ in rest], n, gathered)
        for d, _, k in copies:
            self.lengths[self.row_of(d)] = k

    def write_prefix(self, request_ids: Sequence[str], kv: Sequence[mx.array]) -> None:
        """One prefix into rows (``SlotBuffers.write_prefix``: a broadcast slice write per run of neighbouring rows;
        the runner keeps a step's rows that share a prefix neighbours in each pass). Lengths are the caller's."""
        slots = sorted(self.slot_of(rid) for rid in request_ids)
        self.ensure(len(self.ids), kv[0].shape[1] + 1)
        self.buffers.write_prefix(slots, kv, self.options.batched_moves)

    # -- retiring ---------------------------------------------------------------------------------
    def remove_many(self, request_ids: Sequence[str]) -> None:
        """Retire rows. Each region's holes are filled by its own rows from past its new end, so only those move:
        with batched moves in one gather + scatter, on the CPU row by row."""
        gone = {rid for rid in request_ids if rid in self._row}
        if not gone:
            return
        if self.options.rows_stay:  # the others keep their order and slots; the retired rows' slots are free
            keep = [i for i, rid in enumerate(self.ids) if rid not in gone]
            for i, rid in enumerate(self.ids):
                if rid in gone:
                    heapq.heappush(self._free_slots, self._slot[i])
            self.n_decode = sum(1 for i in keep if i < self.n_decode)
            self.ids[:] = [self.ids[i] for i in keep]
            self.lengths[:] = [self.lengths[i] for i in keep]
            self._slot[:] = [self._slot[i] for i in keep]
            self._reindex()
            return
        keep_dec = [i for i in range(self.n_decode) if self.ids[i] not in gone]
        keep_pre = [i for i in range(self.n_decode, len(self.ids)) if self.ids[i] not in gone]
        nd, end = len(keep_dec), len(keep_dec) + len(keep_pre)
        moves = _fill(keep_dec, 0, nd)  # decode rows past the region's new end fill its holes
        moves += _fill(keep_pre, nd, end)  # so do the prefill rows (their order is the next step's ``arrange``'s)
        self._move_rows(moves)
        del self.ids[end:]
        del self.lengths[end:]
        self._reindex()
        self.n_decode = nd

    def remove(self, request_id: str) -> None:
        """Retire a row; the region's last row fills the hole (at most two rows copied; none where rows stay)."""
        if self.options.rows_stay:
            self.remove_many([request_id])
            return
        row = self._row.pop(request_id)
        if row < self.n_decode:
            last_dec = self.n_decode - 1
            self._copy_row(last_dec, row)
            self.n_decode -= 1
            row = last_dec
        last = len(self.ids) - 1
        if row != last:
            self._copy_row(last, row)
        self.ids.pop()  # the last row (its id, if it moved, now also stands in the hole)
        self.lengths.pop()

    def compact(self, rows: int) -> None:
        """Where rows stay: rows held in slots ``rows ..`` move to free slots below it (before the buffers shrink to
        ``rows``)."""
        used = set(self._slot)
        high = [i for i, s in enumerate(self._slot) if s >= rows]
        low = [s for s in range(rows) if s not in used][: len(high)]
        if high:
            n = max(self.lengths[i] for i in high)
            if n:
                self.buffers.copy_rows([self._slot[i] for i in high], low, n)
                self.buffers.traffic.row_moved_bytes += len(high) * n * self.buffers.position_bytes
            for i, s in zip(high, low):
                self._slot[i] = s
        used = set(self._slot)
        self._span = max(used, default=-1) + 1
        self._free_slots = [s for s in range(self._span) if s not in used]  # sorted: a heap

    def check_integrity(self) -> None:
        """Assert the books agree (tests call it after every operation)."""
        assert self._row == {rid: i for i, rid in enumerate(self.ids)}, "row index out of step with the rows"
        assert len(self.lengths) == len(self.ids) and 0 <= self.n_decode <= len(self.ids)
        assert all(0 <= n <= self.buffers.pos_cap for n in self.lengths) and len(self.ids) <= self.buffers.rows_cap
        if self.options.rows_stay:
            assert len(self._slot) == len(self.ids) and len(set(self._slot)) == len(self._slot), "slots held twice"
            assert sorted(self._slot + self._free_slots) == list(range(self._span)), "slots lost or made up"
            assert self._span <= self.buffers.rows_cap
