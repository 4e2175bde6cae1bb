"""The prefix cache: shared prompt blocks are computed once, and greedy output is unchanged by it."""

from __future__ import annotations

import random

import pytest

from mlxbatch import SamplingParams
from mlxbatch.engine import Engine, EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def label_like(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    instruction = [rng.randrange(10, 1000) for _ in range(150)]
    return [instruction + [rng.randrange(10, 1000) for _ in range(rng.randint(5, 40))] for _ in range(n)]


def fewshot_like(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 1000) for _ in range(rng.randint(40, 90))] for _ in range(4)]
    return [prefixes[i % 4] + [rng.randrange(10, 1000) for _ in range(rng.randint(3, 20))] for i in range(n)]


def run(loaded, prompts, cache: bool, **cfg):
    if cache:  # room for ~1,000 blocks, far more than these prompts hold (the default, 2 GiB, is 131k blocks of the
        # tiny model, and checking every one after every step was 90% of this module's time)
        cfg.setdefault("prefix_cache_bytes", 16 << 20)
    eng = Engine(loaded, EngineConfig(prefix_cache=cache, warm_up=False, **cfg))
    if cache:  # the block pool's invariants hold after every engine step
        step = eng.core.step

        def checked_step():
            out = step()
            eng.core.scheduler.prefix.pool.check_integrity()
            eng.core.runner.batch.check_integrity()
            return out

        eng.core.step = checked_step
    outs = eng.generate(prompts, GREEDY)
    if cache:
        pool = eng.core.scheduler.prefix.pool
        assert pool.stats.blocks_referenced == 0  # every hit was released after its copy
    return outs, eng.stats()


@pytest.mark.parametrize("model", ["tiny_loaded", "tiny64_loaded"])  # head dim 64: fused attention on a GPU
def test_cache_on_equals_cache_off_and_computes_the_shared_prefix_once(model, request):
    loaded = request.getfixturevalue(model)
    for prompts in (label_like(24), fewshot_like(24)):
        off, off_stats = run(loaded, prompts, cache=False, max_num_seqs=4)
        on, on_stats = run(loaded, prompts, cache=True, max_num_seqs=4)
        assert [o.token_ids for o in on] == [o.token_ids for o in off]
        computed_on = on_stats["profile"]["prefill_tokens"]
        computed_off = off_stats["profile"]["prefill_tokens"]
        reused = on_stats["prefix_cache"]["tokens_reused"]
        assert reused > 0 and computed_on == computed_off - reused
        assert sum(o.cached_tokens for o in on) == reused


def test_label_job_prefill_approaches_the_distinct_token_floor(tiny_loaded):
    from mlxbatch.engine.sched.planner import plan

    prompts = label_like(32)
    _, stats = run(tiny_loaded, prompts, cache=True, max_num_seqs=8)
    floor = plan(prompts).distinct_tokens
    computed = stats["profile"]["prefill_tokens"]
    # rows wait for a shared prefix being computed instead of recomputing it; what is left above the floor is
    # block granularity: each row recomputes the shared tokens of its last, partial block (< 16 each)
    assert floor <= computed <= floor + len(prompts) * 15


def test_different_prefixes_never_share_and_a_tiny_cache_degrades_to_recomputing(tiny_loaded):
    rng = random.Random(3)
    a = [rng.randrange(10, 1000) for _ in range(64)]
    b = list(a)
    b[5] += 1  # differs early: no block of b may come from a
    prompts = [a + [7, 8, 9], b + [7, 8, 9]]
    _, stats = run(tiny_loaded, [prompts[0]], cache=True)
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False, prefix_cache_bytes=1))  # room for one block
    first = eng.generate([prompts[0]], GREEDY)
    second = eng.generate([prompts[1]], GREEDY)
    assert eng.stats()["prefix_cache"]["tokens_reused"] == 0
    alone = run(tiny_loaded, [prompts[1]], cache=False)[0]
    assert second[0].token_ids == alone[0].token_ids and len(first[0].token_ids) == 12


def test_a_prompts_block_hashes_given_with_it_are_its_prefix_keys(tiny_loaded, monkeypatch):
    """A caller that hashed its prompts off the step loop (a job's feed) hands in their ``prompt_block_hashes``: the
    prefix index takes them instead of hashing the prompts, and the run computes and reuses exactly what it does
    when it hashes them itself. A count that does not fit the prompt is refused."""
    import mlxbatch.engine.sched.prefix_books as books
    from mlxbatch import InvalidRequestError
    from mlxbatch.engine import prompt_block_hashes

    prompts = [p[: len(p) - (len(p) % 16) + 3] for p in label_like(12)]  # 3 tokens past a block: 12 new stay in it
    hashed = []
    real = books.block_hashes
    monkeypatch.setattr(books, "block_hashes", lambda tokens, *a, **k: hashed.append(len(tokens)) or real(tokens, *a, **k))

    def run_given(given: bool):
        eng = Engine(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=4, prefix_cache_bytes=16 << 20))
        for i, ids in enumerate(prompts):
            eng.core.add_request(ids, GREEDY, request_id=f"r{i}",
                                 block_hashes=prompt_block_hashes(ids) if given else None)
        outs = sorted(eng.core.run_until_done(), key=lambda o: int(o.request_id[1:]))
        stats = eng.stats()
        with pytest.raises(InvalidRequestError, match="block_hashes"):
            eng.core.add_request(prompts[0], GREEDY, block_hashes=prompt_block_hashes(prompts[0])[1:])
        eng.close()
        return [o.completions[0].token_ids for o in outs], stats["profile"]["prefill_tokens"], \
            stats["prefix_cache"]["tokens_reused"]

    hashed.clear()
    own = run_given(False)
    assert len(hashed) >= len(prompts)  # the prefix index hashed every prompt
    hashed.clear()
    given = run_given(True)
    assert hashed == []  # none: every prompt's blocks came with it
    assert given == own and own[2] > 0
