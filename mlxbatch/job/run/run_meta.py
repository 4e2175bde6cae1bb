"""What a run records in the checkpoint's manifest besides its rows, and what it takes back from earlier runs there.

Owns three entries of the manifest's metadata: ``job_spec`` (``status.JOB_SPEC_META``: the job as this run parsed
it and what of the model its keys depend on, so ``mlxbatch status`` tells current records from stale ones), ``plan``
(the plan's parameters of the first run: a resumed run plans the same windows, hence the same order, whatever the
job file says now) and ``batch_invariant`` (whether every run that checkpointed rows here had it). The folder's
owner (manifest meta ``job``) is ``job.check.outdir``'s.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from mlxbatch.io import CheckpointStore
from mlxbatch.job.executors.base import ModelInfo
from mlxbatch.job.report.status import JOB_SPEC_META
from mlxbatch.job.spec import JobSpec

log = logging.getLogger(__name__)


def save_job_meta(store: CheckpointStore, spec: JobSpec, model: ModelInfo) -> None:
    """The job as this run parsed it (command-line changes included) and what of the model its keys depend on
    (identity, whether it takes images, its context), so ``mlxbatch status OUT`` can tell current records from
    stale ones without the command line or the model. (The folder's owner, ``job.check.outdir``'s record, is kept
    apart.)"""
    raw = json.loads(json.dumps(spec.raw or {}, default=str))
    meta = {"source": spec.source, "base_dir": str(spec.base_dir or Path.cwd()), "raw": raw,
            "model_identity": model.identity, "takes_images": model.takes_images,
            "context_length": model.context_length}
    if store.get_meta(JOB_SPEC_META) != meta:
        store.set_meta(JOB_SPEC_META, meta)


def follow_saved_plan(store: CheckpointStore, spec: JobSpec) -> JobSpec:
    """The plan's parameters go into the manifest on the first run; a resumed run plans with the saved ones
    (the same windows, hence the same order), whatever the job file says now: ``spec`` with the plan to run."""
    saved = store.get_meta("plan")
    current = {"window": spec.plan.window, "enabled": spec.plan.enabled, "order": "trie-largest-first",
               "ramp": spec.plan.ramp}
    if saved is None:
        store.set_meta("plan", current)
        return spec
    if (saved["window"], saved["enabled"]) != (current["window"], current["enabled"]):
        log.warning("resuming with the plan of the first run %s (the job file now says %s)", saved, current)
    # (a first run before the ramp of windows, 2026-12-07, saved none: it cut every window alike)
    return dataclasses.replace(spec, plan=dataclasses.replace(
        spec.plan, window=int(saved["window"]), enabled=bool(saved["enabled"]), ramp=bool(saved.get("ramp", False))))


def record_invariance(store: CheckpointStore, spec: JobSpec) -> bool:
    """Whether every row of the output is computed batch-invariant: this run has ``engine.batch_invariant`` and
    so had every earlier run that checkpointed rows here (kept in the manifest)."""
    flag = spec.engine.batch_invariant
    prior = store.get_meta("batch_invariant")
    now = flag and (prior if prior is not None else not store.shards)
    if prior != now:
        store.set_meta("batch_invariant", now)
    if flag and not now:
        log.warning("engine.batch_invariant: rows checkpointed by an earlier run without it keep their results, "
                    "so the output as a whole is not batch-invariant (output.overwrite: true recomputes them)")
    return now
