"""Log-likelihood scoring: candidate continuations scored in the batch equal a direct full-sequence forward."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxbatch import SamplingParams
from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.engine.kv import LayoutOptions
from mlxbatch.errors import InvalidRequestError

ITEMS = [
    ("The capital of France is", [" Paris", " London", " a city in Europe with many museums"]),
    ("Question: what is two plus two?\nAnswer:", [" 4", " four", " 22"]),
    ("The capital of France is", [" Berlin"]),
]


def direct(loaded, context: str, cont: str) -> tuple[list[float], list[bool]]:
    tok = loaded.tokenizer
    ctx = list(tok.encode(context))
    ids = list(tok.encode(cont, add_special_tokens=False))
    logits = loaded.model(mx.array([ctx + ids]))[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    rows = range(len(ctx) - 1, len(ctx) + len(ids) - 1)
    return ([lp[p, ids[k]].item() for k, p in enumerate(rows)],
            [int(mx.argmax(logits[p]).item()) == ids[k] for k, p in enumerate(rows)])


@pytest.mark.parametrize("cfg", [dict(), dict(prefix_cache=False), dict(prefill_chunk_size=5, max_num_seqs=2),
                                 dict(cuda_path=True), dict(cuda_path=True, prefill_chunk_size=5, max_num_seqs=2)])
def test_scores_equal_a_full_forward(tiny_loaded, cfg):
    cfg = dict(cfg)
    cuda_path = cfg.pop("cuda_path", False)
    # CUDA's flags: bucketed passes, packed prefill, rows staying in their slots (score rows run bucketed passes over
    # their slots beside packed generation rows)
    cuda = LayoutOptions(batched_moves=True, shape_buckets=True, packed_prefill=True, rows_stay=True)
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False, **cfg), layout=cuda if cuda_path else None)
    # scoring rows share the batch with generation rows
    gen = eng.core.add_request("Hello there", SamplingParams(temperature=0, max_tokens=6))
    outs = eng.score(ITEMS)
    for (context, cands), out in zip(ITEMS, outs):
        assert len(out.completions) == len(cands)
        for cand, c in zip(cands, out.completions):
            want, greedy = direct(tiny_loaded, context, cand)
            got = [lp.logprob for lp in c.logprobs]
            assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < 1e-4
            assert abs(c.cumulative_logprob - sum(want)) < 1e-3
            assert c.greedy == all(greedy)
            assert list(c.token_ids) == list(tiny_loaded.tokenizer.encode(cand, add_special_tokens=False))
    eng.core.run_until_done()
    assert gen not in eng.core._groups


def test_a_greedy_continuation_is_flagged_greedy(tiny_loaded):
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False))
    context = "Once upon a time"
    text = eng.generate([context], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    out = eng.score([(context, [list(text.token_ids), list(text.token_ids[:-1]) + [text.token_ids[-1] + 1]])])[0]
    assert out.completions[0].greedy is True and out.completions[1].greedy is False


def test_shared_contexts_are_computed_once(tiny_loaded):
    few_shot = " ".join(f"Q{i}: what is {i} plus {i}? A: {2 * i}." for i in range(12))
    items = [(few_shot + f" Q: what is {k} plus 1? A:", [f" {k + 1}", f" {k + 2}", f" {k}"]) for k in range(6)]
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=4))
    eng.score(items)
    stats = eng.stats()
    total = sum(len(eng.core.encode(c)) + len(tiny_loaded.tokenizer.encode(x, add_special_tokens=False))
                for c, xs in items for x in xs)
    ctx_len = len(eng.core.encode(few_shot))
    # every candidate of every row after the first reuses the few-shot prefix's full blocks
    assert stats["profile"]["prefill_tokens"] < total - (3 * len(items) - 1) * (ctx_len // 16 * 16 - 16)


def test_bad_candidates_are_rejected(tiny_loaded):
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False))
    with pytest.raises(InvalidRequestError, match="candidates"):
        eng.core.add_score_request("context", [])
    with pytest.raises(InvalidRequestError, match=r"candidates\[1\]"):
        eng.core.add_score_request("context", [" ok", ""])
    long = [1] * (tiny_loaded.context_length + 1)
    with pytest.raises(InvalidRequestError, match="context"):
        eng.core.add_score_request("context", [long])
    assert eng.score([("context", [" ok"])])[0].completions[0].logprobs


def test_a_context_of_whole_blocks_still_scores_its_first_candidate_token(tiny_loaded):
    # the context is exactly two cache blocks and cached by the first row: the next rows must still compute its
    # last position, which predicts the candidate's first token
    ctx = list(range(100, 132))
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False))
    outs = eng.score([(ctx, [[7], [8, 9]]), (ctx, [[7], [10]]), (ctx, [[11]])])
    assert eng.stats()["prefix_cache"]["tokens_reused"] > 0
    ref = Engine(tiny_loaded, EngineConfig(warm_up=False, prefix_cache=False)).score([(ctx, [[7], [8, 9]])])[0]
    for out in outs:
        assert all(len(c.logprobs) == len(c.token_ids) for c in out.completions)
    assert abs(outs[1].completions[0].cumulative_logprob - ref.completions[0].cumulative_logprob) < 1e-4


@pytest.mark.parametrize("cfg", [dict(prefix_cache=False), dict(prefill_chunk_size=5, max_num_seqs=2)])
def test_one_token_candidates_are_one_sequence(tiny_loaded, cfg):
    """All candidates one token: the context runs once and its last logits score each (no candidate token is run);
    the scores, greedy flags and order are those of a direct forward."""
    ctx = "Answer with a letter. The answer is"
    cands = [[7], [300], [42], [7]]  # a repeated candidate is scored twice, in place
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False, **cfg))
    out = eng.score([(ctx, cands)])[0]
    n_ctx = len(eng.core.encode(ctx))
    assert out.prompt_tokens == n_ctx
    assert eng.stats()["profile"]["prefill_tokens"] == n_ctx  # the context alone, once
    assert [c.index for c in out.completions] == [0, 1, 2, 3]
    assert [list(c.token_ids) for c in out.completions] == cands
    for cand, c in zip(cands, out.completions):
        want, greedy = _direct_ids(tiny_loaded, ctx, cand)
        assert len(c.logprobs) == 1 and abs(c.logprobs[0].logprob - want) < 1e-4 and c.greedy == greedy
    assert out.completions[0].logprobs == out.completions[3].logprobs


def _direct_ids(loaded, context: str, ids: list[int]) -> tuple[float, bool]:
    ctx = list(loaded.tokenizer.encode(context))
    logits = loaded.model(mx.array([ctx]))[0, -1].astype(mx.float32)
    return (logits - mx.logsumexp(logits)).tolist()[ids[0]], int(mx.argmax(logits).item()) == ids[0]
