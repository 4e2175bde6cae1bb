"""Overlapped steps on and off in one process (diagnostic, for an A/B on a GPU)

    python3 scripts/overlap_ab.py --model 0.5b --runs label:2048,fewshot:2048,chat:1024,unique:1024

Each workload runs four times, interleaved: overlap on, off, on, off (``EngineConfig.overlap_steps``). The first pair
pays the cuDNN graph builds of new prefill shapes (the first run of all more than the second); the second pair finds
them built. Prints wall, prefill / decode / host seconds, syncs, and rows whose tokens equal between on and off.
"""

# ruff: isort: skip_file
from __future__ import annotations

import sys

import mlxbatch  # noqa: F401  (first: it sets up MLX's BLAS on Linux CPUs)
from mlxbatch.bench.cli import parse_script_args
from mlxbatch.bench.harness import Bench, log


def main() -> None:
    mine, args = parse_script_args(sys.argv[1:], tag="", runs="label:2048,fewshot:2048,chat:1024,unique:1024")
    b = Bench(args)
    C = b.concurrency
    warm = b.workload("label", 64)
    b.run_engine(warm, max_num_seqs=C)
    rows = []
    for item in mine.runs.split(","):
        name, n = item.split(":")
        w = b.workload(name, int(n))
        tokens: dict[bool, list[list[int]]] = {}
        for pair in ("first", "again"):
            for overlap in (True, False):
                run = b.run_engine(w, max_num_seqs=C, overlap_steps=overlap)
                p = run.extra["profile"]
                tokens.setdefault(overlap, run.tokens)
                rows.append((name, pair, "on" if overlap else "off", run.wall_s, p["prefill_s"], p["decode_s"],
                             p["host_s"], p["steps"], p["syncs"]))
                log(f"  {name} {pair} {overlap}: " + ", ".join(f"{k} {v}" for k, v in p.items()
                                                              if k.endswith("build_s") or k.startswith("waited_")))
                log(f"{mine.tag} {rows[-1]}")
        same = sum(1 for a, c in zip(tokens[True], tokens[False]) if a == c)
        rows.append((name, "rows equal on/off", f"{same}/{len(w.prompts)}", 0, 0, 0, 0, 0, 0))
    print(f"\n{mine.tag}: concurrency {C}, mlxbatch from {mlxbatch.__file__}")
    print("| workload | pair | overlap | wall s | prefill s | decode s | host s | steps | syncs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, pair, ov, wall, ps, ds, hs, st, sy in rows:
        if pair == "rows equal on/off":
            print(f"| {name} | rows equal, on vs off (first runs) | {ov} | | | | | | |")
            continue
        print(f"| {name} | {pair} | {ov} | {wall:.2f} | {ps:.2f} | {ds:.2f} | {hs:.2f} | {st} | {sy} |")


if __name__ == "__main__":
    main()
