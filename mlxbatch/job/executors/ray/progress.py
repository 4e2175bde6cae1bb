"""The progress file of a distributed run: ``<output>/progress.json``, per engine actor, for ``mlxbatch status``.

Owns the file's name, its shape and its life. The Ray driver rewrites it (atomically) about once a second while it
runs; it is removed when the run completes (a complete folder looks exactly like a single-machine run's) and by
the next run of either kind. A driver that died leaves it behind: ``status`` tells by the output folder's lock (held
by every run while it lives, released by the kernel when it dies, ``io.lock``) and says the run stopped, not that
its actors are live.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from mlxbatch.io import PROGRESS_NAME
from mlxbatch.io.atomic import atomic_write_json
from mlxbatch.io.lock import lock_holder

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


def driver_running(out_dir: Path, p: dict[str, Any]) -> bool:
    """Whether the driver that wrote ``p`` still runs: it holds the output folder's lock (written with its pid)."""
    holder = lock_holder(out_dir)
    pid = (p.get("driver") or {}).get("pid")
    return holder is not None and (not holder.isdigit() or pid is None or int(holder) == pid)


def progress_lines(p: dict[str, Any], running: bool = True) -> list[str]:
    """Human-readable lines: one for the run, one per actor. ``running``: its driver still runs (``driver_running``);
    if not, the run stopped whatever the file says, and its actors (the driver's) went with it."""
    age = time.time() - float(p.get("updated_at", 0))
    actors = p.get("actors", [])
    live = sum(a["state"] != "dead" for a in actors)
    executor = p.get("executor", "ray")
    if not running:
        driver = p.get("driver") or {}
        who = f" (pid {driver['pid']} on {driver.get('host') or '?'})" if driver.get("pid") else ""
        head = (f"  distributed run ({executor}): stopped, the driver{who} is not running (last update {age:.0f} s "
                f"ago); run the job again to resume. As it last wrote:")
    else:
        head = (f"  distributed run ({executor}, {live}/{len(actors)} actors live, {p.get('state', 'running')}, "
                f"updated {age:.0f} s ago)")
        if age > STALE_S and p.get("state") == "running":
            head += ": no update for a while, the driver may be stuck"
    lines = [head, f"    rows: {p.get('rows_done', 0)} done, {p.get('rows_queued', 0)} queued on the driver"]
    for a in actors:
        ratio = a["prefill_tokens"] / a["floor_tokens"] if a.get("floor_tokens") else None
        lines.append(f"    {a['name']:<9} {a['state']:<8} {a.get('host') or '?'} pid {a.get('pid') or '?'}: "
                     f"{a['rows']} rows ({a['errors']} errors), {a['in_flight']} in flight, {a['queued']} queued, "
                     f"{a['generated_tokens']} tokens generated"
                     + (f", prefill/floor {ratio:.2f}" if ratio is not None else ""))
    return lines
