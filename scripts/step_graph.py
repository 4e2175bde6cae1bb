"""What one decode step asks MLX to run, primitive by primitive (diagnostic; CPU or GPU)

    python3 scripts/step_graph.py --model 0.5b --rows 256

A decode step of a small model on a GPU is bound by the host's work per kernel (docs/benchmarks.md: ~5-7 us a
kernel to build and encode). This counts the primitives in the lazy graph of one steady-state decode step of the
engine (its decode forward, the draw and the commit: what ``Traffic.launch`` enqueues, every row decoding) and of a
bare mlx-lm step (model + KVCache, forward + argmax) at the same rows, by kind. Views (reshape of a contiguous
array, slices, transposes, broadcasts) cost the host a node but usually no kernel; they are listed apart.
"""

# ruff: isort: skip_file
from __future__ import annotations

import argparse
import collections
import io
import re
from pathlib import Path

import mlxbatch  # noqa: F401  (first: it sets up MLX's BLAS on Linux CPUs)
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlxbatch.bench.harness import resolve_model
from mlxbatch.config import EngineConfig
from mlxbatch.engine import Engine
from mlxbatch.engine.outputs import Traffic
from mlxbatch.types import SamplingParams

VIEWS = {"Reshape", "Slice", "Transpose", "Broadcast", "Squeeze", "ExpandDims", "Depends", "StopGradient"}


def primitives(*arrays: mx.array) -> collections.Counter:
    """Primitive nodes of the graph that evaluating ``arrays`` would run, by name."""
    buf = io.StringIO()
    mx.export_to_dot(buf, *arrays)
    return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', buf.getvalue()))


def show(title: str, counts: collections.Counter, layers: int) -> None:
    kernels = {k: v for k, v in counts.items() if k not in VIEWS}
    views = {k: v for k, v in counts.items() if k in VIEWS}
    n = sum(kernels.values())
    print(f"\n{title}: {n} primitives that may run a kernel ({n / layers:.1f} a layer), "
          f"{sum(views.values())} views")
    for k, v in sorted(kernels.items(), key=lambda kv: -kv[1]):
        print(f"  {v:5d}  {k}")
    print("  views: " + ", ".join(f"{k} {v}" for k, v in sorted(views.items(), key=lambda kv: -kv[1])))


def engine_step(path: Path, rows: int, prompt_len: int) -> collections.Counter:
    """The primitives of the engine's steady decode launch: of the launches where every row decodes, the one with
    the fewest among those holding the whole forward (others also move rows, lazily, before their forward; a few
    hold only the draw). On a CPU MLX's fast ops (norms, RoPE, attention) show as the ops of their fallbacks."""
    got: list[collections.Counter] = []
    launch = Traffic.launch

    def recorded(self: Traffic, kind: str, *arrays: mx.array) -> int:
        if kind == "decode":
            got.append(primitives(*arrays))
        return launch(self, kind, *arrays)

    Traffic.launch = recorded  # type: ignore[method-assign]
    try:
        eng = Engine(path, EngineConfig(seed=0, max_num_seqs=rows, max_num_batched_tokens=rows * prompt_len))
        prompts = [[(7 * i + j) % 900 + 10 for j in range(prompt_len)] for i in range(rows)]
        eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        eng.close()
    finally:
        Traffic.launch = launch  # type: ignore[method-assign]
    whole = [c for c in got if c["RMSNorm"] == max(g["RMSNorm"] for g in got)]  # the model's whole forward in it
    return min(whole, key=lambda c: sum(v for k, v in c.items() if k not in VIEWS))


def bare_step(path: Path, rows: int, prompt_len: int) -> collections.Counter:
    model, _ = load(str(path))
    cache = make_prompt_cache(model)
    x = mx.array([[(7 * i + j) % 900 + 10 for j in range(prompt_len)] for i in range(rows)], dtype=mx.int32)
    y = mx.argmax(model(x, cache=cache)[:, -1, :], axis=-1)
    mx.eval(y, [c.state for c in cache])
    return primitives(mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="0.5b")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    a = ap.parse_args()
    path = resolve_model(a.model, Path("~/.cache/mlxbatch/bench").expanduser())
    layers = len(load(str(path))[0].layers)
    print(f"device {mx.default_device()}, {a.rows} rows, {a.prompt_len}-token prompts, {layers} layers")
    show("engine decode step (forward, draw, commit)", engine_step(path, a.rows, a.prompt_len), layers)
    show("bare mlx-lm step (forward + argmax)", bare_step(path, a.rows, a.prompt_len), layers)


if __name__ == "__main__":
    main()
