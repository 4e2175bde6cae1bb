"""The feed reads the input once, beside the engine: the same items in the background as inline, a reader's failure
raised where rows are taken, and a run that reads and prepares every row exactly once (its results written from
the rows as they were read)."""

from __future__ import annotations

import json
import threading
import time

import pyarrow.parquet as pq
import pytest

from mlxbatch.engine import prompt_block_hashes
from mlxbatch.io import InputError, open_reader
from mlxbatch.io.expected import ExpectedSpool
from mlxbatch.job.check.validate import input_spec, validate_job
from mlxbatch.job.rows.feed import Failed, RowFeed, Submit
from mlxbatch.job.rows.prepare import RowPreparer
from mlxbatch.job.run.runner import JobRunner
from tests.job.jobkit import texts, write_job, write_jsonl


def _items(feed: RowFeed) -> list[tuple]:
    out = []
    while not feed.finished:
        for item in feed.take(7):
            if isinstance(item, Submit):
                # a text row comes with its prompt's block hashes, the prefix index's keys, made off the step loop
                assert item.block_hashes == (prompt_block_hashes(item.token_ids) if item.token_ids else None)
                out.append(("submit", item.index, tuple(item.token_ids or ()), item.cache_tokens))
            elif isinstance(item, Failed):
                out.append(("failed", item.index, item.kind))
            else:
                out.append(("resumed", item.index, item.error))
    feed.close()
    return out


def test_background_feed_hands_out_what_the_inline_feed_does(tmp_path, tiny_model_path, tiny_loaded):
    rows = texts(40)
    path = write_jsonl(tmp_path / "in.jsonl", rows, extra_lines=[b"{not json"])
    spec = validate_job(write_job(tmp_path, tiny_model_path, path, tmp_path / "out", plan={"window": 9}))
    done_keys = {RowPreparer(spec, "identity").prepare(r).key for r in list(open_reader(input_spec(spec)))[:5]}

    def feed(background: bool, spool: ExpectedSpool | None = None) -> RowFeed:
        return RowFeed(open_reader(input_spec(spec)), RowPreparer(spec, "identity"), tiny_loaded.tokenizer,
                       done_keys, window=9, spool=spool, background=background)

    spool = ExpectedSpool(tmp_path)
    inline, background = _items(feed(False)), _items(feed(True, spool))
    assert background == inline
    assert sum(1 for i in inline if i[0] == "resumed") == 5 and any(i[0] == "failed" for i in inline)
    assert sorted(i[1] for i in inline) == list(range(41))  # every row once, by input position
    # the spool holds every row read, in input order, with its key (the final Parquet is written from it)
    assert spool.complete
    again = RowPreparer(spec, "identity")
    cols = spool.columns()
    assert list(zip(cols.row_ids.to_pylist(), cols.keys.to_pylist())) == [
        (p.row_id, p.key) for p in map(again.prepare, open_reader(input_spec(spec)))]
    spool.remove()
    assert not spool.path.exists()


def test_a_reader_failure_is_raised_where_rows_are_taken(tmp_path, tiny_model_path, tiny_loaded):
    path = write_jsonl(tmp_path / "in.jsonl", texts(4))
    spec = validate_job(write_job(tmp_path, tiny_model_path, path, tmp_path / "out"))

    def rows():
        yield from open_reader(input_spec(spec))
        raise InputError("the disk went away")

    feed = RowFeed(rows(), RowPreparer(spec, "identity"), tiny_loaded.tokenizer, set(), window=2, background=True)
    with pytest.raises(InputError, match="the disk went away"):
        while not feed.finished:
            feed.take(100)
    feed.close()


def test_an_engine_with_rows_in_hand_is_never_held_by_a_window_in_preparation(tmp_path, tiny_model_path,
                                                                             tiny_loaded):
    """``take(wait=False)`` (the engine has rows to run) hands out what is ready and returns at once, also at the end
    of a window; ``take(wait=True)`` (an idle engine) waits only while nothing at all is in hand."""
    path = write_jsonl(tmp_path / "in.jsonl", texts(9))
    spec = validate_job(write_job(tmp_path, tiny_model_path, path, tmp_path / "out"))
    more = threading.Event()  # the input's second window is read only once this is set (a slow disk)

    def rows():
        for i, row in enumerate(open_reader(input_spec(spec))):
            if i == 4:
                more.wait(10)
            yield row

    feed = RowFeed(rows(), RowPreparer(spec, "identity"), tiny_loaded.tokenizer, set(), window=4, background=True)
    assert len(feed.take(3)) == 3  # waits for the first window (nothing in hand)
    assert len(feed.take(100)) == 1  # the window's last row: not held back for the next window
    t0 = time.monotonic()
    assert feed.take(100, wait=False) == []  # the next window is being read: nothing ready, no wait
    assert time.monotonic() - t0 < 1.0
    more.set()
    got = feed.take(100)  # an idle engine waits for it
    assert len(got) == 4 and not feed.finished
    feed.close()


