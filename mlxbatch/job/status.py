"""``mlxbatch status``: how far a run got and what failed, read from its output folder.

Strictly read-only and lock-free, so it works while a run is writing the folder: it reads the shard files
directly and skips (and reports) any that do not open as a complete Arrow file; repairing is left to the
next run. A distributed run's progress file adds a line per engine actor. Loads no model.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pyarrow as pa

from mlxbatch.errors import MlxbatchError
from mlxbatch.job.progress import progress_lines, read_progress


def _read_shard(path: Path) -> pa.Table | None:
    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_file(source).read_all().select(["error", "error_kind"])
    except (pa.ArrowInvalid, OSError, KeyError):
        return None


def read_status(out_dir: Path) -> dict[str, Any]:
    shards_dir = out_dir / "shards"
    if not (out_dir / "manifest.json").exists() and not shards_dir.exists():
        raise MlxbatchError(f"{out_dir}: no mlxbatch run here (no manifest.json)")
    kinds: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}
    rows, shards, unreadable = 0, 0, []
    for path in sorted(shards_dir.glob("shard-*.arrow")) if shards_dir.exists() else []:
        table = _read_shard(path)
        if table is None:
            unreadable.append(path.name)
            continue
        shards += 1
        rows += table.num_rows
        for err, kind in zip(table.column("error").to_pylist(), table.column("error_kind").to_pylist()):
            if err is not None:
                kinds[kind or "error"] += 1
                examples.setdefault(kind or "error", err)
    report_path = out_dir / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    complete = (out_dir / "_SUCCESS").exists()
    errors = sum(kinds.values())
    lines = [f"{out_dir}: {'complete' if complete else 'incomplete (running, or run the job again to resume)'}",
             f"  checkpointed rows: {rows} in {shards} shard(s); errors: {errors}"]
    lines += [f"    {k}: {n}  e.g. {examples[k][:160]}" for k, n in kinds.most_common()]
    if unreadable:
        lines.append(f"  shards that do not open (cut short by a crash; the next run redoes their rows): "
                     f"{', '.join(unreadable)}")
    progress = read_progress(out_dir)  # a distributed run: per engine actor
    if progress is not None and not complete:
        lines += progress_lines(progress)
    if report and complete:
        lines.append(f"  report: {report['rows']['output']} rows, {report['generated_tokens_per_s']} tok/s, "
                     f"{report['wall_s']} s")
    return {"complete": complete, "checkpointed_rows": rows, "shards": shards, "errors": errors,
            "errors_by_kind": dict(kinds), "unreadable_shards": unreadable, "report": report, "progress": progress,
            "summary": "\n".join(lines)}
