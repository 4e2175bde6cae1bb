"""Fuller prefill passes (``SchedulerConfig.fill_slots``, on where a pass's fixed host cost binds: CUDA).

A few new rows wait one step for more free slots, and a short row is never split at the token budget's edge: the
decisions are pinned on the scheduler alone, and the engine's greedy outputs are the same with them as without.
"""

from __future__ import annotations

import dataclasses
import random

from test_scheduler import cost, req, run_step

from mlxbatch import SamplingParams
from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.engine.sched.scheduler import Scheduler, SchedulerConfig


def started(fill: int, max_tokens: list[int], waiting: int = 4) -> dict[str, int]:
    """The step at which each waiting row got its first chunk, with ``max_tokens`` for the rows admitted first."""
    s = Scheduler(SchedulerConfig(max_num_seqs=len(max_tokens), max_num_batched_tokens=64, fill_slots=fill), cost)
    for i, m in enumerate(max_tokens):
        s.add(req(f"r{i}", 4, m))
    for i in range(waiting):
        s.add(req(f"w{i}", 4, 20))
    first: dict[str, int] = {}
    for step in range(12):
        out, _ = run_step(s)
        s.reap()
        for c in out.prefills:
            first.setdefault(c.request.request_id, step)
    return {k: v for k, v in first.items() if k.startswith("w")}


def test_a_lone_free_slot_waits_a_step_for_the_next_one():
    # r0 draws its last token a step before r1: without filling w0 starts alone, a step before w1
    assert started(0, [2, 3, 9, 9])["w0"] < started(0, [2, 3, 9, 9])["w1"]
    filled = started(2, [2, 3, 9, 9])
    assert filled["w0"] == filled["w1"] == started(0, [2, 3, 9, 9])["w1"]


def test_the_wait_is_one_step_at_most():
    unfilled, filled = started(0, [2, 9, 9, 9]), started(2, [2, 9, 9, 9])
    assert filled["w0"] == unfilled["w0"] + 1  # no second slot frees: it goes alone a step later
    assert filled["w1"] > filled["w0"]


def test_no_wait_for_the_last_rows_of_the_queue():
    assert started(2, [2, 9, 9, 9], waiting=1) == started(0, [2, 9, 9, 9], waiting=1)


def test_no_wait_when_a_prefill_runs_anyway():
    s = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, prefill_chunk_size=8, fill_slots=3),
                  cost)
    s.add(req("d", 2, 2))  # done after step 1
    s.add(req("e", 2, 9))  # decodes on
    s.add(req("long", 40, 5))  # prefills over several steps
    for i in range(3):
        s.add(req(f"w{i}", 4, 5))
    for _ in range(3):
        out, _ = run_step(s)
        s.reap()
    # step 2: one free slot (fewer than 3) while "e" decodes, but "long" prefills anyway: w0 joins that pass
    assert [c.request.request_id for c in out.prefills] == ["long", "w0"]


def chunks(fill: int, lengths: list[int]) -> list[tuple[str, int, int]]:
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, prefill_chunk_size=8, fill_slots=fill),
                  cost)
    for i, n in enumerate(lengths):
        s.add(req(f"r{i}", n, 4))
    return [(c.request.request_id, c.start, c.end) for c in s.schedule().prefills]


def test_a_short_row_is_not_split_at_the_budget_edge():
    assert chunks(0, [4, 4, 4]) == [("r0", 0, 4), ("r1", 0, 4), ("r2", 0, 2)]
    assert chunks(1, [4, 4, 4]) == [("r0", 0, 4), ("r1", 0, 4), ("r2", 0, 4)]  # 12 tokens: past 10 by < 8 // 2
    # a row with more than prefill_chunk_size // 2 tokens left is split as before
    assert chunks(1, [4, 8]) == chunks(0, [4, 8]) == [("r0", 0, 4), ("r1", 0, 6)]


def test_greedy_outputs_are_the_same_with_filled_passes(tiny_loaded):
    """The decisions move rows between steps only: every row's tokens are the same (float32, CPU), and the prefill
    tokens computed stay those of the trie (a shared instruction, then each row's own item)."""
    rng = random.Random(3)
    instruction = [rng.randrange(10, 500) for _ in range(40)]
    prompts = [instruction + [rng.randrange(10, 500) for _ in range(rng.randrange(5, 30))] for _ in range(24)]
    params = [SamplingParams(temperature=0, max_tokens=3 + i % 7, ignore_eos=True) for i in range(len(prompts))]
    outs, profiles = [], []
    for fill in (0, 3):
        engine = Engine(tiny_loaded, EngineConfig(max_num_seqs=8, max_num_batched_tokens=96, warm_up=False, seed=0))
        sched = engine.core.scheduler
        sched.config = dataclasses.replace(sched.config, fill_slots=fill)  # CPU: off by default
        passes = []
        schedule = sched.schedule

        def counted(schedule=schedule, passes=passes):
            out = schedule()
            passes.append(sum(c.end - c.start for c in out.prefills))
            return out

        sched.schedule = counted
        outs.append([o.token_ids for o in engine.generate(prompts, params)])
        profiles.append((engine.stats()["profile"]["prefill_tokens"], sum(1 for n in passes if n)))
        engine.close()
    assert outs[0] == outs[1]
    (tokens_off, passes_off), (tokens_on, passes_on) = profiles
    assert abs(tokens_on - tokens_off) <= 16  # which running row a prefix comes from may differ, not the trie
    assert passes_on < passes_off
