"""How much memory the engine may use, and the MLX memory settings that keep it there.

Owns the memory rules of a device: what the host really has free (Linux ``/proc/meminfo``; macOS ``sysctl`` +
``vm_stat``), what the device can take (CUDA reports total and free memory; Metal shares the host's RAM, so what is
available is the recommended working set less what MLX holds, but never more than the host has free: the OS and
other apps use the same memory), the default share of it for KV (smaller on small Macs), and the limits a run sets
and restores: MLX's buffer cache bounded (freed buffers otherwise pile up and, on a Mac, push the machine into swap)
and, on Metal, the run's weights and KV wired so they are not paged out between steps (what mlx-lm's
``maybe_set_recommended_wired_limit`` does). The platform, device facts and MLX calls are injectable for tests.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from mlxbatch.engine.sched.sizing import SMALL_MAC, GiB

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostMemory:
    total: int
    available: int


def _meminfo(text: str, key: str) -> int:
    m = re.search(rf"^{key}:\s+(\d+)\s*kB", text, re.M)
    return int(m.group(1)) * 1024 if m else 0


def _vm_stat_available(text: str) -> int:
    """Free + inactive + speculative + purgeable pages of ``vm_stat`` output, in bytes."""
    page = re.search(r"page size of (\d+) bytes", text)
    size = int(page.group(1)) if page else 4096
    pages = 0
    for key in ("Pages free", "Pages inactive", "Pages speculative", "Pages purgeable"):
        m = re.search(rf"^{key}:\s+(\d+)", text, re.M)
        pages += int(m.group(1)) if m else 0
    return pages * size


def host_memory(platform: str = sys.platform, read: Callable[[list[str]], str] | None = None) -> HostMemory:
    """The host's RAM and what is free now (``read`` runs a command or reads a file: injectable)."""

    def run(cmd: list[str]) -> str:
        if cmd[0] == "cat":
            with open(cmd[1]) as f:
                return f.read()
        return subprocess.run(cmd, capture_output=True, text=True, timeout=5, check=True).stdout

    read = read or run
    try:
        if platform == "darwin":
            total = int(read(["sysctl", "-n", "hw.memsize"]).strip())
            return HostMemory(total, _vm_stat_available(read(["vm_stat"])) or total // 2)
        text = read(["cat", "/proc/meminfo"])
        total = _meminfo(text, "MemTotal")
        if total:
            return HostMemory(total, _meminfo(text, "MemAvailable") or total // 2)
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return HostMemory(total, total // 2)


def device_available(kind: str, info: dict[str, Any], host: HostMemory, mlx_held: int) -> tuple[int, int]:
    """(total, available) bytes for a device: ``mlx_held`` is MLX's active memory plus its buffer cache."""
    if kind == "cuda":
        total = int(info.get("total_memory") or info.get("memory_size") or 0)
        free = info.get("free_memory")
        return total, int(free) if free is not None else max(0, total - mlx_held)
    if kind == "metal":  # unified memory: the working set MLX may use, and what the host really has free
        working_set = int(info.get("max_recommended_working_set_size") or info.get("memory_size") or host.total)
        return working_set, max(0, min(working_set - mlx_held, host.available))
    return host.total, host.available


def default_kv_fraction(kind: str, host_total: int) -> float:
    """The share of available memory given to KV when the config does not say: less on small Macs, where the OS
    and the desktop live in the same memory."""
    return 0.3 if kind == "metal" and host_total <= SMALL_MAC else 0.5


def kv_budget(free: int, fraction: float | None, kind: str, host_total: int, bytes_per_token: int) -> int:
    """Memory an engine may fill with KV (slots and caches): ``fraction`` of ``free``, what the device has free after
    the weights (None: the device's default share, smaller on small Macs); at least 256 tokens' worth."""
    if fraction is None:
        fraction = default_kv_fraction(kind, host_total)
    if free <= 0:  # the backend did not say: assume 8 GiB rather than starving the batch
        log.warning("device memory unknown; assuming 8 GiB are free for KV")
        free = 8 << 30
    return max(bytes_per_token * 256, int(free * fraction))


class MemoryLimits:
    """MLX's cache limit (every GPU) and wired limit (Metal) for one engine's life; ``restore`` puts them back."""

    def __init__(self, kind: str, backend: Any = None) -> None:
        import mlx.core as mx

        self._kind = kind
        self._mx = backend or mx
        self._saved: dict[str, int] = {}
        self._step_bytes = 0

    def apply(self, working_set: int, needed: int, step_bytes: int = 0) -> None:
        if self._kind == "cpu":
            return
        self._step_bytes = step_bytes
        self._mx.clear_cache()  # what loading left behind
        self._saved["cache"] = self._mx.set_cache_limit(max(GiB // 4, working_set // 16))
        if self._kind == "metal":
            wired = min(needed, working_set)
            self._saved["wired"] = self._mx.set_wired_limit(wired)
            log.info("wired %.1f GiB (weights and KV) of a %.1f GiB working set", wired / GiB, working_set / GiB)

    @contextmanager
    def step_bound(self) -> Iterator[None]:
        """Bound a step's transient memory: inside, MLX may allocate ``step_bytes`` beyond the arrays it holds on
        entry, then waits for dispatched kernels to finish (and free their buffers) before it dispatches more. MLX
        otherwise runs a whole forward ahead of the device and keeps every layer's activations until the device
        catches up (~0.4 MB a prefill token on CUDA). The limit is put back on exit, so work outside the engine is
        unbound. A step that reaches the bound costs a CUDA launch thread dearly (``default_step_bytes``), so there
        the bound is sized for a step not to reach it."""
        if not self._step_bytes:
            yield
            return
        old = self._mx.set_memory_limit(self._mx.get_active_memory() + self._step_bytes)
        try:
            yield
        finally:
            self._mx.set_memory_limit(old)

    def restore(self) -> None:
        if "cache" in self._saved:
            self._mx.set_cache_limit(self._saved.pop("cache"))
        if "wired" in self._saved:
            self._mx.set_wired_limit(self._saved.pop("wired"))
        if self._kind != "cpu":
            self._mx.clear_cache()


def default_step_bytes(kind: str, host_total: int, spare: int = 0) -> int:
    """A step's transient memory bound on GPUs. CUDA: half of ``spare`` (what the device has free beside the weights
    and the KV budget), at least 2 GiB. A bound that a step reaches costs a CUDA launch thread dearly: MLX waits for
    the device in the middle of encoding and trims its buffer cache inside allocations, freeing unified-memory
    buffers with a synchronous ``cudaFree``; on an H200 the 100k-row job's 16384-token steps of the 0.5B model
    (~17 GB of transients) spent 6.0 s of a 30k-row run encoding with a 2 GiB bound (5.5 s with 8 GiB) against 2.3 s
    unbound, for a peak of 10 against 21.5 GB (docs/benchmarks.md). Metal: 2 GiB (1 GiB on small Macs): a Mac's
    GPU shares the host's memory with everything else, and the bound keeps a step's transients small (on an H200,
    before the launch thread, 2 GiB cut the engine's peak over its start from 10.9-15.1 GiB to 5.2-6.3 at the same
    speed; not measured on a Mac). None on the CPU, where the engine's passes are small (2,048 tokens)."""
    if kind == "cpu":
        return 0
    if kind == "cuda":
        return max(2 * GiB, spare // 2)
    return GiB if kind == "metal" and host_total <= SMALL_MAC else 2 * GiB


@dataclass(frozen=True)
class MemoryPlan:
    """How an engine splits its memory: the running rows' KV (what the scheduler admits against), the prefix
    cache's blocks and the vision cache, all inside one budget."""

    slot_budget: int
    prefix_blocks: int
    vision_cache_bytes: int
    total: int  # slots + caches
    step_bytes: int = 0  # a step's transient memory bound (0: none)


def plan_memory(config: Any, kind: str, host_total: int, auto_budget: Callable[[float | None], int],
                block_bytes: int, takes_images: bool, free: int = 0) -> MemoryPlan:
    """``config`` is an ``EngineConfig``; ``auto_budget(fraction)`` what the worker finds free for KV; ``free`` what
    the device has free after the weights (0: unknown).

    The budget is ``kv_budget_bytes`` when set, else the automatic one; either way the caches are carved out of it
    (the prefix cache a quarter of it, at most 2 GiB, unless ``prefix_cache_bytes`` says; the vision cache as
    configured, at most a quarter) and the running rows' slots get the rest, at least a quarter. A step's transient
    bound is ``step_memory_bytes`` when set, else the device's (``default_step_bytes``, of what is free beside the
    budget)."""
    total = config.kv_budget_bytes or auto_budget(config.kv_memory_fraction)
    prefix = min(config.prefix_cache_bytes or min(total // 4, 2 * GiB), total // 2) if config.prefix_cache else 0
    vision = min(config.vision_cache_bytes if takes_images else 0, total // 4)
    slots = max(total // 4, total - prefix - vision)
    blocks = max(1, prefix // block_bytes) if config.prefix_cache else 0
    held = slots + blocks * block_bytes + vision
    step_bytes = (default_step_bytes(kind, host_total, max(0, free - held)) if config.step_memory_bytes is None
                  else config.step_memory_bytes)
    return MemoryPlan(slots, blocks, vision, held, step_bytes)
