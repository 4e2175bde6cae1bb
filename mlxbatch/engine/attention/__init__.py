"""The engine's own attention kernels, one face: what the KV layout's passes call where the device runs them.

- ``DecodeAttention`` (``decode.py``, ``decode.cu``): a decode pass's attention over each row's own keys, fused (CUDA).
- ``PackedAttention`` (``packed.py``, ``packed.cu``): a packed prefill pass's attention in one launch a layer (CUDA).
- ``PrefillAttention`` (``prefill.py``): which prefill passes run MLX's fused attention (cuDNN on CUDA) and which run
  ``unfused`` (MLX's fallback ops, a new shape's graph build spared).

Kernel sources are ``.cu`` files of this package, read at import (``sources.py``). Each kernel's ``create`` returns
None where the device cannot run it or where it disagrees with MLX's attention on a probe; callers then keep MLX's.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlxbatch.engine.attention.decode import DecodeAttention
from mlxbatch.engine.attention.packed import FIELDS, PackedAttention, unit_rows, units
from mlxbatch.engine.attention.prefill import PrefillAttention, causal_mask, unfused
from mlxbatch.engine.backend import Backend

__all__ = ["FIELDS", "AttentionKernels", "DecodeAttention", "PackedAttention", "PrefillAttention", "causal_mask",
           "unfused", "unit_rows", "units"]


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
        CUDA text path's packed prefill) the prefill policy and the packed kernel too."""
        decode = DecodeAttention.create(backend, heads, kv_heads, head_dim, dtype)
        if not prefill:
            return AttentionKernels(decode)
        return AttentionKernels(decode, PrefillAttention(heads, kv_heads, head_dim, dtype),
                                PackedAttention.create(backend, heads, kv_heads, head_dim, dtype))
