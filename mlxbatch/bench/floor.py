"""The hardware floor of a job: the least time this machine could take for the work the job cannot avoid.

Two measurements of the machine, taken in the benchmark's own process (``machine_speed``): the matmul rate of a large
square matmul in the model's dtype (8192^3 on a GPU, 2048^3 on a CPU) and the bandwidth of an element-wise pass over a
large array (1 GiB on a GPU, 256 MiB on a CPU; bytes read + written). Then (``job_floor``):

    prefill: distinct window-floor prefill tokens x 2 x parameters / matmul FLOP/s   (every distinct token once)
    decode:  decode steps x weight bytes / bandwidth                                 (the weights read once a step)

with decode steps = rows x (new tokens - 1) / a reference batch (the first token of a row comes from its prefill; 256
rows decoding together, the GPU suite's decode level). Attention, sampling and the KV are left out: the floor is a
bound no engine reaches, and its fraction says how far a run is from the machine.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import mlx.core as mx


@dataclass(frozen=True)
class MachineSpeed:
    matmul_flops: float  # FLOP/s of a large square matmul in the model's dtype
    bandwidth: float  # bytes/s read + written by an element-wise pass
    matmul_n: int
    stream_bytes: int


@dataclass(frozen=True)
class Floor:
    prefill_tokens: int
    decode_steps: int
    prefill_s: float
    decode_s: float

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    def as_dict(self) -> dict:
        return {**asdict(self), "seconds": self.seconds}


def _best(fn, repeats: int) -> float:
    fn()  # warm-up: kernel compilation, page faults
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def machine_speed(dtype: str, n: int | None = None, stream_bytes: int | None = None,
                  repeats: int = 5) -> MachineSpeed:
    gpu = mx.default_device() == mx.gpu
    speed = _measure(dtype, n or (8192 if gpu else 2048), stream_bytes or ((1 << 30) if gpu else (256 << 20)),
                     repeats)
    mx.clear_cache()  # the arrays are gone: give their memory back
    return speed


def _measure(dtype: str, n: int, stream_bytes: int, repeats: int) -> MachineSpeed:
    dt = getattr(mx, dtype)
    a = mx.random.normal((n, n)).astype(dt)
    b = mx.random.normal((n, n)).astype(dt)
    big = mx.ones((stream_bytes // 4,), dtype=mx.float32)
    mx.eval(a, b, big)
    t_mm = _best(lambda: mx.eval(a @ b), repeats)
    t_bw = _best(lambda: mx.eval(big * 2), repeats)
    return MachineSpeed(2 * n**3 / t_mm, 2 * big.nbytes / t_bw, n, big.nbytes)


def job_floor(window_floor_tokens: int, rows: int, new_tokens: int, params: int, weight_bytes: int,
              speed: MachineSpeed, batch: int = 256) -> Floor:
    steps = math.ceil(rows * max(0, new_tokens - 1) / batch)
    return Floor(window_floor_tokens, steps, window_floor_tokens * 2 * params / speed.matmul_flops,
                 steps * weight_bytes / speed.bandwidth)
