"""Decode attention over slot rows of different lengths, fused, on CUDA.

A decode step's rows hold different numbers of keys. MLX's CUDA attention runs such a step unfused: its vector kernel
and cuDNN's decode path refuse a mask array, so it falls back to matmuls, a ``where`` and a softmax (1.28 ms a layer
at 256 rows x 1,024 keys on an H200, where reading the keys and values once takes ~0.03 ms). This kernel reads each
row's own keys straight from the slot buffers (no slice, no mask): one thread block per (row, KV head) serves that
KV head's query heads (GQA reads the keys once), in tiles of keys with an online softmax. Its source is ``decode.cu``.

``DecodeAttention.create()`` returns None where it cannot run (no CUDA, a head size it does not take) or where its
output disagrees with MLX's masked attention on a probe; callers then keep MLX's attention. It has two layouts of
reading values (``_LONG_KEYS``), each compiled on its own (NVRTC, in every process: MLX keeps no disk cache of
``mx.fast.cuda_kernel``'s builds); each is probed when first needed (``probe``): the short-row layout at ``create``
(every engine's buffers start with 256 positions), the long-row one when the buffers first grow past 512, so a job
whose rows stay shorter never compiles it.
"""

from __future__ import annotations

import logging
import time

import mlx.core as mx

from mlxbatch.engine.attention.sources import kernel_source
from mlxbatch.engine.backend import Backend

log = logging.getLogger(__name__)

_THREADS = 256  # threads a block; also keys a tile (one key per thread while scoring)
# A block reads its row's keys tile after tile. With few blocks and long rows most of the GPU idles, where MLX's
# attention spreads the keys over the device: the kernel runs when there are blocks enough for the device (an H200
# has 132 SMs) or rows short enough (four tiles) for the sequential tiles not to matter.
_MIN_BLOCKS = 128
_SHORT_KEYS = 1024
# Buffers holding more positions than this read values in the long-row layout (``L = 1``): on an H200 at 256 rows
# of 14/2 x 64 heads it was 1.53x faster at ~1,000 keys a row and 1.65x at ~2,000, and 0.80x at ~128 (the partials'
# sum costs more than the loads it overlaps), where the short-row layout (a dim a thread) stays
_LONG_KEYS = 512
_PROBE_CAPACITY = (256, 640)  # a probe's buffers, by layout: rows up to the capacity (over ``_LONG_KEYS``: layout 1)
_LAYOUT_NAMES = ("short-row", "long-row")  # the layouts, in messages

SOURCE = kernel_source("decode.cu")  # the kernel body (``decode.cu``)


