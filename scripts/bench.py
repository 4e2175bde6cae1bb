#!/usr/bin/env python
"""mlxbatch benchmarks: every figure is a ratio against baselines run in the same process.

    .venv/bin/python scripts/bench.py --section engine --model tiny [--json results.json]
    .venv/bin/python scripts/bench.py --section job --model tiny     # job layer: see bench_job.py

The method is ../shared/design/benchmarks.md: one model object (loaded once, same dtype) serves every
baseline and mlxbatch; workloads are token ids generated from a seed (``bench_workloads.py``); each path
is warmed up on a couple of rows, then run ``--repeats`` times (interleaved) and its median reported.

Baselines: B0 one request at a time (``mlx_lm.stream_generate``), B1 ``mlx_lm.batch_generate`` in input
order, B2 the same after sorting prompts by length. EOS is disabled for all of them (a copy of the
tokenizer wrapper with no EOS ids) and the engine runs with ``ignore_eos``: every row generates exactly
``max_tokens`` tokens, so rows/s and tok/s compare like with like.

Sections are functions registered in ``SECTIONS`` (``@section("name")``); each receives the shared
``Bench`` (model, tokenizer, flags, measuring helpers) and returns ``Table``s. Add a section by writing a
function; add a workload in ``bench_workloads.py``. The ``job`` section (mlxbatch run vs the engine alone,
and streaming memory of the reader + checkpoint path) lives in ``bench_job.py``.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# isort: off
import mlxbatch  # noqa: F401  (must come first: it preloads OpenBLAS before mlx is imported)
import mlx.core as mx

# isort: on
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm import batch_generate, stream_generate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_workloads as wl  # noqa: E402

sys.modules.setdefault("bench", sys.modules[__name__])  # bench_job's ``from bench import ...`` gets this module

from mlxbatch import _blas  # noqa: E402
from mlxbatch.engine import Engine, EngineConfig, LoadedModel, ModelSpec, load_model  # noqa: E402
from mlxbatch.models.random_model import SHAPES, build_random_model  # noqa: E402
from mlxbatch.types import SamplingParams  # noqa: E402

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


# -- memory ------------------------------------------------------------------------------------------
def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # a lifetime high-water


class MemoryProbe:
    """MLX peak (reset at entry) and sampled process RSS over a block, after freeing MLX's cache."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()

    def __enter__(self) -> MemoryProbe:
        gc.collect()
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        self.mlx_base = mx.get_active_memory()
        self.rss_base = self.rss_peak = _rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.rss_peak = max(self.rss_peak, _rss())

    def __exit__(self, *exc: object) -> None:
        mx.synchronize()
        self._stop.set()
        self._thread.join()
        self.rss_peak = max(self.rss_peak, _rss())
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

    def run_engine(self, w: wl.Workload, name: str = "engine", **config: Any) -> Run:
        """mlxbatch Engine.generate (greedy, ignore_eos) on a fresh engine; construction is not timed."""
        params = SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
        engine = Engine(self.loaded, EngineConfig(seed=0, **config))
        try:
            t0 = time.perf_counter()
            outs = engine.generate(w.prompts, params)
            wall = time.perf_counter() - t0
            stats = engine.stats()
        finally:
            engine.close()
        tokens = [list(o.token_ids) for o in outs]
        extra = {"profile": stats["profile"], "preemptions": stats["preemptions"], "kv_bytes": stats["kv_bytes"],
                 "kv_budget_bytes": stats["kv_budget_bytes"], "config": config}
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
    def register(fn: SectionFn) -> SectionFn:
        SECTIONS[name] = fn
        return fn

    return register


@section("job")
def job_section(b: Bench) -> list[Table]:
    """mlxbatch run (in process) vs the engine alone on the same rows; streaming memory at 10k-1M rows."""
    import bench_job

    return bench_job.job_section(b)


# the sections living in their own files register themselves on import
import bench_engine  # noqa: E402,F401
import bench_suite  # noqa: E402,F401
import bench_tasks  # noqa: E402,F401


# -- main --------------------------------------------------------------------------------------------
def machine_meta(b: Bench) -> dict[str, Any]:
    cfg = b.loaded.config
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                               cwd=Path(__file__).parent, timeout=5).stdout.strip()
        git += " (uncommitted changes)" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        git = "?"
    if b.args.commit and (not git or git == "?" or not git[0].isalnum()):
        git = f"{b.args.commit} (given)"
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(x) for x in [Path(sys.executable).name, *sys.argv]),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "device": str(mx.default_device()),
        "openblas": _blas.loaded_path or "not loaded",
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "mlxbatch": mlxbatch.__version__,
        "git": git,
        "model": b.args.model,
        "model_path": b.model_path,
        "shape": {k: cfg.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                           "num_key_value_heads", "intermediate_size", "vocab_size")},
        "params": sum(v.size for _, v in tree_flatten(b.model.parameters())),
        "dtype": b.loaded.dtype,
        "tokenizer_vocab": len(b.tokenizer),
        "concurrency": b.concurrency,
        "load_s": round(b.load_s, 2),
    }


