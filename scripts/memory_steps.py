"""Where the engine's working memory peaks, step by step, against B1's (diagnostic, GPU)

    python3 scripts/memory_steps.py --model 0.5b --runs unique:1024,fewshot:2048 [--top 8]

For each workload, in one process: mlx-lm's batch_generate (B1) and the engine, each inside the suite's
``MemoryProbe`` (peak MLX memory over the run's start). The engine's peak is then found step by step: the peak is
reset before every ``EngineCore.step`` and read after it (with a synchronize), beside the step's make-up (decode
rows, prefill chunks and tokens) and the KV it holds at the end of the step (slot buffers, prefix store). Prints
the steps with the highest peaks. Wraps our own ``EngineCore.step`` and ``ModelRunner.launch`` (this script only).
"""

# ruff: isort: skip_file
from __future__ import annotations

import sys

import mlx.core as mx

import mlxbatch  # noqa: F401  (first: it sets up MLX's BLAS on Linux CPUs)
from mlxbatch.bench.cli import parse_script_args
from mlxbatch.bench.harness import Bench, MemoryProbe, log
from mlxbatch.engine import runner as runner_mod
from mlxbatch.engine.core import EngineCore

GiB = 2**30


def main() -> None:
    mine, args = parse_script_args(sys.argv[1:], runs="unique:1024,fewshot:2048", top="8")
    mine.top = int(mine.top)
    b = Bench(args)
    C = b.concurrency
    steps: list[dict] = []
    shape: dict = {}
    runner_cls = runner_mod.ModelRunner
    launch, step = runner_cls.launch, EngineCore.step

    def recorded_launch(self, out):  # type: ignore[no-untyped-def]
        shape.update(decodes=len(out.decodes), chunks=len(out.prefills),
                     prefill_tok=sum(c.end - c.start for c in out.prefills), stores=len(out.stores))
        return launch(self, out)

    def measured_step(self):  # type: ignore[no-untyped-def]
        shape.clear()
        mx.synchronize()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        deltas = step(self)
        mx.synchronize()
        st = self.runner.stats()
        steps.append({"peak": mx.get_peak_memory(), "base": base, "after": mx.get_active_memory(), "slots": st.kv_bytes,
                      "store": st.prefix_store_bytes, "cap": f"{self.runner.batch._rows_cap}x{self.runner.batch._pos_cap}", **shape})
        return deltas

    runner_cls.launch, EngineCore.step = recorded_launch, measured_step
    b.run_engine(b.workload("label", 32), max_num_seqs=C)
    for item in mine.runs.split(","):
        name, n = item.split(":")
        w = b.workload(name, int(n))
        with MemoryProbe() as p1:
            b.run_b1(w, C, args.prefill_batch)
        steps.clear()
        with MemoryProbe() as pe:
            b.run_engine(w, max_num_seqs=C)
        start = pe.mlx_base  # the probe's own peak is reset at every step: the engine's is the steps' highest
        b1, eng = (p1.mlx_peak - p1.mlx_base) / GiB, (max(s["peak"] for s in steps) - start) / GiB
        print(f"\n{name} {n}: B1 peak over start {b1:.2f} GiB, engine {eng:.2f} GiB ({eng / max(b1, 1e-9):.2f}x); "
              f"{len(steps)} steps")
        print("| step | peak over start GiB | active after | slots GiB | store GiB | rows x positions | decodes | chunks "
              "| prefill tok | stores |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        top = sorted(range(len(steps)), key=lambda i: -steps[i]["peak"])[: mine.top]
        for i in sorted(top):
            s = steps[i]
            print(f"| {i} | {(s['peak'] - start) / GiB:.2f} | {(s['after'] - start) / GiB:.2f} | {s['slots'] / GiB:.2f} "
                  f"| {s['store'] / GiB:.2f} | {s['cap']} | {s.get('decodes', 0)} | {s.get('chunks', 0)} "
                  f"| {s.get('prefill_tok', 0)} | {s.get('stores', 0)} |")
        log(f"{name} done")


if __name__ == "__main__":
    main()
