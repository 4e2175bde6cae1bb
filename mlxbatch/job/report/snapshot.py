"""What a run records of itself beside its numbers: the software that ran it and the job as it ran.

Owns ``versions`` (mlxbatch, MLX, mlx-lm, mlx-vlm and Python: ``mlxbatch info``, report.json and the results'
Parquet metadata show the same) and ``job_snapshot`` (the job file's absolute path, the job as parsed with the
command-line changes applied, and the keys a trial changed), so a results file found later says what made it.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import sys
from pathlib import Path
from typing import Any

from mlxbatch.job.spec import JobSpec

_PACKAGES = ("mlx", "mlx-lm", "mlx-vlm")


def versions() -> dict[str, str | None]:
    """The versions of mlxbatch, the MLX packages (None: not installed) and Python."""
    # the package's own __version__ (what `mlxbatch --version` says), read off the loaded package: importing the
    # package's face from here would import the job layers above this one (import-linter)
    found: dict[str, str | None] = {"mlxbatch": getattr(sys.modules["mlxbatch"], "__version__", None)}
    for name in _PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    found["python"] = platform.python_version()
    return found


def job_path(spec: JobSpec) -> str:
    """The job file's absolute path ("<dict>" for a job given as a mapping)."""
    return spec.source if spec.source.startswith("<") else str(Path(spec.source).resolve())


def job_snapshot(spec: JobSpec) -> dict[str, Any]:
    """The job as this run parsed it: its file, the folder its relative paths start from, the mapping with the
    command-line changes applied (JSON-safe), and the keys those changes made a trial of (None: not a trial)."""
    return {"file": job_path(spec), "base_dir": str(spec.base_dir or Path.cwd()),
            "job": json.loads(json.dumps(spec.raw or {}, default=str)), "trial": list(spec.trial) or None}


def results_metadata(spec: JobSpec, batch_invariant: bool) -> dict[str, str]:
    """results.parquet's schema metadata: batch invariance, the versions and the job snapshot (JSON text)."""
    return {"mlxbatch.batch_invariant": str(batch_invariant).lower(), "mlxbatch.versions": json.dumps(versions()),
            "mlxbatch.job": json.dumps(job_snapshot(spec))}
