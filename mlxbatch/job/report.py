"""Run statistics and the run report (JSON): counts, tokens, speed, errors by kind, engine profile."""

from __future__ import annotations

import collections
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq

from mlxbatch.io import ResultRecord
from mlxbatch.job.spec import JobSpec


def accuracy(results: Path) -> dict[str, Any] | None:
    """Correct / answered over the final results' ``correct`` column (None when the job scores no answers)."""
    if "correct" not in pq.read_schema(results).names:
        return None
    col = pq.read_table(results, columns=["correct"]).column("correct")
    answered = len(col) - col.null_count
    right = pc.sum(col.cast("int64")).as_py() or 0
    return {"answered": answered, "correct": right, "accuracy": round(right / answered, 4) if answered else None}


@dataclass
class RunStats:
    total: int | None = None  # input rows (an upper bound for JSONL: blank lines count)
    finished: int = 0  # rows finished in this run (successes and errors)
    skipped: int = 0  # rows already checkpointed by an earlier run
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    resumed_shards: int = 0
    final_rows: int = 0
    started: float = field(default_factory=time.monotonic)
    errors_by_kind: collections.Counter[str] = field(default_factory=collections.Counter)
    engine: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    accuracy: dict[str, Any] | None = None  # task score with an answer column: over every row of the results
    batch_invariant: bool = False  # every output row computed with engine.batch_invariant (this run and earlier ones)

    def add(self, record: ResultRecord) -> None:
        self.finished += 1
        if record.error is not None:
            self.errors += 1
            self.errors_by_kind[record.error_kind or "error"] += 1
        self.prompt_tokens += record.prompt_tokens
        self.generated_tokens += record.generated_tokens

    @property
    def wall_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / max(self.wall_s, 1e-9)

    def report(self, spec: JobSpec, loaded: Any) -> dict[str, Any]:
        wall = self.wall_s
        prof = self.engine.get("profile", {})
        return {
            "job": spec.source,
            "output": str(spec.output),
            "model": {"path": spec.model.path, "identity": loaded.identity, "dtype": loaded.dtype},
            "device": self.engine.get("device"),
            "batch_invariant": self.batch_invariant,
            "host": platform.node(),
            "rows": {"output": self.final_rows, "finished_this_run": self.finished, "resumed": self.skipped,
                     "ok": self.finished - self.errors, "errors": self.errors},
            "errors_by_kind": dict(self.errors_by_kind),
            "tokens": {"prompt": self.prompt_tokens, "generated": self.generated_tokens},
            "generated_tokens_per_s": round(self.generated_tokens / max(wall, 1e-9), 2),
            "rows_per_s": round(self.finished / max(wall, 1e-9), 3),
            "prefix_reuse": {"prefill_tokens_computed": prof.get("prefill_tokens", 0),
                             "prompt_tokens": self.prompt_tokens,
                             "cached_tokens": (self.engine.get("prefix_cache") or {}).get("tokens_reused", 0)},
            "plan": self.plan,
            **({"accuracy": self.accuracy} if self.accuracy is not None else {}),
            "vision_cache": self.engine.get("vision_cache"),  # vision-language models: hits, encoder time saved
            "engine": self.engine,
            "wall_s": round(wall, 3),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
