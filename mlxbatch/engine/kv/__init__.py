"""The running batch's KV on the device: its layout (slots), the prefix cache's block tensors and the copies
between them.

``KVLayout`` is what the runner and the prefix copies need from a layout. ``SlotBatch`` (fixed slots with per-row
lengths, ``kv.slots``) is the one there is; a paged layout (blocks read in place by an attention kernel) would be
another implementation of the same protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx

from mlxbatch.engine.attention import AttentionKernels
from mlxbatch.engine.backend import Backend
from mlxbatch.engine.outputs import Traffic


@dataclass(frozen=True)
class LayoutOptions:
    """How the running batch's rows are laid out and their passes run on a device: decided once, when the runner is
    made (``paths.layout_for``), and fixed for the layout's life. ``base`` gives what follows from the device alone;
    the CUDA text path (a model whose body is ours) adds the rest. Tests and diagnostics pass other values to run
    another device's decisions here (``Engine(..., layout=)``)."""

    # rows move (and blocks are read) in one gather + scatter per buffer for all rows of a step, a scatter where a
    # prefix goes to scattered rows: on a GPU, where each op and each sync costs a launch (per-row copies were ~a
    # third of a GPU step); on the CPU per-row slice copies (memcpy), since CPU scatters go element by element
    batched_moves: bool = False
    # rows stay in their slots (CUDA, where every pass reads and writes rows by slot): promoting, arranging and
    # retiring rows changes books only, no KV moves
    rows_stay: bool = False
    # prefill passes padded to recurring shapes (``slot_forward.bucketed_pass``): on CUDA, where each new attention
    # shape costs a cuDNN graph build
    shape_buckets: bool = False
    # a step's prefill rows as one packed pass (``forward_packed``, CUDA, where the host's work per pass binds)
    packed_prefill: bool = False
    # decode passes replayed from compiled graphs (``kv.compiled``: CUDA, with the decode kernel)
    compiled_decode: bool = False
    # packed prefill passes through the packed attention kernel replayed from compiled graphs (``kv.compiled``, CUDA)
    compiled_prefill: bool = False
    # the runner's: a CPU prefill runs its last layer only for the rows whose logits are needed (an extra small
    # forward a step; on a GPU that launch costs more than 1/L of the prefill saves)
    prune_last: bool = False
    # the runner's: the model's q/k/v and gate/up as one matmul each (``OwnBody.fuse``: fewer launches a layer, CUDA)
    fuse: bool = False
    attention: AttentionKernels = field(default_factory=AttentionKernels)  # the engine's kernels (CUDA), else MLX's

    @staticmethod
    def base(backend: Backend) -> LayoutOptions:
        """What follows from the device alone: batched moves on a GPU, the pruned prefill on the CPU."""
        return LayoutOptions(batched_moves=backend.gpu, prune_last=not backend.gpu)


class KVLayout(Protocol):
    """KV of every admitted sequence, one row each: rows ``[0, n_decode)`` decode, the rest prefill."""

    traffic: Traffic  # what the layout copies and waits for (shared with the runner's step profile)
    options: LayoutOptions  # its layout and passes (read only)
    n_decode: int
    ids: list[str]  # request id per row, in row order (read only)
    compiled_decode: Any  # ``kv.compiled.CompiledPasses`` where ``options.compiled_decode`` (its counts)
    compiled_prefill: Any  # the same for packed prefill passes, where ``options.compiled_prefill``

    def __contains__(self, request_id: str) -> bool: ...

    @property
    def position_bytes(self) -> int:
        """Bytes of one position of one row: keys and values of every layer."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes held by the layout's buffers (capacity, not use)."""
        ...

    def kv_arrays(self) -> list[mx.array]:
        """Every buffer (to evaluate pending writes)."""
        ...

    def add(self, request_id: str, kv: Sequence[tuple[mx.array, mx.array]] = (), length: int = 0) -> None:
        """Admit a sequence as a prefilling row, optionally starting from ``length`` positions of ``kv``."""
        ...

    def copy_prefixes(self, copies: Sequence[tuple[str, str, int]]) -> None:
        """(destination, source, n): each new destination row gets the source row's first ``n`` positions."""
        ...

    def write_blocks(self, targets: Sequence[tuple[str, int]], keys: Sequence[mx.array], values: Sequence[mx.array],
                     block_size: int) -> None:
        """Block ``b`` (per layer ``[H, block_size, D]``) goes to row ``targets[b][0]`` from ``targets[b][1]``."""
        ...

    @property
    def broadcast_rows(self) -> int:
        """New rows that must share a prefix for ``write_prefix`` to write it into them all at once."""
        ...

    def write_prefix(self, request_ids: Sequence[str], kv: Sequence[mx.array]) -> None:
        """One prefix (every layer's keys then values, ``[H, n, D]``) into positions ``0 .. n`` of these rows."""
        ...

    def arrange(self, request_ids: Sequence[str]) -> None:
        """Make these prefilling rows contiguous, in this order, right after the decode rows."""
        ...

    def forward(self, model: Any, start: int, tokens: Sequence[Sequence[int]] | mx.array, full: bool = False,
                offsets: Sequence[int] | None = None) -> mx.array:
        """Run rows ``[start, start + len(tokens))`` over their new tokens (writing their KV); each row's last output,
        or every position's with ``full``."""
        ...

    def forward_packed(self, model: Any, start: int, tokens: Sequence[Sequence[int]], sizes: Sequence[int],
                       rows: Sequence[int], lead: mx.array | None = None) -> mx.array:
        """Rows ``[start, start + len(tokens))`` in one pass, their tokens end to end (attention in pass groups of
        ``sizes`` rows); the last output of each row in ``rows``. ``lead``: the first rows' one token each, on the
        device (decode rows)."""
        ...

    def advance(self, request_id: str, count: int) -> None:
        """Commit ``count`` new positions of a row (the step that wrote them succeeded)."""
        ...

    def advance_decodes(self) -> None:
        """Commit one new position of every decode row (rows ``0 .. n_decode``: a step feeds each one token)."""
        ...

    def promote(self, request_id: str) -> None:
        """A prefilling row finished its prefill: it joins the decode rows."""
        ...

    def promote_many(self, request_ids: Sequence[str]) -> None:
        """Several prefilling rows join the decode rows at once, in this order (one move on a GPU)."""
        ...

    def read_blocks(self, sources: Sequence[tuple[str, int]], block_size: int) -> tuple[list[mx.array], list[mx.array]]:
        """Blocks of rows (row id, first position), lazily, per layer ``[n, H, block_size, D]``: one gather per
        buffer."""
        ...

    def extract(self, request_id: str) -> list[tuple[mx.array, mx.array]]:
        """A copy of one row's KV, per layer ``[1, H, length, D]``."""
        ...

    def row_view(self, request_id: str) -> list[tuple[mx.array, mx.array]]:
        """Lazy views of one row's KV, per layer; evaluate before the layout is written again."""
        ...

    def remove_many(self, request_ids: Sequence[str]) -> None:
        """Retire rows."""
        ...

    def shrink(self) -> None:
        """Give back capacity no longer needed."""
        ...

    def shrink_if_settled(self) -> None:
        """``shrink``, once the capacity has not been needed for a while (a call each step that retired rows)."""
        ...

    def committed(self, request_id: str) -> int:
        """KV positions of the row committed so far."""
        ...

    def check(self, expected: dict[str, int]) -> None:
        """Assert that the rows are exactly ``expected`` (request id -> committed positions)."""
        ...
