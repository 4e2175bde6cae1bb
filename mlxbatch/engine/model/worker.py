"""The device side of an engine (the seed system's MLXWorker, made real).

Owns what the engine knows about its device: name and memory on Metal / CUDA / CPU, memory left for KV
after the weights, bytes per KV token and per block (measured from the model's own cache), warm-up,
a health check, and shutdown that frees MLX memory.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxbatch import _blas, _cuda
from mlxbatch.engine.backend import Backend
from mlxbatch.engine.model.loader import LoadedModel
from mlxbatch.engine.model.memory import HostMemory, device_available, host_memory, kv_budget
from mlxbatch.engine.sched.sizing import BatchSize, DeviceFacts, device_defaults
from mlxbatch.errors import ModelLoadError

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "metal" | "cuda" | "cpu"
    name: str
    total_memory: int  # bytes the device can use (GPU memory, or system RAM on CPU)
    available_memory: int  # bytes free now (on Metal: within the working set and what the host has free)
    blas: str  # CPU only: the BLAS MLX uses ("openblas: <path>" or "reference")
    host_memory: int = 0  # the machine's RAM
    kernel_launch: str = ""  # CUDA only: "direct" or "cuda graphs" (``mlxbatch._cuda``)

    @property
    def sizing_facts(self) -> DeviceFacts:
        """What the batch's default size goes by: a GPU's own memory on CUDA; the machine's RAM on a Mac (its chip
        class) and on the CPU."""
        return DeviceFacts(self.kind, self.total_memory if self.kind == "cuda" else self.host_memory)

    @property
    def batch_defaults(self) -> BatchSize:
        """The batch this device runs before a model's KV budget is known (``engine.sched.sizing``)."""
        return device_defaults(self.sizing_facts)


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    dtype: str  # mlx dtype name of the KV ("float32", "bfloat16", ...)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class HealthReport:
    ok: bool
    device: str
    latency_s: float
    active_memory: int
    peak_memory: int
    message: str = ""


def device_info(backend: Backend | None = None, host: HostMemory | None = None) -> DeviceInfo:
    """The facts of ``backend``'s device now (None: the device MLX runs on, ``Backend.detect``)."""
    backend = backend or Backend.detect()
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    host = host or host_memory()
    if backend.gpu:
        kind = backend.kind
        total, avail = device_available(kind, info, host, mx.get_active_memory() + mx.get_cache_memory())
        launch = _cuda.kernel_launch() if kind == "cuda" else ""
        return DeviceInfo(kind, str(info.get("device_name", kind)), total, avail, "", host.total, launch)
    blas = f"openblas: {_blas.loaded_path}" if _blas.loaded_path else "reference"
    return DeviceInfo("cpu", str(info.get("device_name", "cpu")), host.total, host.available, blas, host.total)


class Worker:
    """Device facts and services for one loaded model. ``backend``: the device, decided once (``Backend.detect``)
    and passed to everything in the engine that does something differently per device."""

    def __init__(self, loaded: LoadedModel, backend: Backend | None = None) -> None:
        self.loaded = loaded
        self.backend = backend or Backend.detect()
        self.device = device_info(self.backend)
        self.geometry = self._measure_geometry()
        self.weights_bytes = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))

    def _measure_geometry(self) -> KVGeometry:
        cache = make_prompt_cache(self.loaded.model)
        if not all(type(c) is KVCache for c in cache):
            kinds = sorted({type(c).__name__ for c in cache})
            raise ModelLoadError(f"model={self.loaded.spec.model!r}: needs cache types {kinds}; the engine "
                                 "supports models with standard attention KV caches (KVCache) only")
        self.loaded.model(mx.array([[0]], dtype=mx.int32), cache=cache)
        k = cache[0].keys
        mx.eval(k)
        return KVGeometry(len(cache), k.shape[1], k.shape[3], k.dtype.size, str(k.dtype).rsplit(".", 1)[-1])

    def free_bytes(self) -> int:
        """What the device has free now (the weights loaded): 0 if it does not say."""
        return device_info(self.backend).available_memory

    def kv_budget_bytes(self, fraction: float | None = None, free: int | None = None) -> int:
        """Memory the engine may fill with KV (slots and caches): a fraction of what is free after the weights
        (None: the device's default share, smaller on small Macs); ``free``: that figure if already read."""
        return kv_budget(self.free_bytes() if free is None else free, fraction, self.device.kind,
                         self.device.host_memory, self.geometry.bytes_per_token)

    def warm_up(self) -> float:
        """Run one prefill and one decode shape so the first real step does not pay JIT compilation."""
        t0 = time.perf_counter()
        cache = make_prompt_cache(self.loaded.model)
        out = self.loaded.model(mx.zeros((1, 8), dtype=mx.int32), cache=cache)
        out = self.loaded.model(mx.argmax(out[:, -1:, :], axis=-1).astype(mx.int32), cache=cache)
        mx.eval(out)
        return time.perf_counter() - t0

    def health_check(self) -> HealthReport:
        t0 = time.perf_counter()
        try:
            out = self.loaded.model(mx.array([[1, 2, 3]], dtype=mx.int32))
            ok = bool(mx.all(mx.isfinite(out)).item())
            msg = "" if ok else "model produced non-finite logits"
        except Exception as exc:  # the report is the point: never raise from a health check
            ok, msg = False, f"{type(exc).__name__}: {exc}"
        return HealthReport(ok, self.device.kind, time.perf_counter() - t0, mx.get_active_memory(),
                            mx.get_peak_memory(), msg)

    def peak_memory(self) -> int:
        """MLX's peak memory in this process so far (bytes)."""
        return mx.get_peak_memory()

    def shutdown(self) -> None:
        mx.synchronize()
        mx.clear_cache()
