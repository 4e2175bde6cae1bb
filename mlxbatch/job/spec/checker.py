"""The job file's checker: every problem found while the sections are parsed, each with its key path.

Owns the known keys of each section (an unknown key is reported with the section it belongs under, or the closest
known key, and the ones expected) and the checks every section
parser shares (a mapping, a type, a positive number). A parser reports to it and goes on, so every problem of a file
is found in one pass (``job.spec.job`` raises them together).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Collection
from typing import Any

from mlxbatch.types import SamplingParams

SAMPLING_KEYS = {f.name for f in dataclasses.fields(SamplingParams)} - {"constraint"}  # constraints: output.*

_SECTIONS: dict[str, set[str]] = {
    "model": {"path", "dtype", "adapter", "trust_remote_code"},
    "input": {"path", "format", "id_column", "columns", "split", "image_roots", "max_image_pixels", "limit", "dataset",
              "config"},
    "prompt": {"template", "messages", "system", "chat_template"},
    "output": {"path", "choice", "regex", "json_schema", "constraint_column", "overwrite", "gold", "keep_prompt",
               "extract", "grade_truncated"},
    "score": {"candidates", "answer"},
    "checkpoint": {"every_rows", "every_seconds"},
    "engine": {"max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size", "kv_memory_fraction", "prefix_cache",
               "batch_invariant", "overlap_steps"},  # EngineSection's fields (a test keeps them equal)
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
                self.unknown(f"{name}.{key}", known)
        return value

    def unknown(self, path: str, known: Collection[str]) -> None:
        """An unknown key: the section where it belongs (``sampling.choice`` -> ``output.choice``), else the
        closest known key (``temprature`` -> ``temperature``), then the keys expected."""
        section, _, key = path.rpartition(".")
        sections = {**_SECTIONS, "sampling": SAMPLING_KEYS | {"overrides"}}
        homes = [name for name, keys in sections.items() if key in keys and name != section]
        close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1, cutoff=0.75)
        paths = {k: f"{name}.{k}" for name, keys in sections.items() if name != section for k in keys}
        elsewhere = [paths[k] for k in difflib.get_close_matches(str(key), list(paths), n=1, cutoff=0.75)] \
            if not close else []
        if homes:
            hint = f": it belongs under {homes[0]} ({homes[0]}.{key})"
        elif close or elsewhere:
            hint = f"; did you mean {(close or elsewhere)[0]!r}?"
        else:
            hint = ""
        self.bad(path, f"unknown key{hint} (expected one of: {', '.join(sorted(known))})")

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
