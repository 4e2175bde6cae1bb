"""The engine's own attention kernels, one face: what the KV layout's passes call where the device runs them.

- ``DecodeAttention`` (``decode.py``, ``decode.cu``): a decode pass's attention over each row's own keys, fused (CUDA).
- ``PackedAttention`` (``packed.py``, ``packed.cu``): a packed prefill pass's attention in one launch a layer (CUDA).
- ``PrefillAttention`` (``prefill.py``): which prefill passes run MLX's fused attention (cuDNN on CUDA) and which run
  ``unfused`` (MLX's fallback ops, a new shape's graph build spared).

Kernel sources are ``.cu`` files of this package, read at import (``sources.py``). Each kernel's ``create`` returns
None where the device cannot run it or where it disagrees with MLX's attention on a probe; callers then keep MLX's.

A probe compiles its kernel (NVRTC: seconds on a CUDA host, in every process, MLX keeping no disk cache of
``mx.fast.cuda_kernel``'s) and runs it. ``AttentionKernels.build_early`` starts that on a thread of its own before the
model's weights load, which ``create`` then takes: the compiles run beside the imports and the load instead of after
them (MLX evaluates each thread's arrays on that thread's own stream; the compile itself runs without the GIL).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import mlx.core as mx

from mlxbatch.engine.attention.decode import DecodeAttention
from mlxbatch.engine.attention.packed import FIELDS, PackedAttention, unit_rows, units
from mlxbatch.engine.attention.prefill import PrefillAttention, causal_mask, unfused
from mlxbatch.engine.backend import Backend

__all__ = ["FIELDS", "AttentionKernels", "DecodeAttention", "PackedAttention", "PrefillAttention", "causal_mask",
           "unfused", "unit_rows", "units"]


log = logging.getLogger(__name__)
_EARLY: dict[tuple[object, ...], Future[AttentionKernels]] = {}  # ``build_early``'s builds, by ``create``'s arguments
_EARLY_LOCK = threading.Lock()


@dataclass(frozen=True)
class AttentionKernels:
    """The kernels a slot layout attends with, where the device runs them (None: MLX's attention)."""

    decode: DecodeAttention | None = None  # decode passes over each row's own keys
    prefill: PrefillAttention | None = None  # which prefill passes run fused (the others unfused)
    packed: PackedAttention | None = None  # a packed prefill pass's attention in one launch a layer

    @staticmethod
    def create(backend: Backend, heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype,
               prefill: bool) -> AttentionKernels:
        """The decode kernel where ``backend`` runs it (and it agrees with MLX's attention); with ``prefill`` (the
        CUDA text path's packed prefill) the prefill policy and the packed kernel too. Those ``build_early`` started
        for the same arguments, if it did (each early build is taken once)."""
        key = (backend.kind, heads, kv_heads, head_dim, dtype, prefill)
        with _EARLY_LOCK:
            early = _EARLY.pop(key, None)
        if early is not None:
            t0 = time.perf_counter()
            try:
                kernels = early.result()
            except Exception as exc:  # noqa: BLE001 - (the kernels' own failures are None kernels, not errors)
                log.warning("attention kernels built early failed (%s); building them now", exc)
            else:
                log.debug("attention kernels built beside the model's load (waited %.2f s for them)",
                          time.perf_counter() - t0)
                return kernels
        return AttentionKernels._build(backend, heads, kv_heads, head_dim, dtype, prefill)

    @staticmethod
    def build_early(backend: Backend, heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype,
                    prefill: bool) -> bool:
        """Start ``create``'s work for these arguments on a thread of its own, for the ``create`` that follows (a
        model about to load): True when started (CUDA only: elsewhere there is nothing to compile). The thread is not
        a daemon: a process that ends meanwhile (the load failed) waits for it rather than tear MLX down under it."""
        if not backend.cuda:
            return False
        key = (backend.kind, heads, kv_heads, head_dim, dtype, prefill)
        with _EARLY_LOCK:
            if key in _EARLY:
                return False
            future: Future[AttentionKernels] = Future()
            _EARLY[key] = future

        def build() -> None:
            t0 = time.perf_counter()
            try:
                future.set_result(AttentionKernels._build(backend, heads, kv_heads, head_dim, dtype, prefill))
            except BaseException as exc:  # noqa: BLE001 - ``create`` raises nothing of it: it builds again
                future.set_exception(exc)
            log.debug("attention kernels built early in %.2f s", time.perf_counter() - t0)

        threading.Thread(target=build, name="mlxbatch-attention-kernels").start()
        return True

    @staticmethod
    def _build(backend: Backend, heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype,
               prefill: bool) -> AttentionKernels:
        decode = DecodeAttention.create(backend, heads, kv_heads, head_dim, dtype)
        if not prefill:
            return AttentionKernels(decode)
        return AttentionKernels(decode, PrefillAttention(heads, kv_heads, head_dim, dtype),
                                PackedAttention.create(backend, heads, kv_heads, head_dim, dtype))
