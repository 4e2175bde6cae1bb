"""The benchmark harness: results (Table, Run, Measured), memory probing, the shared ``Bench`` context with the
baseline and engine paths, and the section registry.

Every figure is a ratio against baselines run in the same process (method: docs/benchmarks.md): one
model object (loaded once, same dtype) serves every baseline and mlxbatch; workloads are token ids generated from
a seed (``workloads``); each path is warmed up on a couple of rows, then run ``--repeats`` times (interleaved)
and its median reported.

Baselines: B0 one request at a time (``mlx_lm.stream_generate``), B1 ``mlx_lm.batch_generate`` in input order,
B2 the same after sorting prompts by length. EOS is disabled for all of them (a copy of the tokenizer wrapper with
no EOS ids) and the engine runs with ``ignore_eos``: every row generates exactly ``max_tokens`` tokens, so rows/s
and tok/s compare like with like.

A section is a function ``Bench -> list[Table]`` registered with ``@section("name")`` in its own module.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import batch_generate, stream_generate

from mlxbatch.bench import workloads as wl
from mlxbatch.bench.memory import current_rss
from mlxbatch.engine import Engine, EngineConfig, LayoutOptions, LoadedModel, ModelSpec, load_model
from mlxbatch.models.random_model import SHAPES, build_random_model
from mlxbatch.types import SamplingParams

MB = 1 << 20


# -- results -----------------------------------------------------------------------------------------
@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    raw: dict = field(default_factory=dict, repr=False)  # per-path measurements, for --json only

    def render(self) -> str:
        cells = [[_fmt(v) for v in r] for r in self.rows]
        out = [f"### {self.title}", "", "| " + " | ".join(self.columns) + " |",
               "|" + "|".join("---" for _ in self.columns) + "|"]
        out += ["| " + " | ".join(r) + " |" for r in cells]
        if self.notes:
            out += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(out) + "\n"

    def as_dict(self) -> dict:
        return {"title": self.title, "columns": self.columns, "rows": self.rows, "notes": self.notes,
                "raw": self.raw}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.2f}"
    return str(v)


@dataclass
class Run:
    """One measured run of one path; ``tokens`` are the generated ids per row (input order)."""

    path: str
    wall_s: float
    rows: int
    prompt_tokens: int
    gen_tokens: int
    tokens: list[list[int]] = field(repr=False)
    extra: dict = field(default_factory=dict)
    mlx_base: int = 0  # MLX active bytes when the run started (the weights, mostly)
    mlx_peak: int = 0  # MLX peak bytes during the run
    rss_base: int = 0
    rss_peak: int = 0  # process RSS high-water during the run (sampled)

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.wall_s

    @property
    def gen_tps(self) -> float:
        return self.gen_tokens / self.wall_s

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "tokens"}


@dataclass
class Measured:
    """All repeats of one path; figures are the median run's (by wall time)."""

    runs: list[Run]

    @property
    def median(self) -> Run:
        return sorted(self.runs, key=lambda r: r.wall_s)[(len(self.runs) - 1) // 2]

    @property
    def wall_s(self) -> float:
        return statistics.median(r.wall_s for r in self.runs)

    @property
    def rows_per_s(self) -> float:
        return self.median.rows / self.wall_s

    @property
    def gen_tps(self) -> float:
        return self.median.gen_tokens / self.wall_s

    def as_dict(self) -> dict:
        return {"wall_s_median": self.wall_s, "walls": [r.wall_s for r in self.runs],
                "median_run": self.median.as_dict()}


class MemoryProbe:
    """MLX peak (reset at entry) and sampled process RSS over a block, after freeing MLX's cache.

    Without /proc (macOS) the RSS figures are ``ru_maxrss``: the process's lifetime high-water mark.
    """

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()

    def __enter__(self) -> MemoryProbe:
        gc.collect()
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        self.mlx_base = mx.get_active_memory()
        self.rss_base = self.rss_peak = current_rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.rss_peak = max(self.rss_peak, current_rss())

    def __exit__(self, *exc: object) -> None:
        mx.synchronize()
        self._stop.set()
        self._thread.join()
        self.rss_peak = max(self.rss_peak, current_rss())
        self.mlx_peak = max(mx.get_peak_memory(), self.mlx_base)


# -- the shared context ------------------------------------------------------------------------------
class Bench:
    """The model (loaded once), a tokenizer without EOS for the baselines, flags and run helpers."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.on_gpu = mx.default_device() == mx.gpu
        dtype = args.dtype
        if dtype == "auto":
            dtype = "bfloat16" if self.on_gpu else "float32"
        self.model_path = resolve_model(args.model, Path(args.cache_dir).expanduser())
        t0 = time.perf_counter()
        self.loaded: LoadedModel = load_model(ModelSpec(self.model_path, dtype))
        self.load_s = time.perf_counter() - t0
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.tok_noeos = copy.copy(self.tokenizer)  # a shallow copy of mlx-lm's wrapper: same HF tokenizer
        self.tok_noeos.eos_token_ids = []  # batch_generate / stream_generate then stop at max_tokens only
        vocab_size = min(len(self.tokenizer), int(self.loaded.config.get("vocab_size") or len(self.tokenizer)))
        special = frozenset(int(t) for t in (getattr(self.tokenizer, "all_special_ids", None) or ()))
        self.vocab = wl.Vocab(0, vocab_size, special | frozenset(self.tokenizer.eos_token_ids))
        self.concurrency = args.concurrency or (256 if self.on_gpu else 32)

    def workload(self, name: str, rows: int | None = None, **kw: Any) -> wl.Workload:
        return wl.make(name, self.vocab, rows, seed=self.args.seed, **kw)

    def measure(self, paths: dict[str, Callable[[], Run]], repeats: int) -> dict[str, Measured]:
        """Run each path ``repeats`` times, interleaved (rotating order), each under a memory probe."""
        runs: dict[str, list[Run]] = {name: [] for name in paths}
        names = list(paths)
        for r in range(repeats):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                with MemoryProbe() as probe:
                    run = paths[name]()
                run.mlx_base, run.mlx_peak = probe.mlx_base, probe.mlx_peak
                run.rss_base, run.rss_peak = probe.rss_base, probe.rss_peak
                runs[name].append(run)
                log(f"  {name}: {run.wall_s:.2f} s, {run.rows} rows, {run.gen_tokens} tokens "
                    f"({run.gen_tps:.1f} tok/s)")
        return {name: Measured(rs) for name, rs in runs.items()}

    # -- the paths every section can use ---------------------------------------------------------
    def run_b0(self, w: wl.Workload, name: str = "B0") -> Run:
        """One request at a time through mlx_lm.stream_generate (greedy: its default sampler is argmax)."""
        tokens = []
        t0 = time.perf_counter()
        for p in w.prompts:
            tokens.append([r.token for r in stream_generate(self.model, self.tok_noeos, p, max_tokens=w.max_tokens)])
        wall = time.perf_counter() - t0
        return Run(name, wall, w.rows, w.prompt_tokens, sum(map(len, tokens)), tokens)

    def run_b1(self, w: wl.Workload, completion_batch_size: int, prefill_batch_size: int,
               sort: bool = False, name: str = "B1") -> Run:
        """mlx_lm.batch_generate over the prompts (B2: sorted longest first; outputs put back in order)."""
        order = list(range(w.rows))
        if sort:
            order.sort(key=lambda i: len(w.prompts[i]), reverse=True)
        t0 = time.perf_counter()
        resp = batch_generate(self.model, self.tok_noeos, [w.prompts[i] for i in order], max_tokens=w.max_tokens,
                              completion_batch_size=completion_batch_size,
                              prefill_batch_size=min(prefill_batch_size, completion_batch_size),
                              return_token_ids=True)
        wall = time.perf_counter() - t0
        tokens: list[list[int]] = [[] for _ in order]
        for i, ids in zip(order, resp.token_ids):
            tokens[i] = [int(t) for t in ids]
        s = resp.stats
        extra = {"prompt_s": s.prompt_time, "decode_s": s.decode_time, "other_s": s.overhead_time,
                 "wall_inner_s": s.wall_time, "decode_tps": s.decode_tps, "prompt_tps": s.prompt_tps,
                 "generation_steps": s.generation_steps, "peak_memory_gb": s.peak_memory}
        return Run(name, wall, w.rows, w.prompt_tokens, sum(map(len, tokens)), tokens, extra)

    def run_engine(self, w: wl.Workload, name: str = "engine", layout: LayoutOptions | None = None,
                   launch_thread: bool | None = None, **config: Any) -> Run:
        """mlxbatch Engine.generate (greedy, ignore_eos) on a fresh engine; construction is not timed. ``layout``,
        ``launch_thread``: another device's decisions (None: this device's)."""
        params = SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
        engine = Engine(self.loaded, EngineConfig(seed=0, **config), layout=layout, launch_thread=launch_thread)
        try:
            t0, c0 = time.perf_counter(), time.thread_time()
            outs = engine.generate(w.prompts, params)
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            stats = engine.stats()
        finally:
            engine.close()
        tokens = [list(o.token_ids) for o in outs]
        extra = {"profile": stats["profile"], "preemptions": stats["preemptions"], "kv_bytes": stats["kv_bytes"],
                 "kv_budget_bytes": stats["kv_budget_bytes"], "config": config, "thread_cpu_s": cpu}
        return Run(name, wall, w.rows, w.prompt_tokens, sum(map(len, tokens)), tokens, extra)


def resolve_model(name: str, cache_dir: Path) -> str:
    """A shape name becomes a random-weight qwen2 model built once into the cache; anything else is a path."""
    if name in SHAPES:
        out = cache_dir / name
        if not (out / ".complete").exists():
            log(f"building the random-weight {name} model in {out} (once)")
        return str(build_random_model(out, name))
    return name


def agreement(tokens: list[list[int]], ref: list[list[int]], n: int) -> tuple[int, int]:
    """Rows whose first ``n`` generated ids equal the reference's."""
    same = sum(1 for a, b in zip(tokens, ref) if a[:n] == b[:n])
    return same, len(tokens)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


# -- sections ----------------------------------------------------------------------------------------
SectionFn = Callable[[Bench], list[Table]]
SECTIONS: dict[str, SectionFn] = {}


def section(name: str) -> Callable[[SectionFn], SectionFn]:
    """Register a section under ``name`` (``--section NAME`` / ``mlxbatch bench NAME``)."""
    def register(fn: SectionFn) -> SectionFn:
        SECTIONS[name] = fn
        return fn

    return register
