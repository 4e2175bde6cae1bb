"""The engine's kernel sources: ``.cu`` (CUDA) and ``.metal`` files of this package, read at import (package data:
``pyproject.toml`` ships them), so a kernel reads and diffs as the code it is, not as a Python string."""

from __future__ import annotations

from importlib import resources


def kernel_source(name: str) -> str:
    """The text of kernel source file ``name`` of this package."""
    return resources.files(__package__).joinpath(name).read_text()
