"""Helpers for job tests: write inputs and job files into a temporary folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml


def write_jsonl(path: Path, rows: list[dict[str, Any]], extra_lines: list[bytes] = ()) -> Path:
    with open(path, "wb") as f:
        for r in rows:
            f.write(json.dumps(r).encode() + b"\n")
        for line in extra_lines:
            f.write(line + b"\n")
    return path


def texts(n: int) -> list[dict[str, Any]]:
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    return [{"id": f"row-{i:04d}", "text": " ".join(words[(i + k) % 8] for k in range(3 + i % 5))} for i in range(n)]


def write_job(dirpath: Path, model: Path, data: Path, out: Path, **overrides: Any) -> Path:
    job: dict[str, Any] = {
        "model": str(model),
        "input": {"path": str(data), "id_column": "id"},
        "prompt": {"template": "Summarise: {{ text }}\n"},
        "sampling": {"temperature": 0.8, "max_tokens": 8},
        "output": str(out),
        "checkpoint": {"every_rows": 10, "every_seconds": 600},
        "engine": {"max_num_seqs": 8},
        "seed": 7,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(job.get(key), dict):
            job[key] = {**job[key], **value}
        else:
            job[key] = value
    path = dirpath / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path
