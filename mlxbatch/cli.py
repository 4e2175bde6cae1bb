"""The command line: ``mlxbatch run | validate | plan | status | generate | info``.

Owns process-level concerns only: logging set-up (once, here), exit codes and messages. Exit codes: 0 done,
1 error, 2 invalid job file, 3 too many row errors, 130 interrupted (resume by running the same command).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import NoReturn

import click

import mlxbatch  # noqa: F401  (preloads OpenBLAS before anything imports mlx)
from mlxbatch.errors import MlxbatchError

EXIT_INVALID, EXIT_ERRORS, EXIT_INTERRUPTED = 2, 3, 130


def _fail(exc: MlxbatchError) -> NoReturn:
    """Print ``exc`` as one line and exit with the code its kind maps to."""
    from mlxbatch.job.runner import JobFailed, JobInterrupted
    from mlxbatch.job.spec import JobSpecError

    codes = {JobSpecError: EXIT_INVALID, JobInterrupted: EXIT_INTERRUPTED, JobFailed: EXIT_ERRORS}
    click.echo(f"mlxbatch: {exc}", err=True)
    sys.exit(next((code for kind, code in codes.items() if isinstance(exc, kind)), 1))


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not sys.stderr.isatty():
        logging.getLogger("mlxbatch").setLevel(min(level, logging.INFO))


@click.group()
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.version_option(mlxbatch.__version__)
def main(verbose: int) -> None:
    """Batch / offline LLM jobs on MLX, resumable after any crash."""
    _setup_logging(verbose)


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when on a terminal).")
@click.option("--ray", "ray_address", is_flag=False, flag_value="", default=None, metavar="[ADDRESS]",
              help="Run on engine actors on a Ray cluster: ADDRESS, else executor.address, else $RAY_ADDRESS, "
                   "else a local cluster (needs mlxbatch[ray]).")
@click.option("--local", is_flag=True, help="Run in this process even if the job file says executor.kind: ray.")
def run(job_file: Path, progress: bool | None, ray_address: str | None, local: bool) -> None:
    """Run JOB_FILE; run it again after a crash to resume where it stopped (with or without --ray)."""
    from mlxbatch.job.awake import keep_awake
    from mlxbatch.job.runner import JobRunner
    from mlxbatch.job.spec import with_executor
    from mlxbatch.job.validate import validate_job

    try:
        if ray_address is not None and local:
            raise click.UsageError("give --ray or --local, not both")
        spec = with_executor(validate_job(job_file), "local" if local else "ray" if ray_address is not None else None,
                             ray_address or None)
        with keep_awake():  # macOS: no idle sleep while the job runs (caffeinate)
            result = JobRunner(spec, progress=progress).run()
    except MlxbatchError as exc:
        _fail(exc)
    r = result.report
    click.echo(f"done: {r['rows']['output']} rows ({r['rows']['errors']} errors this run, {r['rows']['resumed']} "
               f"resumed), {r['generated_tokens_per_s']} tok/s -> {result.out_dir}/results.parquet")


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
def validate(job_file: Path) -> None:
    """Check JOB_FILE without loading a model: keys, types, files, template fields."""
    from mlxbatch.job.validate import validate_job

    try:
        spec = validate_job(job_file)
    except MlxbatchError as exc:
        _fail(exc)
    click.echo(f"{job_file}: ok (model {spec.model.path}, input {spec.input.path}, output {spec.output})")


@main.command("plan")
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--window", default=100_000, show_default=True, help="Plan jobs larger than this in windows of rows.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan report as JSON.")
def plan_cmd(job_file: Path, window: int, as_json: bool) -> None:
    """Dry run: tokenize JOB_FILE's prompts and plan the run, without loading model weights."""
    from mlxbatch.job.plan import as_dict, plan_job
    from mlxbatch.job.validate import validate_job

    try:
        report = plan_job(validate_job(job_file), window=window)
    except MlxbatchError as exc:
        _fail(exc)
    click.echo(json.dumps(as_dict(report), indent=2) if as_json else report.summary())


@main.command()
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(out_dir: Path, as_json: bool) -> None:
    """How far the run writing OUT_DIR got, and what failed and why."""
    from mlxbatch.job.status import read_status

    try:
        st = read_status(out_dir)
    except MlxbatchError as exc:
        _fail(exc)
    click.echo(json.dumps(st, indent=2) if as_json else st["summary"])


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
    """The device, its memory and the BLAS MLX uses."""
    from mlxbatch.engine import device_info

    d = device_info()
    click.echo(json.dumps({"device": d.kind, "name": d.name, "total_memory_gb": round(d.total_memory / 2**30, 2),
                           "available_memory_gb": round(d.available_memory / 2**30, 2), "blas": d.blas}, indent=2))


if __name__ == "__main__":
    main()
