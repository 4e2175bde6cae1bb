"""The continuous-batching engine: requests in, tokens out. This module is its face: the job layer, the CLI and
users import from here only (an import-linter contract holds the job layer and the CLI to it).

Layer rule: ``engine`` never imports ``mlxbatch.io`` or ``mlxbatch.job``. Inside, top to bottom: ``api`` /
``async_core`` -> ``core`` (the step loop) -> ``intake`` (submission) -> ``runner`` -> ``commit`` | ``invariant`` ->
``kv`` | ``model`` -> ``vision`` | ``attention`` -> ``sched`` (pure Python) -> ``request`` | ``outputs`` ->
``decoding`` | ``inputs`` | ``backend``. See docs/architecture.md.
"""

from mlxbatch.config import EngineConfig
from mlxbatch.engine.api import Engine
from mlxbatch.engine.async_core import AsyncEngineCore
from mlxbatch.engine.core import EngineCore, max_num_seqs_here, reuse_step_here
from mlxbatch.engine.decoding.structured import GrammarCompiler, grammar_text
from mlxbatch.engine.inputs import PromptEncoder, encode_prompt
from mlxbatch.engine.kv import LayoutOptions
from mlxbatch.engine.model.device_speed import DeviceSpeed
from mlxbatch.engine.model.device_speed import measure as measure_device_speed
from mlxbatch.engine.model.loader import LoadedModel, ModelSpec, load_model, resolve_path
from mlxbatch.engine.model.registry import REGISTRY, ModelRegistry
from mlxbatch.engine.model.worker import DeviceInfo, device_info
from mlxbatch.engine.request import Request, RequestStatus
from mlxbatch.engine.sched.blocks import BLOCK_SIZE, block_hashes
from mlxbatch.engine.sched.planner import Plan, Submission, common_prefix_len, plan, submission_order
from mlxbatch.engine.sched.prefix import LIVE_SOURCES
from mlxbatch.engine.vision.adapter import is_vlm_folder

__all__ = ["BLOCK_SIZE", "LIVE_SOURCES", "REGISTRY", "AsyncEngineCore", "DeviceInfo", "DeviceSpeed", "Engine",
           "EngineConfig", "EngineCore", "GrammarCompiler", "LayoutOptions", "LoadedModel", "ModelRegistry", "ModelSpec", "Plan",
           "PromptEncoder", "Request", "RequestStatus", "Submission", "block_hashes", "common_prefix_len",
           "device_info", "encode_prompt", "grammar_text", "is_vlm_folder", "load_model", "max_num_seqs_here",
           "measure_device_speed", "plan", "resolve_path", "reuse_step_here", "submission_order"]
