"""OpenAI Batch files handled as the Batch API handles them (issue 49): a structured reply cut by ``max_tokens`` is a
reply, failed requests do not fail the batch unless the job sets ``max_error_rate``, ``image_url`` parts run on a
vision-language model, and API-valid bodies are written without a type warning."""

from __future__ import annotations

import base64
import json
import logging
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jobkit import write_job, write_jsonl

from mlxbatch.job.check.validate import validate_job
from mlxbatch.job.run.runner import JobFailed, JobRunner


def run(job):
    return JobRunner(validate_job(job), progress=False).run()


def lines_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def chat(custom_id, content, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], "temperature": 0, **body}}


def batch_job(folder, model, lines, out, **overrides):
    data = write_jsonl(folder / "batch.jsonl", lines)
    return write_job(folder, model, data, out, input={"path": str(data), "id_column": None}, **overrides)


def documented_error_kinds() -> set[str]:
    """The error kinds README.md lists (the bullets after "an `error_kind`, one of:")."""
    text = (Path(__file__).parents[2] / "README.md").read_text()
    section = text.split("an `error_kind`, one of:", 1)[1].split("\n\n", 1)[0]
    return {kind for line in section.splitlines() if line.startswith("- ")
            for kind in re.findall(r"`([a-z_]+)`", line.split(":", 1)[0])}


