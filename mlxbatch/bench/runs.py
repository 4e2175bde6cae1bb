"""``mlxbatch bench runs``: the engine alone on the suite's workloads, under named configurations, in one process.

    mlxbatch bench runs --model 0.5b --runs label:2048,fewshot:2048,chat:1024           # each run twice
    mlxbatch bench runs --model 0.5b --runs chat:1024 --configs 'on:overlap_steps=true;off:overlap_steps=false'
    mlxbatch bench runs --model 0.5b --runs fewshot:2048 --b1 --configs 'none:;2g:step_memory_bytes=2147483648'
    mlxbatch bench runs --model tiny --concurrency 256 --cuda-decisions --runs label:1024,chat:512   # no GPU needed
    python3 -m mlxbatch.bench runs --model 0.5b --mac-decisions --configs 'off:overlap_steps=false;on:overlap_steps=true'
    PYTHONPATH=<another tree> python3 -m mlxbatch.bench runs ...     # the same for another commit: an A/B

What an A/B of engine changes needs on one machine: each workload (``name:rows``, ``:nocache`` for the prefix cache
off) under each configuration (``--configs 'name:field=value,...;...'``: EngineConfig fields), interleaved, for
``--rounds`` rounds (the first pays what a new shape costs, e.g. cuDNN's graph builds on CUDA; the next finds it
paid). Each run under the suite's memory probe. Prints wall, prefill seconds and tokens (against the distinct-trie
floor), decode and host seconds, steps, KV bytes moved (and of it by row moves) and stored, syncs, MLX's peak over the
run's start (x B1's with ``--b1``: mlx-lm's ``batch_generate`` on the same rows, once) and a hash of the greedy
tokens: rows of one table compare, tables of two machines do not.

``--cuda-decisions``: the engine on this machine takes the decisions of the CUDA text path (packed prefill passes,
rows that stay in their slots, batched copies, filled passes, a block reuse step; 4096 tokens a step), with MLX's
ops as kernels. The planner, the scheduler and the copies' books are the same code everywhere, so a CPU run gives
what a GPU run computes, copies and syncs, and the greedy tokens' hash must not move: engine work checked without a
GPU. The engine takes them at construction (``Engine(..., layout=CUDA_DECISIONS)``); its reuse step and filled
passes follow the packed prefill.

``--mac-decisions``: the engine on this GPU takes a Mac's decisions (``suite.MAC``: a GPU's batched row moves, MLX's
attention, nothing of the CUDA text path, steps launched from the engine's own thread, as Metal does): what a Mac
runs, on an NVIDIA GPU (overlapped steps follow the configuration; unset, on, as on a Mac).
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from typing import Any

from mlxbatch.bench import workloads as wl
from mlxbatch.bench.harness import MB, Bench, MemoryProbe, Run, Table, log, ratio
from mlxbatch.bench.meta import emit
from mlxbatch.bench.options import parse_script_args
from mlxbatch.bench.suite import MAC
from mlxbatch.engine import LayoutOptions

CUDA_STEP_TOKENS = 4096  # prefill tokens a step on NVIDIA GPUs under 70 GB (the engine's default there)
# the CUDA text path's layout (the engine's ``paths.layout_for`` there): batched moves, rows that stay in their slots,
# passes in recurring shapes, one packed prefill pass a step. The kernels stay MLX's ops, and the CPU's pruned prefill
# stays (it never runs beside packed passes): only the decisions are CUDA's
CUDA_DECISIONS = LayoutOptions(batched_moves=True, rows_stay=True, shape_buckets=True, packed_prefill=True,
                               prune_last=True)
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One ``--runs`` item: a workload, its rows, and whether the prefix cache is on."""

    workload: str
    rows: int
    cache: bool = True

    @property
    def label(self) -> str:
        return f"{self.workload} {self.rows}" + ("" if self.cache else " nocache")


def parse_runs(text: str) -> list[RunSpec]:
    out = []
    for item in filter(None, text.split(",")):
        name, _, rest = item.partition(":")
        rows, _, mode = rest.partition(":")
        if name not in wl.WORKLOADS or not rows.isdigit() or mode not in ("", "nocache"):
            raise SystemExit(f"--runs: {item!r}: expected workload:rows[:nocache], workload one of "
                             f"{', '.join(wl.WORKLOADS)}")
        out.append(RunSpec(name, int(rows), mode != "nocache"))
    return out


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    try:
        return int(text)
    except ValueError:
        return float(text)


def parse_configs(text: str) -> dict[str, dict[str, Any]]:
    """``'a:overlap_steps=true,max_num_batched_tokens=8192;b:'`` -> {"a": {...}, "b": {}}; '' -> {"default": {}}."""
    out: dict[str, dict[str, Any]] = {}
    for item in filter(None, (x.strip() for x in text.split(";"))):
        name, sep, fields = item.partition(":")
        if not sep:
            name, fields = item, item
        cfg = {}
        for pair in filter(None, fields.split(",")):
            key, eq, value = pair.partition("=")
            if not eq:
                raise SystemExit(f"--configs: {pair!r} in {item!r}: expected field=value")
            try:
                cfg[key.strip()] = _value(value.strip())
            except ValueError:
                raise SystemExit(f"--configs: {pair!r}: the value must be a number, true, false or none") from None
        out[name or "default"] = cfg
    return out or {"default": {}}


