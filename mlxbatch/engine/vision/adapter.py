"""A vision-language model loaded through mlx-vlm, and what its requests carry (``MultimodalInputs``).

Owns the mlx-vlm side of the engine, through mlx-vlm's public API only: ``mlx_vlm.utils.load`` (model + processor),
``prompt_utils.apply_chat_template`` (image placeholders in the prompt), ``utils.prepare_inputs`` (the processor:
pixel values, image grids, one placeholder token per image feature), and the model's own modules:
``vision_tower`` (image features), ``language_model.get_rope_index`` (multimodal RoPE positions and the per-row
``rope_delta``), ``language_model.model`` (the text body, called with ``inputs_embeds`` and ``position_ids``) and the
LM head. ``TextView`` shows the language model as an mlx-lm text model (tokens -> logits, ``.model`` / ``.lm_head``),
so the worker, the warm-up and the runner's body/head split work on it unchanged.
Supported: the Qwen VL family, Qwen2-VL, Qwen2.5-VL and Qwen3-VL, dense or MoE (``model_type`` ``qwen2_vl``,
``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_vl_moe``: multimodal RoPE positions and the same vision-tower call; Qwen3-VL's
tower also gives deepstack levels, which the body adds inside the language model: ``body(deepstack=...)``; each held
to mlx-vlm's own generation by tests/engine/test_vlm.py); other architectures are refused with a clear error.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbatch.errors import InvalidRequestError, ModelLoadError
from mlxbatch.types import ImageInput

SUPPORTED_VLM_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
IMAGE_MARKER = "<image>"  # in a prompt's text: where the next image goes


class _DropProcessorKwargsWarning(logging.Filter):
    """mlx-vlm's chat-template helper passes its options the way transformers 5 warns about on every prompt."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "have to be in `processor_kwargs`" not in record.getMessage()


logging.getLogger("transformers.processing_utils").addFilter(_DropProcessorKwargsWarning())


@dataclass(frozen=True, eq=False)
class ImageSpan:
    """One image of a prompt: its placeholder tokens ``[start, end)`` and what the vision tower needs."""

    start: int
    end: int
    content_hash: str
    source: str
    pixel_values: mx.array  # [patches, channels * temporal * patch * patch]
    grid_thw: tuple[int, int, int]


@dataclass(frozen=True, eq=False)
class MultimodalInputs:
    """What a request with images carries into the engine (read only; the request owns it)."""

    images: tuple[ImageSpan, ...]
    positions: np.ndarray  # [3, prompt tokens] multimodal RoPE positions (temporal, height, width)
    rope_delta: int  # a generated token at sequence index p sits at position p + rope_delta

    @property
    def media(self) -> tuple[tuple[int, str], ...]:
        """(token position, content hash) of each image, for the prefix cache's block hashes."""
        return tuple((s.start, s.content_hash) for s in self.images)


@dataclass(frozen=True)
class MultimodalPrompt:
    """A prompt with images, encoded: its token ids (one placeholder per image feature) and its inputs."""

    token_ids: list[int]
    mm: MultimodalInputs

    def __len__(self) -> int:
        return len(self.token_ids)


def text_positions(cache: Any, batch: int, length: int) -> mx.array:
    """Plain positions ``offset + t`` in all three RoPE sections, per row when the cache has per-row offsets."""
    offset = cache[0].offset if cache else 0
    if isinstance(offset, mx.array) and offset.ndim > 0:
        pos = offset[:, None] + mx.arange(length)[None, :]
    else:
        pos = mx.broadcast_to(mx.arange(int(offset), int(offset) + length)[None, :], (batch, length))
    return mx.broadcast_to(pos[None], (3, batch, length))


class TextView:
    """An mlx-vlm model's language model as an mlx-lm text model (text-only rows, worker, warm-up)."""

    def __init__(self, vlm_model: Any) -> None:
        self._full = vlm_model
        lm = vlm_model.language_model
        self.layers = lm.model.layers
        self.lm_head = getattr(lm, "lm_head", None) or lm.model.embed_tokens.as_linear
        self._body = lm.model

    def model(self, inputs: mx.array, cache: Any = None) -> mx.array:
        """Hidden states of text tokens (positions from the cache's offsets)."""
        return self._body(inputs, cache=cache, position_ids=text_positions(cache, *inputs.shape))

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return self.lm_head(self.model(inputs, cache=cache))

    def parameters(self) -> Any:
        return self._full.parameters()


