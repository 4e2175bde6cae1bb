"""``RowEngine.prepare``: a text row's request made on a thread beside the one that steps (the engine's process does it
on its input thread), then queued by ``submit``. The rows must come out as if submitted on the stepping thread:
the same tokens, the same error rows, nothing lost or doubled."""

from __future__ import annotations

import threading

import pytest

from mlxbatch.engine import EngineConfig
from mlxbatch.job.executors.local import Prepared, RowEngine
from mlxbatch.job.rows.tasks import RowTask
from mlxbatch.types import OutputConstraint, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, seed=11)
UNSEEDED = SamplingParams(temperature=0.8, max_tokens=6)  # its seed derived from the engine's and the row's key
PARAMS = (SAMPLED, UNSEEDED, GREEDY, GREEDY)


def _tasks(n: int = 24) -> list[RowTask]:
    return [RowTask(f"k{i}", f"row{i}", [5 + (i * 7 + j) % 200 for j in range(8 + i % 13)],
                    PARAMS[i % 4], cache_tokens=None) for i in range(n)]


def _run(engine: RowEngine, items: list) -> dict[str, tuple]:
    """Submit ``items`` (tasks or prepared rows) and step until done: key -> (token ids, error, error kind)."""
    for item in items:
        engine.submit(item)
    done: dict[str, tuple] = {}
    while engine.has_work:
        for d in engine.step():
            assert d.key not in done, f"{d.key} came back twice"
            done[d.key] = (d.output.completions[0].token_ids if d.output else None, d.error, d.error_kind)
    return done


@pytest.fixture()
def row_engine(tiny_loaded):
    engine = RowEngine(tiny_loaded, EngineConfig(max_num_seqs=8, seed=3))
    yield engine
    engine.shutdown()


def test_rows_prepared_beside_the_stepping_thread_give_the_rows_submitted_on_it(row_engine):
    tasks = _tasks()
    submitted = _run(row_engine, tasks)
    prepared: list[Prepared] = []
    worker = threading.Thread(target=lambda: prepared.extend(row_engine.prepare(t) for t in tasks))
    worker.start()
    worker.join()
    assert all(p.group is not None for p in prepared)  # text rows: made off the loop
    assert _run(row_engine, prepared) == submitted
    assert len(submitted) == len(tasks) and all(v[1] is None for v in submitted.values())


def test_a_refused_row_is_the_same_error_row_prepared_or_submitted(row_engine, tiny_loaded):
    too_long = RowTask("long", "row-long", [7] * (tiny_loaded.context_length + 5), GREEDY)
    outside = RowTask("vocab", "row-vocab", [1, 2, 10**7], GREEDY)
    submitted = _run(row_engine, [too_long, outside])
    prepared = [row_engine.prepare(too_long), row_engine.prepare(outside)]
    assert all(p.refused is not None and p.group is None for p in prepared)
    assert _run(row_engine, prepared) == submitted
    assert submitted["long"][1].startswith("row-long: ") and "context" in submitted["long"][1]
    assert submitted["vocab"][2] == "request"


def test_rows_the_loop_must_prepare_are_left_to_submit(row_engine):
    """Score rows (their continuations tokenized), constrained rows (the grammar compiler is the loop's) and image
    rows are prepared when submitted, on the stepping thread."""
    score = RowTask("s", "row-s", [5, 6, 7, 8], GREEDY, candidates=(" yes", " no"))
    choice = RowTask("c", "row-c", [5, 6, 7, 9], SamplingParams(temperature=0.0, max_tokens=4,
                                                                constraint=OutputConstraint("choice", ("a", "b"))))
    items = [row_engine.prepare(score), row_engine.prepare(choice)]
    assert all(p.group is None and p.refused is None for p in items)
    done = _run(row_engine, items)
    assert done["s"][1] is None and done["c"][1] is None


def test_a_key_in_flight_is_refused_when_queued_not_when_prepared(row_engine):
    """As a second ``add_request`` of a key in flight is: the row runs once, the second comes back as an error."""
    first, again = row_engine.prepare(_tasks(1)[0]), row_engine.prepare(_tasks(1)[0])
    assert first.group is not None and again.group is not None  # (nothing is in flight while preparing)
    row_engine.submit(first)
    row_engine.submit(again)
    back = []
    while row_engine.has_work:
        back += row_engine.step()
    assert sorted((d.key, d.error is None) for d in back) == [("k0", False), ("k0", True)]
    assert next(d for d in back if d.error).error == "row0: request_id='k0': already in flight"
