"""What a decode step costs the host against the device (diagnostic, GPU)

    python3 scripts/launch_cost.py --model 0.5b --batches 1,64,256

A bare mlx-lm decode loop (model + KVCache, forward + argmax, batch B, 160-token context), each step timed in three
parts: building the lazy graph (Python), ``mx.async_eval`` (MLX encodes every kernel of the graph on the host and
launches it), and waiting for the result; then a decode step over fixed-size KV buffers (every row writes its
position by scatter and reads the whole buffer through a mask: shapes that never change), run as it is
("fixed") and under ``mx.compile`` ("fixed, compiled": MLX fuses elementwise kernels, so fewer kernels are encoded).
If the launch takes about as long as the step, a step is bound by the host's encoding work, not by the device, and
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
from mlxbatch.engine.model.own_body import OwnBody
from pathlib import Path


class FixedCache:
    """One layer's KV as fixed-size buffers ``[B, H, P, D]``: each row writes at its own position (``offset``)."""

    def __init__(self, k: mx.array, v: mx.array, pos: mx.array, mask: mx.array) -> None:
        self.k, self.v, self.offset, self.mask = k, v, pos, mask

    def attend(self, q, k, v, scale, mask):
        B, H = k.shape[0], k.shape[1]
        rows, heads = mx.arange(B)[:, None, None], mx.arange(H)[None, :, None]
        p = self.offset[:, None, None]
        self.k[rows, heads, p] = k
        self.v[rows, heads, p] = v
        return mx.fast.scaled_dot_product_attention(q, self.k, self.v, scale=scale, mask=self.mask)


def fixed_step(model):
    """A decode step over fixed-size buffers: (tokens [B,1], positions [B], *buffers) -> (next, positions + 1,
    *buffers)."""
    body = model.model
    own = OwnBody(body)
    head = model.lm_head if hasattr(model, "lm_head") else body.embed_tokens.as_linear
    L = len(body.layers)

    def step(tok, pos, *bufs):
        P = bufs[0].shape[2]
        mask = (mx.arange(P)[None, :] <= pos[:, None])[:, None, None, :]
        caches = [FixedCache(bufs[i], bufs[L + i], pos, mask) for i in range(L)]
        h = own(tok, cache=caches)
        y = mx.argmax(head(h[:, -1, :]), axis=-1)[:, None].astype(mx.int32)
        return (y, pos + 1, *[c.k for c in caches], *[c.v for c in caches])

    return step


def main() -> None:
    mine, args = parse_script_args(sys.argv[1:], batches="1,64,256", steps="40")
    model, _ = load(resolve_model(args.model, Path(args.cache_dir).expanduser()))
    print("| batch | mode | build ms | launch ms | wait ms | step ms |\n|---|---|---|---|---|---|")
    for B in [int(b) for b in mine.batches.split(",")]:
        ref: list[mx.array] = []
        for mode in ("plain", "fixed", "fixed, compiled"):
            parts, got = [], []
            if mode == "plain":
                cache = make_prompt_cache(model)
                mx.eval(model(mx.random.randint(3, 1000, (B, 160)), cache=cache))
                y = mx.zeros((B, 1), dtype=mx.int32)

                def step(tok, cache=cache):
                    return mx.argmax(model(tok, cache=cache)[:, -1, :], axis=-1)[:, None]
            else:
                attn = model.model.layers[0].self_attn
                H, D = attn.n_kv_heads, attn.k_proj.weight.shape[0] // attn.n_kv_heads
                dtype = attn.k_proj.weight.dtype
                L = len(model.model.layers)
                bufs = [mx.zeros((B, H, 256, D), dtype) for _ in range(2 * L)]
                state = (mx.zeros((B, 1), dtype=mx.int32), mx.full((B,), 160, dtype=mx.int32), *bufs)
                mx.eval(state)
                fn = fixed_step(model)
                fn = mx.compile(fn) if "compiled" in mode else fn
            for i in range(int(mine.steps)):
                t0 = time.perf_counter()
                if mode == "plain":
                    y = step(y)
                    out = [y]
                else:
                    state = fn(*state)
                    out = list(state)
                t1 = time.perf_counter()
                mx.async_eval(out)
                t2 = time.perf_counter()
                mx.eval(out)
                t3 = time.perf_counter()
                if i < 3 and mode != "plain":
                    got.append(state[0])
                if i >= 5:
                    parts.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
            ref = got if mode == "fixed" else ref
            same = all(mx.array_equal(a, b).item() for a, b in zip(got, ref))
            med = [statistics.median(p[j] for p in parts) * 1e3 for j in range(4)]
            note = "" if mode != "fixed, compiled" else (" (same tokens as fixed)" if same else " (TOKENS DIFFER)")
            print(f"| {B} | {mode}{note} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} | {med[3]:.2f} |", flush=True)

if __name__ == "__main__":
    main()
