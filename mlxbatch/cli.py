"""The command line: ``mlxbatch run | validate | plan | status | show | export | generate | info | doctor | bench``.

Owns process-level concerns only: logging set-up (once, here), exit codes and messages. Exit codes: 0 done,
1 error, 2 invalid job file, 3 too many row errors, 64 command-line usage error (an unknown option, a bad option
value), 130 interrupted (resume by running the same command).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, NoReturn

import click

import mlxbatch  # noqa: F401  (preloads OpenBLAS before anything imports mlx)
from mlxbatch.errors import MlxbatchError
from mlxbatch.job.run.stopping import EXIT_INTERRUPTED  # 130, a second signal's too (it exits from the handler)

EXIT_INVALID, EXIT_ERRORS, EXIT_USAGE = 2, 3, 64


def _fail(exc: MlxbatchError) -> NoReturn:
    """Print ``exc`` as one line and exit with the code its kind maps to."""
    from mlxbatch.job.run.runner import JobFailed, JobInterrupted
    from mlxbatch.job.spec import JobSpecError

    codes = {JobSpecError: EXIT_INVALID, JobInterrupted: EXIT_INTERRUPTED, JobFailed: EXIT_ERRORS}
    click.echo(f"mlxbatch: {exc}", err=True)
    sys.exit(next((code for kind, code in codes.items() if isinstance(exc, kind)), 1))


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not sys.stderr.isatty():
        logging.getLogger("mlxbatch").setLevel(min(level, logging.INFO))


class _Commands(click.Group):
    """Command-line usage errors exit with EXIT_USAGE (click's own 2 is an invalid job file here)."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as exc:
            exc.exit_code = EXIT_USAGE
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            exc.exit_code = EXIT_USAGE
            raise


@click.group(cls=_Commands)
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.version_option(mlxbatch.__version__)
def main(verbose: int) -> None:
    """Batch / offline LLM jobs on MLX, resumable after any crash."""
    _setup_logging(verbose)


def _job_options(f: Any) -> Any:
    """--set / --limit / --output: change a job without editing its file (typed and checked like the file)."""
    f = click.option("--output", "-o", "output", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="Output folder (instead of the job's output.path; relative to the current folder).")(f)
    f = click.option("--limit", type=click.IntRange(min=1), default=None,
                     help="Only the first N input rows (a trial run; the same folder resumes them later).")(f)
    return click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                        help="Set a job key, e.g. --set sampling.temperature=0.7 (a YAML value; repeatable).")(f)


def _overrides(sets: tuple[str, ...], limit: int | None, output: Path | None) -> Any:
    from mlxbatch.job.spec.overrides import JobOverrides

    return JobOverrides(sets=sets, limit=limit, output=output)


def _load(job_file: Path, sets: tuple[str, ...], limit: int | None, output: Path | None) -> Any:
    """The job file's spec, not yet checked (its model's torch decided first: ``_without_torch``)."""
    from mlxbatch.job.spec import load_job

    spec = load_job(job_file, _overrides(sets, limit, output))
    _without_torch(spec.model)
    return spec


def _without_torch(model: Any) -> None:
    """A text model uses transformers' tokenizers only: transformers is told there is no torch before anything
    imports it (it would import torch: ``mlxbatch._torch``)."""
    from mlxbatch._torch import without_torch
    from mlxbatch.job.check.model_ref import tokenizers_only

    if tokenizers_only(model):
        without_torch()


def _done_line(report: dict[str, Any], out_dir: str) -> str:
    rows, this = report["rows"], report.get("this_run", {})
    parts = [f"done: {rows['output']} rows, {rows['errors']} errors ({rows['finished_this_run']} run now, "
             f"{rows['resumed']} resumed)"]
    if this.get("finished"):
        if report["tokens"]["generated"] or this.get("generated_tokens_per_s"):
            parts.append(f"{this['generated_tokens_per_s']} tok/s")
        else:  # scoring generates nothing: its speed is in rows and prompt tokens
            parts.append(f"{this['rows_per_s']} rows/s, {this['prompt_tokens_per_s']} prompt tok/s")
    acc = report.get("accuracy")
    if acc and acc.get("rows"):
        from mlxbatch.job.report.metrics import summary_line

        parts.append(summary_line(acc))
    return ", ".join(parts) + f" -> {out_dir}/results.parquet"


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when on a terminal).")
@_job_options
@click.option("--ray", "ray_address", is_flag=False, flag_value="", default=None, metavar="[ADDRESS]",
              help="Run on engine actors on a Ray cluster: ADDRESS, else executor.address, else $RAY_ADDRESS, "
                   "else a local cluster (needs mlxbatch[ray]).")
