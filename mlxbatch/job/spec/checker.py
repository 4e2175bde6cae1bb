"""The job file's checker: every problem found while the sections are parsed, each with its key path.

Owns the known keys of each section (an unknown key is reported with the ones expected) and the checks every section
parser shares (a mapping, a type, a positive number). A parser reports to it and goes on, so every problem of a file
is found in one pass (``job.spec.job`` raises them together).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

_SECTIONS: dict[str, set[str]] = {
    "model": {"path", "dtype", "adapter", "trust_remote_code"},
    "input": {"path", "format", "id_column", "columns", "split", "image_roots", "limit", "dataset", "config"},
    "prompt": {"template", "messages", "system", "chat_template"},
    "output": {"path", "choice", "regex", "json_schema", "constraint_column", "overwrite", "gold", "keep_prompt",
               "extract", "grade_truncated"},
    "score": {"candidates", "answer"},
    "checkpoint": {"every_rows", "every_seconds"},
    "engine": {"max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size", "kv_memory_fraction", "prefix_cache",
               "batch_invariant"},
    "plan": {"enabled", "window"},
}


class Checker:
    """Collects (key path, reason) problems while the sections are parsed."""

    def __init__(self) -> None:
        self.problems: list[tuple[str, str]] = []

    def bad(self, key: str, reason: str) -> None:
        self.problems.append((key, reason))

    def section(self, raw: dict[str, Any], name: str, shorthand: str | None = None,
                keys: Collection[str] | None = None) -> dict[str, Any]:
        """The mapping ``raw[name]``, its unknown keys reported (``keys``: the known ones, else the section's)."""
        value = raw.get(name)
        if value is None:
            return {}
        if shorthand and isinstance(value, str):
            return {shorthand: value}
        if not isinstance(value, dict):
            self.bad(name, f"expected a mapping, got {type(value).__name__}")
            return {}
        known = _SECTIONS.get(name) if keys is None else keys
        for key in value:
            if known is not None and key not in known:
                self.bad(f"{name}.{key}", f"unknown key (expected one of: {', '.join(sorted(known))})")
        return value

    def typed(self, sec: dict[str, Any], path: str, key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        if key not in sec or sec[key] is None:
            return default
        value = sec[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            self.bad(f"{path}.{key}", f"expected {'/'.join(k.__name__ for k in kinds)}, got bool")
            return default
        if float in kinds and isinstance(value, int):
            return float(value)
        if not isinstance(value, kinds):
            self.bad(f"{path}.{key}", f"expected {'/'.join(k.__name__ for k in kinds)}, got {type(value).__name__}")
            return default
        return value

    def positive(self, path: str, value: float) -> None:
        if value <= 0:
            self.bad(path, f"must be > 0, got {value}")
