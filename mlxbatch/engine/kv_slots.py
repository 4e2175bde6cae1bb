"""The running batch's KV: fixed slots, one row per sequence, each with its own length.

Owns the decode-time KV buffers. Row ``i`` of every layer holds one sequence's keys and values at
positions ``0..length-1``; a decode step writes each row's new token at that row's own position and masks
the rest. Admitting a sequence copies only its KV into a free row; retiring one moves the last row into
the hole. No operation copies the whole batch except growth of the buffers (amortised, by doubling rows
or by 256 positions), unlike a left-padded dense cache that is rebuilt at every admission and finish.
The layer caches implement mlx-lm's cache protocol (``offset``, ``update_and_fetch``, ``make_mask``), so
mlx-lm's model definitions run on them unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

POSITION_STEP = 256


def _round_up(n: int, step: int) -> int:
    return ((n + step - 1) // step) * step


class SlotLayerCache:
    """One layer's view of the slot buffers during a decode step (mlx-lm cache protocol)."""

    def __init__(self, owner: SlotBatch, layer: int) -> None:
        self._owner = owner
        self._layer = layer

    @property
    def offset(self) -> mx.array:  # per-row positions of the token being written (RoPE offsets)
        return self._owner._offsets

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        assert N == 1 and window_size is None, "slot caches serve single-token decode steps"
        return self._owner._mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._owner._write(self._layer, keys, values)

    @property
    def state(self) -> Any:
        return self._owner._keys[self._layer], self._owner._values[self._layer]


class SlotBatch:
    """Decode KV for up to ``capacity`` sequences; rows are kept compact (0..n-1)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.ids: list[str] = []  # request id per row
        self.lengths: list[int] = []  # KV positions filled per row
        self._keys: list[mx.array] = []
        self._values: list[mx.array] = []
        self._rows_cap = 0
        self._pos_cap = 0
        self._offsets = mx.array([0])
        self._mask = mx.array([True])
        self._t_used = 0
        self._rows_idx = mx.array([0])
        self._write_pos = mx.array([0])
        self.layers = [SlotLayerCache(self, i) for i in range(num_layers)]

    def __len__(self) -> int:
        return len(self.ids)

    @staticmethod
    def cost_positions(lengths: Sequence[int]) -> int:
        """KV positions held for sequences of these (reserved) lengths: rows x padded longest."""
        if not lengths:
            return 0
        return len(lengths) * _round_up(max(lengths), POSITION_STEP)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self._keys, self._values))

    # -- capacity ------------------------------------------------------------------------------
    def _ensure(self, rows: int, positions: int, like: Sequence[tuple[mx.array, mx.array]]) -> None:
        if not self._keys:
            k0, v0 = like[0]
            self._rows_cap = max(4, rows)
            self._pos_cap = _round_up(max(positions, 1), POSITION_STEP)
            for k, v in like:
                H, Dk, Dv = k.shape[1], k.shape[3], v.shape[3]
                self._keys.append(mx.zeros((self._rows_cap, H, self._pos_cap, Dk), k.dtype))
                self._values.append(mx.zeros((self._rows_cap, H, self._pos_cap, Dv), v.dtype))
            return
        new_rows = self._rows_cap if rows <= self._rows_cap else max(rows, 2 * self._rows_cap)
        new_pos = self._pos_cap if positions <= self._pos_cap else _round_up(positions, POSITION_STEP)
        if (new_rows, new_pos) == (self._rows_cap, self._pos_cap):
            return
        for i in range(self.num_layers):
            for bufs in (self._keys, self._values):
                old = bufs[i]
                R, H, P, D = old.shape
                grown = mx.zeros((new_rows, H, new_pos, D), old.dtype)
                grown[:R, :, :P, :] = old
                bufs[i] = grown
        self._rows_cap, self._pos_cap = new_rows, new_pos
        mx.eval(self._keys, self._values)

    def shrink(self) -> None:
        """Give back rows and positions no longer needed (after many sequences finished)."""
        if not self._keys:
            return
        need_rows = max(4, len(self.ids))
        need_pos = _round_up(max(self.lengths, default=0) + 1, POSITION_STEP)
        if need_rows * 4 > self._rows_cap and need_pos * 2 > self._pos_cap:
            return
        rows, pos = min(self._rows_cap, 2 * need_rows), min(self._pos_cap, need_pos)
        self._keys = [k[:rows, :, :pos, :] for k in self._keys]
        self._values = [v[:rows, :, :pos, :] for v in self._values]
        mx.eval(self._keys, self._values)
        self._keys = [mx.array(k) for k in self._keys]
        self._values = [mx.array(v) for v in self._values]
        self._rows_cap, self._pos_cap = rows, pos

    # -- rows ----------------------------------------------------------------------------------
    def add(self, request_id: str, kv: Sequence[tuple[mx.array, mx.array]], length: int) -> None:
        """Copy one sequence's KV (per layer ``[1, H, >=length, D]``) into the next free row."""
        assert request_id not in self.ids and len(kv) == self.num_layers
        row = len(self.ids)
        self._ensure(row + 1, length + 1, kv)
        for i, (k, v) in enumerate(kv):
            self._keys[i][row, :, :length, :] = k[0, :, :length, :]
            self._values[i][row, :, :length, :] = v[0, :, :length, :]
        self.ids.append(request_id)
        self.lengths.append(length)

    def remove(self, request_id: str) -> None:
        """Retire a row: the last row moves into its place (one row copied, not the batch)."""
        row = self.ids.index(request_id)
        last = len(self.ids) - 1
        if row != last:
            n = self.lengths[last]
            for bufs in (self._keys, self._values):
                for i in range(self.num_layers):
                    bufs[i][row, :, :n, :] = bufs[i][last, :, :n, :]
            self.ids[row], self.lengths[row] = self.ids[last], self.lengths[last]
        self.ids.pop()
        self.lengths.pop()

    def extract(self, request_id: str) -> list[tuple[mx.array, mx.array]]:
        """A copy of one row's KV (per layer ``[1, H, length, D]``)."""
        row = self.ids.index(request_id)
        n = self.lengths[row]
        return [(k[row : row + 1, :, :n, :], v[row : row + 1, :, :n, :]) for k, v in zip(self._keys, self._values)]

    # -- decode step ---------------------------------------------------------------------------
    def prepare(self, request_ids: Sequence[str]) -> None:
        """Set offsets and masks for a decode step over rows in ``request_ids`` order (all rows)."""
        assert list(request_ids) == self.ids, "decode runs every row, in row order"
        n = len(self.ids)
        self._ensure(n, max(self.lengths) + 1, [])
        self._t_used = max(self.lengths) + 1
        self._offsets = mx.array(self.lengths, dtype=mx.int32)
        self._mask = (mx.arange(self._t_used)[None, :] <= self._offsets[:, None])[:, None, None, :]
        self._rows_idx = mx.arange(n)[:, None]
        self._write_pos = self._offsets[:, None]

    def _write(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n, H = keys.shape[0], keys.shape[1]
        heads = mx.arange(H)[None, :]
        k_buf, v_buf = self._keys[layer], self._values[layer]
        k_buf[self._rows_idx, heads, self._write_pos] = keys[:, :, 0, :]
        v_buf[self._rows_idx, heads, self._write_pos] = values[:, :, 0, :]
        t = self._t_used
        return k_buf[:n, :, :t, :], v_buf[:n, :, :t, :]

    def advance(self, rows: int) -> None:
        """Commit a decode step for the first ``rows`` rows (rows added since were not decoded)."""
        self.lengths[:rows] = [n + 1 for n in self.lengths[:rows]]
