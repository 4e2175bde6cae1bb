"""Image rows in jobs (issue #6): paths and Parquet bytes, bad images as row errors, vision-cache stats, resume."""

from __future__ import annotations

import io
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jobkit import write_job, write_jsonl

pytest.importorskip("mlx_vlm")

from mlxbatch.job.check.validate import validate_job  # noqa: E402
from mlxbatch.job.run.runner import JobRunner  # noqa: E402
from mlxbatch.models.random_vlm import synthetic_image  # noqa: E402

ASK = {"template": None, "messages": [{"role": "user", "content": "{{ question }}"}]}


def run(job):
    return JobRunner(validate_job(job), progress=False).run()


def results(out):
    return {r["id"]: r for r in pq.read_table(out / "results.parquet").to_pylist()}


def png(seed: int, size=(112, 112)) -> bytes:
    buf = io.BytesIO()
    synthetic_image(seed, *size).save(buf, "PNG")
    return buf.getvalue()


def image_folder(tmp_path):
    pics = tmp_path / "data" / "pics"
    pics.mkdir(parents=True)
    for seed in (1, 2, 3):
        (pics / f"p{seed}.png").write_bytes(png(seed))
    (pics / "truncated.png").write_bytes(png(4)[:300])
    (pics / "notes.png").write_text("this is not a picture\n")
    (pics / "empty.jpg").write_bytes(b"")
    return pics


def test_image_job_with_bad_files_as_row_errors(tmp_path, tiny_vlm_path):
    image_folder(tmp_path)
    rows = [
        {"id": "a", "images": "pics/p1.png", "question": "What is it?"},
        {"id": "a-again", "images": ["pics/p1.png"], "question": "What colour is it?"},
        {"id": "b", "images": "pics/p2.png", "question": "What is it?"},
        {"id": "two", "images": ["pics/p2.png", "pics/p3.png"], "question": "Compare them."},
        {"id": "text", "question": "No picture here; name a fruit."},
        {"id": "missing", "images": "pics/nowhere.png", "question": "What is it?"},
        {"id": "truncated", "images": "pics/truncated.png", "question": "What is it?"},
        {"id": "not-image", "images": "pics/notes.png", "question": "What is it?"},
        {"id": "empty", "images": ["pics/p1.png", "pics/empty.jpg"], "question": "What is it?"},
        {"id": "folder", "images": "pics", "question": "What is it?"},
    ]
    data = write_jsonl(tmp_path / "data" / "rows.jsonl", rows)
    job = write_job(tmp_path, tiny_vlm_path, data, tmp_path / "out", prompt=ASK,
                    sampling={"temperature": 0.0, "max_tokens": 6}, max_error_rate=0.9)
    report = run(job).report
    res = results(tmp_path / "out")
    assert len(res) == len(rows)
    for rid in ("a", "a-again", "b", "two", "text"):
        assert res[rid]["error"] is None and res[rid]["generated_tokens"] == 6, res[rid]
    expected = {"missing": "nowhere.png: no such file", "truncated": "truncated.png: truncated or corrupt PNG",
                "not-image": "notes.png: not an image", "empty": "empty.jpg: empty file",
                "folder": "pics: is a folder"}
    for rid, words in expected.items():
        assert res[rid]["error_kind"] == "image" and words in res[rid]["error"], res[rid]["error"]
        assert rid in res[rid]["error"] or "rows.jsonl:" in res[rid]["error"]  # names the row
    assert res["a"]["prompt_tokens"] > res["text"]["prompt_tokens"]
    vc = json.loads((tmp_path / "out" / "report.json").read_text())["vision_cache"]
    assert vc == report["vision_cache"]
    # p1 twice (a, a-again) and p2 twice (b, two): 3 distinct pictures encoded; "empty" fails before encoding
    assert vc["images_encoded"] == 3 and vc["hits"] == 2 and vc["misses"] == 3
    assert report["errors_by_kind"] == {"image": 5}

    again = run(job).report  # every key (image digests included) comes out the same: nothing reruns
    assert again["rows"]["resumed"] == len(rows) and again["rows"]["finished_this_run"] == 0
    (tmp_path / "data" / "pics" / "p2.png").write_bytes(png(5))  # a changed picture reruns exactly its rows
    third = run(job).report
    assert third["rows"]["finished_this_run"] == 2 and third["rows"]["resumed"] == len(rows) - 2


