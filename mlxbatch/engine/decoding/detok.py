"""Incremental detokenization and stop strings for one sequence.

Owns a sequence's generated text. Decodes a sliding window of the newest tokens (vLLM's prefix/read
offsets) so each step costs O(1) tokens, holds back text that might be the start of a stop string, and
finds stop strings that span token boundaries. Sequences with no stop strings that nobody streams skip
incremental work and decode once at the end.
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
        vocab_size: int | None = None,
    ) -> None:
        self._tok = tokenizer
        self._stops = tuple(stop)
        self._include_stop = include_stop
        self._incremental = incremental or bool(self._stops)
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._vocab_size = vocab_size
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""  # all decoded text so far (incremental mode)
        self._emitted = 0  # characters of ``text`` handed out as deltas

    def _decode(self, ids: Sequence[int]) -> str:
        if self._vocab_size is not None:  # padded embedding rows have no token
            ids = [t for t in ids if t < self._vocab_size]
        return self._tok.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> StopHit | None:
        """Add one generated token; returns the stop hit when a stop string completes."""
        self._ids.append(token_id)
        if not self._incremental:
            return None
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None  # an incomplete UTF-8 sequence: wait for more tokens
        searched_from = max(0, len(self.text) - self._holdback)
        self.text += new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        for stop in self._stops:
            at = self.text.find(stop, searched_from)
            if at >= 0:
                end = at + len(stop) if self._include_stop else at
                self.text = self.text[:end]
                return StopHit(stop, self.text)
        return None

    def flush(self) -> None:
        """The sequence ended (not on a stop string): keep what trailing tokens decode to, even if partial."""
        if self._incremental and self._read < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            self.text += self._decode(self._ids[self._prefix :])[len(prefix_text) :]
            self._prefix = self._read = len(self._ids)

    def delta(self, final: bool = False) -> str:
        """Text not handed out yet, keeping back a possible stop-string prefix unless ``final``."""
        if not self._incremental:
            return self.final_text() if final else ""
        upto = len(self.text) if final else max(self._emitted, len(self.text) - self._holdback)
        out = self.text[self._emitted : upto]
        self._emitted = upto
        return out

    def final_text(self) -> str:
        if self._incremental:
            return self.text
        return self._decode(self._ids)
