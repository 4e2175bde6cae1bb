"""KV copies by the word: gathers and scatters that move 32-bit words through one index array.

MLX's scatter and gather run a thread per element, and each thread does the index arithmetic of every index array
and axis. A 16-bit KV buffer copied as 16-bit elements through three index arrays (rows, heads, positions) ran at
38-51 GB/s on an H200 (``scripts/copy_kernels.py``); the same copy as 32-bit words through one index array over
``[rows * heads * blocks, block_size, words]`` ran at 71-103 GB/s. The copies of the slot batch (prefix copy-ins,
prompt blocks out to the prefix store, row moves) and of the prefix store go through here. Each returns the new
buffer, which the caller puts in its list in place of the old one (nothing else may hold the old one: it is written
in place, donated, only if the list held the last reference).
"""

from __future__ import annotations

import mlx.core as mx


def as_words(a: mx.array) -> mx.array:
    """``a`` with its last axis as 32-bit words (a view of the same bytes) for 16-bit dtypes whose last axis is even;
    else ``a`` itself."""
    return a.view(mx.uint32) if a.dtype.size == 2 and a.shape[-1] % 2 == 0 else a


def from_words(w: mx.array, like: mx.array) -> mx.array:
    """The inverse of ``as_words`` for an array of ``like``'s dtype."""
    return w.view(like.dtype) if w.dtype != like.dtype else w


def block_rows(buf: mx.array, rows: mx.array, starts: mx.array, block_size: int) -> mx.array | None:
    """One index into ``buf`` (``[R, H, T, D]``) viewed as ``[R * H * T / block_size, block_size, D]``: block ``b``
    of row ``rows[b]`` from position ``starts[b]``, every head (``[n * H]``, head fastest). None when the buffer's
    positions or a start are not whole blocks (the caller indexes rows, heads and positions instead)."""
    R, H, T, _ = buf.shape
    if T % block_size:
        return None
    per_row = T // block_size
    heads = mx.arange(H, dtype=mx.int32)
    return ((rows[:, None] * H + heads[None, :]) * per_row + (starts // block_size)[:, None]).reshape(-1)


def write_blocks(buf: mx.array, index: mx.array, blocks: mx.array) -> mx.array:
    """``buf`` with ``blocks`` (``[n, H, block_size, D]``) written at ``index`` (``block_rows``)."""
    R, H, T, D = buf.shape
    B = blocks.shape[2]
    w = as_words(buf)
    W = w.shape[-1]
    flat = w.reshape(R * H * (T // B), B, W)
    flat[index] = as_words(blocks.astype(buf.dtype)).reshape(-1, B, W)
    return from_words(flat.reshape(R, H, T, W), buf)


def read_blocks(buf: mx.array, index: mx.array, block_size: int) -> mx.array:
    """The blocks of ``buf`` at ``index`` (``block_rows``), ``[n, H, block_size, D]``, lazily."""
    R, H, T, D = buf.shape
    w = as_words(buf)
    W = w.shape[-1]
    got = w.reshape(R * H * (T // block_size), block_size, W)[index]
    return from_words(got.reshape(-1, H, block_size, W), buf)


def take_rows(buf: mx.array, rows: mx.array, n: int) -> mx.array:
    """Positions ``0..n-1`` of ``buf``'s rows ``rows`` (``[len(rows), H, n, D]``), lazily."""
    return from_words(mx.take(as_words(buf)[:, :, :n, :], rows, axis=0), buf)


def put_rows(buf: mx.array, rows: mx.array, n: int, data: mx.array) -> mx.array:
    """``buf`` with ``data`` (``take_rows``'s shape) written at positions ``0..n-1`` of rows ``rows``."""
    w = as_words(buf)
    w[rows, :, :n, :] = as_words(data.astype(buf.dtype))
    return from_words(w, buf)


def take(buf: mx.array, index: mx.array) -> mx.array:
    """``buf[index]`` along the first axis (whole blocks of the prefix store), lazily."""
    return from_words(as_words(buf)[index], buf)


def put(buf: mx.array, index: mx.array, data: mx.array) -> mx.array:
    """``buf`` with ``data`` written at ``index`` along the first axis."""
    w = as_words(buf)
    w[index] = as_words(data.astype(buf.dtype))
    return from_words(w, buf)
