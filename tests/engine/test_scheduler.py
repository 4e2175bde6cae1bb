"""Scheduler decisions, pinned exactly (pure Python, no model)."""

from __future__ import annotations

from mlxbatch import SamplingParams
from mlxbatch.engine.decoding.detok import TextTracker
from mlxbatch.engine.request import Request, RequestStatus
from mlxbatch.engine.sched.scheduler import Scheduler, SchedulerConfig

BYTES_PER_POS = 10


def cost(lengths: list[int]) -> int:
    return sum(lengths) * BYTES_PER_POS


def req(rid: str, prompt_len: int, max_tokens: int = 10) -> Request:
    return Request(rid, rid, 0, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), 0,
                   frozenset({0}), 4096, TextTracker(None, incremental=False))


def run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    for r in out.decodes:
        r.append(token, None)
    for c in out.prefills:
        if c.last:
            c.request.append(token, None)
    return out, s.finish_step(out)


def test_admission_is_bounded_by_kv_memory_not_only_by_count():
    s = Scheduler(SchedulerConfig(max_num_seqs=100, kv_budget_bytes=cost([20, 20])), cost)
    for i in range(5):
        s.add(req(f"r{i}", 10, 10))  # reserves 20 positions each
    out = s.schedule()
    assert [c.request.request_id for c in out.prefills] == ["r0", "r1"]
    assert len(s.waiting) == 3


def test_a_request_larger_than_the_budget_runs_alone():
    s = Scheduler(SchedulerConfig(kv_budget_bytes=5), cost)
    s.add(req("big", 10))
    s.add(req("next", 1))
    out = s.schedule()
    assert [c.request.request_id for c in out.prefills] == ["big"]


def test_count_cap_and_token_budget_with_chunked_prefill():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=12, prefill_chunk_size=8), cost)
    for i in range(3):
        s.add(req(f"r{i}", 10, 3))
    out, _ = run_step(s)
    assert [(c.request.request_id, c.start, c.end, c.last) for c in out.prefills] == [("r0", 0, 8, False),
                                                                                      ("r1", 0, 4, False)]
    out, _ = run_step(s)
    assert [(c.request.request_id, c.start, c.end, c.last) for c in out.prefills] == [("r0", 8, 10, True),
                                                                                      ("r1", 4, 10, True)]
    out, _ = run_step(s)  # both decode now; r2 waits for a slot
    assert [r.request_id for r in out.decodes] == ["r0", "r1"] and not out.prefills
    out, done = run_step(s)  # third token: max_tokens=3 reached
    assert {r.request_id for r in done} == {"r0", "r1"}
    out, _ = run_step(s)
    assert [c.request.request_id for c in out.prefills] == ["r2"]


def test_decode_rows_come_first_and_prefill_gets_the_rest_of_the_budget():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=6, prefill_chunk_size=100), cost)
    s.add(req("a", 2, 50))
    run_step(s)
    s.add(req("b", 20, 5))
    out, _ = run_step(s)
    assert [r.request_id for r in out.decodes] == ["a"]
    assert [(c.request.request_id, c.end - c.start) for c in out.prefills] == [("b", 5)]


def test_out_of_memory_preempts_the_newest_and_shrinks():
    s = Scheduler(SchedulerConfig(max_num_seqs=8), cost)
    for i in range(4):
        s.add(req(f"r{i}", 4, 10))
    run_step(s)
    s.add(req("late", 4, 10))
    failed = s.schedule()
    dropped = s.preempt_for_memory(failed)
    assert [r.request_id for r in s.running] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting][:2] == ["r2", "r3"]
    # every resident row is dropped: the survivors' KV too (a failed GPU step may have left their rows half-moved)
    assert {r.request_id for r in dropped} == {"r0", "r1", "r2", "r3", "late"}
    late = next(r for r in dropped if r.request_id == "late")  # it was prefilling in the failed step
    assert late.status is RequestStatus.WAITING and late.num_computed_tokens == 0
    # preempted sequences keep their generated tokens and recompute prompt + output
    r2 = next(r for r in s.waiting if r.request_id == "r2")
    assert r2.output_token_ids == [7] and r2.num_computed_tokens == 0
    out = s.schedule()  # at most two run now: the survivors recompute prompt + output in place, nobody is admitted
    assert not out.decodes and len(s.running) == 2
    assert [(c.request.request_id, c.start, c.end, c.last) for c in out.prefills] == [("r0", 0, 5, True),
                                                                                      ("r1", 0, 5, True)]
    assert [a.request.request_id for a in out.admissions] == ["r0", "r1"]  # new rows for them


def test_abort_removes_waiting_and_running():
    s = Scheduler(SchedulerConfig(), cost)
    a, b = req("a", 3), req("b", 3)
    s.add(a)
    run_step(s)
    s.add(b)
    gone = s.abort(["a", "b"])
    assert {r.request_id for r in gone} == {"a", "b"} and not s.has_work
    assert a.status.finished and b.status.finished


def test_limits_grow_back_after_calm_steps():
    s = Scheduler(SchedulerConfig(max_num_seqs=8, kv_budget_bytes=10**6), cost)
    for i in range(4):
        s.add(req(f"r{i}", 4, 500))
    run_step(s)
    s.preempt_for_memory(s.schedule())
    assert s._max_seqs == 2 and s.kv_budget_bytes < 10**6
    for _ in range(64 * 8):
        run_step(s)
    assert s._max_seqs == 8 and s.kv_budget_bytes == 10**6


def test_admission_charging_by_rows_and_longest_admits_what_charging_every_length_admits():
    """A layout's cost given by the rows' count and the longest reserved length (``RowsCost``: admission keeps both as
    it adds rows) admits, step by step, exactly what the same cost over every reserved length admits, where the KV
    budget binds and rows of different lengths come and go."""

    def by_rows(rows: int, longest: int) -> int:  # a slot-like layout: rows double, the longest row sets the width
        return (1 << max(2, (rows - 1).bit_length())) * longest

    def by_lengths(lengths: list[int]) -> int:
        return by_rows(len(lengths), max(lengths)) if lengths else 0

    # a long row, then short ones (admitted in its step, charged at its length), then rows of assorted lengths
    rows = [(150, 50)] + [(10, 10)] * 20 + [(5 + 37 * i % 150, 1 + 7 * i % 40) for i in range(30)]
    admitted = []
    for rows_cost in (None, by_rows):
        s = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, kv_budget_bytes=by_rows(8, 200)),
                      by_lengths, rows_cost=rows_cost)
        for i, (prompt, new) in enumerate(rows):
            s.add(req(f"r{i}", prompt, new))
        steps = []
        while s.has_work:
            out, _ = run_step(s)
            steps.append([c.request.request_id for c in out.prefills if c.start == 0])
        admitted.append(steps)
    assert admitted[0] == admitted[1]
    assert len(admitted[0][0]) == 8  # the long row and 7 short ones: 8 rows at its length fill the budget
