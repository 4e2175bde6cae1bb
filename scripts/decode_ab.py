"""The suite's decode table alone, for an A/B of engine folders on one GPU machine (diagnostic)

    PYTHONPATH=<folder> python3 scripts/decode_ab.py --model 0.5b --tag new --levels 64,256

Prints, per level, the engine step and forward tok/s against the bare mlx-lm forward + argmax loop measured in the
same process (``mlxbatch.bench.suite.suite_decode``: each path ``--decode-repeats`` times, interleaved, default 3;
medians, and the engine step's range). Run once per commit's ``mlxbatch`` folder.
"""

# ruff: isort: skip_file
from __future__ import annotations

import sys

import mlxbatch
from mlxbatch.bench.cli import parse_script_args
from mlxbatch.bench.harness import Bench
from mlxbatch.bench.suite import suite_decode


def main() -> None:
    mine, args = parse_script_args(sys.argv[1:], tag="", levels="64,256")
    b = Bench(args)
    _, raw = suite_decode(b, [int(x) for x in mine.levels.split(",")], repeats=args.decode_repeats)
    print(f"\n{mine.tag}: mlxbatch from {mlxbatch.__file__}")
    print("| tag | sequences | engine step tok/s | step min-max | engine fwd tok/s | bare tok/s | step x bare | "
          "fwd x bare |")
    print("|---|---|---|---|---|---|---|---|")
    for level, r in raw.items():
        lo, hi = min(r["engine_steps"]), max(r["engine_steps"])
        print(f"| {mine.tag} | {level} | {r['engine_step']:,.0f} | {lo:,.0f}-{hi:,.0f} | {r['engine_fwd']:,.0f} "
              f"| {r['bare']:,.0f} | {r['engine_step'] / r['bare']:.2f} | {r['engine_fwd'] / r['bare']:.2f} |")


if __name__ == "__main__":
    main()