def test_parquet_bytes_share_features_with_the_same_picture_as_a_file(tmp_path, tiny_vlm_path):
    pics = tmp_path / "data"
    pics.mkdir()
    (pics / "p1.png").write_bytes(png(1))
    bmp = io.BytesIO()
    synthetic_image(1).save(bmp, "BMP")  # the same pixels, other bytes
    table = pa.table({
        "id": ["file", "png-bytes", "bmp-bytes", "hf-struct", "broken"],
        "images": [["p1.png"], None, None, None, None],
        "image_bytes": [None, png(1), bmp.getvalue(), None, b"\x89PNG\r\n\x1a\n garbage"],
        "question": ["What is it?"] * 5,
    })
    # the images column mixes forms row by row: paths, bytes, HF's {"bytes", "path"} struct
    column = [["p1.png"], [png(1)], [bmp.getvalue()], [{"bytes": png(1), "path": None}], [b"\x89PNG\r\n\x1a\n garbage"]]
    table = table.drop(["images", "image_bytes"]).append_column("images", pa.array(
        [[{"bytes": v if isinstance(v, bytes) else (v["bytes"] if isinstance(v, dict) else None),
           "path": v if isinstance(v, str) else None} for v in row] for row in column]))
    pq.write_table(table, pics / "rows.parquet")
    job = write_job(tmp_path, tiny_vlm_path, pics / "rows.parquet", tmp_path / "out", prompt=ASK,
                    sampling={"temperature": 0.0, "max_tokens": 6}, max_error_rate=0.9,
                    input={"columns": ["id", "question", "images"]})
    report = run(job).report
    res = results(tmp_path / "out")
    texts = {rid: res[rid]["text"] for rid in ("file", "png-bytes", "bmp-bytes", "hf-struct")}
    assert len(set(texts.values())) == 1, texts  # one picture, four encodings: one answer
    assert res["broken"]["error_kind"] == "image" and "broken" in res["broken"]["error"]
    assert report["vision_cache"]["images_encoded"] == 1 and report["vision_cache"]["hits"] == 3


def test_image_row_for_a_text_only_model_is_a_row_error_and_nothing_is_opened(tmp_path, tiny_model_path):
    (tmp_path / "p1.png").write_bytes(png(1))
    os.mkfifo(tmp_path / "pipe.png")  # opened, it would hang the job; read, /dev/zero would fill the memory
    rows = [{"id": "pic", "images": "p1.png", "question": "What is it?"},
            {"id": "text", "question": "Name a fruit."},
            {"id": "pipe", "images": "pipe.png", "question": "What is it?"},
            {"id": "hostile", "images": ["/dev/zero", "../../../../etc/passwd", "nowhere.png"], "question": "?"},
            {"id": "no-images", "images": [], "question": "Name a colour."}]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", prompt=ASK,
                    sampling={"temperature": 0.0, "max_tokens": 4}, max_error_rate=0.9)
    run(job)
    res = results(tmp_path / "out")
    for rid, name in (("pic", "p1.png"), ("pipe", "pipe.png"), ("hostile", "/dev/zero, ../../../../etc/passwd")):
        err = res[rid]["error"]
        assert res[rid]["error_kind"] == "request" and "text-only" in err and name in err, err
        assert f"rows.jsonl:{[r['id'] for r in rows].index(rid) + 1}:" in err  # names the row (file:line)
    for rid in ("text", "no-images"):
        assert res[rid]["error"] is None and res[rid]["generated_tokens"] == 4


def test_status_counts_image_rows_as_the_run_keyed_them(tmp_path, tiny_vlm_path):
    from click.testing import CliRunner

    from mlxbatch.cli import main

    image_folder(tmp_path)
    rows = [{"id": "a", "images": "pics/p1.png", "question": "What is it?"},
            {"id": "b", "images": ["pics/p2.png", "pics/p3.png"], "question": "Compare them."},
            {"id": "text", "question": "Name a fruit."}]
    data = write_jsonl(tmp_path / "data" / "rows.jsonl", rows)
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_vlm_path, data, out, prompt=ASK, sampling={"max_tokens": 3})
    run(job)
    for target in (out, job):  # the image rows' keys hold their images' digests: status must key them so too
        res = CliRunner().invoke(main, ["status", str(target), "--json"])
        assert res.exit_code == 0, res.output
        st = json.loads(res.output)
        assert (st["rows_done"], st["total_rows"], st["errors"], st["stale_records"]) == (3, 3, 0, 0), st


