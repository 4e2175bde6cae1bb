"""The running batch's KV: fixed slots, one row per sequence, each with its own length (``SlotBatch``).

The one ``KVLayout`` there is, composed of three parts, each owning its state:
- ``SlotBuffers`` (``kv.buffers``): one keys and one values buffer per layer, ``[slots, kv_heads, positions,
  head_dim]``, their capacity and every copy into or out of them. A slot of every layer holds one sequence's keys
  and values at positions ``0..length-1``;
- ``SlotRows`` (``kv.rows``): the batch's order (decoding rows first, prefilling rows after them), each row's slot and
  committed length, and the moves that admitting, promoting, arranging and retiring rows make (rows move on the CPU;
  where ``rows_stay``, CUDA, the order is a book entry and KV never moves but at a shrink);
- ``SlotPasses`` (``kv.slot_passes``): the forward passes over the rows. A pass runs over a range of rows with ``T``
  new tokens per row (``T`` = 1 for decode, a chunk for prefill, right-padded): each row writes at its own offset and
  a causal mask per row hides the rest (``kv.slot_forward``); on CUDA a step's prefill rows run as one packed pass
  instead (``forward_packed``, ``kv.packed``: their tokens end to end).
This class is their face to the runner and the prefix copies, and owns when capacity is given back
(``shrink_if_settled``). Nothing copies the whole batch except buffer growth (amortised: rows double, positions grow
by 256), unlike a left-padded dense cache that is rebuilt at every admission and finish.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlxbatch.engine.attention import DecodeAttention
from mlxbatch.engine.kv import LayoutOptions
from mlxbatch.engine.kv.buffers import POSITION_STEP, SlotBuffers, row_capacity
from mlxbatch.engine.kv.compiled import CompiledPasses
from mlxbatch.engine.kv.packed import PackedPass, round_up
from mlxbatch.engine.kv.rows import SlotRows
from mlxbatch.engine.kv.slot_forward import ForwardPass, SlotLayerCache
from mlxbatch.engine.kv.slot_passes import SlotPasses
from mlxbatch.engine.outputs import Traffic

__all__ = ["POSITION_STEP", "SHRINK_CALLS", "SlotBatch", "row_capacity"]

SHRINK_CALLS = 32  # ``SlotBatch.shrink_if_settled``: calls in a row with oversized buffers before they shrink


class SlotBatch:
    """KV for every admitted sequence; rows ``[0, n_decode)`` decode, rows ``[n_decode, n)`` prefill."""

    def __init__(self, num_layers: int, traffic: Traffic | None = None,
                 options: LayoutOptions | None = None) -> None:
        self.num_layers = num_layers
        self.options = options or LayoutOptions()  # (default: the plain path, rows by slice copies)
        self.traffic = traffic if traffic is not None else Traffic()  # bytes copied and syncs, for the step profile
        self.buffers = SlotBuffers(num_layers, self.traffic)
        self.rows = SlotRows(self.buffers, self.options)
        self.passes = SlotPasses(self.rows, self.buffers, self.options)
        self._oversized_calls = 0  # ``shrink_if_settled``'s count

    # -- the rows' books (read only) ---------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.rows

    @property
    def ids(self) -> list[str]:  # request id per row, in row order
        return self.rows.ids

    @property
    def lengths(self) -> list[int]:  # committed positions per row
        return self.rows.lengths

    @property
    def n_decode(self) -> int:
        return self.rows.n_decode

    def row_of(self, request_id: str) -> int:
        return self.rows.row_of(request_id)

    def slot_of(self, request_id: str) -> int:
        return self.rows.slot_of(request_id)

    def committed(self, request_id: str) -> int:
        return self.rows.committed(request_id)

    def check_integrity(self) -> None:
        self.rows.check_integrity()

    # -- the buffers ---------------------------------------------------------------------------------
    @staticmethod
    def cost_positions(lengths: Sequence[int]) -> int:
        """KV positions the buffers hold for sequences of these (reserved) lengths (``rows_cost_positions``)."""
        return SlotBatch.rows_cost_positions(len(lengths), max(lengths)) if lengths else 0

    @staticmethod
    def rows_cost_positions(rows: int, longest: int) -> int:
        """KV positions the buffers hold for ``rows`` sequences of at most ``longest`` (reserved) positions: the row
        capacity that many rows grow the buffers to (rows double) x the longest, padded. What is charged is what is
        allocated."""
        return row_capacity(rows) * round_up(longest, POSITION_STEP) if rows else 0

    def kv_arrays(self) -> list[mx.array]:
        return self.buffers.arrays()

    @property
    def position_bytes(self) -> int:
        return self.buffers.position_bytes

    @property
    def nbytes(self) -> int:
        return self.buffers.nbytes

    def allocate(self, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> None:
        """Create the (empty) buffers; called once, before the first row is added."""
        self.buffers.allocate(kv_heads, head_dim, dtype)

    def reset(self) -> None:
        """Drop every row and start again from new, empty buffers (an evaluation that wrote the old ones failed: on
        Metal their contents, written or not, are undefined, and a row's unused positions are read under a mask,
        where a NaN would still poison its attention)."""
        k = self.buffers.keys[0]
        self.buffers = SlotBuffers(self.num_layers, self.traffic)
        self.buffers.allocate(k.shape[1], k.shape[3], k.dtype)
        self.rows = SlotRows(self.buffers, self.options)
        self.passes = SlotPasses(self.rows, self.buffers, self.options)
        self._oversized_calls = 0

    def ensure(self, rows: int, positions: int) -> None:
        """Room for rows ``0 .. rows`` of ``positions`` positions (the buffers grow by doubling rows)."""
        self.rows.ensure(rows, positions)

    def _oversized(self) -> tuple[int, int] | None:
        """(rows, positions) needed now, if the buffers hold 4x the rows or 2x the positions of that."""
        need_rows = max(4, len(self.ids))
        need_pos = round_up(max(self.lengths, default=0) + 1, POSITION_STEP)
        b = self.buffers
        if not b.keys or (need_rows * 4 > b.rows_cap and need_pos * 2 > b.pos_cap):
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
        b = self.buffers
        rows, pos = min(b.rows_cap, row_capacity(2 * need_rows)), min(b.pos_cap, need_pos)
        if self.options.rows_stay:
            self.rows.compact(rows)
        b.shrink_to(rows, pos)

    # -- rows ----------------------------------------------------------------------------------------
    def add(self, request_id: str, kv: Sequence[tuple[mx.array, mx.array]] = (), length: int = 0) -> None:
        self.rows.add(request_id, kv, length)

    def advance(self, request_id: str, count: int) -> None:
        self.rows.advance(request_id, count)

    def advance_decodes(self) -> None:
        self.rows.advance_decodes()

    def promote(self, request_id: str) -> None:
        self.rows.promote(request_id)

    def promote_many(self, request_ids: Sequence[str]) -> None:
        self.rows.promote_many(request_ids)

    def arrange(self, request_ids: Sequence[str]) -> None:
        self.rows.arrange(request_ids)

    def remove(self, request_id: str) -> None:
        self.rows.remove(request_id)

    def remove_many(self, request_ids: Sequence[str]) -> None:
        self.rows.remove_many(request_ids)

    @property
    def broadcast_rows(self) -> int:
        return self.rows.broadcast_rows

    def copy_prefixes(self, copies: Sequence[tuple[str, str, int]]) -> None:
        self.rows.copy_prefixes(copies)

    def write_prefix(self, request_ids: Sequence[str], kv: Sequence[mx.array]) -> None:
        self.rows.write_prefix(request_ids, kv)

    def write_blocks(self, targets: Sequence[tuple[str, int]], keys: Sequence[mx.array], values: Sequence[mx.array],
                     block_size: int) -> None:
        """Write cached blocks into rows: block ``b`` (``keys[layer][b]``, ``[H, block_size, D]``) goes to row
        ``targets[b][0]`` at positions ``targets[b][1] .. + block_size``. One scatter per buffer for all rows (the GPU
        path for prefixes that few rows share: ``write_prefix`` writes a shared one into many rows at once)."""
        if not targets:
            return
        self.ensure(len(self.ids), max(p for _, p in targets) + block_size + 1)
        self.buffers.write_blocks([(self.slot_of(rid), p) for rid, p in targets], keys, values, block_size)

    def read_blocks(self, sources: Sequence[tuple[str, int]], block_size: int) -> tuple[list[mx.array], list[mx.array]]:
        """Blocks of rows, lazily, per layer ``[n, H, block_size, D]``: block ``b`` is row ``sources[b][0]``'s positions
        ``sources[b][1] .. + block_size`` (past the row's length: whatever is there). One gather per buffer for all
        rows (the inverse of ``write_blocks``); evaluate before any row is written or moved again."""
        return self.buffers.read_blocks([(self.slot_of(rid), p) for rid, p in sources], block_size)

    def extract(self, request_id: str) -> list[tuple[mx.array, mx.array]]:
        """A copy of one row's KV, per layer ``[1, H, length, D]``."""
        copies = self.buffers.row_copies(self.slot_of(request_id), self.committed(request_id))
        layers = self.num_layers
        return [(copies[i][None], copies[layers + i][None]) for i in range(layers)]

    def row_view(self, request_id: str) -> list[tuple[mx.array, mx.array]]:
        """Lazy slices of one row's KV, per layer ``[1, H, length, D]``: evaluate them before the next forward
        (a pending slice keeps the buffer referenced, so the forward's in-place write would copy it whole)."""
        return self.buffers.view(self.slot_of(request_id), self.committed(request_id))

    # -- passes --------------------------------------------------------------------------------------
    @property
    def layers(self) -> list[SlotLayerCache]:
        return self.passes.layers

    @property
    def compiled_decode(self) -> CompiledPasses | None:
        return self.passes.compiled_decode

    @property
    def compiled_prefill(self) -> CompiledPasses | None:
        return self.passes.compiled_prefill

    @property
    def decode_attention(self) -> DecodeAttention | None:
        return self.passes.decode_attention

    def forward(self, model: Any, start: int, tokens: Sequence[Sequence[int]] | mx.array, full: bool = False,
                offsets: Sequence[int] | None = None) -> mx.array:
        return self.passes.forward(model, start, tokens, full, offsets)

    def forward_packed(self, model: Any, start: int, tokens: Sequence[Sequence[int]], sizes: Sequence[int],
                       rows: Sequence[int], lead: mx.array | None = None) -> mx.array:
        return self.passes.forward_packed(model, start, tokens, sizes, rows, lead)

    def current_pass(self) -> ForwardPass | PackedPass:
        return self.passes.current_pass()
