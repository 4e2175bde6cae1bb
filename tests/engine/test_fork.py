"""n > 1 from one prefill: samples share the prompt's KV (forked when its prefill ends), each with its own seed."""

from __future__ import annotations

import random

from mlxbatch import SamplingParams
from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.engine.decoding.sampling import derive_seed


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def test_n_samples_prefill_once_and_equal_their_solo_runs(tiny_loaded):
    p = prompt(120)
    params = SamplingParams(temperature=0.9, top_p=0.95, n=8, seed=11, max_tokens=10, ignore_eos=True, logprobs=0)
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False, prefix_cache=False))
    out = eng.generate([p], params)[0]
    assert len(out.completions) == 8 and len({c.token_ids for c in out.completions}) > 1
    assert eng.stats()["profile"]["prefill_tokens"] == len(p)  # the prompt is prefilled once, not 8 times
    # each sample is exactly what a single request with its derived seed produces
    solo = Engine(tiny_loaded, EngineConfig(warm_up=False, prefix_cache=False))
    for i, c in enumerate(out.completions):
        one = solo.generate([p], SamplingParams(temperature=0.9, top_p=0.95, seed=derive_seed(11, i), max_tokens=10,
                                               ignore_eos=True, logprobs=0))[0]
        assert c.token_ids == one.token_ids
        # float32, batch of 8 rows vs 1: the same within rounding
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(c.logprobs, one.logprobs))


def test_forks_work_with_chunked_prefill_mixed_batches_and_tight_limits(tiny_loaded):
    rng = random.Random(4)
    prompts = [prompt(rng.randint(20, 90), seed=s) for s in range(6)]
    params = [SamplingParams(temperature=0.7, n=rng.randint(1, 4), seed=s, max_tokens=rng.randint(1, 8),
                             ignore_eos=True) for s in range(6)]
    ref = Engine(tiny_loaded, EngineConfig(warm_up=False, prefix_cache=False)).generate(prompts, params)
    # chunks of 16 tokens, few sequences at once: parents are prefilled over several steps, some samples are
    # admitted too late to fork and prefill on their own; the outputs must not change
    tight = Engine(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=3, prefill_chunk_size=16,
                                             max_num_batched_tokens=24))
    out = tight.generate(prompts, params)
    for a, b in zip(out, ref):
        assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
    computed = tight.stats()["profile"]["prefill_tokens"]
    assert computed < sum(len(p) * q.n for p, q in zip(prompts, params))
