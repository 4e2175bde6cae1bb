"""Executors: where a job's rows run. ``open_executor`` picks the implementation the job asks for: on one machine
the engine in a process of its own (``process``) or in the run's (``local``), by one rule (``placement``), or engine
actors on a Ray cluster (``ray/``, imported only then). The boundary itself is ``base``. Importing this package
imports neither MLX nor the engine (the command line reads ``placement`` before it checks a job)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from mlxbatch.job.executors.placement import ENGINE_PROCESS_ENV, ENGINE_PROCESS_MIN_ROWS, engine_process, stop_engine
from mlxbatch.job.spec import JobSpec

if TYPE_CHECKING:
    from mlxbatch.job.executors.base import Executor


@contextmanager
def open_executor(spec: JobSpec, rows: int | None = None,
                  early: subprocess.Popen[bytes] | None = None) -> Iterator[Executor]:
    """The executor the job asks for (``spec.executor.kind``), released when the block ends. The Ray executor
    is imported only here, only for ``kind: ray``: the single-machine path never imports Ray. A single-machine job
    runs its engine in a process of its own or in this one (``placement.engine_process``; ``rows``: the job's, None:
    not known); ``early``: its engine process, started already (``placement.early_engine``), adopted here or
    stopped."""
    from mlxbatch.engine import REGISTRY
    from mlxbatch.job.executors.base import ExecutorError, model_spec

    process = spec.executor.kind != "ray" and engine_process(spec, rows, bool(REGISTRY.users(model_spec(spec.model))))
    if not process:
        stop_engine(early)
    if spec.executor.kind == "ray":
        try:
            from mlxbatch.job.executors.ray.executor import open_ray_executor
        except ImportError as exc:
            raise ExecutorError(f"executor.kind ray needs Ray: pip install 'mlxbatch[ray]' ({exc})") from exc

        with open_ray_executor(spec) as executor:
            yield executor
        return
    if process:
        from mlxbatch.job.executors.process import open_process_executor

        with open_process_executor(spec, early) as executor:
            yield executor
        return
    from mlxbatch.job.executors.local import open_local_executor

    with open_local_executor(spec) as executor:
        yield executor


__all__ = ["ENGINE_PROCESS_ENV", "ENGINE_PROCESS_MIN_ROWS", "engine_process", "open_executor"]
