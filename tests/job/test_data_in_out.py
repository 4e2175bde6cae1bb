"""Data in and out as users have it: datasets by name, output folders `datasets` reads, OpenAI Batch bodies as vLLM
takes them, input column types and a stable ``parsed`` column."""

from __future__ import annotations

import datetime as dt
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jobkit import texts, write_job, write_jsonl

from mlxbatch.job.check.validate import validate_job
from mlxbatch.job.run.runner import JobRunner


def run(job):
    return JobRunner(validate_job(job), progress=False).run()


def with_input(job, section):
    """The job file with its input section replaced."""
    import yaml

    raw = yaml.safe_load(job.read_text())
    raw["input"] = section
    job.write_text(yaml.safe_dump(raw))
    return job


def test_a_dataset_by_name_offline_says_which_setting_and_a_local_folder_is_read(tmp_path, tiny_model_path,
                                                                                 monkeypatch):
    from click.testing import CliRunner

    from mlxbatch.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty cache
    job = with_input(write_job(tmp_path, tiny_model_path, tmp_path / "unused", tmp_path / "out"),
                     {"dataset": "someone/some-dataset", "split": "train", "id_column": "id"})
    res = CliRunner().invoke(main, ["validate", str(job)])
    assert res.exit_code == 2 and "input.dataset" in res.output
    assert "not in the local Hugging Face cache, and HF_HUB_OFFLINE is set" in res.output
    folder = tmp_path / "local-ds"
    folder.mkdir()
    write_jsonl(folder / "part-0.jsonl", texts(4))
    write_jsonl(folder / "part-1.jsonl", texts(7)[4:])
    job = with_input(write_job(tmp_path, tiny_model_path, tmp_path / "unused", tmp_path / "out"),
                     {"dataset": str(folder), "id_column": "id"})
    run(job)
    ids = pq.read_table(tmp_path / "out" / "results.parquet").column("id").to_pylist()
    assert ids == [f"row-{i:04d}" for i in range(7)]


def test_a_saved_dataset_folder_given_as_input_dataset_is_pointed_to_input_path(tmp_path, tiny_model_path):
    """QA: `input.dataset:` naming a `save_to_disk` folder failed with advice to set HF_HUB_OFFLINE; the folder is
    read through input.path."""
    import datasets
    from click.testing import CliRunner

    from mlxbatch.cli import main

    folder = tmp_path / "saved-ds"
    datasets.Dataset.from_list(texts(5)).save_to_disk(str(folder))
    job = with_input(write_job(tmp_path, tiny_model_path, tmp_path / "unused", tmp_path / "out"),
                     {"dataset": str(folder), "id_column": "id"})
    res = CliRunner().invoke(main, ["validate", str(job)])
    assert res.exit_code == 2, res.output
    assert "HF_HUB_OFFLINE" not in res.output, res.output
    assert "saved with save_to_disk" in res.output and "input.path" in res.output, res.output
    run(with_input(job, {"path": str(folder), "id_column": "id"}))  # as the message says: it reads
    assert pq.read_table(tmp_path / "out" / "results.parquet").num_rows == 5