@click.option("--local", is_flag=True, help="Run in this process even if the job file says executor.kind: ray.")
def run(job_file: Path, progress: bool | None, sets: tuple[str, ...], limit: int | None, output: Path | None,
        ray_address: str | None, local: bool) -> None:
    """Run JOB_FILE; run it again after a crash to resume where it stopped (with or without --ray)."""
    from mlxbatch.job.check.validate import validate_job
    from mlxbatch.job.executors.placement import early_engine, stop_engine
    from mlxbatch.job.spec import with_executor

    engine = None
    try:
        if ray_address is not None and local:
            raise click.UsageError("give --ray or --local, not both")
        spec = with_executor(_load(job_file, sets, limit, output),
                             "local" if local else "ray" if ray_address is not None else None, ray_address or None)
        engine = early_engine(spec)  # its imports while this process checks the job (a process of its own)
        spec = validate_job(spec)
        from mlxbatch.job.run.awake import keep_awake  # (after ``_load``: the runner imports transformers)
        from mlxbatch.job.run.runner import JobRunner

        with keep_awake():  # macOS: no idle sleep while the job runs (caffeinate)
            result = JobRunner(spec, progress=progress, engine=engine).run()
    except MlxbatchError as exc:
        _fail(exc)
    finally:
        stop_engine(engine)  # (one the run did not adopt: a job that failed its checks)
    click.echo(_done_line(result.report, result.out_dir))
    if (result.report.get("accuracy") or {}).get("warning"):
        click.echo(f"warning: {result.report['accuracy']['warning']}", err=True)


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@_job_options
def validate(job_file: Path, sets: tuple[str, ...], limit: int | None, output: Path | None) -> None:
    """Check JOB_FILE without loading a model: keys, types, files, model, template fields, constraint."""
    from mlxbatch.job.check.outdir import output_in_use
    from mlxbatch.job.check.validate import check_spec

    try:
        result = check_spec(_load(job_file, sets, limit, output))
    except MlxbatchError as exc:
        _fail(exc)
    from mlxbatch.job.run.runner import OutputInUse  # (after ``_load``: the runner imports transformers)

    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    spec = result.spec
    in_use = output_in_use(spec)
    if in_use is not None:  # run would fail on it (exit 1) before loading the model
        _fail(OutputInUse(f"{in_use} (e.g. --output DIR)"))
    click.echo(f"{job_file}: ok (model {spec.model.path}, input {spec.input.dataset or spec.input.path}, "
               f"output {spec.output})")


@main.command("plan")
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--window", type=click.IntRange(min=1), default=None,
              help="Rows planned together (default: the job's plan.window).")
@click.option("--calibrate/--no-calibrate", default=True, show_default=True,
              help="Time a short real step of the model for the ETA (loads its weights); off: estimate from FLOPs.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan report as JSON.")
@_job_options
def plan_cmd(job_file: Path, window: int | None, calibrate: bool, as_json: bool, sets: tuple[str, ...],
             limit: int | None, output: Path | None) -> None:
    """Dry run: tokenize JOB_FILE's prompts and plan the run as `run` would; predicts prefill tokens and an ETA."""
    from mlxbatch.job.check.validate import validate_job

    try:
        spec = validate_job(_load(job_file, sets, limit, output), writes_output=False)  # a dry run: writes nothing
        from mlxbatch.job.plan.predict import as_dict, plan_job  # (after ``_load``: it imports transformers)

        report = plan_job(spec, window=window, calibrate=calibrate)
    except MlxbatchError as exc:
        _fail(exc)
    click.echo(json.dumps(as_dict(report), indent=2) if as_json else report.summary())


