"""Loading a model and tokenizer through mlx-lm: aliases, local folders, hub ids, dtypes, adapters.

Owns the rules that turn a ``ModelSpec`` into a ``LoadedModel``: float32 on CPU (quantized checkpoints
dequantized), the checkpoint's own dtype on Metal and CUDA unless asked otherwise; ``trust_remote_code``
only when asked; errors that name the path and the reason.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxbatch.errors import ModelLoadError

log = logging.getLogger(__name__)

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass(frozen=True)
class ModelSpec:
    """What to load: a path, hub id or alias, a dtype ("auto" or a name) and an optional LoRA adapter."""

    model: str
    dtype: str = "auto"
    adapter_path: str | None = None
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ModelLoadError(f"model: expected a path, hub id or alias, got {self.model!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ModelLoadError(f"dtype={self.dtype!r}: expected auto or one of {', '.join(DTYPES)}")


@dataclass(frozen=True)
class LoadedModel:
    spec: ModelSpec
    path: Path
    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict[str, Any]
    dtype: str
    context_length: int
    identity: str  # content hash of config, weights index and adapter: part of every result key
    vlm: Any = None  # vision-language models: the mlx-vlm model + processor (engine.vision.adapter); ``model`` is its text view


def resolve_path(name: str) -> str:
    """An alias or local folder becomes a path; a hub id stays as it is (mlx-lm fetches it)."""
    from mlxbatch.models.smollm2 import SMOLLM2_ALIAS, ensure_smollm2

    if name.lower() in (SMOLLM2_ALIAS, "smollm2-135m", "smollm2-135m-instruct"):
        return str(ensure_smollm2())
    if name.lower() == "tiny-random-vlm":  # a random-weight Qwen2-VL for trying image jobs offline
        from mlxbatch.models.random_vlm import ensure_tiny_vlm

        return str(ensure_tiny_vlm())
    p = Path(name).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise ModelLoadError(f"model={name!r}: folder has no config.json (not a Hugging Face model folder)")
        return str(p)
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ModelLoadError(f"model={name!r}: no such folder, and not a hub id (owner/name) or alias")
    return name


def _identity(path: Path, adapter: str | None, dtype: str) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "chat_template.json", "generation_config.json"):
        f = path / name
        if f.exists():
            h.update(f.read_bytes())
    # hidden files are not the model: macOS Finder's .DS_Store, AppleDouble ._*.safetensors on non-Apple volumes
    for f in sorted(f for f in path.glob("*.safetensors") if not f.name.startswith(".")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}".encode())
    if adapter:
        for f in sorted(Path(adapter).glob("*")):
            if f.is_file() and not f.name.startswith("."):
                h.update(f.name.encode() + f.read_bytes()[:1 << 20])
    h.update(dtype.encode())
    return h.hexdigest()[:16]


def _is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def load_model(spec: ModelSpec) -> LoadedModel:
    from mlx_lm import load as mlx_load
    from mlx_lm.utils import dequantize_model, hf_repo_to_path, load_adapters

    source = resolve_path(spec.model)
    if Path(source).is_dir():
        from mlxbatch.engine.vision.adapter import is_vlm_folder

        if is_vlm_folder(Path(source)):
            return _load_vision_language(spec, Path(source))
    if spec.adapter_path is not None:
        ap = Path(spec.adapter_path).expanduser()
        if not (ap / "adapter_config.json").exists() or not (ap / "adapters.safetensors").exists():
            raise ModelLoadError(f"adapter_path={spec.adapter_path!r}: expected a folder with adapter_config.json "
                                 "and adapters.safetensors (mlx-lm LoRA layout)")
    try:
        model, tokenizer, config = mlx_load(  # trust_remote_code always explicit: transformers never asks
            source, return_config=True, trust_remote_code=spec.trust_remote_code,
            tokenizer_config={"trust_remote_code": spec.trust_remote_code},
        )
    except Exception as exc:
        raise ModelLoadError(f"model={spec.model!r}: could not be loaded: {type(exc).__name__}: {exc}") from exc
    if spec.adapter_path is not None:
        try:
            model = load_adapters(model, spec.adapter_path)
            model.eval()
        except Exception as exc:
            raise ModelLoadError(f"adapter_path={spec.adapter_path!r}: could not be applied to {spec.model!r}: "
                                 f"{type(exc).__name__}: {exc}") from exc
    path = Path(source) if Path(source).exists() else Path(hf_repo_to_path(source))
    on_cpu = mx.default_device() == mx.cpu
    dtype = _choose_dtype(spec, config, on_cpu)
    if on_cpu and _is_quantized(model):
        log.info("dequantizing %s for the CPU", spec.model)
        model = dequantize_model(model)
    model.set_dtype(DTYPES[dtype])
    mx.eval(model.parameters())
    ctx = int(config.get("max_position_embeddings") or config.get("max_sequence_length") or 4096)
    return LoadedModel(spec, path, model, tokenizer, config, dtype, ctx, _identity(path, spec.adapter_path, dtype))


def _choose_dtype(spec: ModelSpec, config: dict[str, Any], on_cpu: bool) -> str:
    if spec.dtype != "auto":
        return spec.dtype
    if on_cpu:
        return "float32"  # bf16/fp16/quantized matmuls bypass BLAS on CPU and are slow
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").replace("torch.", "")
    return dtype if dtype in DTYPES else "bfloat16"


def _load_vision_language(spec: ModelSpec, path: Path) -> LoadedModel:
    """A vision-language checkpoint through mlx-vlm: same dtype rules; ``model`` is its language model's text view."""
    from mlx_lm.utils import dequantize_model

    from mlxbatch.engine.vision.adapter import TextView, load_vlm, processor_identity

    if spec.adapter_path is not None:
        raise ModelLoadError(f"adapter_path={spec.adapter_path!r}: adapters on vision-language models are not supported")
    vlm = load_vlm(path, spec.trust_remote_code)
    on_cpu = mx.default_device() == mx.cpu
    dtype = _choose_dtype(spec, vlm.config, on_cpu)
    if on_cpu and _is_quantized(vlm.model):
        log.info("dequantizing %s for the CPU", spec.model)
        vlm.set_model(dequantize_model(vlm.model))
    vlm.model.set_dtype(DTYPES[dtype])
    mx.eval(vlm.model.parameters())
    ctx = int(vlm.config.get("max_position_embeddings") or 4096)
    identity = hashlib.sha256((_identity(path, None, dtype) + processor_identity(path)).encode()).hexdigest()[:16]
    return LoadedModel(spec, path, TextView(vlm.model), vlm.tokenizer, vlm.config, dtype, ctx, identity, vlm)
