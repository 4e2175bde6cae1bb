"""The progress file of a distributed run: ``<output>/progress.json``, per engine actor, for ``mlxbatch status``.

Owns the file's name, its shape and its life. The Ray driver rewrites it (atomically) about once a second while it
runs; it is removed when the run completes (a complete folder looks exactly like a single-machine run's) and by
the next run of either kind. A driver that died leaves it behind with an old ``updated_at``: ``status`` says so.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from mlxbatch.io import PROGRESS_NAME
from mlxbatch.io.atomic import atomic_write_json

STALE_S = 60.0  # no update for this long: the driver has probably stopped


def write_progress(out_dir: Path, progress: dict[str, Any]) -> None:
    atomic_write_json(out_dir / PROGRESS_NAME, {**progress, "updated_at": time.time()})


def clear_progress(out_dir: Path) -> None:
    (out_dir / PROGRESS_NAME).unlink(missing_ok=True)


def read_progress(out_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out_dir / PROGRESS_NAME).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def progress_lines(p: dict[str, Any]) -> list[str]:
    """Human-readable lines: one for the run, one per actor."""
    age = time.time() - float(p.get("updated_at", 0))
    actors = p.get("actors", [])
    live = sum(a["state"] != "dead" for a in actors)
    head = (f"  distributed run ({p.get('executor', 'ray')}, {live}/{len(actors)} actors live, "
            f"{p.get('state', 'running')}, updated {age:.0f} s ago)")
    if age > STALE_S and p.get("state") == "running":
        head += ": no update for a while, the driver may have stopped (run the job again to resume)"
    lines = [head, f"    rows: {p.get('rows_done', 0)} done, {p.get('rows_queued', 0)} queued on the driver"]
    for a in actors:
        ratio = a["prefill_tokens"] / a["floor_tokens"] if a.get("floor_tokens") else None
        lines.append(f"    {a['name']:<9} {a['state']:<8} {a.get('host') or '?'} pid {a.get('pid') or '?'}: "
                     f"{a['rows']} rows ({a['errors']} errors), {a['in_flight']} in flight, {a['queued']} queued, "
                     f"{a['generated_tokens']} tokens generated"
                     + (f", prefill/floor {ratio:.2f}" if ratio is not None else ""))
    return lines
