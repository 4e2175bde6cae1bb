"""Row identity: the result key that makes resume exactly-once, canonical parameter JSON, and duplicate-id
detection.

Owns the key format (versioned). A result key changes iff something that determines the row's output changes
(row id, rendered prompt, model identity, sampling parameters, seed), so a re-run skips exactly the rows whose
key is already checkpointed and redoes only the rows a change touched.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Any

from mlxbatch.types import SamplingParams

logger = logging.getLogger(__name__)

KEY_VERSION = "mlxbatch-key-v1"
KEY_HEX_CHARS = 32


def _normalize(value: Any) -> Any:
    # 0 and 0.0 (a YAML int vs. a float default) must not make two keys for one output.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, Mapping):
        return {str(k): _normalize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalize(v) for v in value]
    return value


def canonical_params(params: SamplingParams | Mapping[str, Any]) -> str:
    """Sampling parameters as canonical JSON (sorted keys, no spaces, 1.0 written as 1): stable for ``result_key``."""
    data = dataclasses.asdict(params) if isinstance(params, SamplingParams) else dict(params)
    if data.get("constraint", 0) is None:
        del data["constraint"]  # unconstrained rows keep the keys they had before constraints existed
    return json.dumps(_normalize(data), sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=list)


def result_key(row_id: str, rendered_prompt: str, model_identity: str, params_json: str, seed: int | None) -> str:
    """The sha256 (first 32 hex chars) of everything that determines a row's output.

    ``model_identity`` should name the exact weights (path or repo + revision / content hash, adapter,
    quantisation). ``params_json`` should come from ``canonical_params``. ``seed`` is the row's effective seed.
    The fields are JSON-encoded as one array, so no two different inputs can collide by concatenation.
    """
    blob = json.dumps([KEY_VERSION, row_id, rendered_prompt, model_identity, params_json, seed],
                      ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:KEY_HEX_CHARS]


class DuplicateIdTracker:
    """Gives every row of a stream an id of its own (the readers never dedupe).

    Memory is one set entry per distinct id. ``add`` returns False for an id already taken: by an earlier real row
    (a duplicate), or given earlier to a row without an id of its own (``is_generated`` tells which). ``generated``
    gives a row an id that is free: the reader's id for a row without one, or the id a duplicate is written under,
    with a ``#n`` suffix where that id is taken. So no two output rows share an id.
    """

    def __init__(self, max_examples: int = 10) -> None:
        self._seen: set[str] = set()
        self._generated: set[str] = set()
        self._max_examples = max_examples
        self.duplicates = 0
        self.examples: list[str] = []

    def generated(self, row_id: str) -> str:
        """A free id for a row whose own id is ``row_id`` made up by its reader, or taken already."""
        unique, n = row_id, 1
        while unique in self._seen or unique in self._generated:
            n += 1
            unique = f"{row_id}#{n}"
        self._generated.add(unique)
        return unique

    def is_generated(self, row_id: str) -> bool:
        """Whether ``row_id`` was given by ``generated`` (to a row without an id of its own, or a duplicate)."""
        return row_id in self._generated

    def add(self, row_id: str) -> bool:
        """Take a real row's id: False when it is taken already (the row is a duplicate)."""
        if row_id in self._seen or row_id in self._generated:
            self.duplicates += 1
            if len(self.examples) < self._max_examples and row_id not in self.examples:
                self.examples.append(row_id)
            return False
        self._seen.add(row_id)
        return True

    def report(self) -> dict[str, Any]:
        """A JSON-ready summary for the run report."""
        return {"duplicate_rows": self.duplicates, "examples": list(self.examples)}
