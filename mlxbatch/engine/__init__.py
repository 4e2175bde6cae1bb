"""The continuous-batching engine: requests in, tokens out.

Layer rule: ``engine`` never imports ``mlxbatch.io`` or ``mlxbatch.job``.
"""

from mlxbatch.config import EngineConfig
from mlxbatch.engine.api import Engine
from mlxbatch.engine.async_core import AsyncEngineCore
from mlxbatch.engine.core import EngineCore
from mlxbatch.engine.model.loader import LoadedModel, ModelSpec, load_model
from mlxbatch.engine.request import Request, RequestStatus

__all__ = ["AsyncEngineCore", "Engine", "EngineConfig", "EngineCore", "LoadedModel", "ModelSpec",
           "Request", "RequestStatus", "load_model"]
