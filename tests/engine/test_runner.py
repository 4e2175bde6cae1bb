"""The runner executes exactly what a ``SchedulerOutput`` lists (tiny real model): copies from a running row or
from cached blocks give a new row the very KV it would have computed, stores fill the listed blocks, and the step's
results come back in the ``RunnerOutput``."""

from __future__ import annotations

import mlx.core as mx

from mlxbatch import SamplingParams
from mlxbatch.engine.decoding.detok import TextTracker
from mlxbatch.engine.model.worker import Worker
from mlxbatch.engine.request import Request, RequestStatus
from mlxbatch.engine.runner import PASS_WASTE, ModelRunner, _pad_groups
from mlxbatch.engine.sched.prefix import BlockStore, CachedBlocks, RunningRow
from mlxbatch.engine.sched.scheduler import Admission, PrefillChunk, SchedulerOutput

B = 16


def req(rid: str, tokens: list[int]) -> Request:
    r = Request(rid, rid, 0, tokens, SamplingParams(temperature=0.0, max_tokens=4), 0, frozenset(), 4096,
                TextTracker(None, incremental=False))
    r.status = RequestStatus.PREFILLING
    return r


def kv_of(runner: ModelRunner, rid: str, n: int) -> list[mx.array]:
    return [x[0, :, :n, :] for kv in runner.batch.row_view(rid) for x in kv]


def test_copies_and_stores_follow_the_scheduler_output(tiny_loaded):
    w = Worker(tiny_loaded)
    runner = ModelRunner(tiny_loaded.model, w.geometry, w.backend, prefix_blocks=8, block_size=B)
    prompt = [(7 * i) % 500 + 3 for i in range(40)]
    a = req("a", prompt)
    out = runner.execute(SchedulerOutput((), (PrefillChunk(a, 0, 40, True),), admissions=(Admission(a),),
                                         stores=(BlockStore("a", 0, (5, 2), (11, 12)),)))
    assert set(out.sampled) == {"a"} and not out.scored and not out.grammar_done
    assert runner.traffic.stored_bytes == 2 * B * runner.geometry.bytes_per_token
    a.num_computed_tokens = 40

    # b continues a's prompt: its first 35 tokens come from a's running row, to the token
    b = req("b", prompt[:35] + [9, 9, 9])
    runner.execute(SchedulerOutput((), (PrefillChunk(b, 35, 38, True),), admissions=(Admission(b, RunningRow("a", 35)),)))
    # c starts from the two cached blocks (32 tokens) and computes the rest
    c = req("c", prompt[:32] + [4, 4])
    runner.execute(SchedulerOutput((), (PrefillChunk(c, 32, 34, True),),
                                   admissions=(Admission(c, CachedBlocks((5, 2), 32)),)))
    # the reference: the same prompts computed from scratch in a fresh runner
    ref = ModelRunner(tiny_loaded.model, runner.geometry, w.backend)
    for r in (req("b", b.prompt_token_ids), req("c", c.prompt_token_ids)):
        ref.execute(SchedulerOutput((), (PrefillChunk(r, 0, r.num_prompt_tokens, True),), admissions=(Admission(r),)))
    for rid, n in (("b", 38), ("c", 34)):
        for got, want in zip(kv_of(runner, rid, n), kv_of(ref, rid, n)):
            assert mx.allclose(got, want, atol=1e-5).item(), rid


def test_a_prefill_chunk_that_does_not_end_the_prompt_samples_nothing(tiny_loaded):
    w = Worker(tiny_loaded)
    runner = ModelRunner(tiny_loaded.model, w.geometry, w.backend)
    a = req("a", list(range(3, 43)))
    out = runner.execute(SchedulerOutput((), (PrefillChunk(a, 0, 20, False),), admissions=(Admission(a),)))
    assert out.sampled == {} and runner.batch.committed("a") == 20
    out = runner.execute(SchedulerOutput((), (PrefillChunk(a, 20, 40, True),)))
    assert list(out.sampled) == ["a"] and runner.batch.committed("a") == 40


def test_prefill_passes_apart_pad_at_most_pass_waste(tiny_loaded):
    """A step's prefill rows of different lengths (the CPU: passes apart) go in passes that pad at most
    ``PASS_WASTE`` of their real tokens, each row in one pass: lengths 60, 56, 44 and 42 (one pass at 25%: 19% padding)
    make two passes here, and every row gets the KV it gets computed alone."""
    w = Worker(tiny_loaded)
    runner = ModelRunner(tiny_loaded.model, w.geometry, w.backend)
    lengths = {"a": 60, "b": 56, "c": 44, "d": 42}
    rs = {rid: req(rid, [(11 * i + len(rid) * n) % 500 + 3 for i in range(n)]) for rid, n in lengths.items()}
    groups = _pad_groups(tuple(PrefillChunk(r, 0, lengths[rid], True) for rid, r in rs.items()), None, PASS_WASTE)
    assert sorted(c.request.request_id for g in groups for c in g) == sorted(lengths)
    for g in groups:
        real = sum(c.end for c in g)
        assert max(c.end for c in g) * len(g) <= (1 + PASS_WASTE) * real
    assert [[c.request.request_id for c in g] for g in groups] == [["a", "b"], ["c", "d"]]
    assert len(_pad_groups(groups[0] + groups[1], None, 0.25)) == 1  # (the rule before: one pass)

    before = runner.traffic.launches
    out = runner.execute(SchedulerOutput((), tuple(PrefillChunk(r, 0, lengths[rid], True) for rid, r in rs.items()),
                                         admissions=tuple(Admission(r) for r in rs.values())))
    assert set(out.sampled) == set(lengths) and runner.traffic.launches - before >= 2
    for rid, r in rs.items():
        ref = ModelRunner(tiny_loaded.model, runner.geometry, w.backend)
        alone = req(rid, r.prompt_token_ids)
        ref.execute(SchedulerOutput((), (PrefillChunk(alone, 0, lengths[rid], True),), admissions=(Admission(alone),)))
        for got, want in zip(kv_of(runner, rid, lengths[rid]), kv_of(ref, rid, lengths[rid])):
            assert mx.allclose(got, want, atol=1e-5).item(), rid
