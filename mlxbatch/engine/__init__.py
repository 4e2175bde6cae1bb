"""The continuous-batching engine: requests in, tokens out. This module is its face: the job layer, the CLI and
users import from here only (an import-linter contract holds the job layer and the CLI to it).

Layer rule: ``engine`` never imports ``mlxbatch.io`` or ``mlxbatch.job``. Inside, top to bottom: ``api`` /
``async_core`` -> ``core`` (the step loop) | ``dry_run`` (its scheduling without a model) -> ``intake`` (submission) -> ``runner`` -> ``commit`` | ``invariant`` ->
``kv`` | ``model`` -> ``vision`` | ``attention`` -> ``sched`` (pure Python) -> ``request`` | ``outputs`` ->
``decoding`` | ``inputs`` | ``backend``. See docs/architecture.md.
"""

from mlxbatch.config import EngineConfig
from mlxbatch.engine.api import Engine
from mlxbatch.engine.async_core import AsyncEngineCore
from mlxbatch.engine.backend import Backend
from mlxbatch.engine.core import EngineCore
from mlxbatch.engine.decoding.detok import byte_of_char
from mlxbatch.engine.decoding.structured import GrammarCompiler, grammar_text
from mlxbatch.engine.dry_run import DryModel, DryRun
from mlxbatch.engine.inputs import PromptEncoder
from mlxbatch.engine.intake import RequestGroup
from mlxbatch.engine.kv import LayoutOptions
from mlxbatch.engine.model.device_speed import measure as measure_device_speed
from mlxbatch.engine.model.loader import LoadedModel, ModelSpec, load_model, resolve_path
from mlxbatch.engine.model.registry import REGISTRY
from mlxbatch.engine.model.worker import DeviceInfo, device_info
from mlxbatch.engine.sched.blocks import prompt_block_hashes
from mlxbatch.engine.sched.planner import common_prefix_len, plan, submission_order
from mlxbatch.engine.vision.adapter import is_vlm_folder

__all__ = ["REGISTRY", "AsyncEngineCore", "Backend", "DeviceInfo", "DryModel", "DryRun", "Engine", "EngineConfig",
           "EngineCore", "GrammarCompiler", "LayoutOptions", "LoadedModel", "ModelSpec", "PromptEncoder", "RequestGroup",
           "byte_of_char", "common_prefix_len", "device_info", "grammar_text", "is_vlm_folder", "load_model", "measure_device_speed",
           "plan", "prompt_block_hashes", "resolve_path", "submission_order"]