def token_hash(tokens: list[list[int]]) -> str:
    return hashlib.sha256(repr(tokens).encode()).hexdigest()[:12]


def engine_runs(b: Bench, runs: list[RunSpec], configs: dict[str, dict[str, Any]], rounds: int, b1: bool,
                decisions: bool, mac: bool = False) -> Table:
    C = b.concurrency
    base: dict[str, Any] = {"max_num_seqs": C}
    if decisions:
        base.update(max_num_batched_tokens=CUDA_STEP_TOKENS, warm_up=False)
    device: dict[str, Any] = {"layout": CUDA_DECISIONS} if decisions else MAC if mac else {}
    b.run_engine(b.workload("label", min(64, max(8, C))), max_num_seqs=C, **device)  # warm-up: kernels, first shapes
    tab = Table(f"engine runs: concurrency {C}" + (", CUDA's decisions" if decisions else "")
                + (", a Mac's decisions" if mac else "")
                + f", {rounds} round(s) interleaved",
                ["workload", "config", "round", "wall s", "prefill s", "prefill tok", "prefill / floor", "decode s",
                 "host s", "engine's thread CPU s", "steps", "moved MB", "of it row moves MB", "stored MB", "syncs",
                 "peak GiB over start", "peak x B1", "tokens"])
    raw: dict[str, Any] = {}
    for spec in runs:
        w = b.workload(spec.workload, spec.rows)
        b1_peak = None
        if b1:
            with MemoryProbe() as probe:
                r = b.run_b1(w, C, b.args.prefill_batch)
            b1_peak = probe.mlx_peak - probe.mlx_base
            tab.rows.append([spec.label, "B1 (mlx-lm)", 1, r.wall_s, r.extra["prompt_s"], w.prompt_tokens,
                             ratio(w.prompt_tokens, w.trie_floor), r.extra["decode_s"], None, None, None, None,
                             None, None, None, b1_peak / GiB, 1.0, token_hash(r.tokens)])
        for rnd in range(1, rounds + 1):
            for name, cfg in configs.items():
                with MemoryProbe() as probe:
                    run: Run = b.run_engine(w, name=name, **device,
                                            **{**base, **cfg, **({} if spec.cache else {"prefix_cache": False})})
                p = run.extra["profile"]
                peak = probe.mlx_peak - probe.mlx_base
                tab.rows.append([spec.label, name, rnd, run.wall_s, p["prefill_s"], p["prefill_tokens"],
                                 ratio(p["prefill_tokens"], w.trie_floor), p["decode_s"], p["host_s"],
                                 run.extra["thread_cpu_s"], p["steps"],
                                 p["moved_bytes"] / MB, p.get("row_moved_bytes", 0) / MB, p["stored_bytes"] / MB, p["syncs"],
                                 peak / GiB, ratio(peak, b1_peak), token_hash(run.tokens)])
                raw[f"{spec.label} / {name} / {rnd}"] = {"profile": p, "config": run.extra["config"]}
                log(f"{spec.label} {name} round {rnd}: {run.wall_s:.2f} s, prefill {p['prefill_s']:.2f} s")
    tab.notes += [
        "configs: " + "; ".join(f"{k}: {v or 'defaults'}" for k, v in configs.items())
        + f" (on top of max_num_seqs={C}" + (f", max_num_batched_tokens={CUDA_STEP_TOKENS}" if decisions else "")
        + ").",
        "prefill / decode s: the engine's step profile (build + the wait for the device); host s: the rest of the "
        "steps. engine's thread CPU s: the CPU time of the thread that ran generate() (submission, scheduling, "
        "building passes, reading tokens; MLX computes on threads of its own, a CPU's too): the host's work, "
        "measured without a GPU. tokens: a hash of every row's greedy tokens (equal hashes: the same output).",
    ]
    tab.raw = raw
    return tab


def main(argv: list[str] | None = None) -> int:
    mine, args = parse_script_args(
        list(sys.argv[1:] if argv is None else argv), "runs", __doc__,
        runs=("label:2048,fewshot:2048,chat:1024", "workload:rows[:nocache],... (default the suite's three)"),
        configs=("", "name:field=value,...;... EngineConfig fields per configuration (default: one, the defaults)"),
        rounds=(2, "runs of each workload x configuration, interleaved (default 2: first, again)"),
        b1=(False, "also run mlx-lm's batch_generate once per workload (memory x B1)"),
        cuda_decisions=(False, "take the CUDA text path's decisions on this machine (a CPU check of a GPU run)"),
        mac_decisions=(False, "take a Mac's decisions on this GPU (MLX's attention, row moves, no launch thread)"))
    if mine.cuda_decisions and mine.mac_decisions:
        raise SystemExit("--cuda-decisions and --mac-decisions: one device's decisions at a time")
    runs, configs = parse_runs(mine.runs), parse_configs(mine.configs)
    b = Bench(args)
    tab = engine_runs(b, runs, configs, mine.rounds, mine.b1, mine.cuda_decisions, mine.mac_decisions)
    emit(b, [tab])
    return 0
