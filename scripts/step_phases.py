"""Where an engine step's time goes on a device, phase by phase (diagnostic: each phase is synchronised, so the
walls add up to more than an unprofiled run; the split is what counts).

    python3 scripts/step_phases.py --model 0.5b --workload label --rows 2048

Wraps the runner's phases (prefix copy-ins, row moves, forwards by kind and shape, sampling, cache stores, frees)
with a device synchronisation before and after, and prints the seconds per phase; prefill forwards are split by
whether their (rows, tokens, keys) shape was seen before in the run. The copy-ins are also split into their parts
(indented: running rows' prefixes, the store's gather, the writes into the rows, which the first includes), each
evaluated on its own. On CUDA a step's prefill rows run as one packed pass (``kv.packed``), listed by its groups.
"""

# ruff: isort: skip_file
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import mlxbatch  # noqa: F401  (first: it sets up MLX's BLAS on Linux CPUs)
import mlx.core as mx
import mlxbatch.engine.kv.reuse as reuse
import mlxbatch.engine.runner as runner_mod
from mlxbatch.bench import workloads as wl
from mlxbatch.bench.harness import resolve_model
from mlxbatch.config import EngineConfig
from mlxbatch.engine import Engine
from mlxbatch.engine.core import EngineCore
from mlxbatch.engine.kv.prefix_store import PrefixStore
from mlxbatch.engine.kv.slots import SlotBatch
from mlxbatch.engine.request import Request
from mlxbatch.engine.sched.scheduler import Scheduler
from mlxbatch.types import SamplingParams

SECONDS: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()
SEEN: set = set()
PASSES: list = []


def timed(name, fn, sync=True):
    """``fn`` timed under ``name``; ``sync``: a device phase, synchronised before and after (host-only phases are
    not: two syncs around a per-token call would cost more than the call)."""
    def run(*a, **kw):
        if sync:
            mx.synchronize()
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        if sync:
            if isinstance(out, mx.array):
                mx.eval(out)
            mx.synchronize()
        SECONDS[name] += time.perf_counter() - t0
        CALLS[name] += 1
        return out
    return run


def settled(name, fn, arrays):
    """A part of a phase (its name starts with a space: not added again to the total), timed with everything it made
    lazily: ``arrays(self, out)`` are evaluated before the clock stops (a diagnostic sync the engine does not make)."""
    def run(self, *a, **kw):
        mx.synchronize()
        t0 = time.perf_counter()
        out = fn(self, *a, **kw)
        mx.eval(arrays(self, out))
        mx.synchronize()
        SECONDS[name] += time.perf_counter() - t0
        CALLS[name] += 1
        return out
    return run


def forward(orig):
    def run(self, model, start, tokens, full=False, offsets=None):
        n, T = len(tokens), max(len(t) for t in tokens)
        offs = list(offsets) if offsets is not None else self.lengths[start : start + n]
        K = max(o + T for o in offs)
        kind = "decode" if T == 1 else "prefill"
        if kind == "prefill":
            key = (n, T, K, len(set(offs)) == 1)
            kind += " (new shape)" if key not in SEEN else " (seen shape)"
            SEEN.add(key)
        before = SECONDS[f"forward: {kind}"]
        out = timed(f"forward: {kind}", orig)(self, model, start, tokens, full, offsets)
        if T > 1:  # each prefill pass: (tokens computed, longest keys, seconds, how it attends, rows x tokens run)
            fp = self.current_pass()
            how = ("causal" if isinstance(fp.mask, str) else "array mask") + (", fused" if fp.fused else ", unfused")
            PASSES.append((sum(len(t) for t in tokens), K, SECONDS[f"forward: {kind}"] - before, how,
                           (fp.stop - fp.start) * fp.width))
        return out
    return run


def forward_packed(orig):
    """``SlotBatch.forward_packed`` (CUDA: a step's prefill rows in one pass, ``kv.packed``), timed as a prefill
    pass; its run tokens are its padded tokens (what its projections and MLP run)."""
    def run(self, model, start, tokens, sizes, rows):
        before = SECONDS["forward: prefill (packed)"]
        out = timed("forward: prefill (packed)", orig)(self, model, start, tokens, sizes, rows)
        fp = self.current_pass()
        kind = ("packed, one kernel" if fp.kernel is not None else
                f"packed, {len(fp.groups)} groups" if len(fp.groups) < 4 else "packed, 4+ groups")
        PASSES.append((fp.tokens, fp.keys, SECONDS["forward: prefill (packed)"] - before, kind, fp.padded))
        return out
    return run


