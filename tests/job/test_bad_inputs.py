"""The bad-input corpus: one job whose rows break in every way a row can, run to the end.

Every bad row becomes an error row of the right kind with a message naming it, the good rows run, and nothing
stops the job. Kinds covered: input (bad JSON, an unterminated string, not an object, bad UTF-8, no id), duplicate_id,
params, render (missing field, null field, division by zero, int + str, a runaway range), request (a prompt far
beyond the context, refused before tokenizing; an empty prompt), and a generated id that equals a real one (either
first): no two result rows share an id.
"""

from __future__ import annotations

import json
import time

import pyarrow.parquet as pq
from jobkit import texts, write_job, write_jsonl

from mlxbatch.job.check.validate import validate_job
from mlxbatch.job.run.runner import JobRunner

TEMPLATE = "Summarise: {{ text }} ({{ 10 // d }}{{ range(k)|length }}{{ a + b }})\n"


def good(i: int, **changes) -> dict:
    row = {"id": f"row-{i:02d}", "text": f"alpha beta {i}", "d": 1, "k": 0, "a": 0, "b": 0}
    row.update(changes)
    return row


def run(job):
    return JobRunner(validate_job(job), progress=False).run()


def test_every_kind_of_bad_row_is_an_error_row_and_the_job_completes(tmp_path, tiny_model_path):
    rows = [good(i) for i in range(12)]
    rows[1] = good(1, d=0)  # 10 // 0
    rows[2] = good(2, a=1, b="x")  # int + str
    rows[3] = good(3, k=10**9)  # range(10**9)
    rows[4] = good(4, text=None)  # a null printed
    rows[5] = {k: v for k, v in good(5).items() if k != "text"}  # a missing field
    rows[6] = good(6, text="word " * 250_000)  # 1.25 M characters: far beyond a 4096-token context
    rows[7] = good(7, budget=-4)  # a bad override
    rows[8] = good(0, text="again")  # a duplicate id
    rows[9] = good(9, id="in.jsonl:16")  # a real id equal to the id line 16 (malformed) would be given
    rows[10] = good(10, id="in:17")  # an id of the old generated form
    extra = [b'{"id": "broken", "text": "unterminated',  # line 13
             b"[1, 2]",  # line 14
             b'{"id": "bad-utf8", "text": "\xff\xfe"}',  # line 15
             b'{"id": "x", "text": ',  # line 16: its generated id must not take row-09's
             b'{"text": "no id here", "d": 1, "k": 0, "a": 0, "b": 0}',  # line 17
             b'{"id": "in.jsonl:14", "text": "late", "d": 1, "k": 0, "a": 0, "b": 0}']  # 18: line 14's id, taken
    data = write_jsonl(tmp_path / "in.jsonl", rows, extra_lines=extra)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", prompt={"template": TEMPLATE},
                    sampling={"temperature": 0, "max_tokens": 4, "overrides": {"max_tokens": "budget"}},
                    max_error_rate=1.0)
    start = time.monotonic()
    report = run(job).report
    assert time.monotonic() - start < 60
    res = pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()
    assert len(res) == 18 and len({r["id"] for r in res}) == 18, [r["id"] for r in res]  # no id twice
    dup = res[8]
    assert dup["id"] == "row-00#2" and dup["error_kind"] == "duplicate_id" and "in.jsonl:9" in dup["error"]
    assert "duplicate id 'row-00'" in dup["error"]
    late = res[17]  # a real id that equals the id an unreadable line before it was given
    assert late["id"] == "in.jsonl:14#2" and late["error_kind"] == "duplicate_id", late
    assert "'in.jsonl:14' (given to an earlier row that had no id of its own" in late["error"]
    by_id = {r["id"]: r for r in res}

    def err(rid, kind, *words):
        r = by_id[rid]
        assert r["error_kind"] == kind, (rid, r["error_kind"], r["error"])
        for w in words:
            assert w in r["error"], (rid, w, r["error"])

    err("row-01", "render", "ZeroDivisionError", "in.jsonl:2")
    err("row-02", "render", "TypeError")
    err("row-03", "render", "range()")
    err("row-04", "render", "'text' is null")
    err("row-05", "render", "'text' is undefined")
    err("row-06", "request", "row-06", "far beyond the model's context of 4,096 tokens", "refused before tokenizing")
    err("row-07", "params", "max_tokens")
    err("in.jsonl:13", "input", "Unterminated string")
    assert "control character" not in by_id["in.jsonl:13"]["error"]
    err("in.jsonl:14", "input", "expected a JSON object")
    err("in.jsonl:15", "input", "invalid UTF-8")
    err("in.jsonl:16#2", "input", "invalid JSON")  # the real in.jsonl:16 came first: the generated one steps aside
    err("in.jsonl:17", "input", "id column 'id' is missing")
    for rid in ("row-00", "row-11", "in.jsonl:16", "in:17"):  # real rows run, none is a duplicate
        assert by_id[rid]["error"] is None and by_id[rid]["generated_tokens"] > 0, by_id[rid]
    assert report["errors_by_kind"] == {"render": 5, "request": 1, "params": 1, "duplicate_id": 2, "input": 5}


