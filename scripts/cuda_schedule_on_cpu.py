"""The engine on this machine with CUDA's decisions forced: what the suite's workloads compute, copy and launch.

    python3 scripts/cuda_schedule_on_cpu.py --model tiny --runs label:512,fewshot:512,chat:256
    PYTHONPATH=/path/to/other/tree python3 scripts/cuda_schedule_on_cpu.py ...   # the same for another commit

No GPU is needed: the planner, the scheduler and the copies' books are the same code everywhere, so the engine on a
CPU with the CUDA path's flags set (packed prefill passes, rows that stay in their slots, batched copies, filled
passes, a block reuse step) takes the decisions the H200 takes: the same prefill tokens, bytes moved and stored,
syncs and KV copy operations (``Traffic.copy_ops``: a device kernel each on CUDA, where a span read of every buffer
is one kernel and here a gather per buffer). Compare two commits' tables row by row; the walls are CPU walls, and
the greedy tokens (their hash) must not change. Diagnostic only: GPU figures come from the GPU suite
(docs/benchmarks.md).
"""

# ruff: isort: skip_file
from __future__ import annotations

import dataclasses
import hashlib
import sys
import time

import mlxbatch  # (first: it sets up MLX's BLAS on Linux CPUs)
from mlxbatch import SamplingParams
from mlxbatch.bench.cli import parse_script_args
from mlxbatch.bench.harness import Bench, log
from mlxbatch.engine import Engine, EngineConfig

BLOCK = 16  # the reuse step where prefill passes are packed (``EngineCore.reuse_step``)
STEP_TOKENS = 4096  # prefill tokens a step on NVIDIA GPUs (``model.memory.default_step_tokens``)


def cuda_decisions(engine: Engine, max_num_seqs: int) -> None:
    """Set the CUDA path's flags on a new engine (before any row is added): what ``ModelRunner`` and ``EngineCore``
    set where the device is a CUDA GPU. The kernels stay MLX's ops: only the decisions are CUDA's."""
    core = engine.core
    batch = core.runner.batch
    batch.batched_moves = batch.rows_stay = batch.shape_buckets = batch.packed_prefill = True  # type: ignore[attr-defined]
    core.reuse_step = BLOCK
    if core.scheduler.prefix is not None:
        core.scheduler.prefix.live_margin = BLOCK
    core.scheduler.config = dataclasses.replace(core.scheduler.config, fill_slots=max_num_seqs // 16)


def main() -> None:
    mine, args = parse_script_args(sys.argv[1:], tag="", runs="label:512,fewshot:512,chat:256")
    b = Bench(args)
    C = b.concurrency
    params = lambda w: SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)  # noqa: E731
    rows = []
    for item in mine.runs.split(","):
        name, n = item.split(":")
        w = b.workload(name, int(n))
        engine = Engine(b.loaded, EngineConfig(seed=0, max_num_seqs=C, max_num_batched_tokens=STEP_TOKENS,
                                               warm_up=False))
        cuda_decisions(engine, C)
        try:
            t0 = time.perf_counter()
            outs = engine.generate(w.prompts, params(w))
            wall = time.perf_counter() - t0
            p = engine.stats()["profile"]
        finally:
            engine.close()
        digest = hashlib.sha256(repr([list(o.token_ids) for o in outs]).encode()).hexdigest()[:12]
        rows.append((f"{name} {n}", wall, p["prefill_tokens"], w.trie_floor, p["steps"], p["moved_bytes"] / 2**20,
                     p["stored_bytes"] / 2**20, p["syncs"], p.get("copy_ops", "-"), digest))
        log(f"{mine.tag} {rows[-1]}")
    print(f"\n{mine.tag}: concurrency {C}, {STEP_TOKENS} tokens a step, CUDA's decisions; model {b.model_path}; "
          f"mlxbatch from {mlxbatch.__file__}")
    print("| tag | workload | wall s (CPU) | prefill tok | floor | steps | moved MB | stored MB | syncs | copy ops "
          "| tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, wall, pt, floor, steps, moved, stored, syncs, ops, digest in rows:
        print(f"| {mine.tag} | {name} | {wall:.2f} | {pt:,} | {floor:,} | {steps} | {moved:.1f} | {stored:.1f} "
              f"| {syncs} | {ops} | {digest} |")


if __name__ == "__main__":
    main()
