"""Exceptions of the I/O layer: inputs that cannot be read, checkpoints that cannot be trusted, outputs that
cannot be written.

Owns only the exception classes. A *row* that cannot be read is not an exception: it becomes an
``InputRow`` with ``error`` set, so one bad line never kills a job. These are for problems of the whole
input, checkpoint folder or output.
"""

from __future__ import annotations

from mlxbatch.errors import MlxbatchError


class InputError(MlxbatchError):
    """An input that cannot be opened as asked: no file matches, unknown format, a requested column is missing."""


class CheckpointError(MlxbatchError):
    """A checkpoint folder that cannot be used: unreadable manifest, other version, held by another process."""


class OutputError(MlxbatchError):
    """A final output that cannot be written."""


class IncompleteResultsError(OutputError):
    """``finalize`` was asked for rows that have no result in the checkpoint (and missing rows were not allowed)."""

    def __init__(self, missing: int, examples: list[str]) -> None:
        self.missing, self.examples = missing, examples
        shown = ", ".join(repr(e) for e in examples)
        super().__init__(f"{missing} expected row(s) have no result in the checkpoint (e.g. {shown})")