class VisionLanguageModel:
    """The mlx-vlm model and processor of one loaded checkpoint (and an mlx-lm tokenizer for text and detokenizing)."""

    def __init__(self, model: Any, processor: Any, tokenizer: Any, config: dict[str, Any]) -> None:
        self.processor = processor
        self.tokenizer = tokenizer
        self.config = config
        self.model_type = config["model_type"]
        self.image_token = getattr(processor, "image_token", "<|image_pad|>")
        self.set_model(model)

    def set_model(self, model: Any) -> None:
        """Use ``model`` (e.g. the dequantized one) from now on."""
        self.model = model
        self.image_token_id = int(model.config.image_token_id)
        self.merge = int(model.config.vision_config.spatial_merge_size)
        lm = model.language_model
        self._lm = lm
        self.head = getattr(lm, "lm_head", None) or lm.model.embed_tokens.as_linear

    # -- submission: prompt + images -> token ids and inputs -------------------------------------
    def render(self, prompt: str | Sequence[dict[str, Any]], num_images: int) -> str:
        """The prompt's text with image placeholders (the chat template, unless the text already has them). Each
        ``<image>`` in the text of a user message (or of a string prompt) is where the next image goes; without one,
        the images go where mlx-vlm's chat helper puts them for this model (Qwen2-VL: after the text, Qwen2.5-VL and
        Qwen3-VL: before it)."""
        from mlx_vlm.prompt_utils import apply_chat_template

        if isinstance(prompt, str) and self.image_token in prompt:
            return prompt  # the caller placed the placeholders: raw text
        if not isinstance(prompt, str) and not all(isinstance(m, dict) for m in prompt):
            raise InvalidRequestError("prompt", type(prompt).__name__,
                                      "with images, expected a string or a list of chat messages")
        messages: Any = prompt if isinstance(prompt, str) else [dict(m) for m in prompt]
        if isinstance(messages, str) and IMAGE_MARKER in messages:
            messages = [{"role": "user", "content": messages}]
        if not isinstance(messages, str):
            placed = place_images(messages)
            if placed and placed != num_images:
                raise InvalidRequestError("images", num_images, f"the prompt has {placed} {IMAGE_MARKER} "
                                          f"placeholder(s) for {num_images} image(s): put one per image in the "
                                          "user's text, or none (the model's chat template places them)")
        try:
            return str(apply_chat_template(self.processor, self.config, messages, num_images=num_images))
        except Exception as exc:
            raise InvalidRequestError("prompt", "<messages>", f"chat template failed: {exc}") from exc

    def encode(self, prompt: str | Sequence[dict[str, Any]], images: Sequence[ImageInput]) -> MultimodalPrompt:
        from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

        if not images:
            raise InvalidRequestError("images", "[]", "encode() needs at least one image")
        text = self.render(prompt, len(images))
        try:
            inputs = prepare_inputs(self.processor, images=[im.image for im in images], prompts=text,
                                    add_special_tokens=should_add_special_tokens(self.model_type, self.processor))
        except Exception as exc:
            raise InvalidRequestError("images", [im.source for im in images],
                                      f"the image processor failed: {type(exc).__name__}: {exc}") from exc
        ids = [int(t) for t in inputs["input_ids"][0].tolist()]
        grid = np.asarray(inputs["image_grid_thw"]).astype(np.int64).reshape(-1, 3)
        runs = _runs(ids, self.image_token_id)
        if len(runs) != len(images) or len(grid) != len(images):
            raise InvalidRequestError("images", len(images), f"the prompt has {len(runs)} image placeholder(s)")
        spans, first = [], 0
        for (start, end), g, im in zip(runs, grid, images):
            t, h, w = (int(x) for x in g)
            if end - start != t * h * w // self.merge**2:
                raise InvalidRequestError("images", im.source, "placeholder count does not match the image grid")
            spans.append(ImageSpan(start, end, im.content_hash, im.source,
                                   inputs["pixel_values"][first : first + t * h * w], (t, h, w)))
            first += t * h * w
        mx.eval([s.pixel_values for s in spans])  # nothing lazy outlives the call (it may be another thread's)
        pos, delta = self._lm.get_rope_index(mx.array([ids]), mx.array(grid))
        positions = np.asarray(pos[:, 0, :]).astype(np.int64)
        return MultimodalPrompt(ids, MultimodalInputs(tuple(spans), positions, int(np.asarray(delta).reshape(-1)[0])))

    # -- the forward pieces -----------------------------------------------------------------------
    def encode_images(self, spans: Sequence[ImageSpan]) -> list[mx.array]:
        """Vision-tower features of each image, in one batched call: ``[tokens, hidden]``, or ``[1 + K, tokens,
        hidden]`` where the tower also gives K deepstack levels (Qwen3-VL: features added to the hidden states of the
        language model's first K layers at the image's positions)."""
        dtype = self.model.vision_tower.patch_embed.proj.weight.dtype
        pixels = mx.concatenate([s.pixel_values for s in spans], axis=0).astype(dtype)
        grid = mx.array([s.grid_thw for s in spans])
        feats = self.model.vision_tower(pixels, grid, output_hidden_states=False)
        if isinstance(feats, tuple):  # (features, deepstack levels)
            main, deep = feats
            feats = mx.stack([main, *deep]) if deep else main
        axis = feats.ndim - 2
        sizes = np.cumsum([s.end - s.start for s in spans])[:-1].tolist()
        return list(mx.split(feats, sizes, axis=axis)) if sizes else [feats]

    def embed(self, inputs: mx.array) -> mx.array:
        return self._lm.model.embed_tokens(inputs)

    def body(self, inputs: mx.array, embeds: mx.array, cache: Any, positions: mx.array,
             deepstack: tuple[mx.array, list[mx.array]] | None = None) -> mx.array:
        """Hidden states of the text body over ``embeds`` at multimodal ``positions`` ``[3, rows, T]``;
        ``deepstack``: the image positions ``[rows, T]`` and, per level, their features in row-major order."""
        if deepstack is None:
            return self._lm.model(inputs, inputs_embeds=embeds, cache=cache, position_ids=positions)
        mask, levels = deepstack
        return self._lm.model(inputs, inputs_embeds=embeds, cache=cache, position_ids=positions,
                              visual_pos_masks=mask, deepstack_visual_embeds=levels)


