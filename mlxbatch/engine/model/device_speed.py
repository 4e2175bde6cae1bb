"""How fast this device multiplies matrices and streams memory: the two numbers an ETA is made of.

Owns a short measurement (well under a second each) at a model's own sizes and dtype, without the model's
weights: a ``[512, hidden] x [hidden, intermediate]`` matmul (prefill and batched decode are matmul-bound) and a
reduction over a 256 MiB array (small-batch decode reads every weight once per step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class DeviceSpeed:
    matmul_flops: float  # achieved FLOP/s of a model-sized matmul
    bandwidth: float  # achieved bytes/s of a streaming read


def _best(fn, repeats: int = 5) -> float:
    fn()  # warm-up (kernel compilation, page faults)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(hidden: int, intermediate: int, dtype: str = "float32") -> DeviceSpeed:
    dt = getattr(mx, dtype)
    a = mx.random.normal((512, hidden)).astype(dt)
    b = mx.random.normal((hidden, intermediate)).astype(dt)
    big = mx.ones((64 << 20,), dtype=mx.float32)  # 256 MiB
    mx.eval(a, b, big)
    t_mm = _best(lambda: mx.eval(a @ b))
    t_bw = _best(lambda: mx.eval(mx.sum(big)))
    return DeviceSpeed(2 * 512 * hidden * intermediate / t_mm, big.nbytes / t_bw)
