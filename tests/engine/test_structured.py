"""Grammar-constrained masks on real tokenizers (the tiny test model's BPE and SmolLM2's): choice, regex and
JSON schema allow exactly the valid continuations, EOS exactly when the output is complete, unconstrained rows
stay bit-identical, and greedy decoding of a random model under a constraint yields output that matches."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import numpy as np
import pytest

from mlxbatch.engine.decoding.structured import GrammarCompiler, Matcher, constrain_logits
from mlxbatch.errors import InvalidRequestError
from mlxbatch.types import OutputConstraint

CHOICES = ["yes", "no", "a.b*c", 'say "hi"', "back\\slash", "ünï\ncode", "(x|y)+"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["happy", "sad"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "mood", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_compiler(tiny_loaded) -> GrammarCompiler:
    tok = tiny_loaded.tokenizer
    return GrammarCompiler(tok._tokenizer, tiny_loaded.config["vocab_size"], tok.eos_token_ids)


@pytest.fixture(scope="module")
def smol_compiler() -> GrammarCompiler:
    from transformers import AutoTokenizer

    from mlxbatch.models.smollm2 import ensure_smollm2

    hf = AutoTokenizer.from_pretrained(str(ensure_smollm2()))
    return GrammarCompiler(hf, len(hf))


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def compiler(request) -> GrammarCompiler:
    return request.getfixturevalue({"tiny": "tiny_compiler", "smollm2": "smol_compiler"}[request.param])


def encode(compiler: GrammarCompiler, text: str) -> list[int]:
    return compiler.tokenizer.tokenize_str(text)


def allowed(m: Matcher, vocab: int) -> np.ndarray:
    """The ids the mask allows for this matcher (one row through constrain_logits)."""
    out = constrain_logits(mx.zeros((1, vocab)), [0], [m])
    return np.nonzero(np.isfinite(np.array(out[0])))[0]


def walk(compiler: GrammarCompiler, c: OutputConstraint, text: str) -> tuple[bool, Matcher]:
    """Feed ``text``'s tokens one by one, checking each against the mask; False at the first masked token."""
    m = compiler.matcher(c)
    for tok in encode(compiler, text):
        if tok not in set(allowed(m, compiler.vocab_size).tolist()):
            return False, m
        assert m.consume(tok)
    return True, m


def eos_allowed(compiler: GrammarCompiler, m: Matcher) -> bool:
    ok = set(allowed(m, compiler.vocab_size).tolist())
    return all(e in ok for e in compiler.eos_token_ids)


def test_eos_is_the_models_end_token(tiny_compiler, smol_compiler):
    from transformers import AutoTokenizer

    from mlxbatch.models.smollm2 import ensure_smollm2

    im_end = AutoTokenizer.from_pretrained(str(ensure_smollm2())).convert_tokens_to_ids("<|im_end|>")
    assert im_end in smol_compiler.eos_token_ids
    assert 2 in tiny_compiler.eos_token_ids  # the tiny model's <|im_end|>


def test_choice_matches_each_option_exactly(compiler):
    c = OutputConstraint.choice(CHOICES)
    for option in CHOICES:
        ok, m = walk(compiler, c, option)
        assert ok, option
        assert m.accepting and m.done
        assert set(allowed(m, compiler.vocab_size).tolist()) == set(compiler.eos_token_ids)  # nothing but EOS
    # regex metacharacters are literal: no option is a pattern
    for wrong in ["a-b*c", "a.bbc", "xy", "(x|y)", "yess", "say hi", "back\\\\slash"]:
        ok, m = walk(compiler, c, wrong)
        assert not (ok and m.accepting), wrong
    m = compiler.matcher(c)
    assert not m.accepting and not eos_allowed(compiler, m)  # an empty answer is no answer


def test_regex_allows_exactly_matching_output(compiler):
    c = OutputConstraint.regex(r"\d{3}-\d{4}")
    ok, m = walk(compiler, c, "555-1234")
    assert ok and m.done and m.accepting
    for bad in ["55-1234", "5551234", "555-12345", "abc-defg"]:
        ok, m = walk(compiler, c, bad)
        assert not (ok and m.accepting), bad
    # an open-ended pattern: EOS allowed exactly when the output so far matches
    open_c = OutputConstraint.regex("[a-z]+")
    m = compiler.matcher(open_c)
    assert not m.accepting and not eos_allowed(compiler, m)
    ok, m = walk(compiler, open_c, "abc")
    assert ok and m.accepting and not m.done and eos_allowed(compiler, m)