def render_meta(m: dict[str, Any]) -> str:
    s = m["shape"]
    return "\n".join([
        f"## mlxbatch bench — {m['date']}",
        "",
        f"- command: `{m['command']}`",
        f"- machine: {m['platform']}, {m['cpu']}, {m['cpu_count']} CPUs; device {m['device']}; "
        f"OpenBLAS: {m['openblas']}",
        f"- software: python {m['python']}, mlx {m['mlx']}, mlx-lm {m['mlx_lm']}, mlxbatch {m['mlxbatch']} "
        f"(git {m['git']})",
        f"- model: {m['model']} ({m['params'] / 1e6:.1f}M params, {m['dtype']}): hidden {s['hidden_size']}, "
        f"{s['num_hidden_layers']} layers, {s['num_attention_heads']} heads / {s['num_key_value_heads']} KV heads, "
        f"intermediate {s['intermediate_size']}, vocab {s['vocab_size']} (tokenizer {m['tokenizer_vocab']})",
        "",
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--section", action="append", choices=["engine", "job", "nsample", "score", "gpu"],
                    help="section(s) to run (repeatable; default: engine)")
    ap.add_argument("--model", default="tiny",
                    help=f"{'|'.join(SHAPES)} (random-weight qwen2, built once into --cache-dir) or a model path "
                         "(default tiny)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto (default): float32 on CPU, bfloat16 on GPU")
    ap.add_argument("--cache-dir", default="~/.cache/mlxbatch/bench", help="where random models are built")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    ap.add_argument("--rows", type=int, default=256, help="rows of the main workload (default 256)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="new tokens per row (default: the workload's: unique 64, label 32, fewshot 8, chat 32)")
    ap.add_argument("--workload", default="unique", choices=["unique", "label", "fewshot", "chat"],
                    help="engine section workload (default unique; others add engine-nocache)")
    ap.add_argument("--b0-rows", type=int, default=16, help="rows B0 runs (default 16; 0 skips B0)")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="engine max_num_seqs = B1 completion_batch_size (default 32 on CPU, 256 on GPU)")
    ap.add_argument("--prefill-batch", type=int, default=8, help="B1/B2 prefill_batch_size (default 8, as mlx-lm)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs per path, median reported (default: engine 1 on CPU, 3 on GPU; job 3)")
    ap.add_argument("--decode-levels", default="1,8,64,256",
                    help="concurrent sequences for the decode table (default 1,8,64,256; '' skips it)")
    ap.add_argument("--decode-prompt-len", type=int, default=32, help="decode table prompt length (default 32)")
    ap.add_argument("--decode-new-tokens", type=int, default=128, help="decode table new tokens (default 128)")
    ap.add_argument("--job-rows", type=int, default=512, help="job section: rows of the overhead run (default 512; "
                    "0 skips it)")
    ap.add_argument("--job-max-tokens", type=int, default=16, help="job section: max_tokens (default 16)")
    ap.add_argument("--job-checkpoint-rows", type=int, default=64,
                    help="job section: checkpoint.every_rows (default 64)")
    ap.add_argument("--stream-rows", default="10000,100000,1000000",
                    help="job section: rows streamed through reader + checkpoint, one process each ('' skips)")
    ap.add_argument("--stream-checkpoint-rows", type=int, default=1000,
                    help="job section: rows per checkpoint shard when streaming (default 1000)")
    ap.add_argument("--stream-track-ids", default="1000000",
                    help="job section: sizes also streamed with the run loop's duplicate-id set (default 1000000)")
    ap.add_argument("--stream-timeout", type=int, default=1200, help="job section: seconds per size (default 1200)")
    ap.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    ap.add_argument("--commit", default=os.environ.get("GIT_SHA"),
                    help="the git commit measured (default $GIT_SHA; for copies of the tree without .git)")
    ap.add_argument("--out", default=None, help="gpu section: folder for gpu_suite.json and gpu_suite.md")
    ap.add_argument("--suite-workloads", default="label,fewshot,chat,unique",
                    help="gpu section: workloads to run (default label,fewshot,chat,unique)")
    ap.add_argument("--rows-scale", type=float, default=1.0,
                    help="gpu section: scale the target sizes (default 1: label/fewshot 2048, chat/unique 1024)")
    args = ap.parse_args(argv)
    args.section = args.section or ["engine"]
    args.repeats_given = args.repeats is not None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if mx.default_device() == mx.gpu else 1
    t0 = time.perf_counter()
    b = Bench(args)
    meta = machine_meta(b)
    print(render_meta(meta), flush=True)
    results: dict[str, Any] = {"meta": meta, "args": vars(args), "sections": {}}
    for name in args.section:
        ts = time.perf_counter()
        tables = SECTIONS[name](b)
        for t in tables:
            print(t.render(), flush=True)
        results["sections"][name] = {
            "seconds": round(time.perf_counter() - ts, 1),
            "tables": [t.as_dict() for t in tables],
        }
    total = time.perf_counter() - t0
    print(f"(total {total:.0f} s)")
    results["total_s"] = round(total, 1)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2, default=str))
        log(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
