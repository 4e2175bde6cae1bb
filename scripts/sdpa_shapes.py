"""Where a GPU prefill's time goes with the prefix cache: MLX's CUDA attention per query/key shape.

    python3 scripts/sdpa_shapes.py [--engine] [--model 0.5b]

On CUDA, ``mx.fast.scaled_dot_product_attention`` with ``T > 1`` runs cuDNN's fused attention, whose graph is built
once per (q, k, v, mask) shape and stride and kept in a per-thread LRU of 256 graphs. A prefill with the cache on
reads a different number of keys at nearly every call. Part A times the first and the repeated call of attention
shapes like those of the label workload (Qwen2.5-0.5B heads), with an array mask and with the fused causal mode;
part B (``--engine``) runs the engine on label twice in one process, so the second run finds its graphs built.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import mlx.core as mx


def part_a() -> None:
    H, KVH, D = 14, 2, 64
    dt = mx.bfloat16
    shapes = [(B, T, 800 + T + j * 7) for B, T in ((32, 160), (40, 192), (48, 224), (36, 256)) for j in range(3)]
    rows = []
    for B, T, K in shapes:
        q = mx.random.normal((B, H, T, D)).astype(dt)
        k = mx.random.normal((B, KVH, K, D)).astype(dt)
        v = mx.random.normal((B, KVH, K, D)).astype(dt)
        mask = (mx.arange(K)[None, None, :] <= (K - T + mx.arange(T))[None, :, None])[:, None]
        mask = mx.broadcast_to(mask, (B, 1, T, K))
        mx.eval(q, k, v, mask)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=mask))
            mx.synchronize()
            times.append(1e3 * (time.perf_counter() - t0))
        rows.append((B, T, K, *times))
    print(f"cudnn sdpa enabled={os.environ.get('MLX_CUDA_USE_CUDNN_SDPA', '1')} device={mx.default_device()}")
    print("B T K | first ms | second ms | third ms")
    for r in rows:
        print(f"{r[0]} {r[1]} {r[2]} | {r[3]:.1f} | {r[4]:.2f} | {r[5]:.2f}")
    firsts = sorted(r[3] for r in rows)
    seconds = sorted(r[4] for r in rows)
    print(f"median first {firsts[len(firsts) // 2]:.1f} ms, median second {seconds[len(seconds) // 2]:.2f} ms")


def part_b(model: str, runs: int) -> None:
    from pathlib import Path

    from mlxbatch.bench import workloads as wl
    from mlxbatch.bench.harness import resolve_model
    from mlxbatch.config import EngineConfig
    from mlxbatch.engine import Engine
    from mlxbatch.types import SamplingParams

    path = resolve_model(model, Path("~/.cache/mlxbatch/bench").expanduser())
    w = wl.make("label", wl.Vocab(0, 150000), 2048, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
    for run in range(runs):
        eng = Engine(path, EngineConfig(seed=0, max_num_seqs=256))
        t0 = time.perf_counter()
        eng.generate(w.prompts, params)
        wall = time.perf_counter() - t0
        p = eng.stats()["profile"]
        eng.close()
        print(f"cudnn={os.environ.get('MLX_CUDA_USE_CUDNN_SDPA', '1')} engine label 2048 run {run + 1}: wall {wall:.2f} s, prefill {p['prefill_s']:.2f} s / "
              f"{p['prefill_tokens']} tok, decode {p['decode_s']:.2f} s, steps {p['steps']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--model", default="0.5b")
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    part_a()
    if not a.child:
        env = {**os.environ, "MLX_CUDA_USE_CUDNN_SDPA": "0"}
        subprocess.run([sys.executable, __file__, "--child"] + (["--engine"] if a.engine else []), env=env)
    if a.engine:
        part_b(a.model, 1 if a.child else 2)


if __name__ == "__main__":
    main()
