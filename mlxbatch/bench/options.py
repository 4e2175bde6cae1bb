"""The bench's options: those every in-process section shares (``build_parser``, ``parse_args``), and a subcommand's
own on top of them (``parse_script_args``). Which names are sections and which are subcommands is decided here.
Imports nothing heavy: ``mlxbatch bench --help`` and a bad option load no MLX.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

SECTION_MODULES = {"engine": "engine", "job": "job", "nsample": "tasks", "score": "tasks", "gpu": "suite"}
IN_PROCESS = tuple(SECTION_MODULES)  # each registers itself (harness.SECTIONS) when its module is imported
# subcommands with their own options (``main(argv)``); those that load a model also take the bench's options
STANDALONE = {"constraints": "mlxbatch.bench.constraints", "vlm": "mlxbatch.bench.vlm",
              "runs": "mlxbatch.bench.runs", "kernels": "mlxbatch.bench.kernels",
              "invariance": "mlxbatch.bench.invariance", "ray": "mlxbatch.bench.ray_runs",
              "userjob": "mlxbatch.bench.userjob"}
SHAPES = ("tiny", "tiny64", "small", "small64", "0.5b")  # mlxbatch.models.random_model.SHAPES (checked by the tests; kept light here)
EXIT_USAGE = 64  # bad usage, as every mlxbatch command (argparse's own 2 is an invalid job file in mlxbatch.cli)


class _Parser(argparse.ArgumentParser):
    """argparse, with bad usage exiting EXIT_USAGE."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="mlxbatch bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [SECTION ...] [options]  |  %(prog)s SUBCOMMAND [options]",
        description="mlxbatch benchmarks: every figure is a ratio against baselines run in the same process.",
        epilog="subcommands (their own options too; see their --help): " + ", ".join(STANDALONE))
    ap.add_argument("sections", nargs="*", metavar="SECTION",
                    help=f"section(s) to run: {', '.join(IN_PROCESS)} (default: engine)")
    ap.add_argument("--section", action="append", choices=list(IN_PROCESS),
                    help="section(s) to run (repeatable; the same as the positional names)")
    ap.add_argument("--model", default="tiny",
                    help=f"{'|'.join(SHAPES)} (random-weight qwen2, built once into --cache-dir) or a model path "
                         "(default tiny)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto (default): float32 on CPU, bfloat16 on GPU")
    ap.add_argument("--cache-dir", default="~/.cache/mlxbatch/bench", help="where random models are built")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    ap.add_argument("--rows", type=int, default=256, help="rows of the main workload (default 256)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="new tokens per row (default: the workload's: unique 64, label 32, fewshot 8, chat 32)")
    ap.add_argument("--workload", default="unique", choices=["unique", "label", "fewshot", "chat"],
                    help="engine section workload (default unique; others add engine-nocache)")
    ap.add_argument("--b0-rows", type=int, default=16, help="rows B0 runs (default 16; 0 skips B0)")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="engine max_num_seqs = B1 completion_batch_size (default 32 on CPU, 256 on GPU)")
    ap.add_argument("--prefill-batch", type=int, default=8, help="B1/B2 prefill_batch_size (default 8, as mlx-lm)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs per path, median reported (default: engine 1 on CPU, 3 on GPU; job 3)")
    ap.add_argument("--decode-levels", default="1,8,64,256",
                    help="concurrent sequences for the decode table (default 1,8,64,256; '' skips it)")
    ap.add_argument("--decode-prompt-len", type=int, default=32, help="decode table prompt length (default 32)")
    ap.add_argument("--decode-new-tokens", type=int, default=128, help="decode table new tokens (default 128)")
    ap.add_argument("--decode-repeats", type=int, default=3,
                    help="GPU suite: runs of each decode-table path, interleaved; medians (default 3)")
    ap.add_argument("--job-rows", type=int, default=512, help="job section: rows of the overhead run (default 512; "
                    "0 skips it)")
    ap.add_argument("--job-max-tokens", type=int, default=16, help="job section: max_tokens (default 16)")
    ap.add_argument("--job-checkpoint-rows", type=int, default=64,
                    help="job section: checkpoint.every_rows (default 64)")
    ap.add_argument("--stream-rows", default="10000,100000,1000000",
                    help="job section: rows streamed through reader + checkpoint, one process each ('' skips)")
    ap.add_argument("--stream-checkpoint-rows", type=int, default=1000,
                    help="job section: rows per checkpoint shard when streaming (default 1000)")
    ap.add_argument("--stream-track-ids", default="1000000",
                    help="job section: sizes also streamed with the run loop's duplicate-id set (default 1000000)")
    ap.add_argument("--stream-timeout", type=int, default=1200, help="job section: seconds per size (default 1200)")
    ap.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    ap.add_argument("--commit", default=os.environ.get("GIT_SHA"),
                    help="the git commit measured (default $GIT_SHA; for copies of the tree without .git)")
    ap.add_argument("--out", default=None, help="gpu section: folder for gpu_suite.json and gpu_suite.md")
    ap.add_argument("--suite-workloads", default="label,fewshot,chat,unique",
                    help="gpu section: workloads to run (default label,fewshot,chat,unique)")
    ap.add_argument("--generic", action=argparse.BooleanOptionalAction, default=True,
                    help="gpu section: also run the engine as a Mac's GPU does (CUDA text path off: MLX's attention, "
                         "no packed prefill), a second column (default on)")
    ap.add_argument("--rows-scale", type=float, default=1.0,
                    help="gpu section: scale the target sizes (default 1: label/fewshot 2048, chat/unique 1024)")
    ap.add_argument("--suite-rows", type=int, default=None,
                    help="gpu section: rows of every workload, instead of the target sizes x --rows-scale "
                         "(a quick check on a small machine)")
    return ap


def parse_args(argv: list[str] | None = None, defaults: dict[str, Any] | None = None) -> argparse.Namespace:
    ap = build_parser()
    ap.set_defaults(**(defaults or {}))  # a subcommand's own defaults for the bench's options
    args = ap.parse_intermixed_args(argv)  # section names may come before, between or after options
    unknown = [s for s in args.sections if s not in IN_PROCESS]
    if unknown:
        where = " (a stand-alone bench: give it first, alone)" if set(unknown) & set(STANDALONE) else ""
        ap.error(f"unknown section(s) {', '.join(unknown)}{where}; choose from {', '.join(IN_PROCESS)}")
    names = [*args.sections, *(args.section or [])]
    args.section = list(dict.fromkeys(names)) or ["engine"]  # in the order given, each once
    del args.sections
    args.repeats_given = args.repeats is not None
    return args


def parse_script_args(argv: list[str], name: str, doc: str, defaults: dict[str, Any] | None = None,
                      **own: tuple[Any, str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    """A subcommand's own options and the bench's options (``--model``, ``--concurrency``, ``--json`` ...) from the
    rest of ``argv``, with ``defaults`` for the latter. ``own``: ``--name`` (``_`` -> ``-``) for each keyword, as
    (default, help); the default's type is the option's (a bool default makes a flag)."""
    ap = _Parser(prog=f"mlxbatch bench {name}", add_help=False, description=doc,
                 formatter_class=argparse.RawDescriptionHelpFormatter,
                 epilog="and the bench's options (mlxbatch bench --help): --model, --dtype, --cache-dir, --seed, "
                        "--concurrency, --prefill-batch, --commit, --json ...")
    for key, (default, help_) in own.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(default, bool):
            ap.add_argument(flag, action="store_true", default=default, help=help_)
        else:
            ap.add_argument(flag, type=type(default) if default is not None else str, default=default, help=help_)
    if "-h" in argv or "--help" in argv:
        ap.print_help()
        raise SystemExit(0)
    mine, rest = ap.parse_known_args(argv)
    return mine, parse_args(rest, defaults)