def test_a_50_mb_prompt_line_is_refused_before_tokenizing(tmp_path, tiny_model_path):
    rows = [{"id": "small", "text": "hello"}, {"id": "huge", "text": "x" * (50 << 20)}]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", prompt={"template": "{{ text }}"},
                    input={"path": str(data), "id_column": "id", "columns": ["id"]}, max_error_rate=1.0)
    start = time.monotonic()
    run(job)
    assert time.monotonic() - start < 30  # tokenizing 50 MB took over a minute and 8 GB
    res = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()}
    assert res["small"]["error"] is None
    assert res["huge"]["error_kind"] == "request" and "'huge'" in res["huge"]["error"]
    assert "refused before tokenizing" in res["huge"]["error"]


def test_an_empty_prompt_is_a_request_error_that_says_so(tmp_path, tiny_model_path):
    rows = [{"id": "a", "text": "hello"}, {"id": "empty", "text": ""}]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", prompt={"template": "{{ text }}"},
                    max_error_rate=1.0)
    run(job)
    res = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()}
    assert res["empty"]["error_kind"] == "request" and "the prompt is empty" in res["empty"]["error"]
    assert "'[]'" not in res["empty"]["error"]


def test_an_override_column_of_whole_floats_is_taken_as_integers(tmp_path, tiny_model_path):
    """pandas stores an integer column with nulls as float64, so a per-row max_tokens column reads 5.0: every
    row with a value was a `params` error ("max_tokens=5.0: must be an integer") while validate said ok. A
    fractional value is still refused."""
    import pandas as pd

    rows = texts(4)
    frame = pd.DataFrame({"id": [r["id"] for r in rows], "text": [r["text"] for r in rows],
                          "budget": [3, None, 2, None], "k": [5, None, 2.5, None]})
    assert str(frame["budget"].dtype) == "float64"
    frame.to_parquet(tmp_path / "in.parquet")
    job = write_job(tmp_path, tiny_model_path, tmp_path / "in.parquet", tmp_path / "out", max_error_rate=1.0,
                    sampling={"temperature": 0, "max_tokens": 6, "overrides": {"max_tokens": "budget",
                                                                                "top_k": "k"}})
    res = {r["id"]: r for r in pq.read_table(run(job).out_dir + "/results.parquet").to_pylist()}
    got = [(res[r["id"]]["error_kind"], res[r["id"]]["generated_tokens"]) for r in rows]
    assert got[0] == (None, 3) and got[1] == (None, 6) and got[3] == (None, 6), got
    assert got[2][0] == "params" and "top_k=2.5" in res[rows[2]["id"]]["error"]
    assert json.loads(res[rows[0]["id"]]["params"])["max_tokens"] == 3
