"""Launch MLX's CUDA kernels directly, not through CUDA graphs.

Owns one thing: the process-wide choice of how MLX's CUDA backend launches kernels. By default MLX records every
kernel into a CUDA graph. At each commit (every 100 kernels on an H100/H200) it adds the graph's edges, updates a
cached executable graph (``cudaGraphExecUpdate``) and launches it. A decode step of a small model is bound by that
host work, not by the device. On an H200 with the 0.5B shape, a bare mlx-lm decode step at 256 rows spent 7.7 of its
8.9 ms inside ``mx.async_eval``, and 0.01 ms waiting for the device. With direct launches
(``MLX_USE_CUDA_GRAPHS=0``) the engine ran label 13% and chat 25% faster, decode and prefill both
(docs/benchmarks.md).

MLX reads ``MLX_USE_CUDA_GRAPHS`` once, when it launches its first CUDA kernel, so mlxbatch sets it when it is
imported. A value the user set wins: ``MLX_USE_CUDA_GRAPHS=1`` keeps MLX's graphs. The variable means nothing
off CUDA. This module must not import mlx.
"""

from __future__ import annotations

import os
import re

VAR = "MLX_USE_CUDA_GRAPHS"


def prefer_direct_launches() -> None:
    """Set ``MLX_USE_CUDA_GRAPHS=0`` unless the user set it."""
    os.environ.setdefault(VAR, "0")


def _atoi(s: str) -> int:
    """C's ``atoi``, which MLX applies to the variable: leading blanks, a sign, digits; anything else is 0."""
    m = re.match(r"\s*([+-]?\d+)", s)
    return int(m.group(1)) if m else 0


def kernel_launch() -> str:
    """How MLX's CUDA backend launches kernels in this process: ``"cuda graphs"`` or ``"direct"``."""
    value = os.environ.get(VAR)
    return "cuda graphs" if value is None or _atoi(value) != 0 else "direct"