def test_image_markers_in_a_jobs_prompt_place_its_images_and_a_row_without_as_many_is_an_error(tmp_path,
                                                                                               tiny_vlm_path):
    """``<image>`` in the job's message text puts each of a row's images there (tests/engine/test_vlm.py checks where;
    without the markers they go where the model's chat template puts them: another prompt, another key); a row with
    fewer images than markers is an error row that says so, and the job goes on."""
    image_folder(tmp_path)
    rows = [{"id": "two", "images": ["pics/p1.png", "pics/p2.png"], "question": "Which is brighter?"},
            {"id": "one", "images": "pics/p3.png", "question": "Which is brighter?"}]
    data = write_jsonl(tmp_path / "data" / "rows.jsonl", rows)
    marked = {"template": None, "messages": [{"role": "user", "content": "First <image>, then <image>. {{ question }}"}]}
    sampling = {"temperature": 0.0, "max_tokens": 4}
    run(write_job(tmp_path, tiny_vlm_path, data, tmp_path / "out", prompt=marked, sampling=sampling,
                  max_error_rate=0.9))
    res = results(tmp_path / "out")
    assert res["two"]["error"] is None and res["two"]["generated_tokens"] == 4, res["two"]
    assert res["one"]["error_kind"] == "request" and "2 <image> placeholder(s) for 1 image(s)" in res["one"]["error"]
    plain = {"template": None, "messages": [{"role": "user", "content": "First , then . {{ question }}"}]}
    run(write_job(tmp_path, tiny_vlm_path, data, tmp_path / "plain", prompt=plain, sampling=sampling,
                  max_error_rate=0.9))
    other = results(tmp_path / "plain")["two"]
    assert other["error"] is None and other["key"] != res["two"]["key"]


def test_max_image_pixels_scales_large_images_down_before_the_model_sees_them(tmp_path, tiny_vlm_path):
    """``input.max_image_pixels``: a large image costs fewer image tokens; the bound is part of the row's key (a run
    with another bound reruns the image rows, the same bound resumes them); a bound under one image token is refused
    before any work, naming the key."""
    from mlxbatch.job.spec.job import JobSpecError

    pics = tmp_path / "data" / "pics"
    pics.mkdir(parents=True)
    (pics / "big.png").write_bytes(png(1, (224, 224)))
    rows = [{"id": "big", "images": "pics/big.png", "question": "What is it?"},
            {"id": "text", "question": "Name a fruit."}]
    data = write_jsonl(tmp_path / "data" / "rows.jsonl", rows)
    sampling = {"temperature": 0.0, "max_tokens": 3}
    run(write_job(tmp_path, tiny_vlm_path, data, tmp_path / "full", prompt=ASK, sampling=sampling))
    full = results(tmp_path / "full")
    job = write_job(tmp_path, tiny_vlm_path, data, tmp_path / "out", prompt=ASK, sampling=sampling,
                    input={"path": str(data), "id_column": "id", "max_image_pixels": 112 * 112})
    run(job)
    res = results(tmp_path / "out")
    # 224 x 224 is 64 image tokens of this model (28 x 28 pixels each); 112 x 112 is 16: 48 fewer prompt tokens
    assert full["big"]["prompt_tokens"] - res["big"]["prompt_tokens"] == 48 and res["big"]["error"] is None
    assert res["big"]["key"] != full["big"]["key"] and res["text"]["key"] == full["text"]["key"]
    assert run(job).report["rows"]["finished_this_run"] == 0  # the same bound: every row resumes
    for bad in (100, "big", -1):
        job.write_text(job.read_text().replace("max_image_pixels: 12544", f"max_image_pixels: {bad}"))
        with pytest.raises(JobSpecError, match="input.max_image_pixels"):
            validate_job(job)
        job.write_text(job.read_text().replace(f"max_image_pixels: {bad}", "max_image_pixels: 12544"))
