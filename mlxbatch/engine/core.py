"""EngineCore: the step loop (schedule -> execute -> update), written once.

Owns the requests in flight and turns submissions into sequences (``n`` samples become ``n`` sequences
with derived seeds) after validating them. ``step()`` is the only place where the scheduler, the runner
and the requests meet. ``AsyncEngineCore`` drives the same loop from asyncio on one dedicated thread.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mlxbatch.config import EngineConfig
from mlxbatch.engine.decoding.detok import TextTracker
from mlxbatch.engine.decoding.sampling import derive_seed, uniform_for
from mlxbatch.engine.decoding.structured import GrammarCompiler, short_value
from mlxbatch.engine.model.loader import LoadedModel
from mlxbatch.engine.model.worker import Worker
from mlxbatch.engine.request import Request
from mlxbatch.engine.runner import ModelRunner
from mlxbatch.engine.sched.scheduler import Scheduler, SchedulerConfig
from mlxbatch.engine.vision.adapter import MultimodalPrompt
from mlxbatch.engine.warmup import warm_up_paths
from mlxbatch.errors import EngineClosedError, InvalidRequestError, OutOfMemoryError
from mlxbatch.types import ImageInput, RequestOutput, RequestTimings, SamplingParams, StreamDelta

log = logging.getLogger(__name__)

Prompt = str | Sequence[int] | Sequence[dict[str, Any]] | MultimodalPrompt
_SCORE_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)  # scoring generates nothing; greedy, no seed


@dataclass
class _Group:
    """A submitted request: its ``n`` sequences and what the caller asked to see."""

    request_id: str
    sequences: list[Request]
    stream: bool
    arrival: float = field(default_factory=time.perf_counter)

    @property
    def finished(self) -> bool:
        return all(s.status.finished for s in self.sequences)

    def output(self) -> RequestOutput:
        first = self.sequences[0]
        sched = [s.first_scheduled for s in self.sequences if s.first_scheduled is not None]
        toks = [s.first_token for s in self.sequences if s.first_token is not None]
        ends = [s.finished_at for s in self.sequences if s.finished_at is not None]
        timings = RequestTimings(self.arrival, min(sched, default=None), min(toks, default=None),
                                 max(ends) if self.finished and ends else None)
        return RequestOutput(self.request_id, first.num_prompt_tokens,
                             tuple(s.completion() for s in self.sequences), timings, self.finished,
                             cached_tokens=first.num_cached_tokens)


def encode_prompt(tok: Any, prompt: Prompt) -> list[int]:
    """Token ids of a prompt with tokenizer ``tok``: text, token ids, or chat messages (the chat template)."""
    if isinstance(prompt, str):
        return list(tok.encode(prompt))
    items = list(prompt)
    if items and all(isinstance(m, dict) for m in items):
        if getattr(tok, "chat_template", None) is None:
            raise InvalidRequestError("prompt", "<messages>", "the model's tokenizer has no chat template")
        try:
            ids = tok.apply_chat_template(items, add_generation_prompt=True, tokenize=True)
        except Exception as exc:
            raise InvalidRequestError("prompt", "<messages>", f"chat template failed: {exc}") from exc
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [int(t) for t in items]
    raise InvalidRequestError("prompt", type(prompt).__name__,
                              "expected a string, a list of token ids or a list of chat messages")


class EngineCore:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 worker: Worker | None = None) -> None:
        self.config = config or EngineConfig()
        self.loaded = loaded
        self.worker = worker or Worker(loaded)
        budget = self.config.kv_budget_bytes or self.worker.kv_budget_bytes(self.config.kv_memory_fraction)
        cache_bytes = 0
        if self.config.prefix_cache:
            cache_bytes = self.config.prefix_cache_bytes or min(budget // 4, 2 << 30)
        self.runner = ModelRunner(loaded.model, self.worker.geometry, cache_bytes, vlm=loaded.vlm,
                                  vision_cache_bytes=self.config.vision_cache_bytes)
        step_tokens = self.config.max_num_batched_tokens or (2048 if self.worker.device.kind == "cpu" else 8192)
        self.scheduler = Scheduler(
            SchedulerConfig(self.config.max_num_seqs, step_tokens,
                            self.config.prefill_chunk_size, budget),
            self.runner.kv_cost,
            self.runner.lookup_prefix if self.runner.prefix is not None else None,
            self.runner.prefix_in_progress if self.runner.prefix is not None else None,
        )
        self._groups: dict[str, _Group] = {}
        self._seqs: dict[str, Request] = {}
        self._ids = itertools.count()
        self._closed = False
        tok = loaded.tokenizer
        self._eos = frozenset(int(t) for t in (tok.eos_token_ids or ()))
        self._vocab_size = len(tok._tokenizer)
        self._compiler: GrammarCompiler | None = None
        if self.config.warm_up:
            self.worker.warm_up()
            if self.worker.device.kind != "cpu":  # GPU kernels compile on first use: not inside the first real steps
                warm_up_paths(loaded, self.config, self.worker)

    @property
    def compiler(self) -> GrammarCompiler:
        """Compiles output constraints for this model's tokenizer (built on first use, then cached)."""
        if self._compiler is None:
            width = self.loaded.config.get("vocab_size") or self._vocab_size
            try:
                self._compiler = GrammarCompiler(self.loaded.tokenizer, width, self._eos)
            except (ValueError, TypeError) as exc:  # e.g. a slow (non-Rust) tokenizer
                raise InvalidRequestError("constraint", "<any>",
                                          f"this model's tokenizer does not support constrained decoding: {exc}") from exc
        return self._compiler

    # -- submission ----------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: text, token ids, or chat messages (rendered with the chat template)."""
        return encode_prompt(self.loaded.tokenizer, prompt)

    def encode_images(self, prompt: Prompt, images: Sequence[ImageInput]) -> MultimodalPrompt:
        """Token ids and image inputs of a prompt with images; a text-only model refuses them (InvalidRequestError)."""
        if self.loaded.vlm is None:
            raise InvalidRequestError("images", ", ".join(im.source or "<image>" for im in images),
                                      f"model {self.loaded.spec.model!r} is text-only and cannot take images")
        if isinstance(prompt, MultimodalPrompt) or (not isinstance(prompt, str) and
                                                    not all(isinstance(m, dict) for m in prompt)):
            raise InvalidRequestError("prompt", type(prompt).__name__, "with images, give text or chat messages")
        return self.loaded.vlm.encode(prompt, images)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, stream: bool = False, cache_tokens: int | None = None,
                    images: Sequence[ImageInput] = ()) -> str:
        """Validate and queue one request; raises InvalidRequestError (the engine goes on) if it cannot run.

        ``cache_tokens`` is the plan's retention for this prompt: how many of its leading tokens later requests
        share (their KV is kept in the prefix cache, longer cached prefixes of it are dropped once it is
        admitted). None (no plan) caches every full block and evicts least recently used first.
        ``images`` go with a text or chat prompt (vision-language models); ``prompt`` may also be a
        ``MultimodalPrompt`` that ``encode_images`` made.
        """
        if self._closed:
            raise EngineClosedError("the engine has shut down")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params", type(params).__name__, "expected SamplingParams")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._groups:
            raise InvalidRequestError("request_id", request_id, "already in flight")
        mm = None
        if images:
            prompt = self.encode_images(prompt, images)
        if isinstance(prompt, MultimodalPrompt):
            ids, mm = prompt.token_ids, prompt.mm
        else:
            ids = self.encode(prompt)
        ctx = self.loaded.context_length
        self._check_ids(ids, "prompt", prompt)
        if params.constraint is not None and (reason := self.compiler.check(params.constraint)) is not None:
            raise InvalidRequestError("constraint", short_value(params.constraint), reason)
        seed = params.seed
        if seed is None:
            seed = (int(uniform_for(self.config.seed, hash(request_id) & 0xFFFFFFFF) * (1 << 53))
                    if self.config.seed is not None else secrets.randbits(63))
        incremental = stream or bool(params.stop)
        # sample 0 prefills the prompt; samples 1..n-1 fork its KV when that prefill ends (prefill once)
        seqs = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}", group_id=request_id, index=i,
                prompt_token_ids=ids, params=params, seed=derive_seed(seed, i), eos_token_ids=self._eos,
                max_context=ctx, cache_tokens=cache_tokens, mm=mm,
                # samples 1..n-1 fork sample 0's KV (text rows; an image row's samples prefill on their own)
                fork_parent=f"{request_id}#0" if i and mm is None else None,
                text=TextTracker(self.loaded.tokenizer, params.stop, params.include_stop_str_in_output,
                                 incremental, self._vocab_size),
            )
            for i in range(params.n)
        ]
        self._groups[request_id] = _Group(request_id, seqs, stream)
        for s in seqs:
            self._seqs[s.request_id] = s
            if params.constraint is not None:
                self.runner.grammars.set(s.request_id, self.compiler.matcher(params.constraint))
            self.scheduler.add(s)
        return request_id

    def _check_ids(self, ids: list[int], what: str, shown: Any, room: int = 1) -> None:
        ctx = self.loaded.context_length
        if not ids:
            raise InvalidRequestError(what, shown if isinstance(shown, str) else "[]", "is empty")
        if len(ids) > ctx - room:
            raise InvalidRequestError(what, f"<{len(ids)} tokens>", f"is longer than the model's context ({ctx} "
                                      f"tokens{', room for one more' if room else ''})")
        vocab = self.loaded.config.get("vocab_size") or self._vocab_size
        if max(ids) >= vocab or min(ids) < 0:
            raise InvalidRequestError(what, f"token id {max(ids)}", f"outside the vocabulary (size {vocab})")

    def add_score_request(self, context: Prompt, continuations: Sequence[str | Sequence[int]],
                          request_id: str | None = None) -> str:
        """Queue the scoring of each continuation after ``context``: log-probability per token, their sum and
        whether each token is the greedy choice (the output's completions, in order; nothing is generated).

        Context and continuations are tokenized separately (a continuation's leading space stays its own), so
        every candidate is scored on the same context tokens. The candidates share the context's KV through the
        prefix cache: the first computes it, the others wait for its blocks and reuse them.
        """
        if self._closed:
            raise EngineClosedError("the engine has shut down")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._groups:
            raise InvalidRequestError("request_id", request_id, "already in flight")
        ctx_ids = self.encode(context)
        self._check_ids(ctx_ids, "context", context, room=0)
        if isinstance(continuations, str) or not continuations:
            raise InvalidRequestError("candidates", continuations if isinstance(continuations, str) else "[]",
                                      "expected a non-empty list of continuations")
        tok = self.loaded.tokenizer
        seqs = []
        for i, cont in enumerate(continuations):
            ids = list(tok.encode(cont, add_special_tokens=False)) if isinstance(cont, str) else [int(t) for t in cont]
            if not ids:
                raise InvalidRequestError(f"candidates[{i}]", cont, "is empty")
            self._check_ids(ctx_ids + ids, f"context + candidates[{i}]", cont, room=0)
            seqs.append(Request(
                request_id=f"{request_id}#{i}", group_id=request_id, index=i, prompt_token_ids=ctx_ids + ids,
                params=_SCORE_PARAMS, seed=0, eos_token_ids=self._eos, max_context=self.loaded.context_length,
                text=TextTracker(tok, (), False, False, self._vocab_size), score_from=len(ctx_ids)))
        self._groups[request_id] = _Group(request_id, seqs, False)
        for s in seqs:
            self._seqs[s.request_id] = s
            self.scheduler.add(s)
        return request_id

    def abort(self, request_id: str) -> None:
        group = self._groups.get(request_id)
        if group is None:
            return
        gone = self.scheduler.abort([s.request_id for s in group.sequences])
        self.runner.free([s.request_id for s in gone])

    @property
    def has_unfinished(self) -> bool:
        return bool(self._groups)

    # -- the step loop -------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """One engine step; returns text deltas (streamed requests) and one final delta per finished request."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if out.empty:
            return self._collect([])
        now = time.perf_counter()
        for req in [c.request for c in out.prefills] + [child for _, child in out.forks]:
            if req.first_scheduled is None:
                req.first_scheduled = now
        try:
            sampled = self.runner.execute(out)
        except OutOfMemoryError as exc:
            log.warning("step failed for lack of memory (%s); shrinking the batch", exc)
            self.runner.free([r.request_id for r in self.scheduler.preempt_for_memory(out)])
            self.worker.shutdown()  # frees MLX's buffer cache
            return []
        touched = []
        for rid, (scores, greedy) in self.runner.scored.items():
            self._seqs[rid].add_scores(scores, greedy)
        for chunk in out.prefills:
            if chunk.last and chunk.request.score_from is not None:
                chunk.request.finish_scored()
                touched.append(chunk.request)
        for rid, tok in sampled.items():
            req = self._seqs[rid]
            req.append(tok.token_id, tok.logprob, force_stop=self.runner.grammars.done(rid))
            touched.append(req)
        finished = self.scheduler.finish_step(out)
        self.runner.free([r.request_id for r in finished])
        prof = self.runner.profile
        prof.steps += 1
        prof.total_s += time.perf_counter() - t0
        return self._collect(touched)

    def _collect(self, touched: list[Request]) -> list[StreamDelta]:
        deltas: list[StreamDelta] = []
        for req in touched:
            group = self._groups[req.group_id]
            if group.stream:
                text = req.text.delta(final=req.status.finished)
                if text or req.status.finished:
                    deltas.append(StreamDelta(group.request_id, req.index, text, (req.output_token_ids[-1],),
                                              req.finish_reason))
        for gid in [g for g, grp in self._groups.items() if grp.finished]:
            group = self._groups.pop(gid)
            for s in group.sequences:
                self._seqs.pop(s.request_id, None)
                self.runner.grammars.set(s.request_id, None)
            deltas.append(StreamDelta(gid, -1, "", (), group.sequences[0].finish_reason, group.output()))
        return deltas

    def run_until_done(self) -> list[RequestOutput]:
        outputs = []
        while self.has_unfinished:
            outputs += [d.output for d in self.step() if d.output is not None]
        return outputs

    def shutdown(self) -> None:
        for gid in list(self._groups):
            self.abort(gid)
        self._groups.clear()
        self._closed = True
        self.worker.shutdown()

    def _prefix_stats(self) -> dict[str, int] | None:
        if self.runner.prefix is None:
            return None
        st = self.runner.prefix.stats()
        live = self.runner.reuse.live_tokens_reused if self.runner.reuse is not None else 0
        st["tokens_reused_live"] = live  # copied from running rows, to the token
        st["tokens_reused"] += live
        return st

    def stats(self) -> dict[str, Any]:
        return {"profile": self.runner.profile.as_dict(), "kv_budget_bytes": self.scheduler.kv_budget_bytes,
                "kv_bytes": self.runner.kv_bytes, "preemptions": self.scheduler.num_preemptions,
                "prefix_cache": self._prefix_stats(),
                "vision_cache": self.runner.mm.stats() if self.runner.mm is not None else None,
                "device": self.worker.device.kind}

