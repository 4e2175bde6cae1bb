"""The engine honours each request's parameters inside a mixed batch (issue: engine foundation)."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

from mlxbatch import FinishReason, SamplingParams
from mlxbatch.engine import Engine, EngineConfig

PROMPTS = [
    "def main():\n    return",
    "import os",
    "class Foo(object):\n    def __init__(self):",
    "x = [1, 2, 3]",
    "The quick brown fox jumps over the lazy dog and then",
    "#",
    "for i in range(10):\n    print(i)\n",
    "while True:",
]


def reference_tokens(loaded, prompt: str, max_tokens: int) -> list[int]:
    """One request alone through mlx-lm's own generation loop (greedy, EOS ignored by length)."""
    out = []
    for resp in stream_generate(loaded.model, loaded.tokenizer, prompt, max_tokens=max_tokens,
                                sampler=make_sampler(0.0)):
        out.append(resp.token)
    return out


@pytest.mark.parametrize("model", ["tiny_loaded", "tiny64_loaded"])  # head dim 64: fused attention on a GPU
def test_greedy_batched_equals_one_at_a_time(model, request):
    loaded = request.getfixturevalue(model)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with Engine(loaded, EngineConfig(max_num_seqs=16, prefill_chunk_size=64, max_num_batched_tokens=256)) as engine:
        batched = engine.generate(PROMPTS, params)
    alone = Engine(loaded, EngineConfig(max_num_seqs=1, warm_up=False))
    for prompt, out in zip(PROMPTS, batched):
        ref = reference_tokens(loaded, prompt, 24)
        assert list(out.token_ids) == ref, prompt
        single = alone.generate([prompt], params)[0]
        assert single.token_ids == out.token_ids
        assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 24


def test_chunked_prefill_matches_whole_prefill(tiny_loaded):
    long_prompt = " ".join(f"word{i}" for i in range(120))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    whole = Engine(tiny_loaded, EngineConfig(prefill_chunk_size=4096, warm_up=False)).generate([long_prompt], params)
    chunked = Engine(tiny_loaded, EngineConfig(prefill_chunk_size=7, max_num_batched_tokens=20, warm_up=False))
    out = chunked.generate([long_prompt, "import os"], params)
    assert out[0].token_ids == whole[0].token_ids
    assert chunked.stats()["profile"]["steps"] > 30  # really ran in many small chunks


def test_seeded_request_is_independent_of_batch_and_order(engine):
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = engine.generate(["import os"], target)[0]
    others = [SamplingParams(temperature=t, seed=s, max_tokens=m, ignore_eos=True)
              for t, s, m in [(1.0, 1, 5), (0.0, None, 40), (1.5, 99, 12), (0.7, 7, 30)]]
    prompts = ["x = [1, 2, 3]", "while True:", "#", "def main():\n    return"]
    mixed = engine.generate(prompts[:2] + ["import os"] + prompts[2:], others[:2] + [target] + others[2:])
    reordered = engine.generate(["import os"] + prompts[::-1], [target] + others[::-1])
    assert mixed[2].token_ids == alone.token_ids
    assert reordered[0].token_ids == alone.token_ids
    # and the seed matters: another seed gives another sample
    other_seed = engine.generate(["import os"], SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=24,
                                                               ignore_eos=True))[0]
    assert other_seed.token_ids != alone.token_ids


