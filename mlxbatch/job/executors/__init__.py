"""Executors: where a job's rows run. ``open_executor`` picks the implementation the job asks for: the
single-machine ``LocalExecutor`` (``local``) or engine actors on a Ray cluster (``ray/``, imported only then).
The boundary itself is ``base``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

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
    with open_local_executor(spec) as executor:
        yield executor
