"""Decode ahead (``EngineConfig.decode_ahead``): the next decode step is dispatched before the host records the one
that just finished, so that recording (appending tokens, finish checks, text) runs while the device computes.

It must change nothing a caller sees: the same tokens, texts, finish reasons and logprobs as steps that wait for
each other, under every kind of sampling (greedy, seeded draws, penalties, logprobs, n > 1, stop strings found in
the text, EOS, lengths that differ). Real tiny model, CPU."""

from __future__ import annotations

from mlxbatch import SamplingParams
from mlxbatch.config import EngineConfig
from mlxbatch.engine import Engine
from mlxbatch.types import OutputConstraint

PROMPTS = ["import os", "x = [1, 2, 3]", "while True:", "#", "def main():\n    return", "class A:", "for i in", "a"]


def _params(stop_text: str) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, max_tokens=17, top_p=0.9),
        SamplingParams(temperature=0.7, seed=3, max_tokens=20, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=30, logprobs=2),
        SamplingParams(temperature=0.8, seed=11, max_tokens=12, n=2),
        SamplingParams(temperature=0, max_tokens=40, stop=[stop_text], ignore_eos=True),  # a stop string in the text
        SamplingParams(temperature=1.0, seed=5, max_tokens=33),  # EOS may end it
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
    ]


def _run(loaded, params: list[SamplingParams], ahead: bool):
    eng = Engine(loaded, EngineConfig(warm_up=False, max_num_seqs=16, seed=0, decode_ahead=ahead))
    try:
        ids = [eng.core.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
        outs = {o.request_id: o for o in eng.core.run_until_done()}
        return [outs[i] for i in ids], eng.stats()["profile"]
    finally:
        eng.close()


def _seen(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.completions] for o in outs]


def _logprobs(outs):
    """Every logprob (chosen and alternatives) with its token id, rounded: a row that decodes one token more (a stop
    string only the text shows) changes the batch of one step, and float32 matmuls on the CPU are not invariant to
    the batch's size in their last bits (bit-for-bit invariance is ``batch_invariant``'s, which never decodes ahead)."""
    return [[[(lp.token_id, round(lp.logprob, 4), tuple((t, round(v, 4)) for t, v in lp.top)) for lp in c.logprobs]
             for c in o.completions if c.logprobs] for o in outs]


def test_decoding_ahead_gives_what_waiting_steps_give(tiny_loaded):
    # a stop string the greedy continuation of one prompt reaches mid-way (found with plain steps first)
    probe, _ = _run(tiny_loaded, _params("\x00"), ahead=False)
    text = probe[5].completions[0].text
    stop_text = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop_text.strip(), text
    params = _params(stop_text)
    waited, p_wait = _run(tiny_loaded, params, ahead=False)
    ahead, p_ahead = _run(tiny_loaded, params, ahead=True)
    assert waited[5].completions[0].finish_reason.value == "stop" and waited[5].completions[0].stop_reason == stop_text
    assert _seen(ahead) == _seen(waited)
    assert _logprobs(ahead) == _logprobs(waited)
    assert p_wait["ahead_steps"] == 0 and p_ahead["ahead_steps"] >= 10
    # the same work: steps, prefill, decode tokens counted (dropped ones aside), row moves
    assert (p_ahead["steps"], p_ahead["prefill_tokens"]) == (p_wait["steps"], p_wait["prefill_tokens"])
    assert p_ahead["decode_tokens"] == p_wait["decode_tokens"]
    assert p_ahead["dropped_tokens"] <= 1  # the stop-string row, at most once
    assert p_ahead["moved_bytes"] == p_wait["moved_bytes"]


def test_constrained_sequences_wait_for_their_records(tiny_loaded):
    """A constrained sequence's next mask needs its matcher advanced by the token just sampled: no step runs ahead
    while one is in flight."""
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=4))
    try:
        letters = SamplingParams(temperature=0, max_tokens=64, constraint=OutputConstraint.regex("[a-z]{40}"))
        outs = eng.generate(["pick:", "x"], [letters, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
        assert len(outs[0].completions[0].token_ids) > 3  # the constrained row ran longest
        assert eng.stats()["profile"]["ahead_steps"] == 0
    finally:
        eng.close()
