"""Generated text and stop strings for one sequence, on mlx-lm's streaming detokenizer.

Owns a sequence's generated text. Tokens go through the tokenizer wrapper's streaming detokenizer
(``TokenizerWrapper.detokenizer``: BPE / SentencePiece aware, O(1) work per token, complete UTF-8 only), so the
text is what mlx-lm itself would print. Special tokens and ids past the tokenizer's vocabulary (padded embedding
rows) never become text. What is ours: stop strings found across token boundaries, and the hold-back of text that
might be the start of a stop string when text is streamed. Sequences with no stop strings that nobody streams skip
incremental work and detokenize once at the end. Pure Python: the tokenizer is the only dependency.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StopHit:
    stop: str
    text: str  # the final text (truncated at the stop string, or including it if asked)


class TextTracker:
    """Text of one sequence's generated tokens; the request that owns it feeds it tokens in order."""

    def __init__(
        self,
        tokenizer: Any,
        stop: Sequence[str] = (),
        include_stop: bool = False,
        incremental: bool = True,
        hidden_ids: frozenset[int] = frozenset(),
        vocab_size: int | None = None,
    ) -> None:
        self._tok = tokenizer  # mlx-lm's TokenizerWrapper
        self._stops = tuple(stop)
        self._include_stop = include_stop
        self._incremental = incremental or bool(self._stops)
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._hidden = hidden_ids  # special tokens: never text
        self._vocab_size = vocab_size
        self._ids: list[int] = []
        self._detok: Any = None
        self._stopped: str | None = None  # the final text once a stop string was found
        self._emitted = 0  # characters handed out as deltas

    def _shown(self, token_id: int) -> bool:
        return token_id not in self._hidden and (self._vocab_size is None or token_id < self._vocab_size)

    def _stream(self) -> Any:
        if self._detok is None:
            self._detok = self._tok.detokenizer  # a fresh copy per sequence
        return self._detok

    @property
    def text(self) -> str:
        """All text so far (incremental mode)."""
        if self._stopped is not None:
            return self._stopped
        return self._detok.text if self._detok is not None else ""

    def add(self, token_id: int) -> StopHit | None:
        """Add one generated token; returns the stop hit when a stop string completes."""
        self._ids.append(token_id)
        if not self._incremental or not self._shown(token_id):
            return None
        detok = self._stream()
        searched_from = max(0, len(detok.text) - self._holdback)
        detok.add_token(token_id)
        if not self._stops:
            return None
        text = detok.text
        for stop in self._stops:
            at = text.find(stop, searched_from)
            if at >= 0:
                self._stopped = text[: at + len(stop) if self._include_stop else at]
                return StopHit(stop, self._stopped)
        return None

    def flush(self) -> None:
        """The sequence ended (not on a stop string): keep what trailing tokens decode to, even if partial."""
        if self._incremental and self._stopped is None and self._detok is not None:
            self._detok.finalize()

    def delta(self, final: bool = False) -> str:
        """Text not handed out yet, keeping back a possible stop-string prefix unless ``final``."""
        if not self._incremental:
            return self.final_text() if final else ""
        text = self.text
        upto = len(text) if final else max(self._emitted, len(text) - self._holdback)
        out = text[self._emitted : upto]
        self._emitted = upto
        return out

    def final_text(self) -> str:
        if self._incremental:
            return self.text
        detok = self._stream()
        detok.reset()
        for t in self._ids:
            if self._shown(t):
                detok.add_token(t)
        detok.finalize()
        return detok.text
