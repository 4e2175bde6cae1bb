"""Random-weight models in Hugging Face layout, for tests and benchmarks.

Owns the recipe for a tiny (or 0.5B-shaped) qwen2 model (``tiny64``: the tiny one with head dim 64, the head dim
of most real models, for which Metal and CUDA run MLX's fused attention kernels; the tiny one's 32 takes the unfused
fallback) and a small byte-level BPE tokenizer trained on
local text. The folder it writes loads through ``mlx_lm.load`` exactly like a real checkpoint; speed does
not depend on weight values, quality does. Nothing here is used on the generation path.
"""

from __future__ import annotations

import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int | None = None  # None: the tokenizer's size
    max_position_embeddings: int = 4096
    # Untied, peaked output weights make a tiny random model's greedy choices clear and varied (good for
    # tests); the 0.5B shape keeps Qwen2.5-0.5B's tied embeddings (494M parameters).
    tie_word_embeddings: bool = False


TINY = ModelShape(128, 2, 4, 2, 256)  # head dim 32
TINY64 = ModelShape(128, 2, 2, 1, 256)  # head dim 64, grouped-query attention (2 query heads per KV head)
SMALL = ModelShape(256, 4, 8, 2, 512)
SMALL64 = ModelShape(512, 8, 8, 2, 1408)  # head dim 64, ~25M parameters: `mlxbatch doctor`'s model on a GPU
QWEN2_0_5B = ModelShape(896, 24, 14, 2, 4864, vocab_size=151936, max_position_embeddings=32768,
                        tie_word_embeddings=True)
SHAPES = {"tiny": TINY, "tiny64": TINY64, "small": SMALL, "small64": SMALL64, "0.5b": QWEN2_0_5B}


def _corpus_files(limit: int = 60) -> list[str]:
    """Python standard-library sources: always on disk, so the tokenizer is reproducible offline."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py"))
    return files[:limit]


def build_tokenizer(out: Path, vocab_size: int = 1024) -> int:
    """Train a byte-level BPE (deterministic for a given corpus) and save it with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_corpus_files(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out))
    return tok.get_vocab_size()


def build_random_model(
    out: Path | str, shape: ModelShape | str = TINY, seed: int = 0, dtype: str = "float32"
) -> Path:
    """Write a random-weight qwen2 model with its tokenizer to ``out``; returns the folder.

    Reuses the folder when it is already complete (a ``.complete`` marker).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen2

    out = Path(out)
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    marker = f"{shape!r} seed={seed} dtype={dtype}"
    tmp = start_build(out, marker)
    if tmp is None:
        return out
    tok_vocab = build_tokenizer(tmp)
    config = {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "intermediate_size": shape.intermediate_size,
        "vocab_size": shape.vocab_size or tok_vocab,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "torch_dtype": dtype,
        "eos_token_id": SPECIAL_TOKENS.index("<|im_end|>"),  # specials take the first ids
    }
    mx.random.seed(seed)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    # Larger embeddings make the random model's next-token distribution peaked, so greedy argmax is
    # decided by clear margins rather than by float rounding.
    if not shape.tie_word_embeddings:
        model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape)
        model.lm_head.weight = mx.random.normal(model.lm_head.weight.shape) * (4.0 / shape.hidden_size**0.5)
    model.set_dtype(getattr(mx, dtype))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return finish_build(tmp, out, marker)


def start_build(out: Path, marker: str) -> Path | None:
    """None when ``out`` holds a complete build of ``marker`` (its ``.complete`` file); otherwise a fresh temporary
    folder next to it to build in (an ``out`` of another recipe is removed)."""
    import shutil

    if (out / ".complete").exists() and (out / ".complete").read_text() == marker:
        return None
    if out.exists():  # built from another recipe: rebuild
        shutil.rmtree(out)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def finish_build(tmp: Path, out: Path, marker: str) -> Path:
    """Mark ``tmp`` complete and move it into place (atomically; if another process finished first, keep its)."""
    import shutil

    (tmp / ".complete").write_text(marker)
    if out.exists():
        shutil.rmtree(tmp)
        return out
    os.replace(tmp, out)
    return out