def pass_sizes() -> None:
    """Prefill passes by the tokens they compute: small passes (a few rows admitted as slots free) cost more per
    token than large ones, whatever the cache saved."""
    print("  prefill passes by tokens computed | passes | s | tokens/s | mean longest keys")
    for lo, hi in ((1, 512), (513, 1024), (1025, 2048), (2049, 4096), (4097, 1 << 30)):
        got = [p for p in PASSES if lo <= p[0] <= hi]
        if got:
            tok, sec = sum(p[0] for p in got), sum(p[2] for p in got)
            print(f"    {lo:>5}-{min(hi, 99999):<5} | {len(got):4d} | {sec:6.2f} | {tok / sec:9,.0f} | "
                  f"{sum(p[1] for p in got) / len(got):7.0f}")
    print("  prefill passes by how they attend | passes | s | tokens/s | run (padded) / computed tokens")
    for how in sorted({p[3] for p in PASSES}):
        got = [p for p in PASSES if p[3] == how]
        tok, sec = sum(p[0] for p in got), sum(p[2] for p in got)
        print(f"    {how:22s} | {len(got):4d} | {sec:6.2f} | {tok / sec:9,.0f} | {sum(p[4] for p in got) / tok:5.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="0.5b")
    ap.add_argument("--workload", action="append")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    a = ap.parse_args()
    reuse.admit = timed("prefix copy-ins (admit)", reuse.admit)
    reuse.store_blocks = timed("cache stores", reuse.store_blocks)
    drawing = sys.modules[runner_mod.ModelRunner._draw_commit.__module__]  # where the runner draws its tokens
    drawing.draw = timed("sampling", drawing.draw)
    drawing.draw_greedy = timed("sampling (greedy)", drawing.draw_greedy)
    Scheduler.schedule = timed("host: schedule", Scheduler.schedule, sync=False)
    Scheduler.finish_step = timed("host: finish_step", Scheduler.finish_step, sync=False)
    Request.append = timed("host: append tokens (detok, stops)", Request.append, sync=False)
    EngineCore._collect = timed("host: collect outputs", EngineCore._collect, sync=False)
    # the copy-ins' parts: running rows' prefixes, the store's gather of cached blocks, their scatter into the slots
    SlotBatch.copy_prefixes = settled("  copy-ins: running rows' prefixes", SlotBatch.copy_prefixes,
                                      lambda b, _: b.kv_arrays())
    PrefixStore.gather = settled("  copy-ins: gather cached blocks", PrefixStore.gather, lambda _, out: out)
    SlotBatch.write_prefix = settled("  copy-ins: write prefixes into rows (both kinds)", SlotBatch.write_prefix,
                                     lambda b, _: b.kv_arrays())
    for name in ("arrange", "promote_many", "remove_many", "shrink"):
        setattr(SlotBatch, name, timed(f"rows: {name}", getattr(SlotBatch, name)))
    SlotBatch.forward = forward(SlotBatch.forward)
    SlotBatch.forward_packed = forward_packed(SlotBatch.forward_packed)
    path = resolve_model(a.model, Path("~/.cache/mlxbatch/bench").expanduser())
    for name in a.workload or ["label"]:
        w = wl.make(name, wl.Vocab(0, 1000), a.rows, seed=0)
        eng = Engine(path, EngineConfig(seed=0, max_num_seqs=a.max_num_seqs))
        SECONDS.clear()
        CALLS.clear()
        SEEN.clear()
        PASSES.clear()
        t0 = time.perf_counter()
        eng.generate(w.prompts, SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True))
        wall = time.perf_counter() - t0
        p = eng.stats()["profile"]
        eng.close()
        print(f"\n{name}: {w.rows} rows, wall {wall:.2f} s, steps {p['steps']}, prefill tokens {p['prefill_tokens']}")
        for k, v in sorted(SECONDS.items(), key=lambda kv: -kv[1]):
            print(f"  {k:32s} {v:7.2f} s  {CALLS[k]:5d} calls  {1e3 * v / CALLS[k]:7.2f} ms/call")
        top = sum(v for k, v in SECONDS.items() if not k.startswith(" "))  # parts are inside their phase's time
        print(f"  {'(rest: host)':32s} {wall - top:7.2f} s", flush=True)
        pass_sizes()


if __name__ == "__main__":
    main()
