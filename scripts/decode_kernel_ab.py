"""The fused decode attention on and off, in one process: time and greedy agreement with mlx-lm (GPU diagnostic)

    python3 scripts/decode_kernel_ab.py --model 0.5b --runs label:512,unique:512

Each workload: B1 (mlx-lm's ``batch_generate``), the engine with the fused decode attention
(``mlxbatch.engine.kv.decode_attention``, CUDA) and without it (MLX's masked attention, what ran before). Prints
wall and decode seconds, and how many rows' greedy tokens equal B1's and the other engine run's, with the mean length
of the common prefix: in bf16 a near-tie between two logits flips with any change of rounding, so agreement below
100% is expected of any two paths; the question is whether the kernel moves it.
"""

# ruff: isort: skip_file
from __future__ import annotations

import sys

import mlxbatch  # noqa: F401  (first: it sets up MLX's BLAS on Linux CPUs)
from mlxbatch.bench.cli import parse_script_args
from mlxbatch.bench.harness import Bench, agreement, log
from mlxbatch.engine.kv import decode_attention


def common_prefix(a: list[list[int]], b: list[list[int]]) -> float:
    total = 0
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        total += n
    return total / max(1, len(a))


def main() -> None:
    mine, args = parse_script_args(sys.argv[1:], runs="label:512,unique:512")
    b = Bench(args)
    C = b.concurrency
    create = decode_attention.DecodeAttention.create
    b.run_engine(b.workload("label", 64), max_num_seqs=C)
    print("| workload | path | wall s | decode s | agree vs B1 | common prefix vs B1 | agree, kernel on vs off |")
    print("|---|---|---|---|---|---|---|")
    for item in mine.runs.split(","):
        name, n = item.split(":")
        w = b.workload(name, int(n))
        b1 = b.run_b1(w, C, 8)
        runs = {}
        for kernel in (True, False):
            decode_attention.DecodeAttention.create = create if kernel else (lambda *a, **k: None)  # type: ignore
            runs[kernel] = b.run_engine(w, max_num_seqs=C)
            log(f"{name} kernel={kernel}: {runs[kernel].wall_s:.2f} s")
        decode_attention.DecodeAttention.create = create  # type: ignore[method-assign]
        on_off = agreement(runs[True].tokens, runs[False].tokens, w.max_tokens)
        print(f"| {name} {n} | B1 | {b1.wall_s:.2f} | {b1.extra['decode_s']:.2f} | - | - | - |")
        for kernel, run in runs.items():
            same, rows = agreement(run.tokens, b1.tokens, w.max_tokens)
            print(f"| {name} {n} | engine, kernel {'on' if kernel else 'off'} | {run.wall_s:.2f} | "
                  f"{run.extra['profile']['decode_s']:.2f} | {same}/{rows} | "
                  f"{common_prefix(run.tokens, b1.tokens):.1f} / {w.max_tokens} | {on_off[0]}/{on_off[1]} |",
                  flush=True)


if __name__ == "__main__":
    main()
