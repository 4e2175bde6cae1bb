"""Generated text and stop strings, on mlx-lm's streaming detokenizer.

``TokenText`` holds a tokenizer's rules for generated tokens (one per engine, shared by its sequences): which ids never
become text (special tokens, ids past the tokenizer's vocabulary: padded embedding rows), a fresh streaming
detokenizer (``TokenizerWrapper.detokenizer``: BPE / SentencePiece aware, O(1) work per token, complete UTF-8 only),
and a sequence's whole text at once (``whole_text``). ``TextTracker`` owns one sequence's generated text. The text is
what mlx-lm itself would print. What is ours: stop strings found across token boundaries, and the hold-back of text
that might be the start of a stop string when text is streamed. Sequences with no stop strings that nobody streams
skip incremental work and get their text once at the end. Pure Python: the tokenizer is the only dependency.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StopHit:
    stop: str
    text: str  # the final text (truncated at the stop string, or including it if asked)


_UNSEEN: Any = object()  # (a token not looked at yet: its bytes are built on first use)


@functools.cache
def byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's ``bytes_to_unicode``) read backwards: each of the 256 characters a token's
    string is made of, to the byte it stands for (the one definition: the bench's constraint libraries use it too)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


class TokenText:
    """A tokenizer's text of generated tokens (``tokenizer``: mlx-lm's ``TokenizerWrapper``).

    ``whole_text`` gives what the streaming detokenizer ends with after every token was added and it was finalized,
    in one call. mlx-lm's byte-level BPE detokenizer decodes the bytes held since its last flush after each token,
    flushes them when they end on a complete character (and the token is not a lone space), and drops a space that
    starts its text: decoding UTF-8 from a complete character on does not depend on what came before, so that text is
    the whole byte string decoded at once, less a leading space. That is computed here from each token's bytes (built
    once a token, then kept), for tokens whose characters are all in the byte alphabet and stand for a byte other than
    0 (there the detokenizer's flushes and its ``finalize`` read characters by other rules); any other token, and any
    other detokenizer, takes the streaming detokenizer token by token. A test holds both equal on real tokenizers."""

    def __init__(self, tokenizer: Any, hidden_ids: frozenset[int] = frozenset(), vocab_size: int | None = None,
                 byte_level: Sequence[Any] | None = None) -> None:
        """``byte_level``: each token's string, where the tokenizer's streaming detokenizer is mlx-lm's byte-level BPE
        one (its ``tokenmap``); None: every text goes through the streaming detokenizer."""
        self._tok = tokenizer
        self._hidden = hidden_ids  # special tokens: never text
        self._vocab_size = vocab_size
        self._tokenmap = byte_level
        self._bytes: dict[int, bytes | None] = {}  # token -> its bytes (None: not in the alphabet's plain part)

    def shown(self, token_id: int) -> bool:
        """Whether a token becomes text (``shown_ids``' rule)."""
        return bool(self.shown_ids((token_id,)))

    def stream(self) -> Any:
        """A fresh streaming detokenizer (mlx-lm's: a copy per sequence)."""
        return self._tok.detokenizer

    def shown_ids(self, ids: Sequence[int]) -> list[int]:
        """``ids`` without those that never become text: special tokens and ids past the tokenizer's vocabulary."""
        hidden, size = self._hidden, self._vocab_size
        if size is None:
            return [t for t in ids if t not in hidden]
        return [t for t in ids if t < size and t not in hidden]

    def whole_text(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (shown tokens) as the streaming detokenizer ends it."""
        if self._tokenmap is not None:
            parts, known = [], self._bytes
            for t in ids:
                b = known.get(t, _UNSEEN)
                if b is _UNSEEN:
                    b = self._token_bytes(t)
                if b is None:
                    break
                parts.append(b)
            else:
                text = b"".join(parts).decode("utf-8", "replace")
                return text[1:] if text[:1] == " " else text
        detok = self.stream()
        for t in ids:
            detok.add_token(t)
        detok.finalize()
        return detok.text

    def _token_bytes(self, token_id: int) -> bytes | None:
        assert self._tokenmap is not None
        chars = self._tokenmap[token_id] if token_id < len(self._tokenmap) else None
        out = None
        if isinstance(chars, str):
            byte_of = byte_of_char()
            values = [byte_of.get(c, 0) for c in chars]
            out = bytes(values) if all(values) else None
        self._bytes[token_id] = out
        return out


class TextTracker:
    """Text of one sequence's generated tokens; the request that owns it feeds it tokens in order. ``text``: the
    tokenizer's (None: a sequence whose text nobody reads)."""

    def __init__(
        self,
        text: TokenText | None,
        stop: Sequence[str] = (),
        include_stop: bool = False,
        incremental: bool = True,
    ) -> None:
        self._text = text
        self._stops = tuple(stop)
        self._include_stop = include_stop
        self._incremental = incremental or bool(self._stops)
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._ids: list[int] = []
        self._detok: Any = None
        self._stopped: str | None = None  # the final text once a stop string was found
        self._emitted = 0  # characters handed out as deltas

    def _stream(self) -> Any:
        if self._detok is None:
            assert self._text is not None
            self._detok = self._text.stream()
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
        if not self._incremental:
            return None
        assert self._text is not None
        if not self._text.shown(token_id):
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
        if self._text is None:
            return ""
        return self._text.whole_text(self._text.shown_ids(self._ids))