@main.command()
@click.argument("target", type=click.Path(exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(target: Path, as_json: bool) -> None:
    """How far a job got and what failed: TARGET is its output folder or its job file."""
    from mlxbatch.job.report.status import read_status

    try:
        st = read_status(target)
    except MlxbatchError as exc:
        _fail(exc)
    click.echo(json.dumps(st, indent=2) if as_json else st["summary"])


@main.command()
@click.argument("target", type=click.Path(exists=True, path_type=Path))
@click.option("--n", "-n", "n", type=click.IntRange(min=0), default=5, show_default=True, help="Rows to print.")
def show(target: Path, n: int) -> None:
    """A few rows of the results (prompt if kept, output, error) and a summary: TARGET is the output folder
    or the job file."""
    from mlxbatch.job.report.show import show as show_results

    try:
        click.echo(show_results(target, n))
    except MlxbatchError as exc:
        _fail(exc)


@main.command()
@click.argument("target", type=click.Path(exists=True, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["lm-eval"]), default="lm-eval", show_default=True,
              help="lm-eval: lm-evaluation-harness's results_<date>.json and samples_<task>_<date>.jsonl.")
@click.option("--to", "dest", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where to write (default: TARGET's output folder / lm-eval).")
@click.option("--task", default=None, help="The task's name in the files (default: the job file's name).")
def export(target: Path, fmt: str, dest: Path | None, task: str | None) -> None:
    """A graded job's results in another tool's shapes: TARGET is its output folder or its job file."""
    from mlxbatch.job.report.export import export_lm_eval

    try:
        done = export_lm_eval(target, dest, task)
    except MlxbatchError as exc:
        _fail(exc)
    click.echo(f"{fmt}: {done.rows} graded rows -> {done.results}, {done.samples}")


@main.command()
@click.option("--model", "-m", default="smollm2", show_default=True, help="Model folder, hub id or alias.")
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--chat/--no-chat", default=True, show_default=True, help="Wrap each prompt in the chat template.")
@click.argument("prompts", nargs=-1, required=True)
def generate(model: str, max_tokens: int, temperature: float, seed: int | None, chat: bool,
             prompts: tuple[str, ...]) -> None:
    """Generate for a few PROMPTS at once (a quick check of a model)."""
    from mlxbatch.job.spec import ModelSection

    _without_torch(ModelSection(model))
    from mlxbatch.engine import Engine
    from mlxbatch.types import SamplingParams

    try:
        with Engine(model) as engine:
            items = [[{"role": "user", "content": p}] if chat else p for p in prompts]
            outs = engine.generate(items, SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed))
    except MlxbatchError as exc:
        _fail(exc)
    for p, o in zip(prompts, outs):
        click.echo(f"> {p}\n{o.text}\n[{o.finish_reason.value if o.finish_reason else '?'}, {o.generated_tokens} tokens]")


@main.command()
def info() -> None:
    """The device, its memory, the BLAS MLX uses, on CUDA how kernels are launched, and the versions of mlxbatch,
    MLX, mlx-lm, mlx-vlm and Python.

    ``total_memory_gb`` is what the device may use (GPU memory; on a Mac, Metal's recommended working set, a share of
    the machine's memory), ``available_memory_gb`` what is free for a run now, ``host_memory_gb`` the machine's RAM,
    ``batch_defaults`` what an engine section without ``max_num_seqs`` / ``max_num_batched_tokens`` gets here (a run
    may get fewer rows, where the model's KV budget holds fewer: its report.json's ``engine.batch`` says).
    """
    from mlxbatch.engine import device_info
    from mlxbatch.job.report.snapshot import versions

    d = device_info()
    total, avail, host = (round(n / 2**30, 2) for n in (d.total_memory, d.available_memory,
                                                         d.host_memory or d.total_memory))
    out = {"device": d.kind, "name": d.name, "total_memory_gb": total, "available_memory_gb": avail,
           "host_memory_gb": host}
    if d.kind == "metal":
        out["total_memory_is"] = "the Metal working-set limit (unified memory: shared with macOS and other apps)"
    if d.kind == "cuda":
        out["kernel_launch"] = d.kernel_launch  # direct, unless MLX_USE_CUDA_GRAPHS=1 was set
    batch = d.batch_defaults
    out["batch_defaults"] = {"max_num_seqs": batch.max_num_seqs, "max_num_batched_tokens": batch.max_num_batched_tokens}
    click.echo(json.dumps({**out, "blas": d.blas, "versions": versions()}, indent=2))


@main.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
@click.option("--quick", is_flag=True, help="Small engine runs (seconds, not half a minute), e.g. in CI.")
@click.option("--no-run", "no_run", is_flag=True, help="The machine checks only: no model is built or run.")
@click.option("--model", default=None, help="The runs' model: a random-weight shape (tiny64, small64, ...; built "
              "once) or a model folder (default: tiny64 on a CPU, small64 on a GPU).")
def doctor_cmd(as_json: bool, quick: bool, no_run: bool, model: str | None) -> None:
    """What a new machine runs first (paste the table into an issue): versions, device, memory, wired limit, BLAS,
    the engine against mlx-lm on the same prompts (about 30 s), and forced out-of-memory steps. Exit 1 on a FAIL."""
    from mlxbatch.bench.doctor import Verdict, doctor, render
    from mlxbatch.bench.doctor import as_json as to_json

    checks = doctor(quick=quick, run=not no_run, model=model)
    click.echo(json.dumps(to_json(checks), indent=2, default=str) if as_json else render(checks))
    sys.exit(1 if any(c.verdict is Verdict.FAIL for c in checks) else 0)


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False,
                                "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args: tuple[str, ...]) -> None:
    """Benchmarks on this machine: SECTION (engine, job, nsample, score, gpu, constraints, vlm) [options].

    Every figure is a ratio against mlx-lm / mlx-vlm run in the same process. `mlxbatch bench --help` lists the
    options; `mlxbatch bench engine --model tiny` takes about a minute on two CPU cores.
    """
    from mlxbatch.bench.cli import main as bench_main

    sys.exit(bench_main(list(args)))


if __name__ == "__main__":
    main()
