"""Prefill passes in exact shapes against bucketed ones on CUDA, each run twice (diagnostic).

    python3 scripts/shape_buckets.py --model 0.5b --suite-workloads label,chat

On CUDA every new attention shape costs a cuDNN graph build; a second run of the same workload in the process finds
its graphs built. For each workload, in one process: exact shapes, exact again, bucketed, bucketed again (the two
modes' shapes differ, so the bucketed first run builds its own). Prints wall, prefill seconds, distinct prefill
shapes and padding per run.
"""

# ruff: isort: skip_file
from __future__ import annotations

import sys
import time

import mlxbatch  # noqa: F401  (first: it sets up MLX's BLAS on Linux CPUs)
from mlxbatch.bench.cli import parse_args
from mlxbatch.bench.harness import Bench, MemoryProbe, log
from mlxbatch.bench.suite import suite_rows
from mlxbatch.config import EngineConfig
from mlxbatch.engine import Engine
from mlxbatch.engine.kv.slots import SlotBatch
from mlxbatch.types import SamplingParams

SHAPES: list[tuple[int, int, int, int, int]] = []
_forward = SlotBatch.forward


def _recording(self, model, start, tokens, full=False, offsets=None):
    out = _forward(self, model, start, tokens, full, offsets)
    fp = self.current_pass()
    if fp.width > 1:
        SHAPES.append((fp.stop - fp.start, fp.width, fp.t_used, len(tokens), max(len(t) for t in tokens)))
    return out


def main() -> None:
    args = parse_args(sys.argv[1:])
    SlotBatch.forward = _recording
    b = Bench(args)
    C = b.concurrency
    rows_out = []
    for name in args.suite_workloads.split(","):
        w = b.workload(name, suite_rows(args.suite_rows, args.rows_scale, name))
        params = SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
        for buckets in (False, True):
            for run in ("first", "again"):
                eng = Engine(b.loaded, EngineConfig(seed=0, max_num_seqs=C))
                eng.core.runner.batch.shape_buckets = buckets
                SHAPES.clear()
                with MemoryProbe():
                    t0 = time.perf_counter()
                    eng.generate(w.prompts, params)
                    wall = time.perf_counter() - t0
                p = eng.stats()["profile"]
                eng.close()
                distinct = len({s[:3] for s in SHAPES})
                pad = sum(r * t for r, t, *_ in SHAPES) / max(1, sum(n * T for *_, n, T in SHAPES))
                rows_out.append((name, "buckets" if buckets else "exact", run, wall, p["prefill_s"],
                                 p["prefill_tokens"], p["decode_s"], len(SHAPES), distinct, pad))
                log(f"{rows_out[-1]}")
    print("| workload | shapes | run | wall s | prefill s | prefill tok | decode s | passes | distinct | padding |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.2f} | {r[4]:.2f} | {r[5]:,} | {r[6]:.2f} | {r[7]} | {r[8]} | "
              f"{r[9]:.2f} |")


if __name__ == "__main__":
    main()
