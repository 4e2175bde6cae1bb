"""The exception hierarchy for user and I/O problems (invariants use asserts)."""

from __future__ import annotations


class MlxbatchError(Exception):
    """Base of every error mlxbatch raises on purpose."""


class InvalidRequestError(MlxbatchError, ValueError):
    """A request or parameter that cannot run: names the field and the value."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field, self.value, self.reason = field, value, reason
        super().__init__(f"{field}={value!r}: {reason}")


class ModelLoadError(MlxbatchError):
    """A model, tokenizer or adapter that cannot be loaded."""


class ModelOwnershipError(MlxbatchError):
    """Two users asked the model registry for incompatible exclusive use of one model."""


class OutOfMemoryError(MlxbatchError):
    """The device could not allocate memory for a step."""


class EngineClosedError(MlxbatchError):
    """A request was submitted to an engine that has shut down."""