def test_json_schema_allows_valid_objects_only(compiler):
    c = OutputConstraint.json_schema(SCHEMA)
    good = '{"name":"Ann","age":41,"mood":"sad","tags":["x","yz"]}'
    ok, m = walk(compiler, c, good)
    assert ok and m.accepting and m.done
    for bad in [
        '{"name": "Ann","age":41,"mood":"sad","tags":[]}',  # compact JSON only: no free whitespace
        '{"age":41,"name":"Ann","mood":"sad","tags":[]}',  # properties in the schema's order
        '{"name":"Ann","age":151,"mood":"sad","tags":[]}',  # maximum
        '{"name":"Ann","age":41,"mood":"angry","tags":[]}',  # enum
        '{"name":"Ann","age":41,"mood":"sad","tags":["a","b","c","d"]}',  # maxItems
        '{"name":"Ann","age":41,"mood":"sad","tags":[],"x":1}',  # additionalProperties
        '{"name":"Ann","age":41,"mood":"sad"}',  # required
    ]:
        ok, m = walk(compiler, c, bad)
        assert not (ok and m.accepting), bad


def test_invalid_constraints_give_a_reason_and_raise(tiny_compiler):
    cases = {
        OutputConstraint.regex("(ab"): "invalid regex",
        OutputConstraint.regex("[z-a]"): "invalid regex",
        OutputConstraint.json_schema({"type": "objectx"}): "invalid JSON schema",
        OutputConstraint.json_schema("[1, 2]"): "invalid JSON schema",
        OutputConstraint.json_schema("not json"): "invalid JSON schema",
        OutputConstraint.json_schema({"$ref": "#/$defs/missing"}): "invalid JSON schema",
        OutputConstraint.json_schema({"type": "array", "uniqueItems": True}): "invalid JSON schema",
    }
    for c, prefix in cases.items():
        reason = tiny_compiler.check(c)
        assert reason is not None and reason.startswith(prefix), (c, reason)
        assert tiny_compiler.check(c) == reason  # cached
        with pytest.raises(InvalidRequestError) as err:
            tiny_compiler.matcher(c)
        assert err.value.field == "constraint" and err.value.reason == reason
    assert tiny_compiler.check(OutputConstraint.json_schema(SCHEMA)) is None
    assert tiny_compiler.check(OutputConstraint.choice(["a"])) is None


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_unconstrained_rows_are_bit_identical(tiny_compiler, dtype):
    vocab = tiny_compiler.vocab_size
    logits = mx.random.normal((5, vocab), key=mx.random.key(0)).astype(dtype)
    before = np.array(logits.astype(mx.float32))
    ms = [tiny_compiler.matcher(OutputConstraint.choice(["yes", "no"])) for _ in range(2)]
    out = constrain_logits(logits, [1, 3], ms)
    assert out.dtype == dtype
    got = np.array(out.astype(mx.float32))
    assert np.array_equal(np.array(logits.astype(mx.float32)), before)  # the input is not modified
    for r in (0, 2, 4):
        assert got[r].tobytes() == before[r].tobytes()
    ok = allowed(ms[0], vocab)
    for r in (1, 3):
        assert np.array_equal(np.nonzero(np.isfinite(got[r]))[0], ok)
        assert np.array_equal(got[r, ok], before[r, ok])  # allowed logits keep their values
    # every row constrained takes the direct path: same result as row by row
    letters = OutputConstraint.regex("[a-z]+")
    all_rows = constrain_logits(logits, list(range(5)), [tiny_compiler.matcher(letters) for _ in range(5)])
    one = constrain_logits(logits[2:3], [0], [tiny_compiler.matcher(letters)])
    assert np.array_equal(np.array(all_rows[2].astype(mx.float32)), np.array(one[0].astype(mx.float32)))
    assert constrain_logits(logits, [], []) is logits