class DecodeAttention:
    """``attend(queries, k_buf, v_buf, rows, lengths, scale)``: each query row ``i`` (``queries[i]``, shape
    ``[heads, 1, dim]``) attends to keys ``[0, lengths[i])`` of slot row ``rows[i]`` of the full buffers
    ``[slots, kv_heads, capacity, dim]``. Returns ``[n, heads, 1, dim]``, as ``mx.fast.scaled_dot_product_attention``
    would with the matching mask."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> None:
        self._kernels: dict[float, object] = {}  # one per attention scale (a constant of the kernel: one op fewer)
        self._geometry = (heads, kv_heads, head_dim, dtype)  # the model's, which the probes take
        self._layouts: dict[int, bool] = {}  # a layout probed -> whether it agreed with MLX's attention

    def _kernel(self, scale: float) -> object:
        kernel = self._kernels.get(scale)
        if kernel is None:
            kernel = self._kernels[scale] = mx.fast.cuda_kernel(
                name=f"mlxbatch_decode_attention_{len(self._kernels)}",
                input_names=["q", "kb", "vb", "rows", "lengths"],
                output_names=["out"],
                source=f"    constexpr float SCALE = {scale:.9e}f;\n" + SOURCE,
                ensure_row_contiguous=False,  # the queries are a view of RoPE's output: read by their strides
            )
        return kernel

    @staticmethod
    def worth(rows: int, kv_heads: int, keys: int) -> bool:
        """Whether the kernel beats MLX's attention for a pass of ``rows`` rows reading up to ``keys`` keys."""
        return rows * kv_heads >= _MIN_BLOCKS or keys <= _SHORT_KEYS

    def serves(self, rows: int, kv_heads: int, keys: int, capacity: int) -> bool:
        """Whether the kernel runs a decode pass of ``rows`` rows reading up to ``keys`` keys of buffers of
        ``capacity`` positions: worth it, and their layout probed and agreeing (else MLX's attention runs it)."""
        return self._layouts.get(_layout(capacity), False) and self.worth(rows, kv_heads, keys)

    def probe(self, capacity: int) -> bool:
        """Whether the layout of buffers of ``capacity`` positions agrees with MLX's attention, probed (compiled)
        the first time it is asked (~1.5 s on an H100): the caller has nothing in flight on another thread, since
        the probe evaluates (the slot rows ask when the buffers grew, after evaluating them)."""
        layout = _layout(capacity)
        ok = self._layouts.get(layout)
        if ok is None:
            t0 = time.perf_counter()
            ok = self._layouts[layout] = self._check(layout)
            log.debug("decode attention kernel: %s layout probed in %.2f s (%s)", _LAYOUT_NAMES[layout],
                      time.perf_counter() - t0, "used" if ok else "not used")
        return ok

    def _check(self, layout: int) -> bool:
        heads, kv_heads, head_dim, dtype = self._geometry
        what = _LAYOUT_NAMES[layout]
        try:
            err = probe_error(self, heads, kv_heads, head_dim, dtype, capacity=_PROBE_CAPACITY[layout])
        except Exception as exc:  # no compiler, a driver that refuses it: MLX's attention stays
            log.warning("decode attention kernel (%s layout) unavailable (%s); using MLX's masked attention",
                        what, exc)
            return False
        if not err <= 2e-2:  # (NaN too)
            log.warning("decode attention kernel (%s layout) disagrees with MLX's attention (max error %.3g); "
                        "not used", what, err)
            return False
        return True

    @staticmethod
    def supports(heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> bool:
        rep = heads // kv_heads if kv_heads else 0
        return (head_dim in (64, 128) and 1 <= rep <= 16 and rep * kv_heads == heads  # shared memory: 16 heads
                and dtype in (mx.bfloat16, mx.float16, mx.float32))

    def __call__(self, queries: mx.array, k_buf: mx.array, v_buf: mx.array, rows: mx.array, lengths: mx.array,
                 scale: float) -> mx.array:
        n, heads, _, dim = queries.shape
        kv_heads = k_buf.shape[1]
        q = queries if queries.dtype == k_buf.dtype else queries.astype(k_buf.dtype)
        (out,) = self._kernel(scale)(  # type: ignore[operator]
            inputs=[q, k_buf, v_buf, rows.astype(mx.int32), lengths.astype(mx.int32)],
            template=[("T", k_buf.dtype), ("D", dim), ("R", heads // kv_heads), ("L", _layout(k_buf.shape[2]))],
            grid=(_THREADS * n * kv_heads, 1, 1),
            threadgroup=(_THREADS, 1, 1),
            output_shapes=[(n, heads, 1, dim)],
            output_dtypes=[k_buf.dtype],
        )
        return out

    @classmethod
    def create(cls, backend: Backend, heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> DecodeAttention | None:
        """The kernel, if this device runs it and its short-row layout agrees with MLX's masked attention on a ragged
        probe (``backend``: the engine's device; CUDA only); the long-row layout is probed when first needed."""
        if not backend.cuda or not hasattr(mx.fast, "cuda_kernel"):
            return None
        if not cls.supports(heads, kv_heads, head_dim, dtype):
            return None
        kernel = cls(heads, kv_heads, head_dim, dtype)
        return kernel if kernel.probe(_PROBE_CAPACITY[0]) else None


def _layout(capacity: int) -> int:
    """The kernel's layout of reading values for buffers of ``capacity`` positions (its template constant ``L``)."""
    return int(capacity > _LONG_KEYS)


def reference(queries: mx.array, k_buf: mx.array, v_buf: mx.array, rows: mx.array, lengths: mx.array,
              scale: float) -> mx.array:
    """The same attention through MLX's masked SDPA (what runs without the kernel)."""
    t = int(mx.max(lengths).item())
    k, v = k_buf[rows, :, :t, :], v_buf[rows, :, :t, :]
    mask = (mx.arange(t)[None, :] < lengths[:, None])[:, None, None, :]
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)


def probe_error(kernel: DecodeAttention, heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype,
                n: int = 6, capacity: int = 640) -> float:
    """Largest difference between the kernel and ``reference`` on random rows of ragged lengths (1 to more than
    two tiles, up to ``capacity``: over ``_LONG_KEYS``, the long-row layout), read from non-contiguous slot rows of a
    larger buffer, the queries a strided view."""
    key = mx.random.key(7)
    kq, kk, kv = mx.random.split(key, 3)
    # the queries as the engine passes them: the first heads of RoPE's output over query and key heads (a view)
    q = mx.random.normal((n, heads + kv_heads, 1, head_dim), key=kq).astype(dtype)[:, :heads]
    kb = mx.random.normal((2 * n, kv_heads, capacity, head_dim), key=kk).astype(dtype)
    vb = mx.random.normal((2 * n, kv_heads, capacity, head_dim), key=kv).astype(dtype)
    rows = mx.array([2 * i + (i % 2) for i in range(n)], dtype=mx.int32)
    lengths = mx.array([min(x, capacity) for x in (1, 31, 256, 257, 600, capacity)][:n], dtype=mx.int32)
    scale = head_dim ** -0.5
    got = kernel(q, kb, vb, rows, lengths, scale).astype(mx.float32)
    want = reference(q, kb, vb, rows, lengths, scale).astype(mx.float32)
    return float(mx.max(mx.abs(got - want)).item())
