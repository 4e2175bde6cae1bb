"""Checkpoints that lie: a shard whose bytes changed, a zeroed checksum, a broken manifest. Nothing wrong is published,
nothing right is lost: bad shards are set aside and their rows redone, a broken manifest is rebuilt from the shards."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jobkit import texts, write_job, write_jsonl

from mlxbatch.job.check.validate import validate_job
from mlxbatch.job.run.runner import JobRunner

ROWS = 30


def results(out):
    return {r["id"]: (r["text"], r["generated_tokens"], r["error"])
            for r in pq.read_table(out / "results.parquet").to_pylist()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_path):
    root = tmp_path_factory.mktemp("faults")
    data = write_jsonl(root / "in.jsonl", texts(ROWS))
    run(job_in(root / "ref", tiny_model_path, data))
    return data, results(root / "ref" / "out")


def job_in(folder, model, data):
    folder.mkdir()
    return write_job(folder, model, data, folder / "out", sampling={"temperature": 0, "max_tokens": 6},
                     checkpoint={"every_rows": 8})


def run(job, runner=JobRunner):
    return runner(validate_job(job), progress=False).run()


def shard_rows(out, name):
    """The rows the manifest lists for shard ``name``."""
    return next(s["rows"] for s in json.loads((out / "manifest.json").read_text())["shards"] if s["name"] == name)


def flip_a_generated_byte(out):
    """Change one byte of a shard's text data: same size, still a readable Arrow file."""
    shard = sorted((out / "shards").glob("shard-*.arrow"))[0]
    data = bytearray(shard.read_bytes())
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["shards"][0]["bytes"] == len(data)
    texts_ = [t for t in pa.ipc.open_file(pa.py_buffer(bytes(data))).read_all().column("text").to_pylist() if t]
    i = data.find(texts_[0].encode())  # a generated text: the corruption would show in the results
    assert i > 0
    data[i] ^= 0x01
    shard.write_bytes(bytes(data))
    return shard.name


def test_a_flipped_byte_in_a_shard_is_found_on_resume_and_its_rows_redone(tmp_path, tiny_model_path, reference):
    data, expected = reference
    job = job_in(tmp_path / "j", tiny_model_path, data)
    run(job)
    out = job.parent / "out"
    name = flip_a_generated_byte(out)
    rows = shard_rows(out, name)  # 8 (every_rows), or more where rows waited for the writer (``Checkpointer``)
    report = run(job).report
    assert report["rows"]["finished_this_run"] == rows and report["rows"]["resumed"] == ROWS - rows
    assert results(out) == expected
    assert (out / "shards" / "corrupt" / name).exists()


def test_a_zeroed_checksum_in_the_manifest_is_not_accepted(tmp_path, tiny_model_path, reference):
    data, expected = reference
    job = job_in(tmp_path / "j", tiny_model_path, data)
    run(job)
    out = job.parent / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["shards"][1]["sha256"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert run(job).report["rows"]["finished_this_run"] == manifest["shards"][1]["rows"]
    assert results(out) == expected


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_a_broken_manifest_does_not_block_resume(tmp_path, tiny_model_path, reference, damage):
    data, expected = reference
    job = job_in(tmp_path / "j", tiny_model_path, data)
    run(job)
    out = job.parent / "out"
    text = (out / "manifest.json").read_text()
    (out / "manifest.json").write_text("" if damage == "empty" else text[: len(text) // 3])
    report = run(job).report
    assert report["rows"]["resumed"] == ROWS and report["rows"]["finished_this_run"] == 0  # nothing redone
    assert results(out) == expected and (out / "_SUCCESS").exists()


class CorruptAfterFirstPass(JobRunner):
    """A disk that changes a shard while the run is going: after the rows ran, before the results are written."""

    passes = 0

    def _generate(self, *args, **kwargs):
        stats = super()._generate(*args, **kwargs)
        CorruptAfterFirstPass.passes += 1
        if CorruptAfterFirstPass.passes == 1:
            flip_a_generated_byte(self.spec.output)
        return stats


def test_shards_are_verified_before_the_results_are_written(tmp_path, tiny_model_path, reference):
    data, expected = reference
    job = job_in(tmp_path / "j", tiny_model_path, data)
    run(job, CorruptAfterFirstPass)
    out = job.parent / "out"
    assert CorruptAfterFirstPass.passes == 2  # the rows of the bad shard ran again
    assert results(out) == expected
    assert list((out / "shards" / "corrupt").iterdir())
