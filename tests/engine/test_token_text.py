"""A sequence's whole text at once (``TokenText.whole_text``) equals what mlx-lm's streaming detokenizer ends with
after every token and ``finalize``, on real byte-level BPE tokenizers (the tiny test model's and SmolLM2's): random
ids from the whole vocabulary (partial UTF-8 bytes, lone spaces), slices of encoded text that start and end inside
characters, and the tokens whose characters the fast path leaves to the streaming detokenizer."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, load

from mlxbatch.engine.decoding.detok import TextTracker, TokenText

TEXTS = [" héllo wörld", "日本語のテキスト", "emoji 🙂🎉 and  two spaces", "\ttabs\n\nnew lines ", "  leading",
         "ünï\ncode", "a" * 40, " ", "x  ", "Ā\x00 zero byte", "mixed: αβγ – “quotes” — done."]


def _tokenizer(name: str, tiny_model_path: Path) -> Any:
    if name == "tiny":
        return load(tiny_model_path)
    from mlxbatch.models.smollm2 import ensure_smollm2

    return load(ensure_smollm2())


def _streamed(tok: Any, ids: list[int]) -> str:
    detok = tok.detokenizer
    for t in ids:
        detok.add_token(t)
    detok.finalize()
    return detok.text


class _Counted(TokenText):
    """Counts the texts that went through the streaming detokenizer."""

    streamed = 0

    def stream(self) -> Any:
        self.streamed += 1
        return super().stream()


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tok(request, tiny_model_path) -> Any:
    return _tokenizer(request.param, tiny_model_path)


def _text_of(tok: Any) -> _Counted:
    stream = tok.detokenizer
    assert isinstance(stream, BPEStreamingDetokenizer)  # both are byte-level BPE: the fast path is what is tested
    hidden = frozenset(tok.all_special_ids)
    return _Counted(tok, hidden, len(tok._tokenizer), stream.tokenmap)


def test_whole_text_equals_the_streaming_detokenizers_text(tok) -> None:
    text_of = _text_of(tok)
    rng = random.Random(0)
    shown = [t for t in range(len(tok._tokenizer)) if text_of.shown(t)]
    cases = [[rng.choice(shown) for _ in range(rng.randint(1, 12))] for _ in range(1500)]
    for s in TEXTS:
        ids = tok.encode(s, add_special_tokens=False)
        cases.append(ids)
        for _ in range(20):  # slices that start or end inside a character
            a = rng.randrange(len(ids))
            cases.append(ids[a : rng.randint(a + 1, len(ids))])
    space = tok.encode(" ", add_special_tokens=False)
    cases += [space, space * 3, space + tok.encode("x", add_special_tokens=False) + space]
    for ids in cases:
        assert text_of.whole_text(ids) == _streamed(tok, ids), ids
    # most texts took the fast path: the streaming detokenizer saw only those with a token outside it
    assert text_of.streamed < len(cases) // 4, (text_of.streamed, len(cases))


def test_a_token_outside_the_fast_path_takes_the_streaming_detokenizer(tok) -> None:
    text_of = _text_of(tok)
    # the character that stands for byte 0 ("Ā"): the streaming detokenizer's flushes and its finalize read it apart
    zero = [t for t in range(len(tok._tokenizer)) if text_of.shown(t) and "Ā" in str(tok.detokenizer.tokenmap[t])]
    if not zero:
        pytest.skip("no token holds byte 0's character")
    ids = tok.encode(" a", add_special_tokens=False) + zero[:1] + tok.encode("b", add_special_tokens=False)
    assert text_of.whole_text(ids) == _streamed(tok, ids)
    assert text_of.streamed == 1


def test_a_sequences_final_text_is_its_streamed_text(tok) -> None:
    """A tracker that gets its text at the end and one that streams it agree, special tokens left out of both."""
    text_of = _text_of(tok)
    rng = random.Random(1)
    specials = sorted(tok.all_special_ids)
    for s in TEXTS:
        ids = tok.encode(s, add_special_tokens=False)
        if specials:
            ids.insert(rng.randrange(len(ids) + 1), specials[0])
        at_end, streamed = TextTracker(text_of, incremental=False), TextTracker(text_of, incremental=True)
        for t in ids:
            at_end.add(t)
            streamed.add(t)
        streamed.flush()
        assert at_end.final_text() == streamed.final_text() == _streamed(tok, [t for t in ids if t not in specials])
