"""The output folder's own files besides the results: the report, the ``_SUCCESS`` marker, and which names are
mlxbatch's.

Call, once ``results.parquet`` is written (``writers.finalize``): ``write_report`` -> ``mark_success``. Call
``clear_success`` when a run starts, so a half-rewritten folder never looks finished. ``foreign_files`` and
``remove_outputs`` tell an mlxbatch folder from a user's and clear an earlier run's outputs (``overwrite``). Every
file is written atomically; a write that fails raises ``OutputError`` and leaves no temporary file.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlxbatch.io.atomic import TMP_SUFFIX, atomic_write_bytes, atomic_write_json, fsync_dir
from mlxbatch.io.card import CARD_NAME, is_own_card
from mlxbatch.io.checkpoint import SHARDS_DIR
from mlxbatch.io.errors import OutputError
from mlxbatch.io.faults import crash, fault_due
from mlxbatch.io.manifest import MANIFEST_NAME
from mlxbatch.io.openai_output import ERRORS_NAME, OUTPUT_NAME

RESULTS_NAME = "results.parquet"
REPORT_NAME = "report.json"
SUCCESS_NAME = "_SUCCESS"
PROGRESS_NAME = "progress.json"  # a distributed run's per-actor progress (job.executors.ray.progress)
OUTPUT_FILES = (RESULTS_NAME, REPORT_NAME, SUCCESS_NAME, OUTPUT_NAME, ERRORS_NAME, PROGRESS_NAME)
_OWN_NAMES = frozenset(OUTPUT_FILES) | {MANIFEST_NAME, SHARDS_DIR, ".lock"}


def oserror_text(exc: OSError) -> str:
    return os.strerror(exc.errno) if exc.errno else str(exc)


def write_report(out_dir: str | Path, report: Mapping[str, Any], *, filename: str = REPORT_NAME) -> Path:
    """Write the run report as JSON (atomically)."""
    path = Path(out_dir) / filename
    try:
        atomic_write_json(path, dict(report))
    except OSError as exc:
        raise OutputError(f"could not write {path}: {oserror_text(exc)}") from exc
    return path


def published_report(out_dir: str | Path) -> dict[str, Any] | None:
    """The report of the run whose results the folder publishes: report.json when ``_SUCCESS`` is there (the
    completing run wrote it just before), None when nothing is published or the report does not read."""
    out = Path(out_dir)
    if not (out / SUCCESS_NAME).exists():
        return None
    try:
        report = json.loads((out / REPORT_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def mark_success(out_dir: str | Path) -> Path:
    """Write the empty ``_SUCCESS`` marker: the last write of a completed job."""
    if fault_due("before-success", 1):
        crash()
    path = Path(out_dir) / SUCCESS_NAME
    try:
        atomic_write_bytes(path, b"")
    except OSError as exc:
        raise OutputError(f"could not write {path}: {oserror_text(exc)}") from exc
    return path


def foreign_files(out_dir: str | Path) -> list[str]:
    """Names in ``out_dir`` that no mlxbatch run writes (sorted); empty for a new or an mlxbatch folder."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir() if p.name not in _OWN_NAMES and not p.name.endswith(TMP_SUFFIX)
                  and not (p.name == CARD_NAME and is_own_card(p)))


def remove_outputs(out_dir: str | Path) -> None:
    """Remove the final outputs of an earlier run (``overwrite``); the checkpoint is the store's to reset."""
    out = Path(out_dir)
    for name in OUTPUT_FILES:
        (out / name).unlink(missing_ok=True)
    if is_own_card(out / CARD_NAME):  # the user's README.md stays
        (out / CARD_NAME).unlink()
    for tmp in out.glob("*" + TMP_SUFFIX):
        if tmp.is_dir():
            shutil.rmtree(tmp)
        else:
            tmp.unlink()
    fsync_dir(out)


def clear_success(out_dir: str | Path) -> bool:
    """Remove ``_SUCCESS`` (at the start of a run that will rewrite outputs). True if there was one."""
    path = Path(out_dir) / SUCCESS_NAME
    if not path.exists():
        return False
    path.unlink()
    fsync_dir(path.parent)
    return True
