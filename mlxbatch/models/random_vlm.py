"""A tiny random-weight Qwen2-VL, Qwen2.5-VL or Qwen3-VL model folder, for tests and benchmarks of vision-language rows.

Owns the recipe: a Qwen2-VL config (2 text layers, hidden 256; vision depth 2, embed 64), Qwen2.5-VL's (the same text
model; a vision tower of width 64 with window attention in its first block and full attention in its second), or
Qwen3-VL's (a Qwen3 text model of the same size, interleaved multimodal RoPE; 16-pixel patches and one deepstack
level: features the tower adds to the language model's first layer at the image's positions; Qwen3-VL-MoE: 4 experts a
layer, 2 a token), random weights saved in mlx-vlm's own layout, the small byte-level BPE of ``random_model`` plus the
Qwen VL special tokens (``<|vision_start|>``, ``<|image_pad|>``, ...) and their chat template, and the image processor
configs. The folder loads through ``mlx_vlm.load`` exactly like a real checkpoint (nothing on the generation path is
special cased). Built once per machine and reused while its ``.complete`` marker matches the recipe.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxbatch.models.random_model import finish_build, start_build

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")

# Qwen2-VL's own chat template (system line shortened): list contents with {"type": "image"} items become
# <|vision_start|><|image_pad|><|vision_end|>, which the processor expands to one pad token per image feature.
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Small images stay small: 28x28 pixels per image token (patch 14, merge 2; Qwen3-VL: 32x32, patch 16), between 4 and
# 64 tokens per image.
IMAGE_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_pixels": 4 * 28 * 28,
    "max_pixels": 64 * 28 * 28,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True,
}

RECIPE = "tiny v2: text 2x256 (4 heads, 2 kv, mrope 8/12/12), vision 2x64, peaked head, loud merger"
# model type -> (architecture, processor class, patch size, its vision config beyond the shared one)
KINDS: dict[str, tuple[str, str, int, dict[str, Any]]] = {
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLProcessor", 14,
                 {"embed_dim": 64, "mlp_ratio": 4}),  # (an integer ratio, or transformers rejects the config)
    # the tower's width is hidden_size (its merger projects to out_hidden_size: the language model's 256); window
    # attention over 112-pixel windows (2x2 merged tokens) in block 0, full attention in block 1
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor", 14,
                   {"hidden_size": 64, "out_hidden_size": 256, "intermediate_size": 128, "window_size": 112,
                    "fullatt_block_indexes": [1], "tokens_per_second": 2}),
    # learned position embeddings over an 8 x 8 grid (interpolated to each image's); block 0's output is a deepstack
    # level, added to the language model's hidden states after its first layer
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLProcessor", 16,
                 {"hidden_size": 64, "out_hidden_size": 256, "intermediate_size": 128, "num_position_embeddings": 64,
                  "deepstack_visual_indexes": [0], "hidden_act": "gelu_pytorch_tanh"}),
}
KINDS["qwen3_vl_moe"] = ("Qwen3VLMoeForConditionalGeneration", "Qwen3VLProcessor", *KINDS["qwen3_vl"][2:])
# Qwen3-VL-MoE's text layers: 4 experts of width 128, 2 a token, in every layer
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
       "moe_intermediate_size": 128}


def _tokenizer(out: Path) -> dict[str, int]:
    """The tiny text model's BPE plus Qwen2-VL's vision specials; returns the special token ids."""
    from transformers import AutoTokenizer

    from mlxbatch.models.random_model import build_tokenizer

    build_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tok.chat_template = QWEN2_VL_TEMPLATE
    tok.save_pretrained(str(out))
    ids = {t: tok.convert_tokens_to_ids(t) for t in (*VISION_TOKENS, "<|im_end|>", "<|endoftext|>")}
    ids["vocab_size"] = len(tok)
    return ids


def build_random_vlm(out: Path | str, seed: int = 0, model_type: str = "qwen2_vl") -> Path:
    """Write the tiny random model of ``model_type`` (a key of ``KINDS``: ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``,
    ``qwen3_vl_moe``) to ``out`` (reused when complete); returns the folder."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    arch, processor_class, patch, vision = KINDS[model_type]
    family = importlib.import_module(f"mlx_vlm.models.{model_type}")
    out = Path(out)
    marker = f"{model_type} {RECIPE} seed={seed}"
    tmp = start_build(out, marker)
    if tmp is None:
        return out
    ids = _tokenizer(tmp)
    hidden, heads = 256, 4
    head_dim = hidden // heads
    mrope = [8, 12, 12]
    assert sum(mrope) == head_dim // 2, "mrope_section must sum to head_dim / 2"
    text: dict[str, Any] = {
        "hidden_size": hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "vocab_size": ids["vocab_size"],
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": mrope},
        "tie_word_embeddings": False,
    }
    if model_type.startswith("qwen3_vl"):  # its text model's own section, as its checkpoints have it (Qwen3:
        # per-head q/k norms, interleaved sections; the context only there: 8192 here, to tell it from a default)
        moe = MOE if model_type == "qwen3_vl_moe" else {}
        text = {"text_config": {**text, **moe, "model_type": f"{model_type}_text", "head_dim": head_dim,
                                "max_position_embeddings": 8192,
                                "rope_scaling": {"rope_type": "default", "mrope_section": mrope,
                                                 "mrope_interleaved": True}},
                "tie_word_embeddings": False}
    config = {
        "model_type": model_type,
        "architectures": [arch],
        **text,
        "torch_dtype": "float32",
        "eos_token_id": ids["<|im_end|>"],
        "bos_token_id": ids["<|endoftext|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "vision_config": {
            "model_type": model_type,
            "depth": 2,
            "hidden_size": hidden,  # Qwen2-VL: the merger projects to the language model's width
            "num_heads": 4,
            **vision,
            "in_channels": 3,
            "patch_size": patch,
            "spatial_patch_size": patch,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }
    mx.random.seed(seed)
    # the same config objects mlx-vlm's loader builds (its from_dict leaves the sub-configs as dicts)
    model_config = family.ModelConfig.from_dict(json.loads(json.dumps(config)))
    if isinstance(model_config.text_config, dict):
        model_config.text_config = family.TextConfig.from_dict(model_config.text_config)
    if isinstance(model_config.vision_config, dict):
        model_config.vision_config = family.VisionConfig.from_dict(config["vision_config"])
    model = family.Model(model_config)
    lm = model.language_model
    # As in random_model: peaked, untied output weights make greedy choices clear (decided by margins, not
    # rounding) and make the output depend visibly on the image features.
    lm.model.embed_tokens.weight = mx.random.normal(lm.model.embed_tokens.weight.shape)
    lm.lm_head.weight = mx.random.normal(lm.lm_head.weight.shape) * (4.0 / hidden**0.5)
    # image features as loud as token embeddings (std ~1, not ~0.2), so that what the picture shows changes the text
    merger = model.vision_tower.merger
    merger_out = merger.mlp[2] if hasattr(merger, "mlp") else merger.linear_fc2
    merger_out.weight = merger_out.weight * 8.0
    model.set_dtype(mx.float32)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    token = patch * 2  # pixels an image token covers (merge 2)
    image_processor = {**IMAGE_PROCESSOR, "processor_class": processor_class, "patch_size": patch,
                       "min_pixels": 4 * token * token, "max_pixels": 64 * token * token}
    (tmp / "preprocessor_config.json").write_text(json.dumps(image_processor, indent=2))
    # written locally so that loading never asks a model hub for them
    (tmp / "video_preprocessor_config.json").write_text(json.dumps(image_processor, indent=2))
    (tmp / "processor_config.json").write_text(json.dumps({"processor_class": processor_class}, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["<|im_end|>"]}, indent=2))
    return finish_build(tmp, out, marker)


