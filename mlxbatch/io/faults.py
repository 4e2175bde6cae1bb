"""Crash-test hooks: ``MLXBATCH_FAULT=<point>:<n>`` kills the process with SIGKILL at that point of the n-th write
of its kind in this process (a real kill -9, at the moment no test could hit by timing alone).

Points: ``mid-shard`` (half a checkpoint shard is written), ``after-rename`` (a shard is in place, the manifest
does not list it yet), ``mid-manifest`` (half of the manifest's temporary file is written), ``mid-results`` (the
first row group of ``results.parquet``'s temporary file is written), ``before-success`` (the report is written,
``_SUCCESS`` is not). Unset (always, outside tests), every hook is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal


def fault_due(point: str, count: int) -> bool:
    return os.environ.get("MLXBATCH_FAULT", "") == f"{point}:{count}"


def crash() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
