"""``mlxbatch status``: how far a run got and what failed, read from its output folder (no model)."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

from mlxbatch.errors import MlxbatchError
from mlxbatch.io import CheckpointError, CheckpointStore


def read_status(out_dir: Path) -> dict[str, Any]:
    if not (out_dir / "manifest.json").exists() and not (out_dir / "shards").exists():
        raise MlxbatchError(f"{out_dir}: no mlxbatch run here (no manifest.json)")
    kinds: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}
    rows = 0
    try:
        store = CheckpointStore(out_dir)
    except CheckpointError as exc:
        raise MlxbatchError(f"{out_dir}: cannot read the checkpoints now ({exc}); is a run in progress?") from exc
    with store:
        for table in store.iter_tables():
            rows += table.num_rows
            for kind, err in zip(table.column("error_kind").to_pylist(), table.column("error").to_pylist()):
                if err is not None:
                    kinds[kind or "error"] += 1
                    examples.setdefault(kind or "error", err)
        shards = len(store.shards)
        recovery = store.recovery
    report_path = out_dir / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    complete = (out_dir / "_SUCCESS").exists()
    errors = sum(kinds.values())
    lines = [f"{out_dir}: {'complete' if complete else 'incomplete (run the job again to resume)'}",
             f"  checkpointed rows: {rows} in {shards} shard(s); errors: {errors}"]
    lines += [f"    {k}: {n}  e.g. {examples[k][:160]}" for k, n in kinds.most_common()]
    if recovery.corrupt:
        lines.append(f"  shards cut short by a crash (moved aside, their rows redone): {len(recovery.corrupt)}")
    if report:
        lines.append(f"  last report: {report['rows']['output']} rows, {report['generated_tokens_per_s']} tok/s, "
                     f"{report['wall_s']} s")
    return {"complete": complete, "checkpointed_rows": rows, "shards": shards, "errors": errors,
            "errors_by_kind": dict(kinds), "report": report, "summary": "\n".join(lines)}
