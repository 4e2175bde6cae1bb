"""``mlxbatch bench kernels``: which device kernels an engine run spends its time in, and how busy the device is.

    python3 -m mlxbatch.bench kernels --model 0.5b --runs label:2048:1,label:2048,decode:256   # the GPU machine

Each run (``workload:rows[:max_tokens][:nocache]``; ``decode:N``: N rows of 32-token prompts, 128 new, the decode
table's shape) is an engine run, after a warm-up run of the same shape, under PyTorch's profiler, which records
every kernel of the process through CUPTI, MLX's included. It needs torch (the GPU machine has it; this project does
not depend on it) and a CUDA device. Prints per run: the wall, the kernels' summed time, the device's busy time (the
union of the kernels' intervals) and its share of the wall, and the kernels that took most of it, by name; then the
host's side: the CUDA runtime and driver calls (launches, allocations, copies, synchronisations) by host time.
``label:2048:1`` (one new token a row) is a run of prefill passes and little else. A step bound by the host shows
as a low busy share: the kernels a step (its launches) are then what to cut.
"""

from __future__ import annotations

import collections
import json
import sys
import tempfile
import time
from pathlib import Path

from mlxbatch.bench import workloads as wl
from mlxbatch.bench.harness import Bench, Table, log
from mlxbatch.bench.meta import emit
from mlxbatch.bench.options import parse_script_args
from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.types import SamplingParams

Event = tuple[str, float, float]  # name, start us, duration us


def parse_run(b: Bench, spec: str) -> tuple[wl.Workload, bool]:
    """A ``--runs`` item as (workload, prefix cache on)."""
    parts = spec.split(":")
    cache = parts[-1] != "nocache"
    name, rows, *new = parts if cache else parts[:-1]
    if name == "decode":
        w = wl.make("unique", b.vocab, int(rows), min_len=32, max_len=32, max_tokens=128)
    else:
        w = b.workload(name, int(rows))
    return (wl.Workload(w.name, w.prompts, int(new[0]), w.meta) if new else w), cache


def events(trace: Path, cats: tuple[str, ...]) -> list[Event]:
    """(name, start us, duration us) of every event of the categories ``cats`` in a Chrome trace."""
    data = json.loads(trace.read_text()).get("traceEvents", [])
    return [(e["name"], float(e["ts"]), float(e.get("dur", 0.0))) for e in data if e.get("cat") in cats]


def busy_us(kernels: list[Event]) -> float:
    """Microseconds the device ran at least one kernel (the union of their intervals)."""
    total, end = 0.0, -1.0
    for _, ts, dur in sorted(kernels, key=lambda k: k[1]):
        if ts >= end:
            total += dur
            end = ts + dur
        elif ts + dur > end:
            total += ts + dur - end
            end = ts + dur
    return total


def by_name(title: str, evs: list[Event], total_s: float, top: int) -> Table:
    sums: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for name, _, dur in evs:
        sums[name][0] += 1
        sums[name][1] += dur / 1e6
    tab = Table(title, ["name", "calls", "s", "share", "us a call"])
    for name, (n, s) in sorted(sums.items(), key=lambda kv: -kv[1][1])[:top]:
        tab.rows.append([name[:90], int(n), s, f"{s / total_s:.1%}" if total_s else "-", s / n * 1e6])
    return tab


def profile_run(b: Bench, spec: str, top: int) -> list[Table]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    w, cache = parse_run(b, spec)
    params = SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
    cfg = EngineConfig(seed=0, max_num_seqs=b.concurrency, prefix_cache=cache)
    with Engine(b.loaded, cfg) as eng:
        eng.generate(w.subset(list(range(min(64, w.rows)))).prompts, params)
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
        ks = events(path, ("kernel",))
        api = events(path, ("cuda_runtime", "cuda_driver"))
    busy, summed = busy_us(ks) / 1e6, sum(k[2] for k in ks) / 1e6
    api_s = sum(a[2] for a in api) / 1e6
    log(f"{spec}: {len(ks)} kernels")
    kern = by_name(f"{spec}: kernels by device time ({w.rows} rows, {w.max_tokens} new)", ks, busy, top)
    kern.notes += [
        f"wall {wall:.2f} s; prefill {stats['prefill_s']:.2f} s ({stats['prefill_tokens']:,} tokens), decode "
        f"{stats['decode_s']:.2f} s, {stats['steps']} steps; {len(ks):,} kernels ({len(ks) / max(1, stats['steps']):.0f} "
        f"a step), summed {summed:.2f} s, device busy {busy:.2f} s = {busy / wall:.0%} of the wall; share = of busy"]
    calls = by_name(f"{spec}: CUDA runtime and driver calls by host time", api, wall, top)
    calls.notes.append(f"{len(api):,} calls, {api_s:.2f} s of host time = {api_s / wall:.0%} of the wall; "
                       "share = of the wall")
    kern.raw = {"wall_s": wall, "busy_s": busy, "kernels": len(ks), "summed_s": summed, "api_s": api_s,
                "profile": stats}
    return [kern, calls]


def main(argv: list[str] | None = None) -> int:
    mine, args = parse_script_args(
        list(sys.argv[1:] if argv is None else argv), "kernels", __doc__,
        runs=("label:2048:1,decode:256", "workload:rows[:max_tokens][:nocache],... or decode:N"),
        top=(18, "kernels and calls listed per run (default 18)"))
    try:
        import torch
        from torch.profiler import ProfilerActivity  # noqa: F401
    except ImportError:
        raise SystemExit("mlxbatch bench kernels needs torch (its profiler records the kernels through CUPTI); "
                         "the GPU machine has it: run it there") from None
    if not torch.cuda.is_available():
        raise SystemExit("mlxbatch bench kernels needs a CUDA device: it profiles MLX's CUDA kernels")
    b = Bench(args)
    tables = [t for spec in mine.runs.split(",") for t in profile_run(b, spec, mine.top)]
    emit(b, tables)
    return 0
