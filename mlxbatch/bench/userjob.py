"""``mlxbatch bench userjob``: what a user gets. A labeling job through the real CLI, against mlx-lm and the machine.

    python3 -m mlxbatch.bench userjob --model 0.5b --commit <sha> --json out.json     # the GPU machine: 100k rows
    mlxbatch bench userjob --model tiny --rows 20000 --configs defaults,16,32,64,128,256   # the CPU version
    python3 -m mlxbatch.bench userjob --model 0.5b --configs defaults,512x8192+overlap --mlx-lm-rows 0 ...  # GPU A/B

The job (``jobdata.write_reviews``): ``--rows`` rows (default 100,000), each one shared instruction of ~30 tokens as
the system message and a review of 8-40 words as the user message (~137 prompt tokens a row with the random models'
tokenizer), ``--max-tokens`` new tokens (default 8), greedy, ``model: {path, dtype}`` (``--dtype auto``: bfloat16 on
a GPU, float32 on a CPU). It runs as ``mlxbatch run job.yaml`` in a child process, as a user runs it, once per
``--configs`` entry: ``defaults`` with no ``engine:`` section, N with ``engine: {max_num_seqs: N}``, NxT with
``max_num_batched_tokens: T`` too, a ``+overlap`` suffix with ``overlap_steps: true``
(``512x8192+overlap``, ``defaults+overlap``), a ``+workersK`` suffix with ``MLXBATCH_FEED_WORKERS=K`` (the feed's
rendering, tokenizing and planning in K processes, off the run's GIL: ``defaults+workers4``), a ``+engine1`` or
``+engine0`` suffix with ``MLXBATCH_ENGINE_PROCESS`` (the engine in a process of its own, or in the run's: an A/B of
one tree, ``defaults+engine0``). Then, in
this process, mlx-lm's ``batch_generate`` on the first ``--mlx-lm-rows`` rows (default a tenth) of the same prompts
(the chat template applied by the tokenizer; ``completion_batch_size`` = ``--concurrency``, default 256 on a GPU and
32 on a CPU), and the hardware floor of the job (``floor``: the matmul rate and bandwidth measured here).

Prints, per run: rows/s, the wall (the run's own, from report.json, and the child process's, with its start and model
load), the engine's step time from the report's profile and the wall outside it, the CPU time of the run's thread
and of its feed's thread (one GIL between them: their sum near the wall says the process is bound by it), the
fraction of the floor, the
prefill computed against the window floor and the KV in use; then where a step's time goes (building passes on the
host, waiting for the device, sampling, the rest). ``--json`` writes the tables, the reports and the floor.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mlxbatch.bench.floor import Floor, MachineSpeed, job_floor, machine_speed
from mlxbatch.bench.harness import MB, Bench, Table, log, ratio, resolve_model
from mlxbatch.bench.jobdata import INSTRUCTION, write_reviews
from mlxbatch.bench.meta import emit
from mlxbatch.bench.options import parse_script_args
from mlxbatch.job.executors.placement import ENGINE_PROCESS_ENV
from mlxbatch.job.rows.workers import WORKERS_ENV

MESSAGES = [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": "{{ review }}"}]


def job_file(folder: Path, tag: str, model: str, dtype: str, data: Path, max_tokens: int,
             engine: dict[str, Any] | None) -> Path:
    job: dict[str, Any] = {"model": {"path": model, "dtype": dtype}, "input": {"path": str(data), "id_column": "id"},
                           "prompt": {"messages": MESSAGES}, "sampling": {"temperature": 0, "max_tokens": max_tokens},
                           "output": str(folder / f"out-{tag}")}
    if engine is not None:
        job["engine"] = dict(engine)
    path = folder / f"job-{tag}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run_cli(job: Path, timeout: float, extra: tuple[str, ...] = (),
            env: dict[str, str] | None = None) -> tuple[float, dict[str, Any]]:
    """``mlxbatch run job.yaml [extra]`` in a child process (``env``: its whole environment; default this one's):
    (its wall seconds, report.json)."""
    out = Path(yaml.safe_load(job.read_text())["output"])
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mlxbatch.cli", "run", str(job), "--no-progress", *extra],
                          capture_output=True, text=True, timeout=timeout, env=env)
    wall = time.perf_counter() - t0
    (job.parent / f"{job.stem}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"mlxbatch run {job} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    import json

    return wall, json.loads((out / "report.json").read_text())


def mlx_lm_run(b: Bench, data: Path, rows: int, max_tokens: int, job_out: Path) -> dict[str, Any]:
    """mlx-lm's batch_generate on the first ``rows`` rows, the prompts rendered by the tokenizer's chat template; how
    many rows have the job's prompt length (``job_out``'s results) and its text (greedy both)."""
    import json

    import pyarrow.parquet as pq
    from mlx_lm import batch_generate

    reviews = []
    with open(data, encoding="ascii") as f:
        for line in f:
            if len(reviews) == rows:
                break
            reviews.append(json.loads(line)["review"])
    prompts = [b.tokenizer.apply_chat_template([MESSAGES[0], {"role": "user", "content": r}],
                                               add_generation_prompt=True) for r in reviews]
    C = b.concurrency
    t0 = time.perf_counter()
    resp = batch_generate(b.model, b.tokenizer, prompts, max_tokens=max_tokens, completion_batch_size=C,
                          prefill_batch_size=min(b.args.prefill_batch, C))
    wall = time.perf_counter() - t0
    s = resp.stats
    job = pq.read_table(job_out / "results.parquet", columns=["prompt_tokens", "text"]).slice(0, rows).to_pylist()
    return {"rows": rows, "wall_s": wall, "rows_per_s": rows / wall, "prompt_tokens": sum(map(len, prompts)),
            "prompt_s": s.prompt_time, "decode_s": s.decode_time, "completion_batch_size": C,
            "same_prompt_length": sum(len(p) == j["prompt_tokens"] for p, j in zip(prompts, job)),
            # the job's text drops the leading space a tokenizer may decode first
            "same_text": sum(t.strip() == (j["text"] or "").strip() for t, j in zip(resp.texts, job))}


def model_size(b: Bench) -> tuple[int, int]:
    from mlx.utils import tree_flatten

    arrays = [v for _, v in tree_flatten(b.model.parameters())]
    return sum(v.size for v in arrays), sum(v.nbytes for v in arrays)


def tables(runs: dict[str, tuple[float, dict]], ref: dict | None, floor_s: float, rows: int) -> list[Table]:
    main = Table(f"the user's job: {rows:,} rows through `mlxbatch run`",
                 ["engine section", "rows/s", "wall s", "process s", "engine steps s", "prefill / decode / host s",
                  "wall outside the steps", "of it: in the engine / waiting for rows / writing results / garbage "
                  "collector",
                  "CPU s: the run's thread / the feed's / the engine process's", "wall / steps",
                  "of the floor", "prefill / window floor", "KV in use MB", "MLX peak MB", "steps"])
    split = Table("where a step's time goes (seconds; ms a step)",
                  ["engine section", "steps", "ms a step", "prefill: build", "of it encoding", "prefill: wait",
                   "decode: build", "of it encoding", "decode: wait", "waiting for the launch thread", "sampling",
                   "host (scheduling, bookkeeping)", "syncs"])
    for tag, (process_s, r) in runs.items():
        p, wall = r["engine"]["profile"], r["wall_s"]
        outside = wall - p["total_s"]
        main.rows.append([tag, r["rows_per_s"], wall, process_s, p["total_s"],
                          f"{p['prefill_s']:.1f} / {p['decode_s']:.1f} / {p['host_s']:.1f}",
                          f"{outside:.1f} s ({outside / wall:.0%})", _outside(r.get("this_run") or {}, p),
                          _cpu((r.get("this_run") or {}).get("cpu_s"), r["engine"].get("engine_thread_cpu_s")),
                          ratio(wall, p["total_s"]),
                          f"{floor_s / wall:.1%}", r["prefix_reuse"]["window_floor_ratio"],
                          r["engine"]["kv_bytes"] / MB, r["engine"].get("peak_memory_bytes", 0) / MB, p["steps"]])
        split.rows.append([tag, p["steps"], 1e3 * p["total_s"] / max(1, p["steps"]), p["prefill_build_s"],
                           p.get("encoded_prefill_s"), p.get("waited_prefill_s", 0.0), p["decode_build_s"],
                           p.get("encoded_decode_s"), p.get("waited_decode_s", 0.0),
                           p.get("waited_launch_thread_s", 0.0), p["sampling_s"], p["host_s"], p["syncs"]])
    if ref is not None:
        main.rows.append([f"mlx-lm batch_generate, first {ref['rows']:,} rows", ref["rows_per_s"], ref["wall_s"],
                          None, None, f"{ref['prompt_s']:.1f} / {ref['decode_s']:.1f} / -", None, None, None, None,
                          f"{floor_s * ref['rows'] / rows / ref['wall_s']:.1%}", None, None, None, None])
    split.notes.append("build: the host building and launching the passes (copy-ins and row moves included); wait: "
                       "the host waiting for the device after it; of it encoding: the part of build inside `mx.async_eval` (MLX "
                       "ordering the graph and encoding its kernels; the rest is Python building the graph and the "
                       "step's books), or with the launch thread (NVIDIA), that thread's time in it, beside the step's "
                       "books; waiting for the launch thread: the engine's thread waiting for that encoding to end; "
                       "host: the rest of the step")
    return [main, split]


def _outside(run: dict[str, Any], profile: dict[str, Any]) -> str | None:
    """The parts of the wall outside the steps that the run times: in the engine's step calls but not in its profiled
    steps (finished rows' outputs, steps with nothing to launch: ``stepping_s``), the engine idle while the feed
    prepared the next window (the start, mostly), the end after the last row (results.parquet written, the report's
    summary), and Python's garbage collector (in any thread, so partly inside the steps)."""
    wait, end, gc_s = run.get("waiting_for_rows_s"), run.get("writing_results_s"), run.get("garbage_collector_s")
    if wait is None or end is None:
        return None
    stepping = profile.get("stepping_s")
    engine = f"{stepping - profile['total_s']:.1f} / " if stepping is not None else ""
    return engine + f"{wait:.1f} / {end:.1f}" + (f" / {gc_s:.1f} s" if gc_s is not None else " s")


def _cpu(cpu: dict[str, float] | None, engine_thread: float | None = None) -> str | None:
    """The run's CPU seconds while rows ran: its own thread (the job layer, and the engine's steps where the engine
    runs in the run's process) and the feed's thread (with the GIL they share, their sum near the wall says the process
    is bound by it); where the engine ran in a process of its own, the CPU time of the thread that stepped it."""
    if not cpu:
        return None
    engine = f" / {engine_thread:.1f}" if engine_thread is not None else " / -"
    return f"{cpu['run_thread']:.1f} / {cpu['feed_thread']:.1f}" + engine


DEFAULTS = "none (defaults)"


_CONFIG = re.compile(r"^(?:defaults|(\d+)(?:x(\d+))?)(\+overlap)?(?:\+workers(\d+))?(?:\+engine([01]))?$")


@dataclass(frozen=True)
class RunConfig:
    """One run of the job: its engine section (None: none, the defaults), its feed's worker processes (None: the
    run's default, ``MLXBATCH_FEED_WORKERS`` unset) and where its engine runs (``MLXBATCH_ENGINE_PROCESS``: 1 a
    process of its own, 0 the run's; None: the run's default)."""

    section: dict[str, Any] | None
    workers: int | None = None
    engine_process: int | None = None

    @property
    def env(self) -> dict[str, str]:
        """The environment variables the run is given."""
        return {**({WORKERS_ENV: str(self.workers)} if self.workers is not None else {}),
                **({ENGINE_PROCESS_ENV: str(self.engine_process)} if self.engine_process is not None else {})}

    @property
    def tag(self) -> str:
        """The run's name in the tables: its engine section as the job file says it, and its feed workers."""
        tag = DEFAULTS if self.section is None else ", ".join(
            f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in self.section.items())
        return "; ".join([tag, *(f"{k}={v}" for k, v in self.env.items())])

    @property
    def name(self) -> str:
        """Its files' name: ``defaults``, ``seqs-256-4096-overlap``, with ``-workers4``, ``-engine0``."""
        name = "defaults" if self.section is None else "seqs-" + "-".join(
            "overlap" if v is True else str(v) for v in self.section.values())
        return name + (f"-workers{self.workers}" if self.workers is not None else "") + (
            f"-engine{self.engine_process}" if self.engine_process is not None else "")


def parse_configs(text: str) -> list[RunConfig]:
    """``--configs`` -> the runs: ``defaults`` has no engine section, ``N`` is ``max_num_seqs: N``, ``NxT`` adds
    ``max_num_batched_tokens: T``, a ``+overlap`` suffix ``overlap_steps: true`` (``defaults+overlap``: that key
    alone), a ``+workersK`` suffix runs the feed in K worker processes, ``+engine1`` / ``+engine0`` the engine in a
    process of its own / in the run's."""
    out: list[RunConfig] = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        m = _CONFIG.match(item)
        if m is None or any(g is not None and int(g) == 0 for g in m.groups()[:2]):
            raise SystemExit(f"--configs: {item!r}: expected 'defaults' or N, NxT (max_num_seqs, max_num_batched_tokens: "
                             "integers >= 1), each with an optional '+overlap', '+workersK' and '+engine1' or '+engine0'")
        seqs, tokens, overlap, workers, engine = m.groups()
        section: dict[str, Any] = {}
        if seqs is not None:
            section["max_num_seqs"] = int(seqs)
        if tokens is not None:
            section["max_num_batched_tokens"] = int(tokens)
        if overlap:
            section["overlap_steps"] = True
        out.append(RunConfig(section or None, int(workers) if workers is not None else None,
                             int(engine) if engine is not None else None))
    if not out:
        raise SystemExit("--configs: name at least one run ('defaults' or a max_num_seqs)")
    return out


def notes(runs: dict[str, tuple[float, dict]], ref: dict | None, floor: Floor, speed: MachineSpeed, params: int,
          weight_bytes: int, a: Any, floor_batch: int) -> list[str]:
    first = next(iter(runs.values()))[1]
    hand = {t: r for t, (_, r) in runs.items() if not t.startswith(DEFAULTS)}  # (defaults with feed workers: not hand-set)
    out = [
        f"hardware floor {floor.seconds:.2f} s ({a.rows / floor.seconds:,.0f} rows/s): prefill "
        f"{floor.prefill_tokens:,} window-floor tokens x 2 x {params / 1e6:.1f}M parameters at "
        f"{speed.matmul_flops / 1e12:.2f} TFLOP/s ({speed.matmul_n}^3 {a.dtype} matmul) = {floor.prefill_s:.2f} s, "
        f"decode {floor.decode_steps:,} steps ({a.rows:,} rows x {a.max_tokens - 1} tokens / {floor_batch}) x "
        f"{weight_bytes / MB:,.1f} MB of weights at {speed.bandwidth / 1e9:,.1f} GB/s = {floor.decode_s:.3f} s."]
    if DEFAULTS in runs and hand:
        best_tag = max(hand, key=lambda t: hand[t]["rows_per_s"])
        out.append(f"defaults at {runs[DEFAULTS][1]['rows_per_s'] / hand[best_tag]['rows_per_s']:.0%} of the best "
                   f"hand-set section ({best_tag}: {hand[best_tag]['rows_per_s']:,.1f} rows/s).")
    chosen = runs[DEFAULTS][1].get("engine", {}).get("batch") if DEFAULTS in runs else None
    if chosen:  # what the engine sized with no engine section (report.json's engine.batch)
        out.append(f"the defaults ran max_num_seqs {chosen['max_num_seqs']} ({chosen['max_num_seqs_from']}), "
                   f"max_num_batched_tokens {chosen['max_num_batched_tokens']} ({chosen['max_num_batched_tokens_from']})"
                   f"; the KV budget held {chosen['rows_in_kv_budget']} rows of the job's max_tokens.")
    prompt = first["tokens"]["prompt"]
    out.append(f"prompt tokens: the job {prompt:,} ({prompt / a.rows:.1f} a row)"
               + (f"; mlx-lm's {ref['rows']:,} rows {ref['prompt_tokens']:,} ({ref['prompt_tokens'] / ref['rows']:.1f} "
                  f"a row, completion_batch_size {ref['completion_batch_size']}); of those rows "
                  f"{ref['same_prompt_length']:,} have the job's prompt length and {ref['same_text']:,} its text"
                  if ref else "")
               + f"; {a.max_tokens} new tokens at most, greedy, EOS on; model dtype {a.dtype}.")
    return out


def main(argv: list[str] | None = None) -> int:
    mine, args = parse_script_args(
        list(sys.argv[1:] if argv is None else argv), "userjob", __doc__, {"rows": 100_000, "max_tokens": 8},
        configs=("defaults,64,128,256,512,1024", "the runs, in order: 'defaults' (no engine section) and hand-set "
                 "engine sections: N (max_num_seqs), NxT (and max_num_batched_tokens), each with an optional "
                 "'+overlap' (overlap_steps: true) and '+workersK' (MLXBATCH_FEED_WORKERS=K) (default "
                 "defaults,64,128,256,512,1024)"),
        mlx_lm_rows=(-1, "rows for mlx-lm's batch_generate (default: a tenth of --rows; 0 skips it)"),
        floor_batch=(256, "rows decoding together in the floor's decode steps (default 256)"),
        matmul_n=(0, "the floor's matmul size (default 8192 on a GPU, 2048 on a CPU)"),
        stream_mib=(0, "the floor's element-wise pass in MiB (default 1024 on a GPU, 256 on a CPU)"),
        workdir=("", "keep the input, job files, logs and outputs here (default: a temporary folder)"),
        timeout=(7200.0, "seconds a job may take (default 7200)"))
    configs = parse_configs(mine.configs)
    import tempfile

    import mlx.core as mx

    folder = Path(mine.workdir or tempfile.mkdtemp(prefix="mlxbatch-userjob-"))
    folder.mkdir(parents=True, exist_ok=True)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if mx.default_device() == mx.gpu else "float32")
    model = resolve_model(args.model, Path(args.cache_dir).expanduser())
    data = write_reviews(folder / "reviews.jsonl", args.rows, args.seed)
    runs: dict[str, tuple[float, dict]] = {}
    outs: dict[str, Path] = {}
    for config in configs:
        tag = config.tag
        log(f"userjob: {args.rows:,} rows, engine section {tag}")
        job = job_file(folder, config.name, model, dtype, data, args.max_tokens, config.section)
        env = {**os.environ, **config.env} if config.env else None
        outs[tag] = Path(yaml.safe_load(job.read_text())["output"])
        if outs[tag].exists():  # a kept ``--workdir``: every run runs every row, never resumes an earlier call's
            shutil.rmtree(outs[tag])
        runs[tag] = run_cli(job, mine.timeout, env=env)
        log(f"  {runs[tag][1]['rows_per_s']:.1f} rows/s")
    args.dtype = dtype
    b = Bench(args)  # after the jobs: this process holds no model while they run
    ref_rows = args.rows // 10 if mine.mlx_lm_rows < 0 else min(mine.mlx_lm_rows, args.rows)
    ref = mlx_lm_run(b, data, ref_rows, args.max_tokens, next(iter(outs.values()))) if ref_rows else None
    speed = machine_speed(dtype, mine.matmul_n or None, (mine.stream_mib << 20) or None)
    params, weight_bytes = model_size(b)
    first = next(iter(runs.values()))[1]  # every run plans the same windows: the same window floor
    floor = job_floor(first["prefix_reuse"]["window_floor_tokens"], args.rows, args.max_tokens, params, weight_bytes,
                      speed, mine.floor_batch)
    out = tables(runs, ref, floor.seconds, args.rows)
    out[0].notes += [*notes(runs, ref, floor, speed, params, weight_bytes, args, mine.floor_batch),
                     f"job files in {folder}."]
    emit(b, out, {"floor": floor.as_dict(), "speed": speed.__dict__, "params": params, "weight_bytes": weight_bytes,
                  "mlx_lm": ref, "reports": {t: {"process_s": s, "report": r} for t, (s, r) in runs.items()}})
    return 0