def test_close_stops_the_reader_thread(tmp_path, tiny_model_path, tiny_loaded):
    path = write_jsonl(tmp_path / "in.jsonl", texts(50))
    spec = validate_job(write_job(tmp_path, tiny_model_path, path, tmp_path / "out"))
    feed = RowFeed(open_reader(input_spec(spec)), RowPreparer(spec, "identity"), tiny_loaded.tokenizer, set(),
                   window=2, background=True, ahead=1)
    assert len(feed.take(1)) == 1  # the thread is reading ahead now, blocked on the full hand-over queue
    feed.close()
    assert feed._thread is not None and not feed._thread.is_alive()


def test_a_run_reads_and_prepares_each_row_once(tmp_path, tiny_model_path, monkeypatch):
    """The input is read once per run (count_rows' count aside) and each row rendered and keyed once: the results
    are written from what that pass recorded."""
    import mlxbatch.job.run.runner as runner_mod

    rows = texts(30)
    path = write_jsonl(tmp_path / "in.jsonl", rows, extra_lines=[b"{not json"])
    job = write_job(tmp_path, tiny_model_path, path, tmp_path / "out", sampling={"temperature": 0, "max_tokens": 3},
                    plan={"window": 8})
    spec = validate_job(job)
    opened, prepared = [], []
    real_open, real_prepare = runner_mod.open_reader, RowPreparer.prepare
    monkeypatch.setattr(runner_mod, "open_reader", lambda *a, **kw: opened.append(1) or real_open(*a, **kw))
    monkeypatch.setattr(RowPreparer, "prepare", lambda self, row: prepared.append(row.row_id) or real_prepare(self, row))
    JobRunner(spec, progress=False).run()
    assert len(opened) == 1
    assert len(prepared) == len(set(prepared)) == 31
    table = pq.read_table(tmp_path / "out" / "results.parquet")
    assert table.column("id").to_pylist()[:30] == [r["id"] for r in rows]  # input order
    assert table.num_rows == 31 and table.column("error_kind").to_pylist()[30] is not None
    assert not list((tmp_path / "out").glob("*.tmp"))  # the spool is gone
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["rows"]["output"] == 31 and report["rows"]["errors"] == 1


def test_a_run_starts_with_smaller_windows_and_its_plan_cuts_the_same(tmp_path, tiny_model_path, tiny_loaded):
    """The engine's first rows wait for the first window to be read, prepared and planned: a run cuts its input into
    windows of 1/8, 1/4 and 1/2 of ``plan.window`` first (those of ``MIN_RAMP_ROWS`` or more), then whole ones, and
    ``mlxbatch plan`` cuts the same; a resumed run whose first run had no ramp keeps none."""
    from itertools import islice

    from mlxbatch.io import CheckpointStore
    from mlxbatch.job.plan.predict import plan_job
    from mlxbatch.job.run.run_meta import follow_saved_plan
    from mlxbatch.job.spec.sections import MIN_RAMP_ROWS, window_sizes

    assert list(islice(window_sizes(10_000), 5)) == [1250, 2500, 5000, 10_000, 10_000]
    assert list(islice(window_sizes(10_000, ramp=False), 2)) == [10_000, 10_000]
    assert MIN_RAMP_ROWS == 64 and list(islice(window_sizes(200), 3)) == [100, 200, 200]  # 25 and 50: too few
    path = write_jsonl(tmp_path / "in.jsonl", texts(300))
    spec = validate_job(write_job(tmp_path, tiny_model_path, path, tmp_path / "out", plan={"window": 256}))
    assert spec.plan.ramp
    feed = RowFeed(open_reader(input_spec(spec)), RowPreparer(spec, "identity"), tiny_loaded.tokenizer, set(),
                   window=256, ramp=True)
    cut = []
    while not feed.finished:
        cut.append(sorted(item.index for item in feed.take_window()))
    feed.close()
    assert [len(w) for w in cut] == [64, 128, 108] and cut[0] == list(range(64))  # by input position
    assert feed.stats.windows == 3 and plan_job(spec, with_eta=False).windows == 3
    with CheckpointStore(tmp_path / "old") as store:  # a first run before the ramp saved this
        store.set_meta("plan", {"window": 256, "enabled": True, "order": "trie-largest-first"})
        assert not follow_saved_plan(store, spec).plan.ramp
