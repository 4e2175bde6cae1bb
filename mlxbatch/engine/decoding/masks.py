"""Applying the allowed-token bitmasks of a batch's constrained rows to its logits (``structured`` fills them).

Portable MLX ops everywhere (the bits unpacked on the host, one ``mx.where``); llguidance's Metal kernel where the
engine runs on Metal (the caller says so: ``engine.backend``), once it agreed with the portable path on the first real
batch (``_metal_kernel_ok``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)


def apply(logits: mx.array, rows: list[int], mask: np.ndarray, ntok: int, metal: bool = False) -> mx.array:
    """``logits`` with the packed bitmask ``mask`` (one row per entry of ``rows``, ``ntok`` tokenizer ids) applied to
    those rows: disallowed ids and columns past ``ntok`` at -inf; other rows bit-identical, the input untouched.
    ``metal``: the logits are on Metal (llguidance's kernel may run)."""
    if metal and _metal_kernel_ok(logits, rows, mask, ntok):
        return _apply_metal(logits, rows, mask, ntok)
    return _apply_portable(logits, rows, mask, ntok)


def _apply_metal(logits: mx.array, rows: list[int], mask: np.ndarray, ntok: int) -> mx.array:
    """llguidance's Metal kernel on the constrained rows (it masks every column past the mask's words)."""
    import llguidance.mlx as llg_mlx

    if ntok % 32:  # clear the bits past the tokenizer in the last word
        mask = mask.copy()
        mask[:, -1] &= np.int32((1 << (ntok % 32)) - 1)
    if rows == list(range(logits.shape[0])):
        return llg_mlx.apply_token_bitmask(logits, mask)
    idx = mx.array(rows, dtype=mx.int32)
    out = mx.array(logits)  # a new array: the item assignment must not touch the caller's
    out[idx] = llg_mlx.apply_token_bitmask(logits[idx], mask)
    return out


def _apply_portable(logits: mx.array, rows: list[int], mask: np.ndarray, ntok: int) -> mx.array:
    """Unpack the bits on the host, then one ``mx.where`` with -inf (columns >= ``ntok`` are masked too)."""
    batch, width = logits.shape
    keep = min(ntok, width)
    bits = np.unpackbits(mask.view(np.uint8), axis=1, count=keep, bitorder="little").view(np.bool_)
    neg = mx.array(float("-inf"), dtype=logits.dtype)
    if rows == list(range(batch)):  # every row constrained: mask the tokenizer's columns, pad the rest
        head = mx.where(mx.array(bits), logits[:, :keep] if keep < width else logits, neg)
        return head if keep == width else mx.pad(head, ((0, 0), (0, width - keep)), constant_values=neg)
    # some rows: one full-width keep mask (all True in free rows) beats a gather + scatter of the rows ~2x
    full = np.ones((batch, width), np.bool_)
    full[rows] = False
    full[rows, :keep] = bits
    return mx.where(mx.array(full), logits, neg)


_METAL_CHECKED: dict[str, bool] = {}  # "ok" -> whether llguidance's Metal kernel agreed with the portable path


def _metal_kernel_ok(logits: mx.array, rows: list[int], mask: np.ndarray, ntok: int,
                     apply_metal: Callable[..., mx.array] | None = None) -> bool:
    """Whether llguidance's Metal kernel may be used: checked once, on the first real batch, against the portable
    path and evaluated inside the check (a kernel that fails to compile or dispatch only fails when evaluated, long
    after a ``try`` around the call). A kernel that fails or differs is never used again in this process."""
    if "ok" not in _METAL_CHECKED:
        try:
            got = (apply_metal or _apply_metal)(logits, rows, mask, ntok)
            want = _apply_portable(logits, rows, mask, ntok)
            mx.eval(got, want)
            same = got.shape == want.shape and bool(mx.array_equal(got, want).item())
            if not same:
                log.warning("llguidance's Metal kernel disagrees with the portable mask; using the portable one")
        except Exception:  # noqa: BLE001 - compile or dispatch failure: the portable ops
            log.warning("llguidance's Metal kernel failed; using portable MLX ops", exc_info=True)
            same = False
        _METAL_CHECKED["ok"] = same
    return _METAL_CHECKED["ok"]