def synthetic_image(seed: int, width: int = 112, height: int = 112) -> Any:
    """A deterministic test picture: a coloured background with a few coloured rectangles and an ellipse (PIL, RGB)."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)

    def colour() -> tuple[int, int, int]:
        r, g, b = (int(x) for x in rng.integers(0, 256, 3))
        return r, g, b

    img = Image.new("RGB", (width, height), colour())
    draw = ImageDraw.Draw(img)
    for _ in range(4):
        x0, y0 = int(rng.integers(0, max(1, width - width // 3))), int(rng.integers(0, max(1, height - height // 3)))
        draw.rectangle([x0, y0, x0 + width // 4, y0 + height // 4], fill=colour())
    x0, y0 = int(rng.integers(0, width // 2)), int(rng.integers(0, height // 2))
    draw.ellipse([x0, y0, x0 + width // 3, y0 + height // 3], fill=colour())
    return img


TINY_VLM_ALIAS = "tiny-random-vlm"


def ensure_tiny_vlm() -> Path:
    """The tiny random Qwen2-VL under ``$MLXBATCH_CACHE`` (or ``~/.cache/mlxbatch/models``), built on first use."""
    from mlxbatch.models.smollm2 import default_cache_dir

    return build_random_vlm(default_cache_dir() / "tiny-random-qwen2-vl")
