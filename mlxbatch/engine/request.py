"""One sequence's mutable state inside the engine.

Owns its token ids (prompt and generated), its text tracker, its status and timings. The scheduler decides
when it runs; the runner only reads its tokens. A submitted request with ``n`` samples becomes ``n``
sequences (``Request`` objects) sharing a ``group_id``.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mlxbatch.engine.decoding.detok import TextTracker
from mlxbatch.types import Completion, FinishReason, SamplingParams, TokenLogprob


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"  # admitted; computing KV for all its tokens in chunks
    DECODING = "decoding"  # KV holds all but its last token, which the next decode step feeds
    FINISHED = "finished"

    @property
    def finished(self) -> bool:
        return self is _FINISHED


_FINISHED = RequestStatus.FINISHED  # (a module name: on Python 3.11 an Enum's class attribute is a slow lookup)


@dataclass(eq=False, slots=True)
class Request:
    request_id: str  # unique per sequence: "<group id>" or "<group id>#<index>"
    group_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int]
    max_context: int
    text: TextTracker
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    num_computed_tokens: int = 0  # tokens whose KV exists (prefix cache included)
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    # n > 1: the sequence whose prefill this one shares (its KV is forked when that prefill ends); None once
    # forked, or when it has to prefill on its own
    fork_parent: str | None = None
    # scoring: the prompt's tokens from here on are a continuation to score (log-probabilities, no generation)
    score_from: int | None = None
    # scoring one-token candidates: the prompt is the context, and its last position scores each of these tokens
    # (one sequence for them all); empty: the prompt's own tokens from ``score_from`` on are scored
    score_tokens: tuple[int, ...] = ()
    score_greedy: list[bool] = field(default_factory=list)
    # prompt tokens later sequences will reuse (the plan's retention); None: unknown, cache every full block
    cache_tokens: int | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    finished_at: float | None = None
    mm: Any = None  # vision-language inputs (engine.vlm_model.MultimodalInputs), read only; None for text
    # the prompt's full blocks' chained hashes (``sched.blocks.prompt_block_hashes``), where the caller computed them
    # off the step loop (a job's feed); None: the prefix index hashes the prompt when it first needs to
    prompt_hashes: Sequence[int] | None = None
    plain_greedy: bool = field(init=False, default=False)  # set from ``params`` (see ``__post_init__``)
    # its draw reads its own earlier tokens on the host (penalties, min_tokens bans): a step that draws it must know
    # the token drawn before (it cannot be launched while that token is still on the device)
    needs_history: bool = field(init=False, default=False)
    pending: int = 0  # tokens drawn on the device and not appended yet (0 or 1: the step in flight drew one)
    # ``len(prompt_token_ids)``, kept as a plain attribute: a prompt never changes once its sequence is made, and the
    # scheduler reads its length for every running row every step
    num_prompt_tokens: int = field(init=False, default=0)
    # (token position, content hash) of the prompt's images: keys for the prefix cache's block hashes (from ``mm``)
    media: tuple[tuple[int, str], ...] = field(init=False, default=())
    # KV positions this sequence may need by the time it finishes (fixed once it is made: the scheduler reads it for
    # every running row when it admits)
    reserved_tokens: int = field(init=False, default=0)
    # generated tokens at which it ends by length: ``max_tokens`` or the context
    _length_limit: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if (self.params.logprobs is not None or self.score_from is not None) and self.logprobs is None:
            self.logprobs = []
        p = self.params
        # its next token is the argmax of its logits as they are: no penalty, no banned token, no logprobs
        self.plain_greedy = p.greedy and not p.has_penalties and p.min_tokens == 0 and p.logprobs is None
        self.needs_history = p.has_penalties or p.min_tokens > 0
        self.num_prompt_tokens = n = len(self.prompt_token_ids)
        self.media = self.mm.media if self.mm is not None else ()
        scoring = self.score_from is not None
        self.reserved_tokens = n if scoring else min(n + p.max_tokens, self.max_context)
        self._length_limit = min(p.max_tokens, self.max_context - n)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def score_targets(self) -> list[tuple[int, int]]:
        """(position, token) pairs this scoring sequence scores, in order: the position's logits give the token's
        log-probability (position ``p`` of the prompt predicts what follows it)."""
        assert self.score_from is not None
        n = self.num_prompt_tokens
        if self.score_tokens:
            return [(n - 1, t) for t in self.score_tokens]
        return [(p, self.prompt_token_ids[p + 1]) for p in range(self.score_from - 1, n - 1)]

    def unscored_targets(self) -> list[tuple[int, int]]:
        """``score_targets`` not scored yet: a sequence recomputed after an out-of-memory step keeps the scores it
        read, and its prefill scores each position once."""
        return self.score_targets()[len(self.score_greedy):]

    @property
    def has_score_siblings(self) -> bool:
        """A scoring sequence of one multi-token candidate: its request's other candidates reuse its context."""
        return self.score_from is not None and not self.score_tokens

    @property
    def length_done(self) -> bool:
        """Its tokens, with the one pending, reach ``max_tokens`` or the context: it will not be fed again."""
        return self.score_from is None and len(self.output_token_ids) + self.pending >= self._length_limit

    @property
    def banned_ids(self) -> tuple[int, ...]:
        if len(self.output_token_ids) >= self.params.min_tokens:
            return ()
        return tuple(sorted(self.eos_token_ids | set(self.params.stop_token_ids)))

    def append(self, token_id: int, logprob: TokenLogprob | None, force_stop: bool = False) -> FinishReason | None:
        """Add one sampled token; returns why the sequence finished, if it did.

        ``force_stop``: the output is complete (its grammar allows nothing more): it finishes with STOP.
        """
        if self.first_token is None:
            self.first_token = time.perf_counter()
        p = self.params
        is_eos = not p.ignore_eos and token_id in self.eos_token_ids
        if is_eos or token_id in p.stop_token_ids:
            self.text.flush()
            self.output_token_ids.append(token_id)  # counted, but never shown as text
            if self.logprobs is not None and logprob is not None:
                self.logprobs.append(logprob)
            return self._finish(FinishReason.STOP, token_id)
        self.output_token_ids.append(token_id)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
        hit = self.text.add(token_id)
        if hit is not None:
            return self._finish(FinishReason.STOP, hit.stop)
        if force_stop:
            self.text.flush()
            return self._finish(FinishReason.STOP, None)
        if len(self.output_token_ids) >= self._length_limit:
            self.text.flush()
            return self._finish(FinishReason.LENGTH, None)
        return None

    def add_scores(self, scores: list[TokenLogprob], greedy: list[bool]) -> None:
        """Log-probabilities of scored continuation tokens, in order (from the prefill chunk that saw them)."""
        assert self.logprobs is not None
        self.logprobs.extend(scores)
        self.score_greedy.extend(greedy)

    def finish_scored(self) -> None:
        """Every continuation token is scored: the sequence is done (it generates nothing)."""
        assert self.score_from is not None and len(self.score_greedy) == len(self.score_targets())
        if self.first_token is None:
            self.first_token = time.perf_counter()
        self._finish(FinishReason.STOP, None)

    def _finish(self, reason: FinishReason, stop_reason: str | int | None) -> FinishReason:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finished_at = time.perf_counter()
        return reason

    def abort(self, reason: FinishReason = FinishReason.ABORT) -> None:
        self._finish(reason, None)

    def completions(self) -> list[Completion]:
        """What this sequence gives its request's output: one completion, or one per one-token candidate."""
        if self.score_tokens:
            done = self.status.finished
            lps = self.logprobs or []
            return [Completion(index=self.index + i, text="", token_ids=(t,), finish_reason=self.finish_reason,
                               logprobs=(lps[i],) if i < len(lps) else (),
                               greedy=self.score_greedy[i] if done else None)
                    for i, t in enumerate(self.score_tokens)]
        return [self.completion()]

    def completion(self) -> Completion:
        if self.score_from is not None:
            return Completion(index=self.index, text="", token_ids=tuple(self.prompt_token_ids[self.score_from:]),
                              finish_reason=self.finish_reason,
                              logprobs=tuple(self.logprobs) if self.logprobs is not None else None,
                              greedy=all(self.score_greedy) if self.status.finished else None)
        return Completion(
            index=self.index,
            text=self.text.final_text(),
            token_ids=tuple(self.output_token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=tuple(self.logprobs) if self.logprobs is not None else None,
        )
