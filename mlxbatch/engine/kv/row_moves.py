"""Row moves of the slot batch: promoting, arranging and retiring rows, and copying prefixes from row to row.

Owns how rows change places in the batch's order (``kv.slots``) and keep their books in step. Where a row's place is
its slot, promoting, arranging or retiring one sequence moves at most two rows' KV; with batched moves (a GPU) all the
rows a call moves go at once, in one gather, one sync and one scatter per buffer; on the CPU row by row (slice copies).
Where rows stay in their slots (``rows_stay``, CUDA), the same calls change the books only (the order and each row's
slot). A running row's prefix is copied into a new row's slot by a gather and a scatter (``copy_prefixes``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import mlx.core as mx

# on a GPU, new rows that share a prefix are written by broadcast from this many (``RowMoves.broadcast_rows``)
BROADCAST_ROWS = 8
# a shared prefix goes into at most this many runs of neighbouring rows by slice writes (a kernel per buffer each),
# into rows more scattered than that by one scatter per buffer (``RowMoves.write_prefix``)
MAX_RUNS = 8


def _fill(kept: Sequence[int], lo: int, hi: int) -> list[tuple[int, int]]:
    """Moves (from, to) that bring the rows ``kept`` (sorted) into ``[lo, hi)`` (as many places as rows): those
    already inside stay, those past ``hi`` fill the places left free, in order."""
    inside = {r for r in kept if lo <= r < hi}
    return list(zip([r for r in kept if r >= hi], [p for p in range(lo, hi) if p not in inside]))


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted distinct rows as ``[a, b)`` runs of neighbours."""
    out: list[tuple[int, int]] = []
    for r in rows:
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


