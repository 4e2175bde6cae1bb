"""Request intake: submissions -> validated sequences (``RequestIntake``; the engine core holds one).

A prompt is encoded (text, token ids, chat messages, images) and checked against the model's context and vocabulary,
an output constraint against the grammar compiler. ``n`` samples become ``n`` sequences with derived seeds (a text
prompt is prefilled once: samples 1..n-1 fork sample 0's KV); a score request's candidates become one sequence, or one
each. A request's sequences form a ``RequestGroup``, which the engine core queues, and its step loop finishes and
reports (``engine.core``). Owns the model's token facts (EOS, specials, vocabulary), the grammar compiler and the
request ids it hands out; nothing is queued here, so a refused request leaves nothing behind.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

from mlxbatch.engine.decoding.detok import TextTracker, TokenText
from mlxbatch.engine.decoding.sampling import derive_seed, uniform_for
from mlxbatch.engine.decoding.structured import GrammarCompiler, short_value
from mlxbatch.engine.inputs import Prompt, encode_prompt
from mlxbatch.engine.model.loader import LoadedModel
from mlxbatch.engine.request import Request
from mlxbatch.engine.sched.blocks import BLOCK_SIZE, stable_hash
from mlxbatch.engine.vision.adapter import MultimodalPrompt
from mlxbatch.errors import InvalidRequestError
from mlxbatch.types import ImageInput, RequestOutput, RequestTimings, SamplingParams

_SCORE_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)  # scoring generates nothing; greedy, no seed


@dataclass(slots=True)
class RequestGroup:
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
        finished = self.finished
        if len(self.sequences) == 1:  # (most requests: the same figures without the scans)
            timings = RequestTimings(self.arrival, first.first_scheduled, first.first_token,
                                     first.finished_at if finished else None)
            completions = tuple(first.completions())
        else:
            sched = [s.first_scheduled for s in self.sequences if s.first_scheduled is not None]
            toks = [s.first_token for s in self.sequences if s.first_token is not None]
            ends = [s.finished_at for s in self.sequences if s.finished_at is not None]
            timings = RequestTimings(self.arrival, min(sched, default=None), min(toks, default=None),
                                     max(ends) if finished and ends else None)
            completions = tuple(c for s in self.sequences for c in s.completions())
        # a score request's prompt is its context (each candidate sequence runs context + candidate)
        prompt = first.score_from if first.score_from is not None else first.num_prompt_tokens
        return RequestOutput(self.request_id, prompt, completions, timings, finished,
                             cached_tokens=first.num_cached_tokens)


class RequestIntake:
    """Validates submissions for one model and makes their sequences (``request``, ``score_request``).
    ``seed``: the engine's seed (``EngineConfig.seed``), from which unseeded requests get theirs."""

    def __init__(self, loaded: LoadedModel, seed: int | None) -> None:
        self.loaded = loaded
        self._seed = seed
        self._ids = itertools.count()
        tok = loaded.tokenizer
        self.eos = frozenset(int(t) for t in (tok.eos_token_ids or ()))
        self._vocab_size = len(tok._tokenizer)
        hidden = frozenset(int(t) for t in (getattr(tok, "all_special_ids", None) or ()))
        stream = tok.detokenizer
        byte_level = stream.tokenmap if isinstance(stream, BPEStreamingDetokenizer) else None
        # generated tokens' text rules, shared by every sequence
        self._text = TokenText(tok, hidden, self._vocab_size, byte_level)
        self._compiler: GrammarCompiler | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        """Compiles output constraints for this model's tokenizer (built on first use, then cached)."""
        if self._compiler is None:
            width = self.loaded.config.get("vocab_size") or self._vocab_size
            try:
                self._compiler = GrammarCompiler(self.loaded.tokenizer, width, self.eos)
            except (ValueError, TypeError) as exc:  # e.g. a slow (non-Rust) tokenizer
                msg = f"this model's tokenizer does not support constrained decoding: {exc}"
                raise InvalidRequestError("constraint", "<any>", msg) from exc
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

    def request(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None, stream: bool,
                cache_tokens: int | None, images: Sequence[ImageInput], taken: Container[str],
                block_hashes: Sequence[int] | None = None) -> RequestGroup:
        """Validate one request and make its sequences; raises InvalidRequestError (the engine goes on) if it cannot
        run. ``taken``: the request ids in flight (a given id must not be one).

        ``block_hashes``: the prompt's ``prompt_block_hashes`` (a text prompt's), computed by a caller off the step
        loop (a job's feed); the prefix index takes them instead of hashing the prompt on the step loop. They must be
        that function's of these token ids: other values make the prefix cache reuse another prompt's KV (only their
        count is checked).

        ``cache_tokens`` is the plan's retention for this prompt: how many of its leading tokens later requests
        share (their KV is kept in the prefix cache, longer cached prefixes of it are dropped once it is
        admitted). None (no plan) caches every full block and evicts least recently used first.
        ``images`` go with a text or chat prompt (vision-language models); ``prompt`` may also be a
        ``MultimodalPrompt`` that ``encode_images`` made.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params", type(params).__name__, "expected SamplingParams")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in taken:
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
        if block_hashes is not None and (mm is not None or len(block_hashes) != len(ids) // BLOCK_SIZE):
            raise InvalidRequestError("block_hashes", f"<{len(block_hashes)} hashes>",
                                      f"expected {len(ids) // BLOCK_SIZE} (prompt_block_hashes of the prompt's "
                                      f"{len(ids)} token ids){'; a prompt with images has none' if mm else ''}")
        if params.constraint is not None and (reason := self.compiler.check(params.constraint)) is not None:
            raise InvalidRequestError("constraint", short_value(params.constraint), reason)
        seed = params.seed
        if seed is None and params.greedy:
            seed = 0  # (greedy draws read no seed)
        elif seed is None:
            seed = (int(uniform_for(self._seed, stable_hash(request_id) & 0xFFFFFFFF) * (1 << 53))
                    if self._seed is not None else secrets.randbits(63))
        incremental = stream or bool(params.stop)
        seqs = sample_sequences(request_id, ids, params, seed, self.eos, ctx, cache_tokens, mm,
                                lambda: TextTracker(self._text, params.stop, params.include_stop_str_in_output,
                                                    incremental), block_hashes)
        return RequestGroup(request_id, seqs, stream)

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

    def score_request(self, context: Prompt, continuations: Sequence[str | Sequence[int]], request_id: str | None,
                      cache_tokens: int | None, taken: Container[str]) -> RequestGroup:
        """The scoring of each continuation after ``context``: log-probability per token, their sum and
        whether each token is the greedy choice (the output's completions, in order; nothing is generated).

        Context and continuations are tokenized separately (a continuation's leading space stays its own), so
        every candidate is scored on the same context tokens. When every candidate is one token, they are one
        sequence: the context's last position scores each (the context computed once, no candidate token run).
        Otherwise each candidate is a sequence of its own; they share the context's KV through the prefix cache:
        the first computes it, the others wait for its blocks and reuse them. ``cache_tokens``: the
        plan's retention of the context (what the next row's context shares with it), as for ``add_request``.
        """
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in taken:
            raise InvalidRequestError("request_id", request_id, "already in flight")
        ctx_ids = self.encode(context)
        self._check_ids(ctx_ids, "context", context, room=0)
        if isinstance(continuations, str) or not continuations:
            raise InvalidRequestError("candidates", continuations if isinstance(continuations, str) else "[]",
                                      "expected a non-empty list of continuations")
        tok = self.loaded.tokenizer
        cands = []
        for i, cont in enumerate(continuations):
            ids = continuation_ids(tok, cont)
            if not ids:
                raise InvalidRequestError(f"candidates[{i}]", cont, "is empty")
            self._check_ids(ctx_ids + ids, f"context + candidates[{i}]", cont, room=0)
            cands.append(ids)
        seqs = score_sequences(request_id, ctx_ids, cands, self.eos, self.loaded.context_length, cache_tokens,
                               lambda: TextTracker(self._text, (), False, False))
        return RequestGroup(request_id, seqs, False)


def continuation_ids(tokenizer: Any, continuation: str | Sequence[int]) -> list[int]:
    """A score request's continuation as token ids: text tokenized on its own (its leading space stays its own token),
    ids as given."""
    if isinstance(continuation, str):
        return list(tokenizer.encode(continuation, add_special_tokens=False))
    return [int(t) for t in continuation]


def sample_sequences(request_id: str, ids: list[int], params: SamplingParams, seed: int, eos: frozenset[int],
                     max_context: int, cache_tokens: int | None, mm: Any,
                     text: Callable[[], TextTracker], block_hashes: Sequence[int] | None = None) -> list[Request]:
    """A validated request's ``n`` sequences (``text`` makes each one's text tracker): sample 0 prefills the prompt;
    samples 1..n-1 fork its KV when that prefill ends (prefill once; an image row's samples prefill on their own)."""
    return [
        Request(
            request_id=request_id if params.n == 1 else f"{request_id}#{i}", group_id=request_id, index=i,
            prompt_token_ids=ids, params=params, seed=derive_seed(seed, i), eos_token_ids=eos,
            max_context=max_context, cache_tokens=cache_tokens, mm=mm, prompt_hashes=block_hashes,
            fork_parent=f"{request_id}#0" if i and mm is None else None, text=text())
        for i in range(params.n)
    ]


def score_sequences(request_id: str, ctx_ids: list[int], cands: list[list[int]], eos: frozenset[int],
                    max_context: int, cache_tokens: int | None, text: Callable[[], TextTracker]) -> list[Request]:
    """A validated score request's sequences: one when every candidate is one token (the context's last logits score
    them all), else one per candidate (context + candidate), sharing the context through the prefix cache."""

    def sequence(i: int, ids: list[int], score_tokens: tuple[int, ...] = ()) -> Request:
        return Request(
            request_id=f"{request_id}#{i}", group_id=request_id, index=i, prompt_token_ids=ctx_ids + ids,
            params=_SCORE_PARAMS, seed=0, eos_token_ids=eos, max_context=max_context, text=text(),
            score_from=len(ctx_ids), score_tokens=score_tokens, cache_tokens=cache_tokens)

    if all(len(ids) == 1 for ids in cands):
        return [sequence(0, [], tuple(ids[0] for ids in cands))]
    return [sequence(i, ids) for i, ids in enumerate(cands)]
