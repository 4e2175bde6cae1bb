"""Image paths in jobs (#12, #16): only files inside the input's folder or ``input.image_roots`` are read, only
regular files, and a FIFO, a device or a path that escapes is that row's error while the job goes on."""

from __future__ import annotations

import io
import os

import pyarrow.parquet as pq
import pytest
from jobkit import write_job, write_jsonl

from mlxbatch.job.spec import JobSpecError, load_job

ASK = {"template": None, "messages": [{"role": "user", "content": "{{ question }}"}]}


def test_image_roots_are_folders_resolved_from_the_job_file(tmp_path, tiny_model_path):
    (tmp_path / "photos").mkdir()
    data = write_jsonl(tmp_path / "rows.jsonl", [{"id": "a", "question": "?"}])
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", prompt=ASK,
                    input={"image_roots": ["photos", str(tmp_path / "rows.jsonl"), "nowhere", 3]})
    with pytest.raises(JobSpecError) as err:
        load_job(job)
    keys = [k for k, _ in err.value.problems]
    assert keys == ["input.image_roots[1]", "input.image_roots[2]", "input.image_roots[3]"], err.value.problems
    assert "expected an existing folder" in str(err.value)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", prompt=ASK, input={"image_roots": "photos"})
    with pytest.raises(JobSpecError, match="input.image_roots: expected list, got str"):
        load_job(job)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", prompt=ASK, input={"image_roots": ["photos"]})
    assert load_job(job).input.image_roots == (str(tmp_path / "photos"),)


def test_hostile_image_paths_are_row_errors_and_allowed_roots_open_up(tmp_path, tiny_vlm_path):
    pytest.importorskip("mlx_vlm")
    from mlxbatch.job.check.validate import validate_job
    from mlxbatch.job.run.runner import JobRunner
    from mlxbatch.models.random_vlm import synthetic_image

    data, photos = tmp_path / "data", tmp_path / "photos"
    data.mkdir()
    photos.mkdir()
    buf = io.BytesIO()
    synthetic_image(1).save(buf, "PNG")
    (data / "in.png").write_bytes(buf.getvalue())
    (photos / "out.png").write_bytes(buf.getvalue())
    os.mkfifo(data / "pipe.png")
    (data / "link.png").symlink_to(photos / "out.png")
    rows = [{"id": "inside", "images": "in.png", "question": "What is it?"},
            {"id": "escape", "images": "../photos/out.png", "question": "What is it?"},
            {"id": "link", "images": "link.png", "question": "What is it?"},
            {"id": "fifo", "images": "pipe.png", "question": "What is it?"},
            {"id": "passwd", "images": "/etc/passwd", "question": "What is it?"},
            {"id": "zero", "images": "/dev/zero", "question": "What is it?"}]
    rows_file = write_jsonl(data / "rows.jsonl", rows)
    job = write_job(tmp_path, tiny_vlm_path, rows_file, tmp_path / "out", prompt=ASK,
                    sampling={"temperature": 0.0, "max_tokens": 3}, max_error_rate=1.0)
    JobRunner(validate_job(job), progress=False).run()  # returns: the FIFO does not hang it
    res = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()}
    assert res["inside"]["error"] is None and res["inside"]["generated_tokens"] == 3
    assert res["fifo"]["error_kind"] == "image" and "pipe.png: is a FIFO" in res["fifo"]["error"]
    for rid in ("escape", "link", "passwd", "zero"):
        assert res[rid]["error_kind"] == "image" and "input.image_roots" in res[rid]["error"], res[rid]["error"]
    # the photos folder allowed: its rows run (their keys change with the error gone); inside and fifo are resumed
    # (the refused rows' messages, hence keys, name the allowed folders: they are redone, as errors again)
    job = write_job(tmp_path, tiny_vlm_path, rows_file, tmp_path / "out", prompt=ASK,
                    sampling={"temperature": 0.0, "max_tokens": 3}, max_error_rate=1.0,
                    input={"image_roots": ["photos"]})
    report = JobRunner(validate_job(job), progress=False).run().report
    res = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()}
    assert report["rows"]["finished_this_run"] == 4 and report["rows"]["resumed"] == 2
    assert res["escape"]["error"] is None and res["escape"]["text"] == res["link"]["text"] == res["inside"]["text"]
    assert res["passwd"]["error_kind"] == res["zero"]["error_kind"] == "image"
