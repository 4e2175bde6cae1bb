"""A step's transient memory bound (EngineConfig.step_memory_bytes) against speed and B1's peak (GPU diagnostic)

    python3 scripts/step_memory.py --model 0.5b --runs fewshot:2048,unique:1024,label:2048 --bounds 0,4,2,1,0.5
    python3 scripts/step_memory.py --model 0.5b --runs fewshot:2048 --bounds 2,2 --tokens 8192,4096

For each workload, in one process: mlx-lm's batch_generate (B1) once, then the engine once unbound to build its
cuDNN graphs, then once per bound (GiB; 0: none) in the order given; ``--tokens`` (one per bound) also sets each
run's ``max_num_batched_tokens`` (a step's prefill tokens: what its passes' activations scale with). Each run inside
the suite's ``MemoryProbe``: peak MLX memory over the run's start, wall, prefill and decode seconds.
``--prefill-max-scores`` / ``--prefill-after`` vary CUDA's prefill-attention policy (as in ``engine_runs.py``): e.g.
``--tokens 8192,4096 --prefill-max-scores 16777216`` against the same run without it asks whether a large step's
transient is its unfused attention's scores (passes over 2^24 score elements then run fused; the engine's limit is
2^27).
"""

# ruff: isort: skip_file
from __future__ import annotations

import sys

import mlxbatch  # noqa: F401  (first: it sets up MLX's BLAS on Linux CPUs)
from mlxbatch.bench.cli import parse_script_args
from mlxbatch.bench.harness import Bench, MemoryProbe, log
from engine_runs import set_prefill_policy  # scripts/ is this script's path

GiB = 2**30


def main() -> None:
    mine, args = parse_script_args(sys.argv[1:], runs="fewshot:2048,unique:1024,label:2048", bounds="0,4,2,1,0.5",
                                   tokens="", prefill_after="", prefill_max_scores="")
    set_prefill_policy(mine.prefill_after, mine.prefill_max_scores)
    b = Bench(args)
    C = b.concurrency
    bounds = [float(x) for x in mine.bounds.split(",")]
    tokens = [int(x) for x in mine.tokens.split(",")] if mine.tokens else [0] * len(bounds)
    assert len(tokens) == len(bounds), "--tokens: one per bound"
    b.run_engine(b.workload("label", 64), max_num_seqs=C)
    rows = []
    for item in mine.runs.split(","):
        name, n = item.split(":")
        w = b.workload(name, int(n))
        with MemoryProbe() as p1:
            r1 = b.run_b1(w, C, args.prefill_batch)
        b1_peak = (p1.mlx_peak - p1.mlx_base) / GiB
        rows.append((name, "B1", r1.wall_s, None, None, b1_peak, b1_peak))
        for i, (gib, tok) in enumerate(zip([0.0] + bounds, [0] + tokens)):
            with MemoryProbe() as pe:
                run = b.run_engine(w, max_num_seqs=C, step_memory_bytes=int(gib * GiB),
                                   **({"max_num_batched_tokens": tok} if tok else {}))
            p = run.extra["profile"]
            peak = (pe.mlx_peak - pe.mlx_base) / GiB
            tag = f"{gib:g} GiB" + (f", {tok} tokens" if tok else "") + (" (graphs built here)" if i == 0 else "")
            rows.append((name, tag, run.wall_s,
                         p["prefill_s"], p["decode_s"], peak, b1_peak))
            log(f"{rows[-1]}")
    print(f"\nstep memory bounds: concurrency {C}, B1 wall {r1.wall_s:.2f}")
    print("| workload | bound | wall s | prefill s | decode s | peak over start GiB | x B1 peak |")
    print("|---|---|---|---|---|---|---|")
    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for name, tag, wall, ps, ds, peak, b1 in rows:
        print(f"| {name} | {tag} | {wall:.2f} | {f(ps)} | {f(ds)} | {peak:.2f} | {peak / max(b1, 1e-9):.2f} |")


if __name__ == "__main__":
    main()
