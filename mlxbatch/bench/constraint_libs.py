"""Constrained-decoding libraries behind one interface (llguidance, outlines-core), their inputs and tokenizers.

``LLG`` and ``Outlines`` compile a constraint (choice, regex, JSON schema), allocate and fill a batch's packed
token bitmask and advance a row; ``tokenizer_path`` builds or finds the tokenizers compared (SmolLM2's 49,152 ids,
the tiny test model's 1,024, and a 151,646-id byte-level BPE trained here on local Python sources: Qwen2's
vocabulary size, since none with a real 151k vocabulary can be fetched offline). outlines-core needs a
``Vocabulary`` of token bytes: built here from the byte-level BPE (``Vocabulary.from_pretrained`` would download).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from mlxbatch.engine import byte_of_char

CACHE = Path(os.environ.get("MLXBATCH_TEST_CACHE", Path.home() / ".cache" / "mlxbatch" / "test-models"))
LABELS = ["positive", "negative", "neutral", "mixed", "unknown"]
REGEX = r"\d{3}-\d{4}"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    },
    "required": ["name", "age", "sentiment", "tags"],
    "additionalProperties": False,
}
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "red", "green", "blue", "data", "model"]


def big_bpe_path() -> Path:
    """A 151,646-id byte-level BPE (Qwen2's size) trained once on local Python sources; returns its folder."""
    out = CACHE / "bpe-151k-v1"
    if (out / "tokenizer.json").exists():
        return out
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            f.read_bytes().decode("utf-8")
            files.append(str(f))
        except (UnicodeDecodeError, OSError):
            pass
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train(files, trainers.BpeTrainer(vocab_size=151646, special_tokens=specials, show_progress=False,
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>").save_pretrained(
        str(out))
    return out


def tokenizer_path(name: str) -> Path:
    if name == "smollm2":
        from mlxbatch.engine import resolve_path

        return Path(resolve_path("smollm2"))
    if name == "tiny":
        from mlxbatch.models.random_model import build_random_model

        return build_random_model(CACHE / "tiny-qwen2-v1", "tiny")
    if name == "bpe151k":
        return big_bpe_path()
    raise SystemExit(f"unknown tokenizer {name!r}")


def valid_outputs(kind: str, n: int) -> list[str]:
    """``n`` texts that match the constraint of ``kind`` (compact JSON in schema property order)."""
    import random

    rnd = random.Random(0)
    if kind == "choice":
        return [LABELS[i % len(LABELS)] for i in range(n)]
    if kind == "regex":
        return [f"{rnd.randrange(1000):03d}-{rnd.randrange(10000):04d}" for _ in range(n)]
    out = []
    for _ in range(n):
        obj = {"name": " ".join(rnd.sample(WORDS, 2)), "age": rnd.randrange(100),
               "sentiment": rnd.choice(["positive", "negative", "neutral"]),
               "tags": rnd.sample(WORDS, rnd.randrange(1, 4))}
        out.append(json.dumps(obj, separators=(",", ":")))
    return out


class LLG:
    name = "llguidance"

    def __init__(self, hf):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg, self.lln = llguidance, llguidance.numpy
        self.tok = llguidance.hf.from_tokenizer(hf)
        self.vocab = self.tok.vocab_size
        self.executor = llguidance.LLExecutor()

    def compile(self, kind):
        # the engine's own grammar for the constraint (imported with mlx before timing: see constraints.main)
        from mlxbatch.engine import grammar_text
        from mlxbatch.types import OutputConstraint

        c = {"choice": OutputConstraint.choice(LABELS), "regex": OutputConstraint.regex(REGEX),
             "json_schema": OutputConstraint.json_schema(SCHEMA)}[kind]
        m = self.llg.LLMatcher(self.tok, grammar_text(c), log_level=0)
        assert not m.is_error(), m.get_error()
        self.fill([m.deep_copy()], self.alloc(1))  # the first mask, as for outlines-core
        return m

    def warm_up(self):
        m = self.llg.LLMatcher(self.tok, self.llg.LLMatcher.grammar_from_regex("[a-z]+"), log_level=0)
        self.fill([m], self.alloc(1))

    def rows(self, compiled, n):
        return [compiled.deep_copy() for _ in range(n)]

    def alloc(self, n):
        return self.lln.allocate_token_bitmask(n, self.vocab)

    def fill(self, rows, mask):
        self.lln.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(rows)], mask)

    def consume(self, row, tok):
        ok = row.consume_token(tok)
        assert ok, row.get_error()

    def reset(self, row):
        row.reset()


class Outlines:
    name = "outlines-core"

    def __init__(self, hf):
        import numpy as np
        import outlines_core as oc

        self.oc, self.np = oc, np
        decode = byte_of_char()
        special = set(hf.all_special_ids) | {i for i in hf.added_tokens_decoder}
        tokens: dict[bytes, list[int]] = {}
        for text, i in hf.get_vocab().items():
            if i not in special:
                tokens.setdefault(bytes(decode[c] for c in text), []).append(i)
        self.vocab = len(hf)
        self.voc = oc.Vocabulary(hf.eos_token_id, tokens)

    def compile(self, kind):
        if kind == "choice":
            regex = "(" + "|".join(re.escape(x) for x in LABELS) + ")"
        elif kind == "regex":
            regex = REGEX
        else:
            regex = self.oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
        index = self.oc.Index(regex, self.voc)
        first = self.alloc(1)  # the first mask, as for llguidance
        self.fill([self.oc.Guide(index)], first)
        return index

    def warm_up(self):
        self.fill([self.oc.Guide(self.oc.Index("[a-z]+", self.voc))], self.alloc(1))

    def rows(self, index, n):
        return [self.oc.Guide(index) for _ in range(n)]

    def alloc(self, n):
        return self.np.full((n, (self.vocab + 31) // 32), -1, dtype=self.np.int32)

    def fill(self, rows, mask):
        words = mask.shape[1]
        base, stride = mask.ctypes.data, words * 4
        for i, g in enumerate(rows):
            g.write_mask_into(base + i * stride, words, 4)

    def consume(self, row, tok):
        row.advance(tok, return_tokens=False)

    def reset(self, row):
        row.reset()
