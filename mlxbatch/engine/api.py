"""The Python API: ``Engine.generate`` (outputs in input order) and ``Engine.stream``.

Owns nothing but the convenience: an ``EngineCore`` does the work. Loads the model through the shared
registry, so two engines on the same model hold one copy of the weights.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from tqdm import tqdm

from mlxbatch.config import EngineConfig
from mlxbatch.engine.core import EngineCore, Prompt
from mlxbatch.engine.kv import LayoutOptions
from mlxbatch.engine.model.loader import LoadedModel, ModelSpec
from mlxbatch.engine.model.registry import REGISTRY
from mlxbatch.engine.sched.planner import Submission, plan, submission_order
from mlxbatch.errors import InvalidRequestError
from mlxbatch.types import ImageInput, RequestOutput, SamplingParams, StreamDelta

_engine_ids = itertools.count()


class Engine:
    """A model plus a continuous-batching engine.

    >>> engine = Engine("smollm2")
    >>> engine.generate(["Hi!"], SamplingParams(max_tokens=8))[0].text
    """

    def __init__(self, model: str | LoadedModel, config: EngineConfig | None = None, *, dtype: str = "auto",
                 adapter_path: str | None = None, trust_remote_code: bool = False,
                 layout: LayoutOptions | None = None, launch_thread: bool | None = None) -> None:
        """``layout``: the KV layout's options (None: what this device runs, ``paths.layout_for``); tests and
        diagnostics take another device's decisions with it, and with ``launch_thread`` (None: this device's,
        ``paths.uses_launch_thread``) whether steps are launched from a thread of their own."""
        self._user = f"engine-{next(_engine_ids)}"
        if isinstance(model, LoadedModel):
            self._spec = None
            loaded = model
        else:
            self._spec = ModelSpec(model, dtype, adapter_path, trust_remote_code)
            loaded = REGISTRY.acquire(self._spec, self._user)
        self.core = EngineCore(loaded, config, layout=layout, launch_thread=launch_thread)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer

    def _submit(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None,
                stream: bool, images: Sequence[Sequence[ImageInput]] | None = None) -> list[str]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)):
            prompts = [prompts]  # one prompt (text or one conversation), not a list of them
        if images is not None and len(images) != len(prompts):
            raise InvalidRequestError("images", f"<{len(images)} items>", f"expected one image list per prompt "
                                      f"({len(prompts)})")
        if params is None or isinstance(params, SamplingParams):
            per_row = [params or SamplingParams()] * len(prompts)
        else:
            per_row = list(params)
            if len(per_row) != len(prompts):
                raise InvalidRequestError("params", f"<{len(per_row)} items>",
                                          f"expected one SamplingParams or {len(prompts)} of them")
        encoded = [self.core.encode_images(p, images[i]) if images is not None and images[i] else self.core.encode(p)
                   for i, p in enumerate(prompts)]
        # The plan's order (engine/planner.py): rows sharing a prefix back to back along the token trie, each
        # keeping only the prefix KV later rows reuse; rows sharing nothing longest first, so neighbours batch
        # their prefill with little padding. Rows with images are submitted longest first, their KV cached LRU
        # (image placeholders look alike to the planner). Outputs still come back in input order.
        if stream:
            order = [Submission(i, None) for i in range(len(encoded))]
        elif self.core.config.prefix_cache and images is None:
            order = submission_order(plan(encoded, min_step_tokens=self.core.reuse_step))
        else:
            order = [Submission(i, None) for i in sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))]
        ids: dict[int, str] = {}
        try:
            for s in order:
                ids[s.index] = self.core.add_request(encoded[s.index], per_row[s.index], stream=stream,
                                                     cache_tokens=s.cache_tokens)
        except Exception:
            for rid in ids.values():  # all or nothing: a bad prompt leaves no half-submitted batch
                self.core.abort(rid)
            self.core.step()
            raise
        return [ids[i] for i in range(len(encoded))]

    def generate(self, prompts: Sequence[Prompt] | Prompt,
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, images: Sequence[Sequence[ImageInput]] | None = None) -> list[RequestOutput]:
        """Run every prompt (text, token ids or chat messages) and return outputs in input order.

        ``images``: one list of images per prompt (vision-language models; an empty list for a text prompt).
        """
        return self._wait(self._submit(prompts, params, stream=False, images=images), use_tqdm)

    def _wait(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request of ``ids`` finished; their outputs in that order."""
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), disable=not use_tqdm, unit="req")
        while len(done) < len(ids):
            for d in self.core.step():
                if d.output is not None and d.request_id in wanted:
                    done[d.request_id] = d.output
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]

    def score(self, items: Sequence[tuple[Prompt, Sequence[str | Sequence[int]]]],
              use_tqdm: bool = False) -> list[RequestOutput]:
        """Log-likelihood of candidate continuations: ``items`` = [(context, [candidate, ...]), ...].

        Each output's completions are the candidates in order: ``logprobs`` per token, ``cumulative_logprob``
        their sum, ``greedy`` whether every token is the model's greedy choice. Rows are submitted in trie order
        of their contexts, so a context shared by several rows (a few-shot prefix) is computed once.
        """
        ctx = [self.core.encode(c) for c, _ in items]
        ids: dict[int, str] = {}
        try:
            for i in sorted(range(len(items)), key=ctx.__getitem__):
                ids[i] = self.core.add_score_request(ctx[i], items[i][1])
        except Exception:
            for rid in ids.values():
                self.core.abort(rid)
            self.core.step()
            raise
        return self._wait([ids[i] for i in range(len(items))], use_tqdm)

    def stream(self, prompts: Sequence[Prompt] | Prompt,
               params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[StreamDelta]:
        """Yield text deltas as they are generated; each request ends with a delta carrying its output."""
        ids = set(self._submit(prompts, params, stream=True))
        left = len(ids)
        while left:
            for d in self.core.step():
                if d.request_id in ids:
                    yield d
                    if d.output is not None:
                        left -= 1

    def stats(self) -> dict:
        return self.core.stats()

    def close(self) -> None:
        self.core.shutdown()
        if self._spec is not None:
            REGISTRY.release(self._spec, self._user)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
