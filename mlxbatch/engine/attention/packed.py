"""A packed prefill pass's attention as one tensor-core kernel a layer, on CUDA.

A packed pass (``kv.packed``) lays a step's prefill tokens end to end; each token attends to its own slot row's keys
up to its own position. Through MLX's ops that takes a gather, a scale, two matmuls, a mask and a softmax per group of
similar rows and a gather back, every layer: ~16 launches and two cuBLAS heuristic queries a group, and the groups'
shapes (rows, width, keys) are new at nearly every step, so the host spent more encoding a cached pass (~27 ms on the
H200) than the device spent running it (~13 ms). This kernel takes the pass as it is: one launch a layer, whatever
the rows, their lengths or their offsets, no mask, no regrouping, no materialised scores.

Work is cut into units of 64 query rows of one slot row and one KV head: a row's ``n`` new tokens times the ``R``
query heads of a KV head (GQA: the heads share the keys) are ``n * R`` rows, 64 at a time. A block of four warps runs
a unit (flash attention: tiles of 64 keys and values staged in shared memory once for the four warps, 16 query rows a
warp through ``mma.sync`` m16n8k16 in bf16/fp16 with float32 accumulation, an online softmax in registers), up to the
unit's last position. ``units`` makes the unit table on the host, once a pass.

``PackedAttention.create()`` returns None where it cannot run (no CUDA, a head size or type it does not take) or
where its output disagrees with ``reference`` (MLX's attention, token by token) on a ragged probe; the packed pass
then keeps MLX's ops (``attention.prefill``). Its source is ``packed.cu`` (helpers: ``packed.cuh``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from mlxbatch.engine.attention.sources import kernel_source
from mlxbatch.engine.backend import Backend

log = logging.getLogger(__name__)

UNIT = 64  # query rows a unit: a block of four warps, 16 rows (an mma tile) each
_WARPS = 4  # warps a block (a unit)
FIELDS = 5  # a unit: slot row, its first packed token, its tokens in the pass, first query row, its offset

HEADER = kernel_source("packed.cuh")  # the mma and packing helpers
SOURCE = kernel_source("packed.cu")  # the kernel body


def units(start: int | Sequence[int], offsets: Sequence[int], lengths: Sequence[int], rep: int) -> list[int]:
    """The unit table of a packed pass over slot rows ``start ..`` (or each row's slot: ``start`` a sequence;
    ``offsets``: their committed lengths; ``lengths``: their new tokens, laid end to end in row order), flat,
    ``FIELDS`` ints a unit (``unit_rows``)."""
    slots = range(start, start + len(offsets)) if isinstance(start, int) else start
    return unit_rows(slots, offsets, lengths, rep).reshape(-1).tolist()


def unit_rows(slots: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], rep: int) -> np.ndarray:
    """The unit table, ``[units, FIELDS]`` int32: each row's ``n * rep`` query rows (its tokens times the query heads
    of a KV head) cut in units of ``UNIT``, a unit (slot row, its first packed token, its tokens, first query row,
    its offset)."""
    slot = np.asarray(slots, np.int32)
    off = np.asarray(offsets, np.int32)
    n = np.asarray(lengths, np.int32)
    first = np.cumsum(n, dtype=np.int32) - n
    per = -(-n * rep // UNIT)  # each row's units
    of = np.repeat(np.arange(len(n)), per)  # each unit's row
    table = np.empty((int(per.sum()), FIELDS), np.int32)
    table[:, 0], table[:, 1], table[:, 2], table[:, 4] = slot[of], first[of], n[of], off[of]
    table[:, 3] = (np.arange(len(table)) - np.repeat(np.cumsum(per) - per, per)) * UNIT
    return table


class PackedAttention:
    """``attend(queries, k_buf, v_buf, units, scale)``: every packed token's attention over its slot row's keys up to
    its own position (``queries``: ``[padded, heads, 1, dim]``, the real tokens first; ``units``: the table ``units()``
    makes, ``[n, 5]``; the buffers ``[slots, kv_heads, capacity, dim]``, this layer's keys written).
    Returns ``[padded, heads, 1, dim]``, the padding tokens' rows zero."""

    def __init__(self, heads: int, kv_heads: int) -> None:
        self.rep = heads // kv_heads
        self._kernels: dict[float, object] = {}  # one per attention scale (a constant of the kernel)

    def _kernel(self, scale: float) -> object:
        kernel = self._kernels.get(scale)
        if kernel is None:
            kernel = self._kernels[scale] = mx.fast.cuda_kernel(
                name=f"mlxbatch_packed_attention_{len(self._kernels)}",
                input_names=["q", "kb", "vb", "units"],
                output_names=["out"],
                source=f"    constexpr float SCALE = {scale:.9e}f;\n" + SOURCE,
                header=HEADER,
                ensure_row_contiguous=False,  # the queries are a view of RoPE's output: read by their strides
            )
        return kernel

    @staticmethod
    def supports(heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> bool:
        rep = heads // kv_heads if kv_heads else 0
        return head_dim in (64, 128) and rep * kv_heads == heads and rep >= 1 and dtype in (mx.bfloat16, mx.float16)

    def __call__(self, queries: mx.array, k_buf: mx.array, v_buf: mx.array, units: mx.array, scale: float
                 ) -> mx.array:
        padded, heads, _, dim = queries.shape
        kv_heads = k_buf.shape[1]
        q = queries if queries.dtype == k_buf.dtype else queries.astype(k_buf.dtype)
        blocks = units.shape[0] * kv_heads + 1  # and one for the padding tokens
        (out,) = self._kernel(scale)(  # type: ignore[operator]
            inputs=[q, k_buf, v_buf, units],
            template=[("T", k_buf.dtype), ("D", dim), ("R", heads // kv_heads)],
            grid=(32 * _WARPS * blocks, 1, 1),
            threadgroup=(32 * _WARPS, 1, 1),
            output_shapes=[(padded, heads, 1, dim)],
            output_dtypes=[k_buf.dtype],
        )
        return out

    @classmethod
    def create(cls, backend: Backend, heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> PackedAttention | None:
        """The kernel, if this device runs it and it agrees with ``reference`` on a ragged probe (``backend``: the engine's device; CUDA only)."""
        if not backend.cuda or not hasattr(mx.fast, "cuda_kernel"):
            return None
        if not cls.supports(heads, kv_heads, head_dim, dtype):
            return None
        try:
            kernel = cls(heads, kv_heads)
            err = probe_error(kernel, heads, kv_heads, head_dim, dtype)
        except Exception as exc:  # no compiler, a driver that refuses it: MLX's ops stay
            log.warning("packed prefill attention kernel unavailable (%s); using MLX's attention", exc)
            return None
        if not err <= 2e-2:  # (NaN too)
            log.warning("packed prefill attention kernel disagrees with MLX's attention (max error %.3g); not used",
                        err)
            return None
        return kernel


def reference(queries: mx.array, k_buf: mx.array, v_buf: mx.array, start: int, offsets: Sequence[int],
              lengths: Sequence[int], scale: float) -> mx.array:
    """What the kernel computes, through MLX's attention row by row (each row's new tokens over its keys up to their
    positions); ``[padded, heads, 1, dim]``, the padding tokens' rows zero."""
    padded, heads, _, dim = queries.shape
    outs, first = [], 0
    for r, (off, n) in enumerate(zip(offsets, lengths)):
        q = queries[first : first + n, :, 0, :].transpose(1, 0, 2)[None]  # [1, heads, n, dim]
        k = k_buf[start + r : start + r + 1, :, : off + n, :]
        v = v_buf[start + r : start + r + 1, :, : off + n, :]
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
        outs.append(o[0].transpose(1, 0, 2))  # [n, heads, dim]
        first += n
    if padded > first:
        outs.append(mx.zeros((padded - first, heads, dim), queries.dtype))
    return mx.concatenate(outs)[:, :, None, :]


def probe_error(kernel: PackedAttention, heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype,
                capacity: int = 768) -> float:
    """Largest difference between the kernel and ``reference`` on a ragged packed pass: rows of 1 to 150 new tokens
    after 0 to 600 committed ones (a unit across two rows' tokens, a row past two key tiles, padding tokens), read
    from non-consecutive slot rows of a larger buffer, the queries a strided view, the table ending in empty units
    (``kv.packed.PackedPass.table``: offset -1, no tokens)."""
    offsets, lengths = [0, 37, 600, 5, 256, 130], [150, 1, 90, 3, 64, 17]
    start, n = 2, sum(lengths)
    padded = -(-n // 128) * 128
    kq, kk, kv = mx.random.split(mx.random.key(11), 3)
    q = mx.random.normal((padded, heads + kv_heads, 1, head_dim), key=kq).astype(dtype)[:, :heads]
    kb = mx.random.normal((start + len(lengths) + 2, kv_heads, capacity, head_dim), key=kk).astype(dtype)
    vb = mx.random.normal((start + len(lengths) + 2, kv_heads, capacity, head_dim), key=kv).astype(dtype)
    flat = units(start, offsets, lengths, heads // kv_heads) + [start, n, 0, 0, -1] * 3  # empty units last
    table = mx.array(flat, dtype=mx.int32).reshape(-1, FIELDS)  # (a compiled pass's table is padded with them)
    scale = head_dim ** -0.5
    got = kernel(q, kb, vb, table, scale).astype(mx.float32)
    want = reference(q, kb, vb, start, offsets, lengths, scale).astype(mx.float32)
    return float(mx.max(mx.abs(got - want)).item())
