"""Structured output in jobs: constrained rows parse, a cut JSON is an error row that says so, bad constraints are
rejected by validate (job file) or become row errors (per-row column)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from jobkit import write_job, write_jsonl

from mlxbatch.job.check.validate import validate_job
from mlxbatch.job.run.runner import JobRunner
from mlxbatch.job.spec import JobSpecError

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["pos", "neg"]}, "score": {"type": "integer"}},
          "required": ["label", "score"], "additionalProperties": False}


def rows(n: int) -> list[dict]:
    return [{"id": f"r{i}", "text": f"review number {i} was {'good' if i % 2 else 'bad'}"} for i in range(n)]


def run(tmp_path, model, data, **kw):
    job = write_job(tmp_path, model, data, tmp_path / "out", max_error_rate=1.0, **kw)
    report = JobRunner(validate_job(job), progress=False).run().report
    return report, {r["id"]: r for r in pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()}


def test_choice_and_per_row_constraints(tmp_path, tiny_model_path):
    data = rows(8)
    data[1]["c"] = {"regex": "[0-9]{3}"}
    data[2]["c"] = {"choice": ["maybe"]}
    data[3]["c"] = {"regex": "(unclosed"}  # invalid: a row error, the job goes on
    data[4]["c"] = {"bogus": 1}  # not a constraint: a row error
    path = write_jsonl(tmp_path / "in.jsonl", data)
    _, out = run(tmp_path, tiny_model_path, path,
                 output={"path": str(tmp_path / "out"), "choice": ["yes", "no"], "constraint_column": "c"},
                 sampling={"temperature": 0.7, "max_tokens": 8})
    assert all(out[f"r{i}"]["text"] in ("yes", "no") for i in (0, 5, 6, 7))
    assert len(out["r1"]["text"]) == 3 and out["r1"]["text"].isdigit() and out["r2"]["text"] == "maybe"
    assert out["r3"]["error_kind"] == "constraint" and "r3" in out["r3"]["error"]
    assert out["r4"]["error_kind"] == "params" and "choice, regex, json_schema" in out["r4"]["error"]


def test_json_schema_rows_get_a_parsed_column_and_cut_rows_say_so(tmp_path, tiny_model_path):
    data = rows(6)
    for r in data:
        r["limit"] = 40
    data[5]["limit"] = 3  # too few tokens to close the object
    path = write_jsonl(tmp_path / "in.jsonl", data)
    _, out = run(tmp_path, tiny_model_path, path, output={"path": str(tmp_path / "out"), "json_schema": SCHEMA},
                 sampling={"temperature": 0, "max_tokens": 40, "overrides": {"max_tokens": "limit"}})
    for r in (out[f"r{i}"] for i in range(5)):
        assert r["error"] is None and r["parsed"] == json.loads(r["text"])
        assert r["parsed"]["label"] in ("pos", "neg") and isinstance(r["parsed"]["score"], int)
    cut = out["r5"]
    assert cut["error_kind"] == "truncated" and "max_tokens=3" in cut["error"]
    assert cut["text"] and cut["parsed"] is None and cut["finish_reason"] == "length"


@pytest.mark.parametrize("output, key", [({"regex": "(unclosed"}, "output.regex"),
                                         ({"json_schema": {"type": "nope"}}, "output.json_schema")])
def test_validate_rejects_a_constraint_that_does_not_compile(tmp_path, tiny_model_path, output, key):
    path = write_jsonl(tmp_path / "in.jsonl", rows(2))
    job = write_job(tmp_path, tiny_model_path, path, tmp_path / "out", output={"path": "out", **output})
    with pytest.raises(JobSpecError) as info:
        validate_job(job)
    assert [k for k, _ in info.value.problems] == [key]
