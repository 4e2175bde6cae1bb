"""The bench's command line. ``mlxbatch bench ...`` and ``python -m mlxbatch.bench ...`` (the GPU machine's form, with
the tree on ``PYTHONPATH``) both end in :func:`main`.

    mlxbatch bench engine --model tiny [--workload label] [--json results.json]
    mlxbatch bench engine job --model tiny               # several sections, one model load
    mlxbatch bench gpu --model 0.5b --commit <sha> --out DIR   # the GPU suite
    mlxbatch bench userjob --model tiny --rows 20000     # subcommands with their own options (+ the bench's):
    mlxbatch bench runs | kernels | invariance | ray | constraints | vlm ...   # see each one's --help

In-process sections share one model object and print Markdown tables (a header with machine, software, git
commit and model first); ``--json`` also writes them with the raw runs. Its options are ``options``'s. This module
imports nothing heavy until it knows what to run, so a subcommand does not load the others.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from mlxbatch.bench.options import EXIT_USAGE, SECTION_MODULES, STANDALONE, parse_args


def run(args: argparse.Namespace) -> int:
    """Load the model once, run the sections in order, print their tables, write ``--json``."""
    import mlx.core as mx

    from mlxbatch.bench.harness import SECTIONS, Bench, log
    from mlxbatch.bench.meta import machine_meta, render_meta

    for name in args.section:  # only the sections asked for: the job section alone imports the job layer
        importlib.import_module(f"mlxbatch.bench.{SECTION_MODULES[name]}")
    if args.repeats is None:
        args.repeats = 3 if mx.default_device() == mx.gpu else 1
    t0 = time.perf_counter()
    b = Bench(args)
    meta = machine_meta(b)
    print(render_meta(meta), flush=True)
    results: dict[str, Any] = {"meta": meta, "args": vars(args), "sections": {}}
    for name in args.section:
        ts = time.perf_counter()
        tables = SECTIONS[name](b)
        for t in tables:
            print(t.render(), flush=True)
        results["sections"][name] = {
            "seconds": round(time.perf_counter() - ts, 1),
            "tables": [t.as_dict() for t in tables],
        }
    total = time.perf_counter() - t0
    print(f"(total {total:.0f} s)")
    results["total_s"] = round(total, 1)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2, default=str))
        log(f"wrote {args.json_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in STANDALONE:
        try:
            return int(importlib.import_module(STANDALONE[argv[0]]).main(argv[1:]) or 0)
        except SystemExit as exc:  # a stand-alone bench parses its own options with plain argparse: 2 is bad usage
            if exc.code == 2:
                raise SystemExit(EXIT_USAGE) from None
            raise
    return run(parse_args(argv))