def test_columns_past_the_tokenizer_are_masked(tiny_loaded):
    tok = tiny_loaded.tokenizer
    ntok = len(tok._tokenizer)
    wide = ntok + 500  # a model whose logits are wider than its tokenizer (e.g. Qwen2's padded 151,936)
    compiler = GrammarCompiler(tok._tokenizer, wide, tok.eos_token_ids)
    logits = mx.ones((2, wide))
    out = np.array(constrain_logits(logits, [1], [compiler.matcher(OutputConstraint.regex("[a-z]+"))]))
    assert np.all(np.isneginf(out[1, ntok:])) and np.isfinite(out[1, :ntok]).sum() > 0
    assert np.all(out[0] == 1.0)
    letters = OutputConstraint.regex("[a-z]+")
    both = np.array(constrain_logits(logits, [0, 1], [compiler.matcher(letters), compiler.matcher(letters)]))
    assert np.array_equal(both[0], out[1]) and np.array_equal(both[1], out[1])


def _greedy(loaded, prompt: str, matcher: Matcher | None, compiler: GrammarCompiler, limit: int = 200) -> str:
    """Greedy decoding with a full forward per step (no KV cache: a unit-level loop)."""
    tok = loaded.tokenizer
    ids = list(tok.encode(prompt))
    out: list[int] = []
    for _ in range(limit):
        logits = loaded.model(mx.array([ids + out]))[:, -1, :].astype(mx.float32)
        if matcher is not None:
            logits = constrain_logits(logits, [0], [matcher])
        t = int(mx.argmax(logits, axis=-1).item())
        if t in compiler.eos_token_ids:
            assert matcher is None or matcher.accepting
            break
        if matcher is not None:
            assert matcher.consume(t)
        out.append(t)
        if matcher is not None and matcher.done:
            break
    return tok.decode(out)


def test_greedy_random_model_output_matches_its_constraint(tiny_loaded, tiny_compiler):
    prompt = "Reply in JSON: name, age, mood and tags.\n"
    garbage = _greedy(tiny_loaded, prompt, None, tiny_compiler, limit=40)
    with pytest.raises(ValueError):
        json.loads(garbage)  # random weights: unconstrained output is not JSON
    text = _greedy(tiny_loaded, prompt, tiny_compiler.matcher(OutputConstraint.json_schema(SCHEMA)), tiny_compiler)
    obj = json.loads(text)
    assert list(obj) == ["name", "age", "mood", "tags"]
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 150
    assert obj["mood"] in ("happy", "sad")
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3 and all(len(t) <= 8 for t in obj["tags"])

    text = _greedy(tiny_loaded, "Phone: ", tiny_compiler.matcher(OutputConstraint.regex(r"\d{3}-\d{4}")),
                   tiny_compiler)
    assert re.fullmatch(r"\d{3}-\d{4}", text), text
    text = _greedy(tiny_loaded, "Answer: ", tiny_compiler.matcher(OutputConstraint.choice(CHOICES)), tiny_compiler)
    assert text in CHOICES


@pytest.mark.parametrize("kernel", ["fails", "differs", "agrees"])
def test_the_metal_kernel_is_checked_once_against_the_portable_path(tiny_compiler, kernel, monkeypatch):
    """On a Mac the constrained rows go through llguidance's Metal kernel only if it agreed with the portable path
    on the first batch (evaluated inside the check); here the Metal branch runs (``metal=True``: the engine's backend
    says Metal) with the kernel injected."""
    from mlxbatch.engine.decoding import masks, structured

    monkeypatch.setattr(masks, "_METAL_CHECKED", {})
    calls = {"n": 0}

    def fake_metal(logits, rows, mask, ntok):
        calls["n"] += 1
        if kernel == "fails":
            raise RuntimeError("[metal_kernel] Unable to load kernel")
        if kernel == "differs":
            return logits  # nothing masked
        return masks._apply_portable(logits, rows, mask, ntok)

    monkeypatch.setattr(masks, "_apply_metal", fake_metal)
    m = tiny_compiler.matcher(OutputConstraint.choice(["yes", "no"]))
    logits = mx.random.normal((3, tiny_compiler.vocab_size))
    want = masks._apply_portable(logits, [1], structured.fill_masks([m]), m.tokenizer_vocab)
    for _ in range(3):
        got = constrain_logits(logits, [1], [m], metal=True)
        assert mx.array_equal(got, want).item()
    assert masks._METAL_CHECKED == {"ok": kernel == "agrees"}
    # checked once; then used for every batch only when it agreed
    assert calls["n"] == (1 + 3 if kernel == "agrees" else 1)