def test_different_parameters_in_one_batch_behave_as_alone(engine):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    top1 = SamplingParams(temperature=1.7, top_k=1, seed=3, max_tokens=20, ignore_eos=True)
    hot = SamplingParams(temperature=1.3, top_k=5, seed=11, max_tokens=20, ignore_eos=True)
    base = engine.generate(["import os"], greedy)[0]
    stop_word = base.text[len(base.text) // 2 : len(base.text) // 2 + 3]
    stopper = SamplingParams(temperature=0, max_tokens=20, stop=(stop_word,), ignore_eos=True)
    params = [greedy, top1, hot, stopper]
    alone = [engine.generate(["import os"], p)[0] for p in params]
    together = engine.generate(["import os"] * 4, params)
    for a, t in zip(alone, together):
        assert a.token_ids == t.token_ids and a.text == t.text
    assert together[1].token_ids == base.token_ids  # top_k=1 is greedy whatever the temperature
    assert together[2].token_ids != base.token_ids  # the hot sampler really sampled
    assert stop_word not in together[3].text and base.text.startswith(together[3].text)
    assert together[3].finish_reason is FinishReason.STOP and together[3].completions[0].stop_reason == stop_word


def test_stop_string_split_across_tokens_is_caught_and_not_emitted(engine):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    out = engine.generate(["class Foo(object):\n    def __init__(self):"], greedy)[0]
    tok = engine.tokenizer
    pieces = [tok.decode([t]) for t in out.token_ids]
    # find a boundary between two tokens with at least 2 visible characters on each side
    boundary = next(i for i in range(1, len(pieces))
                    if len(pieces[i - 1].strip()) >= 2 and len(pieces[i].strip()) >= 2)
    prefix_text = tok.decode(list(out.token_ids[:boundary]))
    stop = pieces[boundary - 1][-2:] + pieces[boundary][:2]
    assert stop in out.text
    stopped = engine.generate(["class Foo(object):\n    def __init__(self):"],
                              SamplingParams(temperature=0, max_tokens=30, stop=(stop,), ignore_eos=True))[0]
    assert stopped.finish_reason is FinishReason.STOP
    assert stop not in stopped.text
    assert stopped.text == out.text[: out.text.index(stop)]
    assert len(stopped.text) <= len(prefix_text)
    # streaming never shows a piece of the stop string either
    streamed = "".join(d.text for d in engine.stream(["class Foo(object):\n    def __init__(self):"],
                                                       SamplingParams(temperature=0, max_tokens=30, stop=(stop,),
                                                                      ignore_eos=True)))
    assert streamed == stopped.text


def test_logprobs_match_a_full_forward_pass(engine, tiny_loaded):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    out = engine.generate(["import os"], params)[0]
    ids = list(tiny_loaded.tokenizer.encode("import os")) + list(out.token_ids)
    logits = tiny_loaded.model(mx.array([ids]))[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    n = len(ids) - len(out.token_ids)
    for j, entry in enumerate(out.logprobs):
        row = lp[n - 1 + j]
        assert entry.token_id == out.token_ids[j]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
        assert len(entry.top) == 3 and entry.top[0][0] == entry.token_id  # greedy: chosen is the best
        assert [t for t, _ in entry.top] == mx.argsort(-row)[:3].tolist()


def test_n_samples_get_distinct_derived_seeds(engine):
    out = engine.generate(["import os"], SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=12, ignore_eos=True))[0]
    assert len(out.completions) == 3 and [c.index for c in out.completions] == [0, 1, 2]
    assert len({c.token_ids for c in out.completions}) == 3
    again = engine.generate(["import os"], SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=12,
                                                          ignore_eos=True))[0]
    assert [c.token_ids for c in again.completions] == [c.token_ids for c in out.completions]


def test_max_tokens_eos_and_min_tokens(engine):
    eos = next(iter(engine.core.intake.eos))
    out = engine.generate(["import os"], SamplingParams(temperature=0, max_tokens=5))[0]
    assert len(out.token_ids) <= 5
    forced = engine.generate(["import os"], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(out.token_ids[2],)))
    assert forced[0].finish_reason is FinishReason.STOP and forced[0].token_ids == out.token_ids[:3]
    no_early = engine.generate(["import os"], SamplingParams(temperature=0, max_tokens=8, min_tokens=8,
                                                             stop_token_ids=(out.token_ids[0],)))[0]
    assert len(no_early.token_ids) == 8 and eos not in no_early.token_ids


def test_penalties_change_output_only_for_their_row(engine):
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    pen = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.8,
                         presence_penalty=1.0, frequency_penalty=1.0)
    a, b = engine.generate(["x = [1, 2, 3]", "x = [1, 2, 3]"], [base, pen])
    assert a.token_ids == engine.generate(["x = [1, 2, 3]"], base)[0].token_ids
    assert b.token_ids != a.token_ids
    assert len(set(b.token_ids)) >= len(set(a.token_ids))


def test_many_rows_with_random_parameters_complete(engine):
    rng = random.Random(0)
    params = [SamplingParams(temperature=rng.choice([0, 0.5, 1.0]), top_k=rng.choice([0, 3, 50]),
                             top_p=rng.choice([1.0, 0.8]), min_p=rng.choice([0.0, 0.1]), seed=i,
                             max_tokens=rng.randint(1, 20)) for i in range(40)]
    prompts = [rng.choice(PROMPTS) for _ in params]
    outs = engine.generate(prompts, params)
    assert [len(o.token_ids) <= p.max_tokens for o, p in zip(outs, params)] == [True] * 40
    assert all(o.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for o in outs)