class RowMoves:
    """A base of ``SlotBatch``: moves its rows in its buffers (``_keys``, ``_values``) and books (``ids``,
    ``lengths``, ``n_decode``, ``_row``; where ``rows_stay``, ``_slot`` and ``_free_slots``), counted in its
    ``traffic``; calls its ``row_of``, ``slot_of``, ``_reindex`` and ``_ensure``."""

    def _row_copies(self, row: int, n: int) -> list[mx.array]:
        """Evaluated copies of one row's first ``n`` positions, every layer's keys then values, in one sync.

        A lazy slice would keep the buffer referenced, and the update that follows would then copy the whole
        buffer instead of writing in place (measured on CPU: 67 ms vs 0.1 ms); one eval for all layers keeps
        a row move to a single device sync (on a GPU, one per layer cost ~10 ms a move).
        """
        out = [mx.contiguous(buf[row, :, :n, :]) for buf in (*self._keys, *self._values)]
        self.traffic.evaluate(out)
        return out

    def _put_row(self, row: int, n: int, copies: list[mx.array]) -> None:
        """A row move's write (the CPU path): one row's positions ``0..n-1`` from ``copies``."""
        self.traffic.moved_bytes += n * self._pos_bytes
        self.traffic.row_moved_bytes += n * self._pos_bytes
        for buf, arr in zip((*self._keys, *self._values), copies):
            buf[row, :, :n, :] = arr

    def _copy_row(self, src: int, dst: int) -> None:
        if src == dst:
            return
        n = self.lengths[src]
        if n:
            self._put_row(dst, n, self._row_copies(src, n))
        self.ids[dst], self.lengths[dst] = self.ids[src], self.lengths[src]
        self._row[self.ids[dst]] = dst

    def _swap(self, a: int, b: int) -> None:
        if a == b:
            return
        if self.options.rows_stay:
            self._move_rows([(a, b), (b, a)])
            return
        na, nb = self.lengths[a], self.lengths[b]  # a row without KV (just admitted) moves by its books alone
        ra = self._row_copies(a, na) if na else None
        rb = self._row_copies(b, nb) if nb else None
        if rb is not None:
            self._put_row(a, nb, rb)
        if ra is not None:
            self._put_row(b, na, ra)
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
        if not self.options.batched_moves:  # the CPU: row by row, in order (``remove_many``'s moves read no row written before)
            for s, d in held:
                self._put_row(d, lengths[s], self._row_copies(s, lengths[s]))
            return
        n = max(lengths[s] for s, _ in held)
        self._copy_rows([s for s, _ in held], [d for _, d in held], n)
        self.traffic.row_moved_bytes += len(held) * n * self._pos_bytes

    def _copy_rows(self, src: Sequence[int], dst: Sequence[int], n: int) -> None:
        """Positions ``0..n-1`` of rows ``src`` into rows ``dst``, all rows at once: one gather per buffer, one
        sync, one scatter per buffer."""
        take = mx.array(src, dtype=mx.int32)
        copies = [mx.take(buf[:, :, :n, :], take, axis=0) for buf in (*self._keys, *self._values)]
        self.traffic.evaluate(copies)  # nothing lazy may reference the buffers while they are written in place
        self._put_rows(dst, n, copies)

    def _put_rows(self, dst: Sequence[int], n: int, copies: list[mx.array]) -> None:
        """Rows ``dst``'s positions ``0..n-1`` from ``copies`` (every layer's keys then values, ``[rows, H, n, D]``,
        evaluated): one scatter per buffer."""
        put = mx.array(dst, dtype=mx.int32)
        self.traffic.moved_bytes += len(dst) * n * self._pos_bytes
        for i, c in enumerate(copies):
            target = self._keys if i < self.num_layers else self._values
            target[i % self.num_layers][put, :, :n, :] = c

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
            self._ensure(len(self.ids), max(k for _, k in groups) + 1)
            wide = {key: dsts for key, dsts in groups.items() if len(dsts) >= self.broadcast_rows}
            rest = [(d, s, k) for (s, k), dsts in groups.items() if (s, k) not in wide for d in dsts]
            reads = [[mx.contiguous(buf[self.slot_of(s), :, :k, :]) for buf in (*self._keys, *self._values)]
                     for s, k in wide]
            n = max((k for _, _, k in rest), default=0)
            take = mx.array([self.slot_of(s) for _, s, _ in rest], dtype=mx.int32)
            gathered = [mx.take(buf[:, :, :n, :], take, axis=0) for buf in (*self._keys, *self._values)] if rest else []
            self.traffic.evaluate(reads, gathered)  # nothing lazy may reference the buffers while they are written
            for dsts, kv in zip(wide.values(), reads):
                self.write_prefix(dsts, kv)
            if rest:
                self._put_rows([self.slot_of(d) for d, _, _ in rest], n, gathered)
        for d, _, k in copies:
            self.lengths[self.row_of(d)] = k

    def write_prefix(self, request_ids: Sequence[str], kv: Sequence[mx.array]) -> None:
        """One prefix into rows: ``kv`` holds every layer's keys then values, each ``[H, n, D]`` (evaluated, or lazy
        reads of anything but these buffers), for positions ``0 .. n``. A broadcast slice write per buffer for each
        run of neighbouring rows (the runner keeps a step's rows that share a prefix neighbours in each pass); rows
        in more than ``MAX_RUNS`` runs take one scatter per buffer instead on a GPU (a CPU's scatter goes element by
        element: slices always). Lengths are the caller's."""
        rows = sorted(self.slot_of(rid) for rid in request_ids)
        n = kv[0].shape[1]
        self._ensure(len(self.ids), n + 1)
        self.traffic.moved_bytes += len(rows) * n * self._pos_bytes
        runs = _runs(rows)
        put = mx.array(rows, dtype=mx.int32) if self.options.batched_moves and len(runs) > MAX_RUNS else None
        for i, src in enumerate(kv):
            buf = (self._keys if i < self.num_layers else self._values)[i % self.num_layers]
            if put is not None:
                buf[put, :, :n, :] = src[None]
                continue
            for a, b in runs:
                buf[a:b, :, :n, :] = src[None]

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
