"""Vision-language rows in the batched forward: per-row input embeddings and multimodal RoPE positions.

Owns, for a vision-language model, what one forward over a range of slot rows feeds the language model instead of
token ids: each row's embeddings (token embeddings, with the vision tower's features at the positions of its image
placeholders) and each row's positions ``[3, rows, T]``. Prompt positions come from the request's
``MultimodalInputs`` (``get_rope_index``); every later position ``p`` (generated tokens, a recomputed tail) sits at
``p + rope_delta``; text-only rows use plain positions. The slot cache's per-row offsets are KV indices, not RoPE
positions, so positions are always passed explicitly and the cache only places keys.

Image features come from the content-keyed ``VisionCache``; the images a step still needs are encoded in one batched
vision-tower call. Where the tower also gives deepstack levels (Qwen3-VL: an image's features are ``[1 + levels,
tokens, hidden]``), the forward passes the image positions it covers and those levels' slices, in row-major order, for
the language model to add to its first layers' hidden states. A request holds its images' features from the step that
first needs them until its prefill has passed them (or it is freed), so a long prompt prefilled in several chunks
looks each image up once and never loses it to eviction halfway. Called only by the runner; never patches mlx-vlm.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbatch.engine.request import Request
from mlxbatch.engine.vision.adapter import ImageSpan, VisionLanguageModel
from mlxbatch.engine.vision.cache import DEFAULT_BUDGET_BYTES, VisionCache

Body = Callable[..., mx.array]


@dataclass(frozen=True)
class RowInput:
    """One row of a forward: its sequence, the index of its first new token and how many new tokens are real
    (the rest of the forward's width is padding)."""

    request: Request
    start: int
    length: int


@dataclass(frozen=True)
class _Need:
    row: int
    request_id: str
    index: int  # the image's index in the request
    span: ImageSpan


class VisionLanguageRows:
    def __init__(self, vlm: VisionLanguageModel, cache_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.vlm = vlm
        self.cache = VisionCache(cache_bytes)
        self._held: dict[str, dict[int, mx.array]] = {}  # request id -> image index -> features

    def body(self, rows: Sequence[RowInput]) -> Body:
        """The body callable for one forward over ``rows`` (``fn(inputs, cache=...) -> hidden states``)."""

        def fn(inputs: mx.array, cache: Any = None) -> mx.array:
            n, T = inputs.shape
            embeds = self.vlm.embed(inputs)
            feats = self._features(rows, T)
            mask = None  # the image positions whose deepstack levels this forward passes (Qwen3-VL)
            deep: list[mx.array] = []  # those levels of each image slice, in row-major order of ``mask``
            for need, f in sorted(feats, key=lambda nf: (nf[0].row, nf[0].span.start)):
                r = rows[need.row]
                a, b = max(need.span.start, r.start), min(need.span.end, r.start + min(T, r.length))
                part = slice(a - need.span.start, b - need.span.start)
                embeds[need.row, a - r.start : b - r.start, :] = f[part] if f.ndim == 2 else f[0, part]
                if f.ndim == 3:
                    mask = np.zeros((n, T), dtype=bool) if mask is None else mask
                    mask[need.row, a - r.start : b - r.start] = True
                    deep.append(f[1:, part])
            levels = [mx.concatenate([d[k] for d in deep]) for k in range(deep[0].shape[0])] if deep else None
            return self.vlm.body(inputs, embeds, cache, mx.array(self._positions(rows, T)),
                                 deepstack=(mx.array(mask), levels) if levels else None)

        return fn

    @staticmethod
    def _positions(rows: Sequence[RowInput], T: int) -> np.ndarray:
        pos = np.empty((3, len(rows), T), dtype=np.int32)
        steps = np.arange(T)
        for i, r in enumerate(rows):
            p = r.start + steps
            mm = r.request.mm
            if mm is None:
                pos[:, i, :] = p
                continue
            n = mm.positions.shape[1]
            inside = p < n
            pos[:, i, :] = p + mm.rope_delta
            if inside.any():
                pos[:, i, inside] = mm.positions[:, p[inside]]
        return pos

    def _features(self, rows: Sequence[RowInput], T: int) -> list[tuple[_Need, mx.array]]:
        """Features of every image a row of this forward covers: held, cached, or encoded now (batched)."""
        needs = [
            _Need(i, r.request.request_id, k, s)
            for i, r in enumerate(rows) if r.request.mm is not None
            for k, s in enumerate(r.request.mm.images)
            if s.start < r.start + min(T, r.length) and s.end > r.start
        ]
        if not needs:
            return []
        found: dict[str, mx.array] = {}
        todo: list[ImageSpan] = []
        repeats: list[str] = []
        for need in needs:
            h = need.span.content_hash
            held = self._held.get(need.request_id, {}).get(need.index)
            if held is not None:
                found.setdefault(h, held)
            elif h in found or any(s.content_hash == h for s in todo):
                repeats.append(h)  # a second row with this image in the same step: encoded once
            else:
                f = self.cache.get(h)
                if f is None:
                    todo.append(need.span)
                else:
                    found[h] = f
        if todo:
            t0 = time.perf_counter()
            encoded = self.vlm.encode_images(todo)
            mx.eval(encoded)
            took = time.perf_counter() - t0
            total = sum(s.end - s.start for s in todo)
            for s, f in zip(todo, encoded):
                self.cache.put(s.content_hash, f, took * (s.end - s.start) / total)
                found[s.content_hash] = f
        for h in repeats:
            self.cache.get(h)  # counted as a hit: the encoder ran once for both rows
        out = []
        for need in needs:
            f = found[need.span.content_hash]
            r = rows[need.row]
            if need.span.end > r.start + r.length:  # the image continues in the next chunk: keep its features
                self._held.setdefault(need.request_id, {})[need.index] = f
            else:
                held = self._held.get(need.request_id)
                if held is not None:
                    held.pop(need.index, None)
                    if not held:
                        del self._held[need.request_id]
            out.append((need, f))
        return out

    def free(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def stats(self) -> dict[str, Any]:
        return {**self.cache.stats(), "held_requests": len(self._held)}
