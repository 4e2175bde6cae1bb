"""mlxbatch: batch / offline LLM jobs on MLX.

Importing the package first loads the system OpenBLAS on Linux (before MLX is imported anywhere), and asks MLX's
CUDA backend for direct kernel launches (``mlxbatch._cuda``; a ``MLX_USE_CUDA_GRAPHS`` the user set wins).
"""

from mlxbatch._blas import preload_openblas
from mlxbatch._cuda import prefer_direct_launches

preload_openblas()
prefer_direct_launches()

from mlxbatch.errors import InvalidRequestError, MlxbatchError  # noqa: E402
from mlxbatch.types import FinishReason, OutputConstraint, RequestOutput, SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "FinishReason",
    "InvalidRequestError",
    "JobFailed",
    "JobInterrupted",
    "JobResult",
    "JobSpecError",
    "MlxbatchError",
    "OutputConstraint",
    "RequestOutput",
    "SamplingParams",
    "__version__",
    "run_job",
]


def __getattr__(name: str):  # lazy: importing the engine imports mlx
    if name in ("Engine", "AsyncEngineCore", "EngineCore", "EngineConfig"):
        from mlxbatch import engine

        return getattr(engine, name)
    if name in ("run_job", "JobResult"):  # the in-process job API (notebooks, scripts, threads)
        from mlxbatch.job import api

        return getattr(api, name)
    if name in ("JobSpecError", "JobInterrupted", "JobFailed"):  # what run_job raises (README: Python API)
        from mlxbatch.job import spec
        from mlxbatch.job.run import runner

        return getattr(spec if name == "JobSpecError" else runner, name)
    raise AttributeError(name)