def test_a_structured_reply_cut_by_max_tokens_is_a_reply_with_finish_reason_length(tmp_path, tiny_model_path):
    """OpenAI answers a response_format request cut by max_tokens with its partial content and finish_reason "length";
    it went to errors.jsonl (kind truncated). A schema the grammar compiler refuses is an error of kind constraint,
    which the README did not list."""
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    lines = [chat("object", "JSON?", max_tokens=2, response_format={"type": "json_object"}),
             chat("schema", "An answer?", max_tokens=3,  # '{"answer":""}' takes more than 3 tokens
                  response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}),
             chat("guided", "An answer?", max_tokens=3, guided_json=schema),
             chat("bad-schema", "?", response_format={"type": "json_schema",
                                                      "json_schema": {"name": "b", "schema": {"type": "nonsense"}}})]
    run(batch_job(tmp_path, tiny_model_path, lines, tmp_path / "out"))
    out = {o["custom_id"]: o for o in lines_of(tmp_path / "out" / "openai_output.jsonl")}
    errors = {e["custom_id"]: e["error"] for e in lines_of(tmp_path / "out" / "errors.jsonl")}
    assert set(errors) == {"bad-schema"} and set(out) == {"object", "schema", "guided"}
    assert errors["bad-schema"]["code"] == "constraint" and "invalid JSON schema" in errors["bad-schema"]["message"]
    assert "constraint" in documented_error_kinds() and {"truncated", "params", "image"} <= documented_error_kinds()
    results = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()}
    for custom_id, reply in out.items():
        assert reply["error"] is None and reply["response"]["status_code"] == 200
        choice = reply["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("{"), choice
        assert results[custom_id]["error"] is None and results[custom_id]["finish_reason"] == "length"
    with pytest.raises(json.JSONDecodeError):  # really cut: not a complete object
        json.loads(out["schema"]["response"]["body"]["choices"][0]["message"]["content"])


def test_failed_requests_do_not_fail_the_batch_unless_the_job_sets_max_error_rate(tmp_path, tiny_model_path):
    """4 bad requests of 10: the run exited 3 with no _SUCCESS though both files were complete. The Batch API
    completes such a batch and lists the failed requests in the error file; a job's own max_error_rate still rules."""
    lines = [chat(f"ok-{i}", f"Say {i}", max_tokens=2) for i in range(6)]
    lines += [chat(f"bad-{i}", "x", max_tokens=-1) for i in range(4)]
    (tmp_path / "api").mkdir()
    out = tmp_path / "api" / "out"
    report = run(batch_job(tmp_path / "api", tiny_model_path, lines, out)).report
    assert (out / "_SUCCESS").exists() and report["rows"]["errors"] == 4
    assert len(lines_of(out / "openai_output.jsonl")) == 6 and len(lines_of(out / "errors.jsonl")) == 4
    (tmp_path / "strict").mkdir()
    strict = batch_job(tmp_path / "strict", tiny_model_path, lines, tmp_path / "strict" / "out", max_error_rate=0.1)
    with pytest.raises(JobFailed, match="max_error_rate=0.1"):
        run(strict)
    assert not (tmp_path / "strict" / "out" / "_SUCCESS").exists()
    assert len(lines_of(tmp_path / "strict" / "out" / "errors.jsonl")) == 4  # both files are still written


def test_api_valid_bodies_are_written_without_a_type_warning(tmp_path, tiny_model_path, caplog):
    """Fields the API lets take several shapes (a message's content as text or parts, stop as a string or a list,
    logprobs as a flag or a count) made results.parquet warn "incompatible types; writing it as JSON text". They are
    JSON text for every OpenAI input, whatever rows it holds, with no warning."""
    lines = [chat("text", "Hi", max_tokens=2, stop="\n", logprobs=True),
             chat("parts", [{"type": "text", "text": "Hi"}], max_tokens=2, stop=["\n", "."]),
             chat("picture", [{"type": "text", "text": "What is it?"},  # a text-only model: a row error
                              {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]),
             {"custom_id": "completion", "url": "/v1/completions",
              "body": {"prompt": "Once", "max_tokens": 2, "temperature": 0, "logprobs": 1}}]
    with caplog.at_level(logging.WARNING):
        run(batch_job(tmp_path, tiny_model_path, lines, tmp_path / "out"))
    assert "incompatible types" not in caplog.text
    table = pq.read_table(tmp_path / "out" / "results.parquet")
    assert table.schema.field("messages").type == pa.string()
    rows = {r["id"]: r for r in table.to_pylist()}
    assert json.loads(rows["text"]["messages"]) == [{"role": "user", "content": "Hi"}]
    assert rows["picture"]["error_kind"] == "request" and "text-only" in rows["picture"]["error"]


def png_bytes(seed: int) -> bytes:
    import io

    from mlxbatch.models.random_vlm import synthetic_image

    buf = io.BytesIO()
    synthetic_image(seed, 112, 112).save(buf, "PNG")
    return buf.getvalue()


def test_image_url_parts_run_as_image_rows(tmp_path, tiny_vlm_path):
    """An image_url part was "expected text content". Data URLs and local files (inside the allowed folders) run as
    the same picture in an ``images`` column does; a web address is refused (jobs run offline), with what to do."""
    pytest.importorskip("mlx_vlm")
    folder = tmp_path / "data"
    (folder / "pics").mkdir(parents=True)
    picture = png_bytes(1)
    (folder / "pics" / "p1.png").write_bytes(picture)
    data_url = "data:image/png;base64," + base64.b64encode(picture).decode()

    def asking(url):
        return [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}]

    lines = [chat("data-url", asking(data_url), max_tokens=5),
             chat("path", asking("pics/p1.png"), max_tokens=5),
             chat("file-url", asking((folder / "pics" / "p1.png").as_uri()), max_tokens=5),
             chat("web", asking("https://example.com/cat.png"), max_tokens=5),
             chat("outside", asking(str(tmp_path / "elsewhere.png")), max_tokens=5),
             chat("text", "What is it?", max_tokens=5)]
    run(batch_job(folder, tiny_vlm_path, lines, tmp_path / "out"))
    got = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()}
    # the reference: the same picture and question as an images-column row
    ref_data = write_jsonl(tmp_path / "ref.jsonl", [{"id": "ref", "images": "data/pics/p1.png",
                                                      "question": "What is it?"}])
    (tmp_path / "ref").mkdir()
    run(write_job(tmp_path / "ref", tiny_vlm_path, ref_data, tmp_path / "ref" / "out",
                  prompt={"template": None, "messages": [{"role": "user", "content": "{{ question }}"}]},
                  sampling={"temperature": 0, "max_tokens": 5}))
    ref = pq.read_table(tmp_path / "ref" / "out" / "results.parquet").to_pylist()[0]
    for custom_id in ("data-url", "path", "file-url"):
        row = got[custom_id]
        assert row["error"] is None, row["error"]
        assert (row["prompt_tokens"], row["text"]) == (ref["prompt_tokens"], ref["text"]), custom_id
    assert got["text"]["error"] is None and got["text"]["prompt_tokens"] < ref["prompt_tokens"]
    assert got["web"]["error_kind"] == "image" and "not fetched" in got["web"]["error"]
    assert got["outside"]["error_kind"] == "image" and "outside the folders" in got["outside"]["error"]
    errors = {e["custom_id"]: e["error"] for e in lines_of(tmp_path / "out" / "errors.jsonl")}
    assert set(errors) == {"web", "outside"} and errors["web"]["code"] == "image"
