"""Which engine launch each CUDA kernel of a run came from (GPU machine only; diagnostic).

    python3 scripts/launch_sites.py --model 0.5b --runs label:2048:1,label:2048:1:nocache

Every evaluation of the engine goes through ``Traffic.launch`` or ``Traffic.evaluate``, and MLX encodes and launches
a graph's kernels inside that call (direct launches). This script wraps both in a PyTorch profiler range named after
the launch's kind and its callers (``kind <- caller <- caller's caller``), records the run with CUPTI (the GPU machine
has torch; this project does not depend on it), and ties each kernel to the range its launch call ran in through
CUPTI's correlation ids. Prints, per run (``workload:rows[:max_tokens][:nocache]``, after a warm-up run of the same
shape): kernels a step by launch site, then each site's kernels by name. Kernels launched outside every range are
``(outside)``.
"""

# ruff: isort: skip_file
from __future__ import annotations

import bisect
import collections
import json
import sys
import tempfile
from pathlib import Path

import mlxbatch  # noqa: F401  (first: it sets up MLX's BLAS on Linux CPUs)
from mlxbatch.bench import workloads as wl
from mlxbatch.bench.cli import parse_script_args
from mlxbatch.bench.harness import Bench
from mlxbatch.config import EngineConfig
from mlxbatch.engine import Engine
from mlxbatch.engine.outputs import Traffic
from mlxbatch.types import SamplingParams


def _site(kind: str) -> str:
    f = sys._getframe(2)  # 0: _site, 1: the wrapper, 2: Traffic's caller
    names = []
    for _ in range(2):
        if f is None:
            break
        names.append(f"{Path(f.f_code.co_filename).stem}.{f.f_code.co_name}")
        f = f.f_back
    return " <- ".join([kind, *names])


def _wrap(record_function) -> None:
    launch, evaluate = Traffic.launch, Traffic.evaluate

    def launched(self: Traffic, kind: str, *arrays: object) -> int:
        with record_function(_site(kind)):
            return launch(self, kind, *arrays)

    def evaluated(self: Traffic, *arrays: object) -> None:
        with record_function(_site("evaluate")):
            evaluate(self, *arrays)

    Traffic.launch, Traffic.evaluate = launched, evaluated


def _attribute(trace: Path) -> list[tuple[str, str]]:
    """(site, kernel name) of every kernel in the trace."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    ranges = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                    if e.get("cat") == "user_annotation")  # the launch calls: one at a time, never nested
    starts = [r[0] for r in ranges]
    site_of: dict[int, str] = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            i = bisect.bisect_right(starts, e["ts"]) - 1
            inside = i >= 0 and e["ts"] <= ranges[i][1]
            site_of[e["args"]["correlation"]] = ranges[i][2] if inside else "(outside)"
    return [(site_of.get(e.get("args", {}).get("correlation"), "(outside)"), e["name"][:90])
            for e in events if e.get("cat") == "kernel"]


def main() -> None:
    mine, args = parse_script_args(sys.argv[1:], runs="label:2048:1,label:2048:1:nocache", top="8")
    try:
        from torch.profiler import ProfilerActivity, profile, record_function
    except ImportError:
        sys.exit("launch_sites.py needs torch (the GPU machine has it)")
    _wrap(record_function)
    b = Bench(args)
    for spec in mine.runs.split(","):
        name, rows, *new = [p for p in spec.split(":") if p != "nocache"]
        w = b.workload(name, int(rows))
        w = wl.Workload(w.name, w.prompts, int(new[0]), w.meta) if new else w
        params = SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
        cfg = EngineConfig(seed=0, max_num_seqs=b.concurrency, prefix_cache=not spec.endswith(":nocache"))
        with Engine(b.loaded, cfg) as eng:
            eng.generate(w.subset(list(range(min(64, w.rows)))).prompts, params)
        with Engine(b.loaded, cfg) as eng:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                eng.generate(w.prompts, params)
            steps = eng.stats()["profile"]["steps"]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            kernels = _attribute(path)
        by_site = collections.Counter(s for s, _ in kernels)
        print(f"\n### {spec}: {len(kernels):,} kernels in {steps} steps ({len(kernels) / steps:.0f} a step)\n")
        print("| launch site | kernels a step |\n|---|---|")
        for site, n in by_site.most_common():
            print(f"| {site} | {n / steps:.1f} |")
        for site, _ in by_site.most_common(6):
            names = collections.Counter(k for s, k in kernels if s == site)
            print(f"\n{site}: " + "; ".join(f"{k} x {n / steps:.1f}" for k, n in names.most_common(int(mine.top))))


if __name__ == "__main__":
    main()
