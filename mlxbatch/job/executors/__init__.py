"""Executors: where a job's rows run. ``open_executor`` picks the implementation the job asks for: the
single-machine ``LocalExecutor`` (``local``) or engine actors on a Ray cluster (``ray/``, imported only then).
The boundary itself is ``base``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mlxbatch.engine import is_vlm_folder, resolve_path
from mlxbatch.job.executors.base import Executor, ExecutorError
from mlxbatch.job.executors.local import open_local_executor
from mlxbatch.job.spec import JobSpec


@contextmanager
def open_executor(spec: JobSpec) -> Iterator[Executor]:
    """The executor the job asks for (``spec.executor.kind``), released when the block ends. The Ray executor
    is imported only here, only for ``kind: ray``: the single-machine path never imports Ray."""
    if spec.executor.kind == "ray":
        try:
            from mlxbatch.job.executors.ray.executor import open_ray_executor
        except ImportError as exc:
            raise ExecutorError(f"executor.kind ray needs Ray: pip install 'mlxbatch[ray]' ({exc})") from exc

        with open_ray_executor(spec) as executor:
            yield executor
        return
    if engine_process(spec):
        from mlxbatch.job.executors.process import open_process_executor

        with open_process_executor(spec) as executor:
            yield executor
        return
    with open_local_executor(spec) as executor:
        yield executor


ENGINE_PROCESS_ENV = "MLXBATCH_ENGINE_PROCESS"  # 1: the engine in a process of its own (0 or unset: in the run's)


def engine_process(spec: JobSpec) -> bool:
    """Whether a single-machine job runs its engine in a child process (``job.executors.process``): where
    ``MLXBATCH_ENGINE_PROCESS`` is 1, for a text model (a vision-language model's rows stay in the run's process)."""
    given = os.environ.get(ENGINE_PROCESS_ENV, "").strip()
    if given not in ("", "0", "1"):
        raise ExecutorError(f"{ENGINE_PROCESS_ENV}={given!r}: expected 1 (the engine in a process of its own) or 0")
    return given == "1" and not is_vlm_folder(Path(resolve_path(spec.model.path)))
