"""Where a single-machine job's engine runs: in a process of its own (``process``) or in the run's (``local``), by
one rule, and the start of that process, which the command line begins before it checks the job.

The engine's process is a new interpreter: its imports (MLX, mlx-lm, transformers: ~3 s on an H100's host) come
before it can load the model. Started when the run's executor opens, they were on the run's way to its first step:
on an H100 the 100k-row job's rows ran 12.5% faster in the engine's own process, but from ``loading model`` to the
results written it took 40.1 s against 40.7 s in the run's (docs/benchmarks.md, ``1aeb23c``). ``early_engine``
starts it with its setup as soon as the job file is read, so its imports and the model's load overlap the run's own
imports and the job's checks (the spec they check is the one it was given); the executor adopts it. This module
imports neither MLX nor the engine.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from mlxbatch.errors import MlxbatchError
from mlxbatch.io import count_rows
from mlxbatch.io.frames import frame
from mlxbatch.job.check.model_ref import model_kind
from mlxbatch.job.check.validate import input_spec
from mlxbatch.job.spec import JobSpec

ENGINE_PROCESS_ENV = "MLXBATCH_ENGINE_PROCESS"  # 1: the engine in a process of its own, 0: in the run's
# a job of fewer rows runs its engine in the run's process: the child's start is on the run's way to its first step
# (less of it since ``early_engine``), and on a GPU the GIL it frees is worth ~12% of the job's wall (the 100k-row job
# on an H100: docs/benchmarks.md); on a CPU the two are level (the model's compute binds)
ENGINE_PROCESS_MIN_ROWS = 50_000
# the child: transformers without torch (a text model's rows: ``mlxbatch._torch``), then ``process.serve``
SERVE = ("from mlxbatch._torch import without_torch; without_torch(); "
         "from mlxbatch.job.executors.process import serve; serve()")


class EngineProcessError(MlxbatchError):
    """``MLXBATCH_ENGINE_PROCESS`` is set to something else than 1 or 0."""


def job_rows(spec: JobSpec) -> int | None:
    """The rows the job reads (its input's cheap count within ``input.limit``; None: not known)."""
    total = count_rows(input_spec(spec))
    if spec.input.limit is not None:
        total = spec.input.limit if total is None else min(total, spec.input.limit)
    return total


def engine_process(spec: JobSpec, rows: int | None, held_here: bool = False) -> bool:
    """Whether a single-machine job runs its engine in a child process: ``MLXBATCH_ENGINE_PROCESS`` (1 or 0), else
    for a text model whose job has ``ENGINE_PROCESS_MIN_ROWS`` rows or more (or an unknown count) and which this
    process does not hold loaded already (``held_here``: a notebook's engine; the job shares it rather than load a
    second copy). A vision-language model's rows always run here."""
    given = os.environ.get(ENGINE_PROCESS_ENV, "").strip()
    if given not in ("", "0", "1"):
        raise EngineProcessError(f"{ENGINE_PROCESS_ENV}={given!r}: expected 1 (the engine in a process of its own) "
                                 "or 0")
    if model_kind(spec.model.path) == "vision":
        return False
    if given:
        return given == "1"
    return (rows is None or rows >= ENGINE_PROCESS_MIN_ROWS) and not held_here


def spawn_engine(spec: JobSpec) -> subprocess.Popen[bytes]:
    """A new engine process for ``spec`` (``process.serve``), its setup sent: it imports, loads the model and warms
    up while the run goes on. A session of its own: a Ctrl-C at the terminal reaches the run, which decides what
    stops."""
    proc = subprocess.Popen([sys.executable, "-c", SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        proc.stdin.write(frame(("setup", spec, run_logging())))  # type: ignore[union-attr]  # (the pipe holds it)
        proc.stdin.flush()  # type: ignore[union-attr]
    except OSError:
        pass  # gone at once: the executor reading its output says so
    return proc


def early_engine(spec: JobSpec) -> subprocess.Popen[bytes] | None:
    """The engine process of a job that will run one, started now (the command line, before it checks the job: the
    checks leave the spec as it is); None for a job whose engine runs in the run's process or on Ray. The caller
    stops it unless an executor adopted it (``stop_engine``)."""
    if spec.executor.kind == "ray" or not engine_process(spec, job_rows(spec)):
        return None
    return spawn_engine(spec)


def run_logging() -> tuple[int, str | None]:
    """The run's logging for its engine's process: the level of mlxbatch's loggers and the format of the run's
    first handler (None: the run configured none, e.g. a notebook's)."""
    handlers = logging.getLogger().handlers
    formatter = handlers[0].formatter if handlers else None
    return logging.getLogger("mlxbatch").getEffectiveLevel(), getattr(formatter, "_fmt", None)


def stop_engine(proc: subprocess.Popen[bytes] | None) -> None:
    """End an engine process nobody adopted (at once: it holds no rows); nothing for one that has exited."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