def test_the_output_folder_loads_with_datasets(tmp_path, tiny_model_path):
    import datasets

    data = write_jsonl(tmp_path / "in.jsonl", texts(6))
    run(write_job(tmp_path, tiny_model_path, data, tmp_path / "out"))
    ds = datasets.load_dataset(str(tmp_path / "out"), split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert ds.num_rows == 6 and ds[0]["id"] == "row-0000" and "text" in ds.column_names


def test_openai_batch_text_parts_response_format_and_logprobs(tmp_path, tiny_model_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    lines = [
        {"custom_id": "parts", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say"},
                                                            {"type": "text", "text": "hi"}]}],
                  "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2}},
        {"custom_id": "schema", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "A number?"}], "max_tokens": 24, "temperature": 0,
                  "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}},
        {"custom_id": "object", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "JSON?"}], "max_tokens": 24, "temperature": 0,
                  "response_format": {"type": "json_object"}}},
        {"custom_id": "completion", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Once", "max_tokens": 3, "temperature": 0, "logprobs": 1}},
        {"custom_id": "completion-0", "method": "POST", "url": "/v1/completions",  # the sampled token's only
         "body": {"prompt": "Twice", "max_tokens": 3, "temperature": 0, "logprobs": 0}},
        {"custom_id": "bad-format", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}},
    ]
    data = write_jsonl(tmp_path / "batch.jsonl", lines)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out",
                    input={"path": str(data), "id_column": None, "format": "openai-batch"}, max_error_rate=1.0)
    run(job)
    out = {o["custom_id"]: o for o in map(json.loads, (tmp_path / "out" / "openai_output.jsonl").read_text()
                                          .splitlines())}
    results = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()}
    choice = out["parts"]["response"]["body"]["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == results["parts"]["generated_tokens"] and len(content[0]["top_logprobs"]) == 2
    joined, text = "".join(c["token"] for c in content), choice["message"]["content"]
    # the tokens spell the text; mlx-lm's BPE streaming detokenizer (the engine's text) drops a leading space
    assert joined == text or (joined.startswith(" ") and joined[1:] == text), (joined, text)
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    assert isinstance(json.loads(out["schema"]["response"]["body"]["choices"][0]["message"]["content"])["n"], int)
    obj = results["object"]  # constrained to a JSON object (a random model may not close it in 24 tokens)
    assert obj["text"].startswith("{") and (obj["error"] is None or obj["error_kind"] == "truncated")
    assert out["schema"]["response"]["body"]["choices"][0]["logprobs"] is None  # it did not ask
    lp = out["completion"]["response"]["body"]["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 3
    # completions' integer logprobs is the alternatives per token: one dict entry each (was {} for every token)
    assert [len(top) for top in lp["top_logprobs"]] == [1, 1, 1], lp["top_logprobs"]
    assert all(isinstance(x, float) for top in lp["top_logprobs"] for x in top.values())
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    lp0 = out["completion-0"]["response"]["body"]["choices"][0]["logprobs"]
    assert len(lp0["token_logprobs"]) == 3 and lp0["top_logprobs"] == [{}, {}, {}]
    errors = [json.loads(line) for line in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    bad = {e["custom_id"]: e["error"] for e in errors}["bad-format"]
    assert bad["code"] == "params" and "response_format" in bad["message"]
    assert results["parts"]["logprobs"][0]["token"] == content[0]["token"]  # token strings beside the ids


def test_openai_batch_n_samples_are_every_choice_of_the_response(tmp_path, tiny_model_path):
    """A request with ``n: 3`` was sampled three times (``samples``, usage counting every token), but its response
    had one choice: the other samples were lost from openai_output.jsonl."""
    lines = [{"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "n": 3,
                       "temperature": 0.9, "seed": 1}},
             {"custom_id": "completion", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "Once", "max_tokens": 3, "n": 2, "temperature": 0.9, "seed": 2}},
             {"custom_id": "one", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Say bye"}], "max_tokens": 4}}]
    data = write_jsonl(tmp_path / "batch.jsonl", lines)
    run(write_job(tmp_path, tiny_model_path, data, tmp_path / "out",
                  input={"path": str(data), "id_column": None, "format": "openai-batch"}))
    out = {o["custom_id"]: o["response"]["body"] for o in map(json.loads, (tmp_path / "out" / "openai_output.jsonl")
                                                              .read_text().splitlines())}
    results = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()}
    for rid, n, text_of in (("chat", 3, lambda c: c["message"]["content"]), ("completion", 2, lambda c: c["text"]),
                            ("one", 1, lambda c: c["message"]["content"])):
        choices = out[rid]["choices"]
        assert [c["index"] for c in choices] == list(range(n)), choices
        assert [text_of(c) for c in choices] == (results[rid]["samples"] or [results[rid]["text"]])
        assert all(c["finish_reason"] in ("stop", "length") for c in choices), choices
        assert choices[0]["finish_reason"] == results[rid]["finish_reason"]


def test_input_types_survive_the_shards_and_a_resume(tmp_path, tiny_model_path):
    n = 8
    table = pa.table({
        "id": [f"r{i}" for i in range(n)],
        "text": [f"item {i}" for i in range(n)],
        "at": pa.array([dt.datetime(2024, 5, i + 1, 12, 30, 15, 123456) for i in range(n)], pa.timestamp("us")),
        "day": pa.array([dt.date(2024, 1, i + 1) for i in range(n)], pa.date32()),
        "small": pa.array(range(n), pa.int32()),
        "blob": pa.array([bytes([i, 255]) for i in range(n)], pa.binary()),
        "tags": pa.array([[f"t{i}"] for i in range(n)], pa.list_(pa.string())),
        "money": pa.array([f"{i}.25" for i in range(n)], pa.string()).cast(pa.decimal128(6, 2)),
    })
    pq.write_table(table, tmp_path / "in.parquet")
    job = write_job(tmp_path, tiny_model_path, tmp_path / "in.parquet", tmp_path / "out", sampling={"max_tokens": 2})
    from mlxbatch.job.spec.overrides import JobOverrides

    JobRunner(validate_job(job, JobOverrides(limit=3)), progress=False).run()  # a trial, then the rest resumes
    report = run(job).report
    assert report["rows"]["resumed"] == 3
    got = pq.read_table(tmp_path / "out" / "results.parquet")
    for name in ("at", "day", "small", "blob", "tags", "money"):
        assert got.schema.field(name).type == table.schema.field(name).type, name
        assert got.column(name).to_pylist() == table.column(name).to_pylist(), name


@pytest.mark.parametrize("constraint, expected", [
    ({"json_schema": {"type": "object", "properties": {"n": {"type": "integer"}, "name": {"type": "string"},
                                                       "tags": {"type": "array", "items": {"type": "string"}}},
                      "required": ["n", "name", "tags"]}},  # in sorted order: the test's YAML writer sorts keys
     pa.struct([("n", pa.int64()), ("name", pa.string()), ("tags", pa.list_(pa.string()))])),
    ({"regex": "[a-z]{3,40}"}, pa.string()),
])
def test_parsed_has_the_constraints_type_even_when_no_row_parses(tmp_path, tiny_model_path, constraint, expected):
    rows = texts(6)
    for r in rows:
        r["budget"] = 2  # too short for any row to finish its output: every row is cut (truncated)
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", max_error_rate=1.0,
                    sampling={"temperature": 0, "overrides": {"max_tokens": "budget"}},
                    output={"path": str(tmp_path / "out"), **constraint})
    run(job)
    got = pq.read_table(tmp_path / "out" / "results.parquet")
    assert str(got.schema.field("parsed").type).replace("element:", "item:") == str(expected)  # Parquet's list name
    if "regex" not in constraint:
        assert got.column("parsed").null_count == 6
        assert set(got.column("error_kind").to_pylist()) == {"truncated"}


def test_input_columns_named_like_task_columns_are_renamed_not_the_results_dropped(tmp_path, tiny_model_path):
    """An input column named ``correct``, ``parsed`` or ``samples`` took the place of the task's own column: the
    computed values were dropped from results.parquet, and with the gold column named ``correct`` the run then
    crashed with a traceback (its strings read as the accuracy's booleans)."""
    rows = [{**r, "correct": "yes" if i % 2 else "no", "parsed": i, "samples": f"s{i}"} for i, r in enumerate(texts(6))]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    report = run(write_job(tmp_path, tiny_model_path, data, out, max_error_rate=1.0,
                           sampling={"n": 2, "max_tokens": 4},
                           output={"path": str(out), "choice": ["yes", "no"], "gold": "correct"})).report
    table = pq.read_table(out / "results.parquet")
    assert table.column("input_correct").to_pylist() == [r["correct"] for r in rows]
    assert table.column("input_parsed").to_pylist() == [r["parsed"] for r in rows]
    assert table.column("input_samples").to_pylist() == [r["samples"] for r in rows]
    got = table.to_pylist()
    assert all(len(r["samples"]) == 2 and r["samples"][0] == r["text"] for r in got)
    assert table.schema.field("correct").type == pa.bool_()
    ok = [r for r in got if r["error"] is None]
    assert all(r["parsed"] == r["text"] and r["correct"] == (r["text"] == r["input_correct"]) for r in ok)
    assert report["accuracy"]["answered"] == len(ok)


def test_openai_batch_endpoints_survive_input_columns_that_leave_url_out(tmp_path, tiny_model_path):
    """With input.columns keeping only custom_id (the bodies are big), a /v1/completions request was answered as a
    chat.completion: the writer took each row's endpoint from the results' kept `url` column, else chat."""
    lines = [{"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}},
             {"custom_id": "completion", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "Once", "max_tokens": 3, "temperature": 0, "logprobs": 0}}]
    data = write_jsonl(tmp_path / "batch.jsonl", lines)
    run(write_job(tmp_path, tiny_model_path, data, tmp_path / "out",
                  input={"path": str(data), "id_column": None, "columns": ["custom_id"]}))
    assert "url" not in pq.read_table(tmp_path / "out" / "results.parquet").column_names
    out = {o["custom_id"]: o["response"]["body"] for o in map(json.loads, (tmp_path / "out" / "openai_output.jsonl")
                                                              .read_text().splitlines())}
    assert out["chat"]["object"] == "chat.completion" and "message" in out["chat"]["choices"][0]
    assert out["completion"]["object"] == "text_completion" and "text" in out["completion"]["choices"][0]
    assert len(out["completion"]["choices"][0]["logprobs"]["tokens"]) == 3
