"""The engine's own attention kernels, one face: what the KV layout's passes call where the device runs them.

- ``DecodeAttention`` (``decode.py``, ``decode.cu``): a decode pass's attention over each row's own keys, fused (CUDA).
- ``PackedAttention`` (``packed.py``, ``packed.cu``): a packed prefill pass's attention in one launch a layer (CUDA).
- ``PrefillAttention`` (``prefill.py``): which prefill passes run MLX's fused attention (cuDNN on CUDA) and which run
  ``unfused`` (MLX's fallback ops, a new shape's graph build spared).

Kernel sources are ``.cu`` files of this package, read at import (``sources.py``). Each kernel's ``create`` returns
None where the device cannot run it or where it disagrees with MLX's attention on a probe; callers then keep MLX's.
"""

from mlxbatch.engine.attention.decode import DecodeAttention
from mlxbatch.engine.attention.packed import FIELDS, PackedAttention, units
from mlxbatch.engine.attention.prefill import PrefillAttention, causal_mask, unfused

__all__ = ["FIELDS", "DecodeAttention", "PackedAttention", "PrefillAttention", "causal_mask", "unfused", "units"]
