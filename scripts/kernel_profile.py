"""Which CUDA kernels an engine run spends the device's time in, and how busy the device is (GPU machine only).

    python3 scripts/kernel_profile.py --model 0.5b --runs label:2048:1,label:2048,decode:256

Each run (``workload:rows[:max_tokens]``; ``decode:N``: N rows of 32-token prompts, 128 new, the decode table's shape) is
an engine run (after a warm-up run of the same shape) under PyTorch's profiler, which records every kernel of the
process through CUPTI, MLX's included (the GPU machine has torch; this project does not depend on it). Prints, per
run: the wall, the kernels' summed time, the device's busy time (the union of the kernels' intervals) and its share
of the wall, and the kernels that took the most time, by name. ``label:2048:1`` (one new token a row) is a run of
prefill passes and little else. Then the host's side: the CUDA runtime and driver calls the run made (CUPTI records
them too: launches, allocations, copies, synchronisations), by name, with the host time each took, summed.
"""

# ruff: isort: skip_file
from __future__ import annotations

import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import mlxbatch  # noqa: F401  (first: it sets up MLX's BLAS on Linux CPUs)
from mlxbatch.bench import workloads as wl
from mlxbatch.bench.cli import parse_script_args
from mlxbatch.bench.harness import Bench, log
from mlxbatch.config import EngineConfig
from mlxbatch.engine import Engine
from mlxbatch.types import SamplingParams


def _workload(b: Bench, spec: str) -> wl.Workload:
    name, rows, *new = [p for p in spec.split(":") if p != "nocache"]
    if name == "decode":
        w = wl.make("unique", b.vocab, int(rows), min_len=32, max_len=32, max_tokens=128)
    else:
        w = b.workload(name, int(rows))
    return wl.Workload(w.name, w.prompts, int(new[0]), w.meta) if new else w


def _events(trace: Path, cats: tuple[str, ...]) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every event of the categories ``cats`` in a Chrome trace."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    return [(e["name"], float(e["ts"]), float(e.get("dur", 0.0))) for e in events if e.get("cat") in cats]


def _table(title: str, events: list[tuple[str, float, float]], total: float, top: int) -> None:
    by = collections.defaultdict(lambda: [0, 0.0])
    for name, _, dur in events:
        by[name][0] += 1
        by[name][1] += dur / 1e6
    print(f"| {title} | calls | s | share | us a call |")
    print("|---|---|---|---|---|")
    for name, (n, s) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| {name[:90]} | {n:,} | {s:.3f} | {s / total:.1%} | {s / n * 1e6:.1f} |")


def _busy(kernels: list[tuple[str, float, float]]) -> float:
    """Microseconds the device ran at least one kernel."""
    total, end = 0.0, -1.0
    for _, ts, dur in sorted(kernels, key=lambda k: k[1]):
        if ts >= end:
            total += dur
            end = ts + dur
        elif ts + dur > end:
            total += ts + dur - end
            end = ts + dur
    return total


def main() -> None:
    mine, args = parse_script_args(sys.argv[1:], runs="label:2048:1,decode:256", top="18")
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        sys.exit("kernel_profile.py needs torch (the GPU machine has it)")
    b = Bench(args)
    C = b.concurrency
    for spec in mine.runs.split(","):
        w = _workload(b, spec)
        params = SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
        warm = w.subset(list(range(min(64, w.rows))))
        cfg = EngineConfig(seed=0, max_num_seqs=C, prefix_cache=not spec.endswith(":nocache"))
        with Engine(b.loaded, cfg) as eng:
            eng.generate(warm.prompts, params)
        with Engine(b.loaded, cfg) as eng:
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                eng.generate(w.prompts, params)
                wall = time.perf_counter() - t0
            stats = eng.stats()["profile"]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            ks = _events(path, ("kernel",))
            api = _events(path, ("cuda_runtime", "cuda_driver"))
        busy, summed = _busy(ks) / 1e6, sum(k[2] for k in ks) / 1e6
        log(f"{spec}: {len(ks)} kernels")
        print(f"\n### {spec}: {w.rows} rows, {w.max_tokens} new; wall {wall:.2f} s, prefill {stats['prefill_s']:.2f} s "
              f"({stats['prefill_tokens']:,} tokens), decode {stats['decode_s']:.2f} s, {stats['steps']} steps")
        print(f"kernels {len(ks):,}, summed {summed:.2f} s, device busy {busy:.2f} s = {busy / wall:.0%} of the wall\n")
        _table("kernel (share of busy)", ks, busy, int(mine.top))
        api_s = sum(a[2] for a in api) / 1e6
        print(f"\nCUDA runtime and driver calls: {len(api):,}, {api_s:.2f} s of host time = {api_s / wall:.0%} of the "
              f"wall\n")
        _table("call (share of the wall)", api, wall, int(mine.top))


if __name__ == "__main__":
    main()
