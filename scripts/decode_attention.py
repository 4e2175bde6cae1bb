"""What a decode step's attention costs on the GPU, by how the rows' lengths reach MLX's attention.

    python3 scripts/decode_attention.py

Rows of different lengths need a per-row mask. With a mask array at T = 1, MLX runs attention unfused (matmuls,
where, softmax), since its fused decode kernel and cuDNN's decode path refuse masks; with no mask every row reads
every key (wrong for ragged rows, shown as the floor). "kernel" is mlxbatch's own fused decode attention
(``mlxbatch.engine.kv.decode_attention``), which reads each row's own keys from the full buffers; its probe error
against MLX's masked attention is printed first, per head layout and dtype. Qwen2.5-0.5B heads (14 query, 2 KV, dim 64), bf16,
keys and values sliced from a larger slot buffer as the engine's are.
"""

# ruff: isort: skip_file
from __future__ import annotations

import time
from functools import partial

import mlxbatch  # noqa: F401  (first: it sets up MLX's BLAS on Linux CPUs)
import mlx.core as mx
from mlxbatch.engine.kv.decode_attention import DecodeAttention, probe_error

H, KVH, D = 14, 2, 64
dt = mx.bfloat16


def timed(fn, reps: int = 20) -> tuple[float, float]:
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    first = 1e3 * (time.perf_counter() - t0)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        ts.append(1e3 * (time.perf_counter() - t0))
    return first, sorted(ts)[len(ts) // 2]


def main() -> None:
    kernel = DecodeAttention() if DecodeAttention.create(H, KVH, D, dt) is not None else None
    few_long_rows(kernel)
    for heads, kvh, dim, dtype in [(14, 2, 64, mx.bfloat16), (32, 8, 128, mx.bfloat16), (28, 4, 128, mx.float16),
                                   (16, 16, 64, mx.float32), (12, 2, 128, mx.bfloat16)]:
        try:
            err = probe_error(DecodeAttention(), heads, kvh, dim, dtype)
            print(f"kernel probe heads {heads}/{kvh} dim {dim} {dtype}: max error {err:.4g}", flush=True)
        except Exception as exc:
            print(f"kernel probe heads {heads}/{kvh} dim {dim} {dtype}: FAILED {exc}", flush=True)
    print(f"device {mx.default_device()}; per layer, ms (first call / median of 20)")
    for B in (64, 256):
        for K in (256, 1024, 2048):
            kb = mx.random.normal((2 * B, KVH, K + 256, D)).astype(dt)
            vb = mx.random.normal((2 * B, KVH, K + 256, D)).astype(dt)
            k, v = kb[:B, :, :K], vb[:B, :, :K]
            lens = mx.random.randint(K // 2, K + 1, (B,))
            q1 = mx.random.normal((B, H, 1, D)).astype(dt)
            q2 = mx.random.normal((B, H, 2, D)).astype(dt)
            m1 = (mx.arange(K)[None, :] < lens[:, None])[:, None, None, :]
            m2 = mx.broadcast_to((mx.arange(K)[None, None, :] < lens[:, None, None] + mx.arange(2)[None, :, None])[:, None],
                                 (B, 1, 2, K))
            madd = mx.where(m1, 0.0, -1e9).astype(dt)
            mx.eval(kb, vb, q1, q2, m1, m2, madd)
            cases = [("T=1 bool mask (fallback)", q1, k, v, m1), ("T=1 additive mask", q1, k, v, madd),
                     ("T=1 no mask (floor)", q1, k, v, None),
                     ("T=1 no mask, contiguous k/v", q1, mx.contiguous(k), mx.contiguous(v), None),
                     ("T=2 bool mask (cuDNN)", q2, k, v, m2)]
            rows = mx.arange(B, dtype=mx.int32)
            if kernel is not None:
                f, m = timed(partial(kernel, q1, kb, vb, rows, lens, D ** -0.5))
                print(f"B={B} K={K} | T=1 kernel (ragged, fused) | {f:.2f} | {m:.3f}", flush=True)
            for name, q, kk, vv, mask in cases:
                f, m = timed(partial(mx.fast.scaled_dot_product_attention, q, kk, vv, scale=D ** -0.5, mask=mask))
                print(f"B={B} K={K} | {name} | {f:.2f} | {m:.3f}", flush=True)


def few_long_rows(kernel: DecodeAttention | None) -> None:
    """Few rows of many keys: where the kernel's sequential tiles may lose to MLX (``DecodeAttention.worth``)."""
    if kernel is None:
        return
    for B in (1, 8, 32):
        for K in (1024, 4096, 16384):
            kb = mx.random.normal((B, KVH, K, D)).astype(dt)
            vb = mx.random.normal((B, KVH, K, D)).astype(dt)
            lens = mx.random.randint(K // 2, K + 1, (B,))
            q1 = mx.random.normal((B, H, 1, D)).astype(dt)
            m1 = (mx.arange(K)[None, :] < lens[:, None])[:, None, None, :]
            rows = mx.arange(B, dtype=mx.int32)
            mx.eval(kb, vb, q1, m1, lens)
            worth = DecodeAttention.worth(B, KVH, K)
            for name, fn in [(f"kernel (worth: {worth})", partial(kernel, q1, kb, vb, rows, lens, D ** -0.5)),
                             ("bool mask", partial(mx.fast.scaled_dot_product_attention, q1, kb, vb,
                                                   scale=D ** -0.5, mask=m1)),
                             ("no mask (floor)", partial(mx.fast.scaled_dot_product_attention, q1, kb, vb,
                                                         scale=D ** -0.5))]:
                f, m = timed(fn)
                print(f"few long rows B={B} K={K} | {name} | {f:.2f} | {m:.3f}", flush=True)


if __name__ == "__main__":
    main()
