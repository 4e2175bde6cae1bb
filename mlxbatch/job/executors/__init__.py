"""Executors: where a job's rows run. ``open_executor`` picks the implementation the job asks for: on one machine
the engine in a process of its own (``process``) or in the run's (``local``), or engine actors on a Ray cluster
(``ray/``, imported only then). The boundary itself is ``base``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mlxbatch.engine import REGISTRY, is_vlm_folder, resolve_path
from mlxbatch.job.executors.base import Executor, ExecutorError, model_spec
from mlxbatch.job.executors.local import open_local_executor
from mlxbatch.job.executors.process import open_process_executor
from mlxbatch.job.spec import JobSpec


@contextmanager
def open_executor(spec: JobSpec, rows: int | None = None) -> Iterator[Executor]:
    """The executor the job asks for (``spec.executor.kind``), released when the block ends. The Ray executor
    is imported only here, only for ``kind: ray``: the single-machine path never imports Ray. A single-machine job
    runs its engine in a process of its own or in this one (``engine_process``; ``rows``: the job's, None: not
    known)."""
    if spec.executor.kind == "ray":
        try:
            from mlxbatch.job.executors.ray.executor import open_ray_executor
        except ImportError as exc:
            raise ExecutorError(f"executor.kind ray needs Ray: pip install 'mlxbatch[ray]' ({exc})") from exc

        with open_ray_executor(spec) as executor:
            yield executor
        return
    if engine_process(spec, rows):
        with open_process_executor(spec) as executor:
            yield executor
        return
    with open_local_executor(spec) as executor:
        yield executor


ENGINE_PROCESS_ENV = "MLXBATCH_ENGINE_PROCESS"  # 1: the engine in a process of its own, 0: in the run's
# a job of fewer rows runs its engine in the run's process: the child's start (a new interpreter importing MLX, mlx-lm
# and the tokenizer: ~1 s on a 2-core CPU, ~4 s on an H100's host, where the feed's workers were timed) is on the
# run's way to its first step, and on a GPU the GIL it frees is worth ~20-30% of the steps' wall (py-spy, the 100k-row
# job: docs/benchmarks.md): the start is paid back from some 50,000 rows there (estimated; not measured on a GPU yet)
ENGINE_PROCESS_MIN_ROWS = 50_000


def engine_process(spec: JobSpec, rows: int | None) -> bool:
    """Whether a single-machine job runs its engine in a child process (``job.executors.process``):
    ``MLXBATCH_ENGINE_PROCESS`` (1 or 0), else for a text model whose job has ``ENGINE_PROCESS_MIN_ROWS`` rows or
    more (or an unknown count) and which this process does not hold loaded already (a notebook's engine: the job
    shares it rather than load a second copy). A vision-language model's rows always run here."""
    given = os.environ.get(ENGINE_PROCESS_ENV, "").strip()
    if given not in ("", "0", "1"):
        raise ExecutorError(f"{ENGINE_PROCESS_ENV}={given!r}: expected 1 (the engine in a process of its own) or 0")
    if is_vlm_folder(Path(resolve_path(spec.model.path))):
        return False
    if given:
        return given == "1"
    return (rows is None or rows >= ENGINE_PROCESS_MIN_ROWS) and not REGISTRY.users(model_spec(spec.model))
