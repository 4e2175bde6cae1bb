"""What the host's read of a step's drawn tokens costs the next step on the device (diagnostic, CUDA)

    python3 scripts/read_back_cost.py --steps 200

On CUDA, MLX moves a device buffer to unified (managed) memory when the host reads it, and its buffer cache hands
cached buffers of a size class to any later allocation, device or unified alike: after a run of steps, a step's small
arrays (drawn tokens, the embedding gather's indices) may live in managed pages that the host touched, which the GPU
then faults back. A chain shaped like a decode step's ends (embedding gather from the drawn tokens, the LM head,
argmax; 256 rows, a Qwen2.5-0.5B-sized table) is run four ways, each step waited for:

- ``none``: the host reads nothing;
- ``read``: the host reads the drawn tokens (``tolist``) each step, and the next step gathers by them;
- ``read+host``: as ``read``, plus a host-made int32 array of the rows a step (as the engine's offsets), used in the graph;
- ``read copy``: the host reads an int64 copy of the drawn tokens (another size class); the next step gathers by the
  int32 tokens, which the host never reads.

Prints the median ms a step of each; the gap between ``none`` and ``read`` is what the read costs the device.
"""

# ruff: isort: skip_file
from __future__ import annotations

import statistics
import sys
import time

import mlxbatch  # noqa: F401  (first: it sets up MLX's BLAS on Linux CPUs)
import mlx.core as mx

from mlxbatch.bench.cli import parse_script_args


def run(mode: str, emb: mx.array, rows: int, steps: int) -> float:
    chosen = mx.arange(rows, dtype=mx.int32)
    mx.eval(chosen)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        h = emb[chosen[:, None]][:, 0, :]
        if mode == "read+host":
            h = h + mx.array([(i + r) % 7 for r in range(rows)], dtype=mx.int32)[:, None].astype(h.dtype)
        logits = h @ emb.T
        nxt = mx.argmax(logits, axis=-1).astype(mx.int32)
        outs = [nxt]
        host = None
        if mode == "read copy":
            host = nxt.astype(mx.int64)
            outs.append(host)
        mx.eval(outs)
        if mode in ("read", "read+host"):
            nxt.tolist()
        elif host is not None:
            host.tolist()
        chosen = nxt
        times.append(time.perf_counter() - t0)
    return statistics.median(times[10:]) * 1e3


def main() -> None:
    mine, _ = parse_script_args(sys.argv[1:], rows="256", steps="200", vocab="151936", dim="896")
    rows, steps = int(mine.rows), int(mine.steps)
    emb = (mx.random.normal((int(mine.vocab), int(mine.dim))) * 0.02).astype(mx.bfloat16)
    mx.eval(emb)
    modes = ["none", "read", "read+host", "read copy"]
    got = {m: [] for m in modes}
    for _ in range(3):
        for m in modes:
            got[m].append(run(m, emb, rows, steps))
    print("| host reads | ms a step (median of 3 runs) |\n|---|---|")
    for m in modes:
        print(f"| {m} | {statistics.median(got[m]):.3f} |")


if __name__ == "__main__":
    main()
