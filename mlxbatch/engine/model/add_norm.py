"""A residual add and the RMS norm after it as one CUDA kernel, for decode passes of the own body (``own_body``).

A decoder layer adds the attention's output to the residual stream and norms the sum, then adds the MLP's output and
norms that sum for the next layer: four kernels where two do. In a decode step at a few hundred rows each kernel is a
launch the host pays (~15 us on an H200, where the step is bound by the host), so this saves two launches a layer.

The kernel gives MLX's numbers: the sum rounded to the model's dtype as MLX's add rounds it, the norm of that sum in
float32 (``rsqrt(mean(x^2) + eps)``), then the weight times the normed value rounded to the dtype, as MLX's
``rms_norm`` computes it (``backend/cuda/rms_norm.cu``). Only the sum of squares is added in another order.

``AddNorm.create()`` returns None where it cannot run (no CUDA) or where it disagrees with MLX on a probe; the body
then adds and norms with MLX's ops. ``reference`` is the same computation in MLX's ops (what runs without it).
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger(__name__)

_THREADS = 256

_SOURCE = """
    constexpr int NT = 256;
    constexpr int PER = (D + NT - 1) / NT;    // elements a thread holds
    __shared__ float red[NT / 32];
    const int row = blockIdx.x;
    const int tid = threadIdx.x;
    const size_t at = (size_t)row * D;
    float xs[PER];
    float ss = 0.0f;
    #pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int e = tid + k * NT;
      float x = 0.0f;
      if (e < D) {
        const T s = static_cast<T>(static_cast<float>(h[at + e]) + static_cast<float>(a[at + e]));
        summed[at + e] = s;
        x = static_cast<float>(s);
      }
      xs[k] = x;
      ss += x * x;
    }
    for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffff, ss, o);
    if (tid % 32 == 0) red[tid / 32] = ss;
    __syncthreads();
    float total = 0.0f;
    #pragma unroll
    for (int i = 0; i < NT / 32; ++i) total += red[i];
    const float inv = rsqrtf(total / D + EPS);
    #pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int e = tid + k * NT;
      if (e < D) {
        const T y = static_cast<T>(xs[k] * inv);
        normed[at + e] = static_cast<T>(static_cast<float>(w[e]) * static_cast<float>(y));
      }
    }
"""


def reference(h: mx.array, a: mx.array, norm: Any) -> tuple[mx.array, mx.array]:
    """``h + a`` and ``norm(h + a)`` with MLX's ops."""
    s = h + a
    return s, norm(s)


class AddNorm:
    """``add_norm(h, a, norm)`` -> ``(h + a, norm(h + a))`` for an ``nn.RMSNorm`` ``norm``, in one kernel."""

    def __init__(self) -> None:
        self._kernels: dict[float, object] = {}  # one per eps (a constant of the kernel)

    def _kernel(self, eps: float) -> object:
        kernel = self._kernels.get(eps)
        if kernel is None:
            kernel = self._kernels[eps] = mx.fast.cuda_kernel(
                name=f"mlxbatch_add_rms_norm_{len(self._kernels)}",
                input_names=["h", "a", "w"],
                output_names=["summed", "normed"],
                source=f"    constexpr float EPS = {eps:.9e}f;\n" + _SOURCE,
            )
        return kernel

    def __call__(self, h: mx.array, a: mx.array, norm: Any) -> tuple[mx.array, mx.array]:
        if not h.dtype == a.dtype == norm.weight.dtype:  # the kernel reads all three as one type
            return reference(h, a, norm)
        dims = h.shape[-1]
        rows = h.size // dims
        summed, normed = self._kernel(float(norm.eps))(  # type: ignore[operator]
            inputs=[h, a, norm.weight],
            template=[("T", h.dtype), ("D", dims)],
            grid=(_THREADS * rows, 1, 1),
            threadgroup=(_THREADS, 1, 1),
            output_shapes=[h.shape, h.shape],
            output_dtypes=[h.dtype, h.dtype],
        )
        return summed, normed

    @staticmethod
    def applies(norms: list[Any], dtype: mx.Dtype) -> bool:
        """Whether every one of ``norms`` is an RMS norm this kernel computes for activations of ``dtype``."""
        return all(type(n) is nn.RMSNorm and n.weight.dtype == dtype and n.weight.ndim == 1 for n in norms)

    @classmethod
    def create(cls, norm: Any, dtype: mx.Dtype) -> AddNorm | None:
        """The kernel, if this device runs it and it gives MLX's add and norm on a probe through ``norm``."""
        if mx.default_device() != mx.gpu or mx.metal.is_available() or not hasattr(mx.fast, "cuda_kernel"):
            return None
        try:
            kernel = cls()
            err = probe_error(kernel, norm, dtype)
        except Exception as exc:  # no compiler, a driver that refuses it: MLX's ops stay
            log.warning("add + RMS norm kernel unavailable (%s); using MLX's ops", exc)
            return None
        if err > 2e-2:
            log.warning("add + RMS norm kernel disagrees with MLX (max error %.3g); not used", err)
            return None
        return kernel


def probe_error(kernel: AddNorm, norm: Any, dtype: mx.Dtype, rows: int = 7) -> float:
    """Largest difference between the kernel and ``reference`` (sum and normed) on random rows, relative to the
    largest value (a unit in the last place of a bfloat16 is 2^-8 of it)."""
    dims = norm.weight.shape[0]
    kh, ka = mx.random.split(mx.random.key(11))
    h = (4 * mx.random.normal((rows, 1, dims), key=kh)).astype(dtype)
    a = mx.random.normal((rows, 1, dims), key=ka).astype(dtype)
    got, want = kernel(h, a, norm), reference(h, a, norm)
    errors = []
    for g, w in zip(got, want):
        g, w = g.astype(mx.float32), w.astype(mx.float32)
        errors.append(float((mx.max(mx.abs(g - w)) / mx.maximum(mx.max(mx.abs(w)), 1.0)).item()))
    return max(errors)
