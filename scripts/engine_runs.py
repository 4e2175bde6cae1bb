"""The engine alone on the suite's workloads, each run twice in one process (diagnostic, for A/B runs on a GPU)

    python3 scripts/engine_runs.py --model 0.5b --tag main --runs label:2048,fewshot:2048,chat:1024

Each workload: a first run (cuDNN builds a graph for every new attention shape) and the same run again (the graphs
are built). Prints wall, prefill seconds and tokens, decode seconds, and the prefill passes and their distinct
(rows, tokens, keys) shapes. For two commits on one machine: copy each commit's ``mlxbatch`` to a folder and run
this script once per folder with ``PYTHONPATH=<folder>``; compare the rows of one table, not machines.
"""

# ruff: isort: skip_file
from __future__ import annotations

import sys

import mlxbatch  # noqa: F401  (first: it sets up MLX's BLAS on Linux CPUs)
from mlxbatch.bench.cli import parse_script_args
from mlxbatch.bench.harness import Bench, log
from mlxbatch.engine.kv.slots import SlotBatch


def count_passes() -> list[tuple[int, int, int]]:
    """Record the (rows, tokens, keys) of every prefill pass (wraps ``SlotBatch.forward``; this script only)."""
    seen: list[tuple[int, int, int]] = []
    forward = SlotBatch.forward

    def recorded(self: SlotBatch, *a: object, **k: object) -> object:
        out = forward(self, *a, **k)
        fp = self.current_pass()
        if fp.width > 1:
            seen.append((fp.stop - fp.start, fp.width, fp.t_used))
        return out

    SlotBatch.forward = recorded  # type: ignore[method-assign]
    return seen


def main() -> None:
    mine, args = parse_script_args(sys.argv[1:], tag="", runs="label:2048,fewshot:2048,chat:1024")
    b = Bench(args)
    C = b.concurrency
    seen = count_passes()
    warm = b.workload("label", 64)
    b.run_engine(warm, max_num_seqs=C)
    rows = []
    for item in mine.runs.split(","):
        name, n = item.split(":")
        w = b.workload(name, int(n))
        for again in ("first", "again"):
            seen.clear()
            run = b.run_engine(w, max_num_seqs=C)
            p = run.extra["profile"]
            rows.append((name, again, run.wall_s, p["prefill_s"], p["prefill_tokens"], p["decode_s"], len(seen),
                         len(set(seen)), p.get("prefill_unfused_passes", "-")))
            log(f"{mine.tag} {rows[-1]}")
    print(f"\n{mine.tag}: concurrency {C}, mlxbatch from {mlxbatch.__file__}")
    print("| tag | workload | run | wall s | prefill s | prefill tok | decode s | passes | distinct shapes | unfused |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, again, wall, ps, pt, ds, np_, nd, nu in rows:
        print(f"| {mine.tag} | {name} | {again} | {wall:.2f} | {ps:.2f} | {pt:,} | {ds:.2f} | {np_} | {nd} | {nu} |")


if __name__ == "__main__":
    main()
