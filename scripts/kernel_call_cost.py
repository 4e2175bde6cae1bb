"""The host's cost of one kernel: MLX's built-in ops against an ``mx.fast.cuda_kernel`` doing the same (GPU diagnostic)

    python3 scripts/kernel_call_cost.py [--rows 256] [--dims 896] [--chain 48] [--steps 50]

A small model's decode step is bound by the host's work per kernel (docs/benchmarks.md). This builds a chain of
``--chain`` element-wise adds over a ``[rows, dims]`` bf16 array, launches it (``mx.async_eval``) and waits, per
step, three ways: MLX's ``+``, a custom CUDA kernel that adds (``mx.fast.cuda_kernel``), and MLX's ``+`` under
``mx.compile`` (one fused kernel: the floor). Prints the median host ms a step (building and launching) and the wait
after it; the difference between the first two, divided by the chain, is what a custom kernel's call costs the host
beyond a built-in op's (MLX hashes a custom kernel's source at each evaluation: ``backend/cuda/custom_kernel.cpp``).
"""

# ruff: isort: skip_file
from __future__ import annotations

import argparse
import statistics
import time

import mlxbatch  # noqa: F401  (first: it sets up MLX's BLAS on Linux CPUs, and direct CUDA launches)
import mlx.core as mx

_ADD = """
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (size_t)a_shape[0] * a_shape[1]) out[i] = static_cast<T>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--dims", type=int, default=896)
    ap.add_argument("--chain", type=int, default=48)
    ap.add_argument("--steps", type=int, default=50)
    a = ap.parse_args()
    x = mx.random.normal((a.rows, a.dims)).astype(mx.bfloat16)
    y = mx.random.normal((a.rows, a.dims)).astype(mx.bfloat16)
    mx.eval(x, y)
    kernel = mx.fast.cuda_kernel(name="add_probe", input_names=["a", "b"], output_names=["out"],
                                 source=_ADD) if mx.cuda.is_available() else None
    n = a.rows * a.dims

    def custom(u: mx.array, v: mx.array) -> mx.array:
        assert kernel is not None
        (out,) = kernel(inputs=[u, v], template=[("T", u.dtype)], grid=(-(-n // 256) * 256, 1, 1),
                        threadgroup=(256, 1, 1), output_shapes=[u.shape], output_dtypes=[u.dtype])
        return out

    def chain(add, h: mx.array) -> mx.array:
        for _ in range(a.chain):
            h = add(h, y)
        return h

    compiled = mx.compile(lambda h: chain(lambda u, v: u + v, h))
    ways = {"built-in +": lambda h: chain(lambda u, v: u + v, h), "cuda_kernel": lambda h: chain(custom, h),
            "compiled (one kernel)": compiled}
    if not mx.cuda.is_available():  # elsewhere: the built-in ways only
        del ways["cuda_kernel"]
    print(f"device {mx.default_device()}, [{a.rows}, {a.dims}] bf16, a chain of {a.chain} adds, {a.steps} steps")
    print("| way | host ms a step | wait ms | host us a kernel |")
    print("|---|---|---|---|")
    for name, fn in ways.items():
        for _ in range(5):  # warm: JIT compilation
            mx.eval(fn(x))
        host, wait = [], []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            out = fn(x)
            mx.async_eval(out)
            t1 = time.perf_counter()
            mx.eval(out)
            host.append(t1 - t0)
            wait.append(time.perf_counter() - t1)
        h, w = 1e3 * statistics.median(host), 1e3 * statistics.median(wait)
        per = 1e3 * h / a.chain if not name.startswith("compiled") else float("nan")
        print(f"| {name} | {h:.3f} | {w:.3f} | {per:.1f} |", flush=True)


if __name__ == "__main__":
    main()
