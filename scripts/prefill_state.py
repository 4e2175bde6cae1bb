"""Does what ran earlier in the process change the engine's cached prefill? (diagnostic)

    python3 scripts/prefill_state.py --model 0.5b --workload label --rows 2048

In one process, the suite's way (same workload, model, concurrency, memory probe around each run): the engine
with its prefix cache, the same again, mlx-lm's batch_generate (B1), the engine once more, and the engine with
its cache off. Prints each run's wall, prefill seconds and tokens, decode seconds and the cost per prefill token.
The GPU suite at ``350a9f4`` measured cached prefill at 4.7x the uncached cost per token, against ~1.6x in a
fresh process (``scripts/step_phases.py``); this says whether the order of runs explains the gap.
"""

# ruff: isort: skip_file
from __future__ import annotations

import sys

import mlxbatch  # noqa: F401  (first: it sets up MLX's BLAS on Linux CPUs)
from mlxbatch.bench.cli import parse_args
from mlxbatch.bench.harness import Bench, MemoryProbe, log


def main() -> None:
    args = parse_args(sys.argv[1:])
    b = Bench(args)
    C = b.concurrency
    w = b.workload(args.workload, args.rows)
    warm = w.subset(list(range(min(64, w.rows))))
    b.run_b1(warm.subset(list(range(16))), C, args.prefill_batch)
    b.run_engine(warm, max_num_seqs=C)
    b.run_engine(warm, max_num_seqs=C, prefix_cache=False)
    results = []

    def engine(tag: str, **cfg: object) -> None:
        with MemoryProbe() as probe:
            run = b.run_engine(w, max_num_seqs=C, **cfg)
        p = run.extra["profile"]
        cost = 1e6 * p["prefill_s"] / max(1, p["prefill_tokens"])
        results.append((tag, run.wall_s, p["prefill_s"], p["prefill_tokens"], p["decode_s"], cost,
                        (probe.mlx_peak - probe.mlx_base) / 2**30))
        log(f"{tag}: {results[-1]}")

    engine("engine")
    engine("engine again")
    with MemoryProbe() as probe:
        r = b.run_b1(w, C, args.prefill_batch)
    results.append(("B1", r.wall_s, r.extra["prompt_s"], w.prompt_tokens, r.extra["decode_s"],
                    1e6 * r.extra["prompt_s"] / w.prompt_tokens, (probe.mlx_peak - probe.mlx_base) / 2**30))
    engine("engine after B1")
    engine("engine, cache off", prefix_cache=False)
    print(f"\n{args.workload}: {w.rows} rows, {w.prompt_tokens} prompt tokens, concurrency {C}")
    print("| run | wall s | prefill s | prefill tok | decode s | us / prefill tok | peak GiB over start |")
    print("|---|---|---|---|---|---|---|")
    for tag, wall, ps, pt, ds, cost, mem in results:
        print(f"| {tag} | {wall:.2f} | {ps:.2f} | {pt:,} | {ds:.2f} | {cost:.1f} | {mem:.2f} |")


if __name__ == "__main__":
    main()
