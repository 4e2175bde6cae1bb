"""The GPU suite: every workload of the GPU targets and the decode table in one run, one JSON + one Markdown file.

    python3 -m mlxbatch.bench gpu --model 0.5b --commit <sha> --out DIR      # the tree on PYTHONPATH
    python3 -m mlxbatch.bench gpu --model 0.5b --suite-workloads '' --decode-levels 64,256   # the decode table alone

For the GPU benchmark machine (one device call, under 10 minutes), where the copy of the tree has no ``.git``:
the commit is passed in and printed in the header and both files. Sizes are those of the GPU targets in
docs/benchmarks.md: label 2048 rows, fewshot 2048, chat 1024, unique 1024, then decode at 1/8/64/256
sequences against mlx-lm's BatchGenerator and a bare mlx-lm forward + argmax of the same model, batch and context.

Every path runs once, after a warm-up on the same workload's first rows (kernels compile on first use on a GPU, and
a single timed run must not include that), and the engine's construction (with its own warm-up) is not timed. The
engine then runs once more ("engine-again"): its prefill shapes were met by the first run, so on CUDA it builds no
cuDNN attention graph, as a long job whose bucketed shapes recur; x B1 stays the first run's. So does the generic
path's ("engine-generic-again"), whose shapes are not bucketed: a first run on CUDA pays a graph build per shape.
Figures per workload: wall and x B1, prefill tokens / trie floor, where the time goes, what the steps moved
(``Traffic``: KV bytes copied, syncs), the cost per computed prefill token with the cache against without it, and
working memory against B1's.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxbatch.bench import workloads as wl
from mlxbatch.bench.harness import MB, Bench, Run, Table, agreement, log, ratio, section
from mlxbatch.bench.meta import machine_meta, render_meta
from mlxbatch.engine import LayoutOptions

# the path a Mac's GPU takes, run on this GPU: a GPU's row moves (``LayoutOptions.base`` of a GPU) and nothing of the
# CUDA text path (MLX's attention, no packed prefill or shape buckets, no compiled decode, no fused projections;
# hence reuse to the token, unfilled passes). The engine suite's second column: how much of the speed is the CUDA
# kernels', and what a Mac user gets from the rest
GENERIC = LayoutOptions(batched_moves=True)
# a Mac's decisions for ``Bench.run_engine``: that layout, and steps launched from the engine's own thread (Metal has
# no launch thread); overlapped steps follow the configuration (unset: on, as on a Mac's GPU)
MAC: dict[str, Any] = {"layout": GENERIC, "launch_thread": False}

SIZES = {"label": 2048, "fewshot": 2048, "chat": 1024, "unique": 1024}


def suite_rows(rows: int | None, scale: float, name: str) -> int:
    """Rows of workload ``name``: ``rows`` if given, else its target size x ``scale`` (64 at least when scaled)."""
    if rows:
        return rows
    return SIZES[name] if scale == 1 else max(64, int(SIZES[name] * scale))


def _prefill_cost(run: Run) -> float | None:
    p = run.extra["profile"]
    return p["prefill_s"] / p["prefill_tokens"] if p["prefill_tokens"] else None


def suite_workload(b: Bench, name: str, rows: int) -> tuple[Table, dict]:
    w = b.workload(name, rows)
    C = b.concurrency
    warm = w.subset(list(range(min(64, w.rows))))
    log(f"{name}: {w.rows} rows, {w.prompt_tokens} prompt tokens (floor {w.trie_floor}); warming up on {warm.rows}")
    b.run_b1(warm.subset(list(range(min(16, warm.rows)))), C, b.args.prefill_batch)
    b.run_engine(warm, max_num_seqs=C)
    b.run_engine(warm, max_num_seqs=C, prefix_cache=False)
    paths = {"B1": lambda: b.run_b1(w, C, b.args.prefill_batch),
             "engine": lambda: b.run_engine(w, max_num_seqs=C),
             "engine-nocache": lambda: b.run_engine(w, name="engine-nocache", max_num_seqs=C, prefix_cache=False)}
    if b.args.generic:
        b.run_engine(warm, max_num_seqs=C, **MAC)
        paths["engine-generic"] = lambda: b.run_engine(w, name="engine-generic", max_num_seqs=C, **MAC)
    res = {k: m.median for k, m in b.measure(paths, 1).items()}
    # the engine again, its attention shapes met before in this process: on CUDA, without cuDNN's graph builds for
    # new shapes (~50 ms each), which a short run pays at most steps and a long job once per recurring shape
    res["engine-again"] = b.run_engine(w, name="engine-again", max_num_seqs=C)
    if b.args.generic:  # and the generic path again: its first run on CUDA pays a cuDNN graph build per new attention
        # shape (it has no shape buckets), which a Mac's Metal attention does not
        res["engine-generic-again"] = b.run_engine(w, name="engine-generic-again", max_num_seqs=C, **MAC)
    b1 = res["B1"]
    b1_over = b1.mlx_peak - b1.mlx_base
    tab = Table(f"{name}: {w.rows} rows, {w.prompt_tokens} prompt tokens (floor {w.trie_floor}), {w.max_tokens} new",
                ["path", "wall s", "x B1", "prefill s", "prefill tok", "prefill / floor", "decode s", "host s",
                 "steps", "moved MB", "of it row moves MB", "stored MB", "syncs", "mem x B1", "agree vs B1"])
    for path, run in res.items():
        same, tot = agreement(run.tokens, b1.tokens, w.max_tokens)
        row = [path, run.wall_s, ratio(b1.wall_s, run.wall_s)]
        if path == "B1":
            e = run.extra
            row += [e["prompt_s"], w.prompt_tokens, ratio(w.prompt_tokens, w.trie_floor), e["decode_s"],
                    max(0.0, run.wall_s - e["prompt_s"] - e["decode_s"]), e["generation_steps"], None, None, None,
                    None]
        else:
            p = run.extra["profile"]
            row += [p["prefill_s"], p["prefill_tokens"], ratio(p["prefill_tokens"], w.trie_floor), p["decode_s"],
                    max(0.0, run.wall_s - p["prefill_s"] - p["decode_s"] - p["sampling_s"]), p["steps"],
                    p["moved_bytes"] / MB, p.get("row_moved_bytes", 0) / MB, p["stored_bytes"] / MB, p["syncs"]]
        row += [ratio(run.mlx_peak - run.mlx_base, b1_over), f"{same}/{tot}"]
        tab.rows.append(row)
    cost = ratio(_prefill_cost(res["engine"]), _prefill_cost(res["engine-nocache"]))
    tab.notes.append(f"prefill cost per computed token, cache on / off: {cost:.2f}" if cost else "")
    figures = {"rows": w.rows, "floor": w.trie_floor, "x_b1": ratio(b1.wall_s, res["engine"].wall_s),
               "x_b1_nocache": ratio(b1.wall_s, res["engine-nocache"].wall_s),
               "x_b1_again": ratio(b1.wall_s, res["engine-again"].wall_s),
               "x_b1_generic": ratio(b1.wall_s, res["engine-generic"].wall_s) if "engine-generic" in res else None,
               "x_b1_generic_again": (ratio(b1.wall_s, res["engine-generic-again"].wall_s)
                                      if "engine-generic-again" in res else None),
               "prefill_over_floor": ratio(res["engine"].extra["profile"]["prefill_tokens"], w.trie_floor),
               "prefill_cost_cache_vs_nocache": cost,
               "memory_x_b1": ratio(res["engine"].mlx_peak - res["engine"].mlx_base, b1_over),
               "runs": {k: r.as_dict() for k, r in res.items()}}
    return tab, figures


def bare_decode(b: Bench, rows: int, prompt_len: int, new_tokens: int) -> tuple[float, float, float]:
    """A bare mlx-lm forward + argmax loop (the model's own KV cache, one eval per step, no engine): tok/s, and the
    median step's host time (building the graph and ``mx.async_eval``: MLX encodes and launches every kernel) and
    wait for the device after it, in ms."""
    model = b.model
    cache = make_prompt_cache(model)
    y = mx.array(b.workload("short", rows, prompt_len=prompt_len).prompts, dtype=mx.int32)
    logits = model(y, cache=cache)
    y = mx.argmax(logits[:, -1, :], axis=-1)[:, None].astype(mx.int32)
    mx.eval(y)
    for _ in range(3):  # warm
        y = mx.argmax(model(y, cache=cache)[:, -1, :], axis=-1)[:, None].astype(mx.int32)
        mx.eval(y)
    host, wait = [], []
    t0 = time.perf_counter()
    for _ in range(new_tokens - 4):
        t1 = time.perf_counter()
        y = mx.argmax(model(y, cache=cache)[:, -1, :], axis=-1)[:, None].astype(mx.int32)
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        host.append(t2 - t1)
        wait.append(time.perf_counter() - t2)
    tps = rows * (new_tokens - 4) / (time.perf_counter() - t0)
    return tps, 1e3 * statistics.median(host), 1e3 * statistics.median(wait)


def _decode_engine(b: Bench, w: wl.Workload, cfg: dict) -> dict:
    """One engine run of the decode table: step and forward tok/s, host and wait ms a decode pass."""
    p = b.run_engine(w, **cfg).extra["profile"]
    decode_steps = max(1, p["steps"] - 1)
    # the engine's decode passes: building and launching them on the host, then waiting for the device
    waited = p.get("waited_decode_s", 0.0)
    return {"engine_step": p["decode_tokens"] / max(1e-9, p["total_s"] - p["prefill_s"]),
            "engine_fwd": p["decode_tokens"] / max(1e-9, p["decode_s"]),
            "engine_host_ms": 1e3 * (p["decode_s"] - waited) / decode_steps,
            "engine_wait_ms": 1e3 * waited / decode_steps, "syncs_per_step": p["syncs"] / decode_steps,
            "engine_profile": p}


def _generic_cells(runs: list[dict] | None, ref_tps: float) -> list:
    """The generic path's decode cells (its median run's step x mlx-lm, host / wait ms), or blanks when not run."""
    if not runs:
        return [None, None]
    g = _median(runs, lambda e: e["engine_step"])
    return [ratio(g["engine_step"], ref_tps), f"{g['engine_host_ms']:.2f} / {g['engine_wait_ms']:.2f}"]


def _median(runs: list, key: Any) -> Any:
    """The median run by ``key`` (the lower middle one of an even number), so its columns come from one run."""
    return sorted(runs, key=key)[(len(runs) - 1) // 2]


def suite_decode(b: Bench, levels: list[int], prompt_len: int = 32, new_tokens: int = 128,
                 repeats: int = 3, generic: bool = False) -> tuple[Table, dict]:
    """Decode at fixed concurrency: the engine, mlx-lm's BatchGenerator and a bare forward + argmax loop, each run
    ``repeats`` times interleaved (rotating order); medians. A step this short is bound by the host, whose speed
    drifts by up to ~25% between runs, so one run of each is not enough to compare two commits."""
    tab = Table(f"decode at fixed concurrency: {prompt_len}-token prompts, {new_tokens} new tokens, median of "
                f"{repeats}",
                ["sequences", "engine step tok/s", "engine fwd tok/s", "mlx-lm BatchGenerator tok/s",
                 "bare forward+argmax tok/s", "step x mlx-lm", "step x bare", "engine step min-max",
                 "syncs / step", "host / wait ms a step: engine", "bare", "generic step x mlx-lm",
                 "host / wait ms: generic"])
    raw = {}
    for L in levels:
        w = b.workload("short", L, prompt_len=prompt_len, max_tokens=new_tokens)
        cfg = {"max_num_seqs": L, "max_num_batched_tokens": max(2048, L * prompt_len)}
        warm = wl.Workload("warm-up", w.prompts, 4)
        b.run_b1(warm, L, L)
        b.run_engine(warm, **cfg)
        names = ["mlx-lm", "engine", "bare"]
        if generic:
            b.run_engine(warm, **MAC, **cfg)
            names.append("generic")
        got: dict[str, list] = {name: [] for name in names}
        for r in range(repeats):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                if name == "mlx-lm":
                    got[name].append(b.run_b1(w, L, L, name="mlx-lm").extra["decode_tps"])
                elif name == "engine":
                    got[name].append(_decode_engine(b, w, cfg))
                elif name == "generic":
                    got[name].append(_decode_engine(b, w, {**cfg, **MAC}))
                else:
                    got[name].append(bare_decode(b, L, prompt_len, new_tokens))
        eng = _median(got["engine"], lambda e: e["engine_step"])
        ref_tps = _median(got["mlx-lm"], float)
        bare, bare_host, bare_wait = _median(got["bare"], lambda x: x[0])
        step, steps = eng["engine_step"], [e["engine_step"] for e in got["engine"]]
        tab.rows.append([L, step, eng["engine_fwd"], ref_tps, bare, ratio(step, ref_tps), ratio(step, bare),
                         f"{min(steps):,.0f}-{max(steps):,.0f}", eng["syncs_per_step"],
                         f"{eng['engine_host_ms']:.2f} / {eng['engine_wait_ms']:.2f}",
                         f"{bare_host:.2f} / {bare_wait:.2f}"] + _generic_cells(got.get("generic"), ref_tps))
        raw[L] = {**{k: v for k, v in eng.items() if k != "syncs_per_step"}, "mlx_lm": ref_tps, "bare": bare,
                  "bare_host_ms": bare_host, "bare_wait_ms": bare_wait, "engine_steps": steps,
                  "mlx_lm_runs": got["mlx-lm"], "bare_runs": [x[0] for x in got["bare"]],
                  "generic_runs": got.get("generic")}
        log(f"  decode {L}: engine step {step:,.0f} tok/s, mlx-lm {ref_tps:,.0f}, bare {bare:,.0f}")
    tab.notes.append("engine step = decode tokens / (step time - prefill time): forward, sampling and host work; "
                     "bare = mlx-lm model + KVCache, forward + argmax + eval per step (what a raw loop gets). "
                     "host / wait: a step's median host time (building the graph, mx.async_eval: MLX encodes and "
                     "launches every kernel; the engine: its decode passes' mean) and the wait for the device after "
                     "it; a wait near 0 means the step is bound by the host, which overlap cannot hide. Each path "
                     "ran the given number of times, interleaved; the engine's columns are its median run's")
    return tab, raw


@section("gpu")
def gpu_suite(b: Bench) -> list[Table]:
    a = b.args
    commit = a.commit or "unknown"
    log(f"GPU suite at commit {commit}")
    t0 = time.perf_counter()
    tables, figures = [], {}
    partial = Path(a.out) / "gpu_suite.partial.md" if a.out else None

    def keep(tab: Table) -> None:  # each table as soon as it is measured: a run cut short keeps what it did
        tables.append(tab)
        if partial is not None:
            partial.parent.mkdir(parents=True, exist_ok=True)
            with partial.open("a") as f:
                f.write(tab.render() + "\n")

    workloads = [x for x in a.suite_workloads.split(",") if x]  # '' runs the decode table alone
    for name in workloads:
        tab, fig = suite_workload(b, name, suite_rows(a.suite_rows, a.rows_scale, name))
        keep(tab)
        figures[name] = fig
    levels = [int(x) for x in a.decode_levels.split(",") if x.strip()]
    if levels:
        tab, dec = suite_decode(b, levels, repeats=a.decode_repeats, generic=a.generic)
        keep(tab)
        figures["decode"] = dec
    summary = Table(f"GPU suite summary at commit {commit}", ["workload", "x B1", "generic path x B1",
                                                              "generic path again", "x B1 (no cache)",
                                                              "x B1 (engine again)", "prefill / floor",
                                                              "cost/token cache vs off", "memory x B1"])
    for name in workloads:
        f = figures[name]
        summary.rows.append([name, f["x_b1"], f["x_b1_generic"], f["x_b1_generic_again"], f["x_b1_nocache"],
                             f["x_b1_again"], f["prefill_over_floor"], f["prefill_cost_cache_vs_nocache"],
                             f["memory_x_b1"]])
    summary.notes.append("engine again: the same engine run once more in the process. On CUDA a packed prefill pass "
                         "attends through one kernel a layer (engine.attention.packed) whatever its shapes; where "
                         "that kernel is not used, a prefill shape runs MLX's unfused attention until it has run 16 "
                         "times in the process (engine.attention.prefill)")
    summary.notes.append("generic path: the engine as a Mac's GPU runs it (suite.MAC: MLX's attention, no packed "
                         "prefill, reuse to the token, overlapped steps launched from the engine's own thread), "
                         "first run; again: its second run, its attention shapes met (on CUDA, MLX's attention builds "
                         "a cuDNN graph for each new prefill shape, which Metal's does not)")
    summary.notes.append(f"suite wall time {time.perf_counter() - t0:.0f} s (model build/load not included)")
    tables.insert(0, summary)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = machine_meta(b)  # the machine, MLX, the CUDA kernel launch: two runs compare only on one machine
        (out / "gpu_suite.json").write_text(json.dumps({"commit": commit, "meta": meta, "figures": figures}, indent=2,
                                                       default=str))
        (out / "gpu_suite.md").write_text(f"GPU figures measured at commit {commit}\n\n{render_meta(meta)}\n"
                                          + "\n".join(t.render() for t in tables))
        log(f"wrote {out}/gpu_suite.json and gpu_suite.md")
    return tables
