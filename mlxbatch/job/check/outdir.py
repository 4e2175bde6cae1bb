"""A job's output folder: checked before any work, claimed under the checkpoint lock.

Owns who may write a folder. A path that is a file is refused. A folder belongs to the job that first wrote it
(its job file and input are recorded in the manifest): another job's folder, or a folder holding files no mlxbatch
run writes, is refused (naming both jobs) unless the job sets ``output.overwrite: true``. Then another job's
results are deleted before the run, and other files are left alone (mlxbatch's own names are replaced). A job's
own folder is resumed, whatever else changed in the job (a renamed job file with the same input is still the
same job). A trial (``--limit`` / ``--set``) into the folder of this job's finished results is refused: they stay
published (``--output`` gives the trial a folder of its own). A folder this process cannot write is refused. A
start that fails before any row is checkpointed leaves a new folder as it was (``release_unused``).
``output_in_use``: whether another run holds the folder now (``validate`` says so as ``run`` would).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxbatch.io import CheckpointStore, OutputError, foreign_files, published_report, remove_outputs
from mlxbatch.io.checkpoint import SHARDS_DIR
from mlxbatch.io.lock import in_use_message, lock_holder
from mlxbatch.job.spec import JobSpec, JobSpecError

log = logging.getLogger(__name__)

JOB_META = "job"


def _identity(spec: JobSpec) -> dict[str, Any]:
    job = spec.source if spec.source.startswith("<") else str(Path(spec.source).resolve())
    return {"job": job, "input": spec.input.path or spec.input.dataset}


def _owner_problem(saved: Any, spec: JobSpec) -> str | None:
    if not isinstance(saved, dict) or not saved.get("job"):
        return None  # a folder of an older version, or a manifest rebuilt from the shards: adopt it
    current = _identity(spec)
    if saved["job"] == current["job"] and (not current["job"].startswith("<") or saved.get("input") == current["input"]):
        return None  # the same job file; jobs given as a mapping (no file: "<dict>") are told apart by their input
    if saved.get("input") == current["input"] and not Path(str(saved["job"])).exists():
        return None  # the job file was renamed or moved
    return (f"holds the results of another job, {saved['job']} (input {saved.get('input')}), not of "
            f"{current['job']}: use another output folder, or set output.overwrite: true to replace them")


def _trial_problem(spec: JobSpec) -> str | None:
    """A trial (``spec.trial``: --limit / --set change what the results are) into a folder that publishes this
    job's own results (``_SUCCESS``, from a run that was no trial) would replace them: refused. A folder not
    finished, or finished by a trial, takes it: the full run resumes its rows later."""
    if not spec.trial:
        return None
    published = published_report(spec.output)
    if published is None or published.get("trial"):
        return None
    return (f"{spec.output} holds the finished results of this job (_SUCCESS), and this run changes "
            f"{', '.join(spec.trial)} (--limit / --set), so its results would replace them: give the trial its own "
            "folder with --output DIR (run_job: output=...), or run the job as its file says")


def _not_writable(out: Path) -> str | None:
    """Why this process cannot write ``out`` (or create it: its nearest existing parent), None when it can."""
    where = out
    while not where.exists() and where != where.parent:
        where = where.parent
    for folder in (where, where / SHARDS_DIR):
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            try:
                read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
            except OSError:
                read_only = False
            why = "a read-only file system" if read_only else "no write permission"
            return (f"{out} is not writable ({folder}: {why}): make it writable, or give another folder "
                    "(--output DIR)")
    return None


def output_problems(spec: JobSpec) -> list[tuple[str, str]]:
    """What stops this job from writing its output folder (read-only, no lock: for ``validate`` and ``run``)."""
    out = spec.output
    if out.exists() and not out.is_dir():
        return [("output.path", f"{out} is a file, not a folder")]
    unwritable = _not_writable(out)
    if unwritable is not None:
        return [("output.path", unwritable)]
    if spec.overwrite or not out.exists():
        return []
    meta = CheckpointStore.peek_meta(out)
    problem = _owner_problem(meta.get(JOB_META), spec)
    if problem is not None:
        return [("output.path", f"{out} {problem}")]
    trial = _trial_problem(spec)
    if trial is not None:
        return [("output.path", trial)]
    foreign = foreign_files(out)
    if foreign and not meta and not (out / "manifest.json").exists():
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        return [("output.path", f"{out} holds files that are not mlxbatch outputs ({shown}): use a new or empty "
                                "folder, or set output.overwrite: true (mlxbatch's own files are written beside them)")]
    return []


def output_in_use(spec: JobSpec) -> str | None:
    """The message ``run`` would fail with when another mlxbatch process holds the output folder's lock (None: it
    is free). Read-only: takes and writes nothing (for ``validate``; ``run`` finds out by taking the lock)."""
    holder = lock_holder(spec.output) if spec.output.is_dir() else None
    return None if holder is None else in_use_message(spec.output, holder)


@dataclass(frozen=True)
class PreparedOutput:
    """The output folder as a run found it: a start that fails leaves a new one as it was (``release_unused``)."""

    path: Path
    made: bool  # created by this run
    new: bool  # created by this run, or empty before it


def prepare_output(spec: JobSpec) -> PreparedOutput:
    """Refuse a folder this job may not write (JobSpecError), then create it (OutputError when it cannot be)."""
    problems = output_problems(spec)
    if problems:
        raise JobSpecError(spec.source, problems)
    made = not spec.output.exists()
    new = made or not any(spec.output.iterdir())
    try:
        spec.output.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"output folder {spec.output} cannot be created: {exc.strerror or exc}") from exc
    return PreparedOutput(spec.output, made, new)


def claim_output(spec: JobSpec, store: CheckpointStore) -> None:
    """Under the store's lock: refuse another job's folder unless overwrite (then empty it), refuse a trial into
    this job's finished folder, and record this job."""
    current = _identity(spec)
    saved = store.get_meta(JOB_META)
    problem = _owner_problem(saved, spec)
    if problem is not None:
        if not spec.overwrite:
            raise JobSpecError(spec.source, [("output.path", f"{spec.output} {problem}")])
        log.warning("output.overwrite: removing the results of job %s from %s", saved.get("job"), spec.output)
        store.reset()
        remove_outputs(spec.output)
    else:
        trial = _trial_problem(spec)
        if trial is not None:
            raise JobSpecError(spec.source, [("output.path", trial)])
    if saved != current:
        store.set_meta(JOB_META, current)


def release_unused(folder: PreparedOutput) -> None:
    """After a start that failed (the model did not load, the cluster could not be had) in a folder that was new:
    remove what the run made (lock, manifest, shards/), so no folder is left claimed by a job that never ran; a
    folder the user made stays, empty. Call it holding the lock, before the store closes; a folder with a shard is
    left alone."""
    out = folder.path
    if not folder.new or any((out / SHARDS_DIR).glob("shard-*")):
        return
    for path in list(out.iterdir()):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if folder.made:
        with contextlib.suppress(OSError):
            out.rmdir()
