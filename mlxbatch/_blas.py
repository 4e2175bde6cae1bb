"""Load the system OpenBLAS before MLX on Linux.

Owns one thing: the process-wide choice of BLAS for MLX's CPU backend. The ``mlx-cpu`` wheel bundles the
netlib reference BLAS (~40x slower float32 matmuls); loading ``libopenblas.so.0`` with ``RTLD_GLOBAL``
before the first ``import mlx`` makes MLX resolve its BLAS symbols there instead.
This module must not import mlx.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

_CANDIDATES = (
    "libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "libopenblas.so",
)

#: OpenBLAS kernels after whose first matmul MLX's CPU ops ran far slower. Measured (2 cores, an Intel Xeon with
#: AVX-512): ``exp`` of 16M floats 0.23 s -> 11 s after one matmul, a tiny-model engine run 1.5 s -> 20 s. The likely
#: cause (not verified): the kernel leaves the AVX registers' upper halves dirty and MLX's non-AVX code pays for it.
SLOW_CORE_TYPES = ("sandybridge",)

#: path of the OpenBLAS that was loaded, "" if none was, None before :func:`preload_openblas` ran.
loaded_path: str | None = None


def preload_openblas() -> str:
    """Load OpenBLAS globally (Linux only); warn once, with the fix, when it is missing.

    Returns the loaded path, or "" when nothing was loaded (not Linux, opted out, or missing).
    """
    global loaded_path
    if loaded_path is not None:
        return loaded_path
    loaded_path = ""
    if not sys.platform.startswith("linux") or os.environ.get("MLXBATCH_NO_OPENBLAS"):
        return loaded_path
    if "mlx.core" in sys.modules:
        warnings.warn(
            "mlxbatch: mlx was imported before mlxbatch, so OpenBLAS could not be preloaded; "
            "CPU matmuls may run on the slow reference BLAS. Import mlxbatch first.",
            stacklevel=3,
        )
        return loaded_path
    _warn_about_core_type(os.environ.get("OPENBLAS_CORETYPE", ""))
    override = os.environ.get("MLXBATCH_OPENBLAS")  # a custom OpenBLAS location, tried alone
    for candidate in (override,) if override else _CANDIDATES:
        try:
            ctypes.CDLL(candidate, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        loaded_path = candidate
        return loaded_path
    warnings.warn(
        "mlxbatch: OpenBLAS not found; MLX's CPU backend will use its bundled reference BLAS, "
        "which is ~40x slower for float32 matmuls. Install it with: "
        "sudo apt-get install libopenblas0-pthread   (Fedora: dnf install openblas-threads)",
        stacklevel=3,
    )
    return loaded_path


def _warn_about_core_type(core_type: str) -> None:
    if core_type.strip().lower() in SLOW_CORE_TYPES:
        warnings.warn(
            f"mlxbatch: OPENBLAS_CORETYPE={core_type} makes MLX's CPU ops after the first matmul far slower (~50x "
            "measured on an Intel Xeon). For a row-invariant float32 kernel on any x86-64 CPU use "
            "OPENBLAS_CORETYPE=Nehalem.",
            stacklevel=4,
        )
