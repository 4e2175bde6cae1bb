"""The two row types of the I/O layer: ``InputRow`` (one row read from an input) and ``ResultRecord`` (one
finished row as it is checkpointed and written out).

Owns their fields and light validation. Does not own how they are stored (``schema``) or keyed (``keys``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from mlxbatch.types import TokenLogprob


@dataclass(frozen=True)
class InputRow:
    """One row of an input, in input order.

    ``row_id`` is the id column's value (as ``str``), or ``"<file stem>:<position>"`` when there is no id column
    (and for rows whose id could not be read). ``position`` is the 1-based line number for JSONL / OpenAI batch
    files and the 0-based row index (within the file or dataset) for Parquet and HF datasets. ``error`` is set,
    with a message naming the file and line, for a row that could not be read; its ``fields`` are then empty.
    ``request`` is the OpenAI batch request ``body`` (only for ``openai-batch`` inputs). ``generated_id`` is True
    when the reader made the id up (no id column, or a row whose id could not be read): such an id never makes a
    real row a duplicate (``keys.DuplicateIdTracker``).
    """

    row_id: str
    source: str
    position: int
    fields: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    request: dict[str, Any] | None = None
    generated_id: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


def generated_id(source: str, stem: str, position: int, has_ids: bool) -> str:
    """The id of a row that has none: ``<stem>:<position>`` when the input has no ids at all, and
    ``<file name>:<position>`` (extension included, so real ids are unlikely to look the same) for a row of an
    input with ids whose own id could not be read."""
    return f"{PurePath(source).name if has_ids else stem}:{position}"


@dataclass(frozen=True)
class ResultRecord:
    """One finished input row: what the checkpoint stores and the final Parquet holds (one row per input row).

    ``key`` is the row's result key (``keys.result_key``): the identity of everything that determines the output.
    ``inputs`` holds the input columns the job keeps (JSON-serialisable; datetimes and bytes are stored as
    strings). ``error`` is None on success; ``error_kind`` is a short class such as ``"input"``, ``"render"``,
    ``"engine"``. ``params`` is the sampling parameters as canonical JSON (``keys.canonical_params``).
    ``extra`` is free-form JSON for later features (n > 1 samples, parsed JSON, cached tokens, ...).
    """

    row_id: str
    key: str
    inputs: dict[str, Any] = field(default_factory=dict)
    text: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] | None = None
    error: str | None = None
    error_kind: str | None = None
    latency_s: float | None = None
    ttft_s: float | None = None
    model: str = ""
    params: str = "{}"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.row_id, str) or not self.row_id:
            raise ValueError(f"ResultRecord.row_id must be a non-empty str, got {self.row_id!r}")
        if not isinstance(self.key, str) or not self.key:
            raise ValueError(f"ResultRecord.key must be a non-empty str, got {self.key!r}")
        if isinstance(self.finish_reason, enum.Enum):  # FinishReason -> its plain string value
            object.__setattr__(self, "finish_reason", str(self.finish_reason.value))
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", tuple(self.logprobs))
        if self.prompt_tokens < 0 or self.generated_tokens < 0:
            raise ValueError("ResultRecord token counts must be >= 0")

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def failed(cls, row_id: str, key: str, error: str, error_kind: str, **kwargs: Any) -> ResultRecord:
        """A record for a row that produced no output (``finish_reason`` is ``"error"``)."""
        kwargs.setdefault("finish_reason", "error")
        return cls(row_id=row_id, key=key, error=error, error_kind=error_kind, **kwargs)


def _id_value(value: Any) -> str | None:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def input_row_from_object(obj: dict[str, Any], *, source: str, stem: str, position: int,
                          id_column: str | None, columns: tuple[str, ...] | None, label: str = "") -> InputRow:
    """Build the ``InputRow`` of one decoded record (shared by all readers).

    Messages name the place as ``"<source>:<label><position>"`` (``"data.jsonl:17"``, ``"x.parquet:row 3"``).
    Requested ``columns`` a row lacks are None. A row whose id column is missing, null or not a string or an
    integer becomes an error row.
    """
    fields = obj if columns is None else {name: obj.get(name) for name in columns}
    if id_column is None:
        return InputRow(row_id=generated_id(source, stem, position, False), source=source, position=position,
                        fields=fields, generated_id=True)
    raw = obj.get(id_column)
    row_id = _id_value(raw)
    if row_id is None:
        problem = "is missing" if raw is None else f"must be a non-empty string or an integer, got {raw!r:.80}"
        return InputRow(row_id=generated_id(source, stem, position, True), source=source,
                        position=position, fields=fields, generated_id=True,
                        error=f"{source}:{label}{position}: id column {id_column!r} {problem}")
    return InputRow(row_id=row_id, source=source, position=position, fields=fields)
