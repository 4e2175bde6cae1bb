"""Loading a model and tokenizer through mlx-lm: aliases, local folders, hub ids, dtypes, adapters.

Owns the rules that turn a ``ModelSpec`` into a ``LoadedModel``: float32 on CPU (quantized checkpoints
dequantized), the weights' own stored floating dtype on Metal and CUDA unless asked otherwise (a config's
``torch_dtype`` label is not trusted: 4-bit checkpoints often store fp16 scales under a bf16 label, and a cast
would double the memory a load needs), with a warning, once a model, when a GPU would run float32 weights;
``trust_remote_code`` only when asked; errors that name the path and the reason.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxbatch.engine.backend import Backend
from mlxbatch.engine.model import early_kernels
from mlxbatch.errors import ModelLoadError

log = logging.getLogger(__name__)

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_warned_float32: set[str] = set()  # models already warned about (``_choose_dtype``): once a process


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
        _kernels_early(spec, Path(source))
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
    on_cpu = _on_cpu()
    if on_cpu and _is_quantized(model):
        log.info("dequantizing %s for the CPU", spec.model)
        model = dequantize_model(model)
    dtype = _choose_dtype(spec, on_cpu, stored_dtype(model))
    _cast(model, dtype)
    ctx = int(config.get("max_position_embeddings") or config.get("max_sequence_length") or 4096)
    return LoadedModel(spec, path, model, tokenizer, config, dtype, ctx, _identity(path, spec.adapter_path, dtype))


def _on_cpu() -> bool:
    return Backend.detect().kind == "cpu"  # (loading comes before any engine: its own ask)


def stored_dtype(model: nn.Module) -> str:
    """The floating dtype most of the model's parameters are stored in (quantized weights' scales included)."""
    counts: dict[str, int] = {}
    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            name = str(p.dtype).rsplit(".", 1)[-1]
            counts[name] = counts.get(name, 0) + p.size
    return max(counts, key=counts.__getitem__) if counts else "bfloat16"


def _kernels_early(spec: ModelSpec, folder: Path) -> None:
    """On CUDA, the engine's attention kernels built while the weights load (``early_kernels``), in the dtype this
    load will choose from what the folder stores."""
    backend = Backend.detect()
    if backend.cuda:
        mx.eval(mx.zeros(1))  # the device set up on this thread first: the build's thread then finds it ready
        stored = early_kernels.stored_dtype_on_disk(folder)
        early_kernels.start(folder, backend, DTYPES[_dtype_for(spec, False, stored or "bfloat16")])


def _dtype_for(spec: ModelSpec, on_cpu: bool, stored: str) -> str:
    """The dtype a model runs in: the one asked for; else float32 on a CPU, what is stored elsewhere (bfloat16 for
    what MLX does not run, e.g. float64)."""
    if spec.dtype != "auto":
        return spec.dtype
    if on_cpu:
        return "float32"  # bf16/fp16/quantized matmuls bypass BLAS on CPU and are slow
    return stored if stored in DTYPES else "bfloat16"


def _choose_dtype(spec: ModelSpec, on_cpu: bool, stored: str) -> str:
    dtype = _dtype_for(spec, on_cpu, stored)
    if dtype == "float32" and not on_cpu and spec.model not in _warned_float32:
        # twice the bytes a step reads and half the matmul speed: issue 47's labeling job on an H100 ran at 467
        # rows/s with the same weights as float32 against 717 as bfloat16
        _warned_float32.add(spec.model)
        why = "asked for by dtype" if spec.dtype == "float32" else "stored so, and dtype auto keeps what is stored"
        log.warning("%s: float32 weights on the GPU (%s) run at about half the speed of bfloat16, in twice the "
                    "memory; set model.dtype: bfloat16 in the job file (ModelSpec(dtype=\"bfloat16\") in Python)",
                    spec.model, why)
    return dtype


def _cast(model: nn.Module, dtype: str) -> None:
    """Floating parameters to ``dtype`` (nothing is copied when they already are), then evaluated."""
    target = DTYPES[dtype]
    if any(mx.issubdtype(p.dtype, mx.floating) and p.dtype != target for _, p in tree_flatten(model.parameters())):
        model.set_dtype(target)
    mx.eval(model.parameters())


def _load_vision_language(spec: ModelSpec, path: Path) -> LoadedModel:
    """A vision-language checkpoint through mlx-vlm: same dtype rules; ``model`` is its language model's text view."""
    from mlx_lm.utils import dequantize_model

    from mlxbatch.engine.vision.adapter import TextView, load_vlm, processor_identity

    if spec.adapter_path is not None:
        raise ModelLoadError(f"adapter_path={spec.adapter_path!r}: adapters on vision-language models are not supported")
    vlm = load_vlm(path, spec.trust_remote_code)
    on_cpu = _on_cpu()
    if on_cpu and _is_quantized(vlm.model):
        log.info("dequantizing %s for the CPU", spec.model)
        vlm.set_model(dequantize_model(vlm.model))
    dtype = _choose_dtype(spec, on_cpu, stored_dtype(vlm.model))
    _cast(vlm.model, dtype)
    # the language model's context: in its text config (Qwen3-VL's checkpoints have it nowhere else)
    text = getattr(vlm.model.config, "text_config", None)
    ctx = int(getattr(text, "max_position_embeddings", None) or vlm.config.get("max_position_embeddings") or 4096)
    identity = hashlib.sha256((_identity(path, None, dtype) + processor_identity(path)).encode()).hexdigest()[:16]
    return LoadedModel(spec, path, TextView(vlm.model), vlm.tokenizer, vlm.config, dtype, ctx, identity, vlm)
