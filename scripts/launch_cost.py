"""What a decode step costs the host against the device (diagnostic, GPU)

    python3 scripts/launch_cost.py --model 0.5b --batches 1,64,256

A bare mlx-lm decode loop (model + KVCache, forward + argmax, batch B, 160-token context), each step timed in three
parts: building the lazy graph (Python), ``mx.async_eval`` (MLX encodes every kernel of the graph on the host and
launches it), and waiting for the result. If the launch takes about as long as the step, a step is bound by the host's encoding work, not by the device, and
overlapping the host's Python work with the device cannot help much.
"""

# ruff: isort: skip_file
from __future__ import annotations

import statistics
import sys
import time

import mlxbatch  # noqa: F401  (first: it sets up MLX's BLAS on Linux CPUs)
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlxbatch.bench.cli import parse_script_args
from mlxbatch.bench.harness import resolve_model
from pathlib import Path


def main() -> None:
    mine, args = parse_script_args(sys.argv[1:], batches="1,64,256", steps="40")
    model, _ = load(resolve_model(args.model, Path(args.cache_dir).expanduser()))
    print("| batch | mode | build ms | launch ms | wait ms | step ms |\n|---|---|---|---|---|---|")
    for B in [int(b) for b in mine.batches.split(",")]:
        for mode in ("plain",):  # (mx.compile of a step over a growing KVCache does not trace)
            cache = make_prompt_cache(model)
            prompt = mx.random.randint(3, 1000, (B, 160))
            mx.eval(model(prompt, cache=cache))
            y = mx.zeros((B, 1), dtype=mx.int32)

            def step(tok, cache=cache):
                return mx.argmax(model(tok, cache=cache)[:, -1, :], axis=-1)[:, None]

            fn = step
            parts = []
            for i in range(int(mine.steps)):
                t0 = time.perf_counter()
                y = fn(y)
                t1 = time.perf_counter()
                mx.async_eval(y)
                t2 = time.perf_counter()
                mx.eval(y)
                t3 = time.perf_counter()
                if i >= 5:
                    parts.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
            med = [statistics.median(p[j] for p in parts) * 1e3 for j in range(4)]
            print(f"| {B} | {mode} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} | {med[3]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
