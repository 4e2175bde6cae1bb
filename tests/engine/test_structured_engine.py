"""Structured outputs per row inside one mixed batch (issue #5, engine level): constrained rows match their
constraint and equal their solo runs, unconstrained rows are untouched, a cut JSON row ends with "length"."""

from __future__ import annotations

import json
import re

import pytest

from mlxbatch import FinishReason, SamplingParams
from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.errors import InvalidRequestError
from mlxbatch.types import OutputConstraint

CHOICES = ["positive", "negative", "neutral"]
REGEX = r"\d{3}-\d{4}"
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 10},
        "score": {"type": "integer", "minimum": 1, "maximum": 5},
        "label": {"enum": CHOICES},
    },
    "required": ["title", "score", "label"],
    "additionalProperties": False,
}


def greedy(constraint: OutputConstraint | None = None, max_tokens: int = 48) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, constraint=constraint)


def check_json(text: str) -> None:
    obj = json.loads(text)
    assert list(obj) == ["title", "score", "label"]
    assert isinstance(obj["title"], str) and len(obj["title"]) <= 10
    assert isinstance(obj["score"], int) and 1 <= obj["score"] <= 5
    assert obj["label"] in CHOICES


ROWS = [
    ("Sentiment of 'great film':", greedy(OutputConstraint.choice(CHOICES))),
    ("def main():\n    return", greedy()),
    ("Call me at", greedy(OutputConstraint.regex(REGEX))),
    ("Review as JSON:", greedy(OutputConstraint.json_schema(SCHEMA))),
    ("import os", greedy()),
    ("Another review as JSON:", greedy(OutputConstraint.json_schema(SCHEMA), max_tokens=6)),  # cut short
    ("Label:", greedy(OutputConstraint.choice(CHOICES))),
]


@pytest.fixture(scope="module")
def batched(tiny_loaded):
    eng = Engine(tiny_loaded, EngineConfig(max_num_seqs=16, prefill_chunk_size=64, max_num_batched_tokens=256))
    yield eng.generate([p for p, _ in ROWS], [s for _, s in ROWS])
    eng.close()


def test_mixed_batch_outputs_match_their_constraints(batched):
    choice, free1, phone, review, free2, cut, label = batched
    assert choice.text in CHOICES and choice.finish_reason is FinishReason.STOP
    assert label.text in CHOICES and label.finish_reason is FinishReason.STOP
    assert re.fullmatch(REGEX, phone.text) and phone.finish_reason is FinishReason.STOP
    check_json(review.text)
    assert review.finish_reason is FinishReason.STOP
    # max_tokens cut the JSON: the job layer reports it truncated from the "length" reason
    assert cut.finish_reason is FinishReason.LENGTH and len(cut.token_ids) == 6
    with pytest.raises(ValueError):
        json.loads(cut.text)
    assert cut.text.startswith('{"title"')


def test_rows_equal_their_solo_runs(batched, tiny_loaded):
    solo = Engine(tiny_loaded, EngineConfig(max_num_seqs=1, warm_up=False))
    try:
        for (prompt, params), out in zip(ROWS, batched):
            alone = solo.generate([prompt], params)[0]
            assert alone.token_ids == out.token_ids, prompt
            assert alone.finish_reason is out.finish_reason
    finally:
        solo.close()


def test_sampled_rows_and_n_samples_match(engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, n=3, max_tokens=48,
                            constraint=OutputConstraint.json_schema(SCHEMA))
    out = engine.generate(["Review as JSON:"], params)[0]
    assert len(out.completions) == 3
    for c in out.completions:
        check_json(c.text)
    again = engine.generate(["x"], SamplingParams(temperature=0.8, seed=3, max_tokens=16,
                                                  constraint=OutputConstraint.regex(REGEX)))[0]
    assert re.fullmatch(REGEX, again.text)


def test_invalid_constraint_is_refused_and_the_engine_goes_on(engine):
    with pytest.raises(InvalidRequestError) as err:
        engine.core.add_request("hi", greedy(OutputConstraint.regex("(unclosed")))
    assert err.value.field == "constraint" and "invalid regex" in err.value.reason
    with pytest.raises(InvalidRequestError) as err:
        engine.core.add_request("hi", greedy(OutputConstraint.json_schema({"type": "objectx"})))
    assert err.value.field == "constraint" and "invalid JSON schema" in err.value.reason
    assert not engine.core.has_unfinished
    out = engine.generate(["Label:"], greedy(OutputConstraint.choice(CHOICES)))[0]
    assert out.text in CHOICES
    assert engine.core.runner.num_constrained == 0  # finished sequences leave no matcher behind


def test_preempted_sequence_keeps_its_grammar_state(tiny_loaded, fail_launch_at):
    """An out-of-memory step sends sequences back to the queue; they resume mid-grammar with the same output."""
    prompts = ["Review as JSON:", "Another review as JSON:"]
    params = greedy(OutputConstraint.json_schema(SCHEMA))
    config = EngineConfig(max_num_seqs=4, warm_up=False)
    ref = Engine(tiny_loaded, config)
    expected = [o.token_ids for o in ref.generate(prompts, params)]
    ref.close()
    eng = Engine(tiny_loaded, config)
    fail_launch_at(eng.core.runner, 6)  # mid-output: both rows have consumed tokens of their grammar
    try:
        outs = eng.generate(prompts, params)
    finally:
        eng.close()
    assert eng.core.scheduler.num_preemptions == 1
    assert [o.token_ids for o in outs] == expected
    for o in outs:
        check_json(o.text)


def test_constrained_logprobs_are_the_models_own(tiny_loaded):
    """A constrained row's logprobs are the model's distribution before the mask: the chosen label's logprob is the
    model's confidence in its token (not 0.0 because the mask left one token), and the top alternatives are the
    model's top tokens, allowed or not (issue #15: label confidence)."""
    import mlx.core as mx

    prompt = "Sentiment of 'great film':"
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, constraint=OutputConstraint.choice(CHOICES))
    with Engine(tiny_loaded, EngineConfig(max_num_seqs=4, warm_up=False)) as eng:
        out = eng.generate([prompt], params)[0]
        ids = eng.core.encode(prompt)
    assert out.text in CHOICES
    first = out.logprobs[0]
    logits = tiny_loaded.model(mx.array([ids]))[0, -1].astype(mx.float32)
    model_lp = logits - mx.logsumexp(logits)
    assert first.logprob == pytest.approx(model_lp[first.token_id].item(), abs=1e-4)
    assert first.logprob < -1e-3  # a random model is not sure of any label
    top = mx.argsort(-model_lp)[:3].tolist()
    assert [t for t, _ in first.top] == top
    assert [v for _, v in first.top] == pytest.approx([model_lp[t].item() for t in top], abs=1e-4)
