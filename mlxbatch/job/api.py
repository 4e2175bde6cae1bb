"""The in-process API: run a job from Python (a notebook, a script, a worker thread).

Owns ``run_job`` and its result. A job is a job file or a mapping with the same keys (relative paths in a mapping
are relative to the current folder). Changes are keyword arguments: whole or partial sections merged into the
job (``sampling={"temperature": 0.7}``), ``limit``, ``output`` and ``sets`` (``["sampling.seed=3"]``, as
``--set``); all are checked by the same parser as the file, with key paths in the errors.

Unlike the command line it never ends the process: off the main thread no signal handler is installed (stop a run
with ``JobRunner.request_stop``); on the main thread (a notebook's kernel) the first interrupt stops the run
after checkpointing what finished, and a second one stops it at once, still keeping finished rows, and raises
``JobInterrupted`` instead of exiting. Run it again to resume. On a Mac the run holds a sleep assertion, as the
command line does (``awake.keep_awake``): a notebook's overnight job does not freeze when the Mac idles.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

from mlxbatch.job.check.validate import check_spec
from mlxbatch.job.run.awake import keep_awake
from mlxbatch.job.run.runner import JobRunner
from mlxbatch.job.spec import JobSpec, load_job, parse_job
from mlxbatch.job.spec.overrides import JobOverrides

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobResult:
    out_dir: Path
    report: dict[str, Any]  # report.json's contents

    @property
    def results_path(self) -> Path:
        return self.out_dir / "results.parquet"

    def table(self) -> Any:
        """The results as a pyarrow Table (one row per input row, in input order)."""
        import pyarrow.parquet as pq

        return pq.read_table(self.results_path)

    def to_pandas(self) -> Any:
        return self.table().to_pandas()


def load_spec(job: str | PathLike[str] | Mapping[str, Any], overrides: JobOverrides | None = None) -> JobSpec:
    """The checked JobSpec of a job file or mapping (warnings are logged); raises JobSpecError."""
    if isinstance(job, Mapping):
        spec = parse_job(dict(job), source="<dict>", base_dir=Path.cwd(), overrides=overrides)
    else:
        spec = load_job(job, overrides)
    result = check_spec(spec)
    for warning in result.warnings:
        log.warning("%s", warning)
    return result.spec


def run_job(job: str | PathLike[str] | Mapping[str, Any], *, limit: int | None = None,
            output: str | PathLike[str] | None = None, sets: Sequence[str] = (), progress: bool = False,
            **sections: Any) -> JobResult:
    """Run (or resume) a job in this process and return its report and results.

    ``run_job("jobs/demo.yaml", limit=20, output="out/trial", sampling={"temperature": 0.7})``
    Raises JobSpecError (an invalid job), JobFailed (``max_error_rate``), JobInterrupted, or another MlxbatchError.
    """
    spec = load_spec(job, JobOverrides(sets=tuple(sets), merge=sections, limit=limit, output=output))
    with keep_awake():  # macOS: no idle sleep while the job runs (caffeinate)
        result = JobRunner(spec, progress=progress, exit_on_second_signal=False,
                           resume_hint="To resume, call run_job again with the same job and changes.").run()
    return JobResult(Path(result.out_dir), result.report)
