"""Shared helpers for the I/O layer tests: a record factory and a JSONL writer.

A plain module (not conftest.py): tests/conftest.py already owns the module name ``conftest``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxbatch.io import ResultRecord, result_key


def make_record(row_id: str, prompt: str = "p", *, params: str = "{}", **kwargs: Any) -> ResultRecord:
    key = result_key(row_id, prompt, "test-model", params, 0)
    defaults: dict[str, Any] = {"text": f"out-{row_id}", "finish_reason": "stop", "prompt_tokens": 3,
                                "generated_tokens": 2, "model": "test-model", "params": params,
                                "latency_s": 0.5, "ttft_s": 0.1}
    defaults.update(kwargs)
    return ResultRecord(row_id=row_id, key=key, **defaults)


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
