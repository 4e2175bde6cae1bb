"""Engine sections of the benchmark: a workload (unique, label, fewshot, chat) vs B0/B1/B2, and decode levels.

Run through ``scripts/bench.py --section engine --workload NAME``; the shared harness (Bench, Table, baselines)
is in bench.py.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import bench_workloads as wl
from bench import MB, Bench, Run, Table, agreement, log, ratio, section


@section("engine")
def engine_section(b: Bench) -> list[Table]:
    """The "unique" workload (no sharing) vs B0/B1/B2, then decode tok/s at fixed concurrency."""
    tables = engine_unique(b)
    if b.args.decode_levels.strip():
        tables.append(engine_decode_levels(b))
    return tables


def engine_unique(b: Bench) -> list[Table]:
    a, C = b.args, b.concurrency
    kw = {"max_tokens": a.max_tokens} if a.max_tokens else {}
    w = b.workload(a.workload, a.rows, **kw)
    b0w = w.subset(wl.length_quantile_subset(w.prompts, a.b0_rows)) if a.b0_rows else None
    P = a.prefill_batch
    paths: dict[str, Callable[[], Run]] = {
        "B1": lambda: b.run_b1(w, C, P),
        "B2": lambda: b.run_b1(w, C, P, sort=True, name="B2"),
        "engine": lambda: b.run_engine(w, max_num_seqs=C),
    }
    if a.workload != "unique":  # the same engine without its prefix cache: what the cache itself buys
        paths["engine-nocache"] = lambda: b.run_engine(w, name="engine-nocache", max_num_seqs=C, prefix_cache=False)
    warm = wl.Workload("warm-up", sorted(w.prompts, key=len)[:2], min(8, w.max_tokens))
    log(f"{w.name}: {w.rows} rows, {w.prompt_tokens} prompt tokens, {w.max_tokens} new tokens each; "
        f"concurrency {C}; warming up")
    b.run_b1(warm, C, P)
    b.run_engine(warm, max_num_seqs=C)
    res = b.measure(paths, a.repeats)
    if b0w is not None:
        b.run_b0(warm)
        log(f"B0 on {b0w.rows} rows spread over the length distribution")
        res = {"B0": b.measure({"B0": lambda: b.run_b0(b0w)}, 1)["B0"], **res}

    b1 = res["B1"]
    ref = b1.median.tokens
    n_cmp = w.max_tokens
    tab = Table(
        f"{w.name}: {w.rows} rows, {w.prompt_tokens} prompt tokens (distinct-trie floor {w.trie_floor}), "
        f"{w.max_tokens} new tokens, greedy, EOS ignored, concurrency {C}",
        ["path", "rows", "wall s", "rows/s", "gen tok/s", "x B1", "x B0", "x B2", "MLX peak MB",
         "MLX over start MB", "mem x B1", "RSS peak MB", "agree vs B1"],
    )
    b0 = res.get("B0")
    for name, m in res.items():
        run = m.median
        if name == "B0":
            idx = wl.length_quantile_subset(w.prompts, a.b0_rows)
            same, tot = agreement(run.tokens, [ref[i] for i in idx], n_cmp)
        elif name == "B1":
            same, tot = len(ref), len(ref)
        else:
            same, tot = agreement(run.tokens, ref, n_cmp)
        over = run.mlx_peak - run.mlx_base
        b1_over = b1.median.mlx_peak - b1.median.mlx_base
        tab.rows.append([
            name, run.rows, m.wall_s, m.rows_per_s, m.gen_tps, ratio(m.rows_per_s, b1.rows_per_s),
            ratio(m.rows_per_s, b0.rows_per_s) if b0 else None, ratio(m.rows_per_s, res["B2"].rows_per_s),
            run.mlx_peak / MB, over / MB, ratio(over, b1_over), run.rss_peak / MB,
            f"{same}/{tot} ({same / tot:.0%})",
        ])
    short = [(name, r.path) for name, m in res.items() for r in m.runs
             if any(len(t) != w.max_tokens for t in r.tokens)]
    tab.notes += [
        f"median of {a.repeats} run(s) per path (B0: 1 run); ratios are rows/s against the baseline's rows/s.",
        f"B0 = mlx_lm.stream_generate one row at a time on {b0w.rows if b0w else 0} rows picked evenly over the "
        "prompt-length distribution (rows/s normalised); B1 = mlx_lm.batch_generate in input order, "
        f"completion_batch_size={C}, prefill_batch_size={min(P, C)}; B2 = B1 with prompts sorted longest first; "
        f"engine = Engine.generate, EngineConfig(max_num_seqs={C}), other settings default.",
        "MLX peak = mx.get_peak_memory() (reset before each run; includes the weights); 'over start' = peak minus "
        "MLX active memory at the start of the run (the run's own working memory); mem x B1 compares that.",
        f"agree = rows whose {n_cmp} generated token ids equal B1's (greedy); B0 is compared on its subset.",
    ]
    if short:
        tab.notes.append(f"WARNING: some rows did not generate {w.max_tokens} tokens: {sorted(set(short))}")

    # where the time goes
    split = Table(f"{w.name}: where the time goes (median run, seconds)",
                  ["path", "wall", "prefill", "decode fwd", "sampling", "other (host)", "steps", "prefill tok",
                   "prefill / floor", "decode tok", "KV moved MB", "KV stored MB", "syncs"])
    for name in ("B1", "B2"):
        e = res[name].median.extra
        split.rows.append([name, res[name].median.wall_s, e["prompt_s"], e["decode_s"], None,
                           max(0.0, res[name].median.wall_s - e["prompt_s"] - e["decode_s"]),
                           e["generation_steps"], w.prompt_tokens, ratio(w.prompt_tokens, w.trie_floor),
                           res[name].median.gen_tokens, None, None, None])
    for name in [n for n in res if n.startswith("engine")]:
        run = res[name].median
        p = run.extra["profile"]
        split.rows.append([name, run.wall_s, p["prefill_s"], p["decode_s"], p["sampling_s"],
                           max(0.0, run.wall_s - p["prefill_s"] - p["decode_s"] - p["sampling_s"]), p["steps"],
                           p["prefill_tokens"], ratio(p["prefill_tokens"], w.trie_floor), p["decode_tokens"],
                           p["moved_bytes"] / MB, p["stored_bytes"] / MB, p["syncs"]])
    run = res["engine"].median
    split.notes += [
        "mlx-lm: BatchStats prompt_time / decode_time (its decode step includes sampling); other = wall minus both.",
        "engine: StepProfile (stats()['profile']); other = wall minus prefill, decode and sampling (scheduling, "
        "KV row moves, bookkeeping, detokenization). Engine decode tok counts tokens from decode forwards only "
        "(the first token of each row comes from its prefill). KV moved = existing KV copied (row moves, prefix "
        "copy-ins, forks), KV stored = copied into the prefix cache, syncs = host waits for the device (Traffic).",
        f"engine preemptions: {run.extra['preemptions']}; KV budget {run.extra['kv_budget_bytes'] / MB:,.0f} MB.",
    ]
    tab.raw = {k: m.as_dict() for k, m in res.items()}
    return [tab, split]


def engine_decode_levels(b: Bench) -> Table:
    """Decode tok/s with exactly L sequences running: all L short prompts are admitted in the first step."""
    a = b.args
    levels = [int(x) for x in a.decode_levels.split(",") if x.strip()]
    tab = Table(
        f"decode throughput at fixed concurrency: {a.decode_prompt_len}-token prompts, "
        f"{a.decode_new_tokens} new tokens",
        ["sequences", "engine decode tok/s (fwd)", "engine decode tok/s (step)", "mlx-lm decode tok/s",
         "x mlx-lm (step)", "engine wall gen tok/s", "mlx-lm wall gen tok/s", "x mlx-lm (wall)", "agree"],
    )
    raw = {}
    for L in levels:
        w = b.workload("short", L, prompt_len=a.decode_prompt_len, max_tokens=a.decode_new_tokens)
        log(f"decode at {L} sequences (warm-up, then measured)")
        cfg = {"max_num_seqs": L, "max_num_batched_tokens": max(2048, L * a.decode_prompt_len)}
        warm = wl.Workload("warm-up", w.prompts, min(4, w.max_tokens))  # the same shapes, a few steps
        b.run_b1(warm, L, L)
        b.run_engine(warm, **cfg)
        res = b.measure({"mlx-lm": lambda w=w, L=L: b.run_b1(w, L, L, name="mlx-lm"),
                         "engine": lambda w=w, cfg=cfg: b.run_engine(w, **cfg)}, a.repeats)
        eng, ref = res["engine"], res["mlx-lm"]
        fwd = statistics.median(r.extra["profile"]["decode_tokens"] / r.extra["profile"]["decode_s"]
                                for r in eng.runs)
        step = statistics.median(
            r.extra["profile"]["decode_tokens"] / (r.extra["profile"]["total_s"] - r.extra["profile"]["prefill_s"])
            for r in eng.runs)
        ref_dec = statistics.median(r.extra["decode_tps"] for r in ref.runs)
        same, tot = agreement(eng.median.tokens, ref.median.tokens, w.max_tokens)
        tab.rows.append([L, fwd, step, ref_dec, ratio(step, ref_dec), eng.gen_tps, ref.gen_tps,
                         ratio(eng.gen_tps, ref.gen_tps), f"{same}/{tot}"])
        raw[L] = {k: m.as_dict() for k, m in res.items()}
    tab.notes += [
        f"median of {a.repeats} run(s), after an untimed warm-up run of the same rows at each level. Engine: fresh Engine(max_num_seqs=L, max_num_batched_tokens>=L x prompt) so "
        "all L rows prefill in the first step and every decode step runs L rows; 'fwd' = decode_tokens / decode_s "
        "(batched forward only), 'step' = decode_tokens / (total step time - prefill time), i.e. with sampling and "
        "host work.",
        "mlx-lm: batch_generate(completion_batch_size=L, prefill_batch_size=L), BatchStats.decode_tps "
        "(generation tokens / time in its decode step, sampling included) - compare with the engine's 'step'.",
        "wall gen tok/s = all generated tokens / wall time of the whole call (prefill included).",
    ]
    tab.raw = raw
    return tab