def place_images(messages: list[dict[str, Any]]) -> int:
    """Each user message whose text holds ``IMAGE_MARKER``: its content becomes text and image parts, an image where
    each marker was (mlx-vlm's chat helper keeps such parts where they are). Returns the markers placed."""
    placed = 0
    for m in messages:
        content = m.get("content")
        if m.get("role", "user") != "user" or not isinstance(content, str) or IMAGE_MARKER not in content:
            continue
        pieces = content.split(IMAGE_MARKER)
        parts: list[dict[str, Any]] = []
        for i, text in enumerate(pieces):
            if i:
                parts.append({"type": "image"})
            if text:
                parts.append({"type": "text", "text": text})
        m["content"] = parts
        placed += len(pieces) - 1
    return placed


def _runs(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    return runs


def is_vlm_folder(path: Path) -> bool:
    try:
        return "vision_config" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False


def load_vlm(path: Path, trust_remote_code: bool = False) -> VisionLanguageModel:
    """Load a vision-language checkpoint through mlx-vlm (model, processor) and its tokenizer through mlx-lm."""
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.utils import load as vlm_load

    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") not in SUPPORTED_VLM_TYPES:
        raise ModelLoadError(f"model={str(path)!r}: vision-language model type {config.get('model_type')!r} is not "
                             f"supported (supported: {', '.join(SUPPORTED_VLM_TYPES)})")
    try:
        model, processor = vlm_load(str(path), trust_remote_code=trust_remote_code)
        tokenizer = load_tokenizer(path, {"trust_remote_code": trust_remote_code},
                                   eos_token_ids=config.get("eos_token_id"))
    except Exception as exc:
        raise ModelLoadError(f"model={str(path)!r}: could not be loaded by mlx-vlm: {type(exc).__name__}: {exc}") from exc
    return VisionLanguageModel(model, processor, tokenizer, config)


def processor_identity(path: Path) -> str:
    """A hash of the image processing configuration (it changes what the model sees, so it is part of keys)."""
    h = hashlib.sha256()
    for name in ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json"):
        f = path / name
        if f.exists():
            h.update(name.encode() + f.read_bytes())
    return h.hexdigest()[:16]
