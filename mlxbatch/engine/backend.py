"""The device the engine runs on, decided once: ``Backend.detect()`` asks MLX, everything else is passed a ``Backend``.

What the engine does differently per device (the CUDA text path's layout and kernels, batched row moves on a GPU, the
CPU's pruned prefill, batch-invariant shapes, llguidance's Metal mask kernel, memory limits) is decided from this one
value, so a component never asks MLX again and a test can say which device's decisions it wants.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("cpu", "metal", "cuda")


@dataclass(frozen=True)
class Backend:
    kind: str  # "cpu" | "metal" | "cuda"

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind

    @property
    def gpu(self) -> bool:
        return self.kind != "cpu"

    @property
    def metal(self) -> bool:
        return self.kind == "metal"

    @property
    def cuda(self) -> bool:
        return self.kind == "cuda"

    @staticmethod
    def detect() -> Backend:
        """MLX's default device: the CPU, or a GPU through Metal (Apple) or CUDA (NVIDIA)."""
        import mlx.core as mx

        if mx.default_device() != mx.gpu:
            return CPU
        try:
            metal = mx.metal.is_available()
        except Exception:  # noqa: BLE001 - a build without the Metal module
            metal = False
        return Backend("metal" if metal else "cuda")


CPU = Backend("cpu")
