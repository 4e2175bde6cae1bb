"""The sampler: each row's filters and draw follow its own parameters and seed."""

from __future__ import annotations

import collections

import mlx.core as mx
import pytest

from mlxbatch import SamplingParams
from mlxbatch.engine.decoding.sampling import SampleRow, derive_seed, sample, uniform_for

V = 50


def _logits(rows: int = 1, seed: int = 0) -> mx.array:
    mx.random.seed(seed)
    return mx.random.normal((rows, V)) * 2.0


def _row(seed=0, position=0, **kw) -> SampleRow:
    return SampleRow(SamplingParams(**kw), seed, position, [1, 2, 3], [])


def test_uniform_is_a_function_of_seed_and_position_only():
    assert uniform_for(1, 2) == uniform_for(1, 2)
    values = [uniform_for(7, i) for i in range(2000)]
    assert len(set(values)) == 2000 and all(0 <= v < 1 for v in values)
    assert 0.45 < sum(values) / len(values) < 0.55
    assert derive_seed(5, 0) == 5 and derive_seed(5, 1) != derive_seed(5, 2)


def test_greedy_picks_argmax_and_top_k_1_is_greedy():
    lg = _logits(3)
    out = sample(lg, [_row(temperature=0), _row(temperature=2.0, top_k=1), _row(temperature=0, seed=9)])
    best = mx.argmax(lg, axis=-1).tolist()
    assert [o.token_id for o in out] == best


def test_greedy_rows_take_the_argmax_of_bfloat16_logits_as_float32_would():
    """All-greedy steps skip the float32 copy of the logits: the choice is the same (bfloat16 converts exactly),
    ties included (close values collide in bfloat16: the first index wins either way)."""
    mx.random.seed(1)
    lg = (mx.random.normal((64, 3000)) * 0.01).astype(mx.bfloat16)  # many ties at bfloat16's precision
    out = sample(lg, [_row(temperature=0) for _ in range(64)])
    assert [o.token_id for o in out] == mx.argmax(lg.astype(mx.float32), axis=-1).tolist()
    mixed = sample(lg[:2], [_row(temperature=0), _row(temperature=0, logprobs=1)])  # logprobs: the float32 path
    assert [o.token_id for o in mixed] == mx.argmax(lg[:2].astype(mx.float32), axis=-1).tolist()
    assert mixed[1].logprob is not None and mixed[0].logprob is None


def _draws(n: int, **kw) -> collections.Counter:
    lg = _logits(1, seed=3)
    rows = [_row(seed=s, **kw) for s in range(n)]
    out = sample(mx.broadcast_to(lg, (n, V)), rows)
    return collections.Counter(o.token_id for o in out)


def test_top_k_top_p_min_p_restrict_the_support():
    lg = _logits(1, seed=3)[0]
    order = mx.argsort(-lg).tolist()
    probs = mx.softmax(lg).tolist()
    assert set(_draws(400, temperature=1.0, top_k=3)) <= set(order[:3])
    # top_p: the smallest prefix of the sorted distribution reaching p
    acc, nucleus = 0.0, []
    for t in order:
        nucleus.append(t)
        acc += probs[t]
        if acc >= 0.6:
            break
    assert set(_draws(400, temperature=1.0, top_p=0.6)) <= set(nucleus)
    floor = 0.2 * max(probs)
    assert set(_draws(400, temperature=1.0, min_p=0.2)) <= {t for t in range(V) if probs[t] >= floor}


def test_draws_follow_the_distribution():
    lg = _logits(1, seed=3)[0]
    probs = mx.softmax(lg).tolist()
    counts = _draws(3000, temperature=1.0)
    top = max(range(V), key=lambda t: probs[t])
    assert abs(counts[top] / 3000 - probs[top]) < 0.04


def test_banned_ids_are_never_chosen_and_penalties_apply():
    lg = mx.zeros((1, V))
    lg[0, 4] = 10.0
    row = SampleRow(SamplingParams(temperature=0), 0, 0, [], [], banned_ids=(4,))
    assert sample(lg, [row])[0].token_id != 4
    pen = SampleRow(SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0), 0, 3, [], [4, 4, 4])
    assert sample(lg, [pen])[0].token_id == 4  # 10 - 2 - 2*3 = 2: still above the others (0)
    lg[0, 4] = 7.0
    assert sample(lg, [pen])[0].token_id != 4  # 7 - 8 < 0
    rep = SampleRow(SamplingParams(temperature=0, repetition_penalty=20.0), 0, 0, [4], [])
    assert sample(lg, [rep])[0].token_id == 4  # 7 / 20 is still above 0
    lg = lg + 1.0
    assert sample(lg, [rep])[0].token_id != 4  # 8 / 20 < 1


def test_logprobs_are_the_models_and_top_alternatives_sorted():
    lg = _logits(2)
    out = sample(lg, [_row(temperature=0, logprobs=4), _row(temperature=0)])
    lp = (lg - mx.logsumexp(lg, axis=-1, keepdims=True))[0]
    entry = out[0].logprob
    assert entry is not None and out[1].logprob is None
    assert entry.logprob == pytest.approx(lp[out[0].token_id].item(), abs=1e-5)
    assert [t for t, _ in entry.top] == mx.argsort(-lp)[:4].tolist()
    assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)
