"""The plan's retention in the engine: only prefixes later rows share are kept, and dropped after their last user.

Also property tests over random prompt sets and tiny cache budgets: output never depends on the cache, and the
block pool's books hold after every step.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_prefix_cache import fewshot_like, label_like

from mlxbatch import SamplingParams
from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.engine.sched.planner import plan, submission_order

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def stepped(eng: Engine, each_step) -> None:
    step = eng.core.step

    def wrapped():
        out = step()
        each_step()
        return out

    eng.core.step = wrapped


def test_submission_order_groups_shared_prefixes_and_sends_loners_longest_first():
    rng = random.Random(0)
    shared = [rng.randrange(10, 1000) for _ in range(40)]
    grouped = [shared + [rng.randrange(10, 1000) for _ in range(rng.randint(1, 9))] for _ in range(5)]
    loners = [[i + 1] + [rng.randrange(10, 1000) for _ in range(n)] for i, n in enumerate((3, 30, 12))]
    rows = loners[:1] + grouped[:3] + loners[1:] + grouped[3:]
    order = submission_order(plan(rows))
    assert sorted(s.index for s in order) == list(range(len(rows)))
    group_idx = {1, 2, 3, 6, 7}
    first = [s.index for s in order[:5]]
    assert set(first) == group_idx  # the group first, in trie order
    assert [rows[i] for i in first] == sorted(rows[i] for i in first)
    # each keeps what it shares with the next; the group's last row keeps nothing
    assert [s.cache_tokens for s in order[:5]] == [40, 40, 40, 40, 0]
    assert [len(rows[s.index]) for s in order[5:]] == [31, 13, 4] and all(s.cache_tokens == 0 for s in order[5:])


def test_plan_retention_drops_dead_prefixes_and_keeps_output_equal(tiny_loaded):
    prompts = label_like(16, seed=5) + fewshot_like(16, seed=6)
    random.Random(2).shuffle(prompts)
    off = Engine(tiny_loaded, EngineConfig(prefix_cache=False, warm_up=False, max_num_seqs=4)).generate(prompts, GREEDY)
    results = {}
    for planned in (True, False):
        eng = Engine(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=4))
        pool = eng.core.scheduler.prefix.pool
        peak = [0]

        def check(pool=pool, peak=peak):
            pool.check_integrity()
            peak[0] = max(peak[0], pool.stats.blocks_cached)

        stepped(eng, check)
        if planned:
            outs = eng.generate(prompts, GREEDY)  # generate() submits in the plan's order with its retention
        else:  # the LRU fallback: no retention given, every full block is offered to the cache
            ids = [eng.core.add_request(p, GREEDY) for p in sorted(prompts)]
            done = {o.request_id: o for o in eng.core.run_until_done()}
            outs = [done[ids[sorted(prompts).index(p)]] for p in prompts]
        assert [o.token_ids for o in outs] == [o.token_ids for o in off]
        results[planned] = (peak[0], pool.stats.blocks_cached, eng.stats()["prefix_cache"])
    (plan_peak, plan_end, plan_stats), (lru_peak, lru_end, lru_stats) = results[True], results[False]
    assert plan_stats["plan_evictions"] > 0 and plan_end == 0  # every prefix dropped after its last user
    assert plan_stats["tokens_reused"] >= lru_stats["tokens_reused"] - 16 * 4
    # at most the shared prefixes themselves (label's 150-token instruction is 9 blocks, each of the 4 few-shot
    # prefixes at most 5; groups overlap in time), far below what LRU accumulates
    assert plan_peak <= 9 + 4 * 5 < lru_peak and lru_end > plan_end, (plan_peak, lru_peak)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), budget_blocks=st.integers(1, 12), planned=st.booleans(),
       max_seqs=st.integers(1, 5))
def test_random_prompt_sets_and_tiny_budgets_never_change_output(tiny_loaded, seed, budget_blocks, planned,
                                                                  max_seqs):
    rng = random.Random(seed)
    stems = [[rng.randrange(10, 1000) for _ in range(rng.randint(8, 70))] for _ in range(3)]
    prompts = [rng.choice(stems)[: rng.randint(1, 70)] + [rng.randrange(10, 1000) for _ in range(rng.randint(1, 20))]
               for _ in range(rng.randint(2, 9))]
    base = Engine(tiny_loaded, EngineConfig(prefix_cache=False, warm_up=False)).generate(prompts, GREEDY)
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=max_seqs,
                                           prefix_cache_bytes=budget_blocks * 16 * eng_bytes(tiny_loaded)))
    pool = eng.core.scheduler.prefix.pool
    stepped(eng, pool.check_integrity)
    if planned:
        outs = eng.generate(prompts, GREEDY)
    else:
        ids = [eng.core.add_request(p, GREEDY) for p in prompts]
        done = {o.request_id: o for o in eng.core.run_until_done()}
        outs = [done[i] for i in ids]
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert pool.stats.blocks_referenced == 0


def eng_bytes(loaded) -> int:
    from mlxbatch.engine.model.worker import Worker

    return Worker(loaded).geometry.bytes_per_token


def test_running_rows_share_their_prefix_to_the_token(tiny_loaded):
    # in the plan's order the row before is usually still running: its KV is copied to the token, so the shared
    # prefixes' partial last blocks are not recomputed and prefill meets the distinct-token floor
    prompts = fewshot_like(24, seed=8) + label_like(12, seed=9)
    off = Engine(tiny_loaded, EngineConfig(prefix_cache=False, warm_up=False)).generate(prompts, GREEDY)
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=4))
    outs = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in off]
    st = eng.stats()
    assert st["prefix_cache"]["tokens_reused_live"] > 0
    floor = plan(prompts).distinct_tokens
    assert floor <= st["profile"]["prefill_tokens"] <= floor * 1.05


def test_batched_copy_ins_of_the_gpu_path_give_the_same_output(tiny_loaded):
    prompts = fewshot_like(20, seed=3) + label_like(10, seed=4)
    ref = Engine(tiny_loaded, EngineConfig(prefix_cache=False, warm_up=False)).generate(prompts, GREEDY)
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=6))
    eng.core.runner.batch.batched_moves = True  # one gather + one scatter per buffer for all rows of a step
    outs = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    st = eng.stats()["prefix_cache"]
    assert st["tokens_reused_live"] > 0 and st["tokens_reused"] > st["tokens_reused_live"]
