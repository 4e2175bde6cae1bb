"""The output folder: whose it is, what happens when it is locked, full, a file, or edited under the job's feet."""

from __future__ import annotations

import base64
import contextlib
import errno
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from jobkit import texts, write_job, write_jsonl

from mlxbatch.cli import main
from mlxbatch.io import CheckpointError, CheckpointStore
from mlxbatch.job.check.validate import validate_job
from mlxbatch.job.run.runner import JobRunner
from mlxbatch.job.spec import JobSpecError, load_job


def run(job, check=True):
    return JobRunner(validate_job(job) if check else load_job(job), progress=False).run()


def results(out):
    return {r["id"]: r for r in pq.read_table(out / "results.parquet").to_pylist()}


def two_jobs(tmp_path, model):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    data_a = write_jsonl(tmp_path / "a" / "in.jsonl", texts(6))
    data_b = write_jsonl(tmp_path / "b" / "other.jsonl", texts(4))
    out = tmp_path / "out"
    return write_job(tmp_path / "a", model, data_a, out), write_job(tmp_path / "b", model, data_b, out), out


def test_another_jobs_folder_is_refused_naming_both_unless_overwrite(tmp_path, tiny_model_path):
    job_a, job_b, out = two_jobs(tmp_path, tiny_model_path)
    run(job_a)
    before = (out / "results.parquet").read_bytes()
    res = CliRunner().invoke(main, ["validate", str(job_b)])
    assert res.exit_code == 2 and "output.path" in res.output, res.output
    assert str(job_a) in res.output and str(job_b) in res.output and "overwrite" in res.output
    with pytest.raises(JobSpecError, match="another job") as refused:
        run(job_b, check=False)  # the run itself checks too, under the lock
    assert str(job_a) in str(refused.value)
    assert (out / "results.parquet").read_bytes() == before and (out / "_SUCCESS").exists()
    # overwrite: the folder becomes job b's, job a's results are gone
    write_job(tmp_path / "b", tiny_model_path, tmp_path / "b" / "other.jsonl", out,
              output={"path": str(out), "overwrite": True})
    report = run(job_b).report
    assert report["rows"]["resumed"] == 0 and len(results(out)) == 4
    with CheckpointStore(out) as store:
        assert store.num_records == 4 and not list((out / "shards").glob("corrupt/*"))


def test_the_same_job_under_a_new_file_name_resumes(tmp_path, tiny_model_path):
    job_a, _, out = two_jobs(tmp_path, tiny_model_path)
    run(job_a)
    renamed = job_a.rename(job_a.with_name("renamed.yaml"))
    assert run(renamed).report["rows"]["resumed"] == 6


def test_a_folder_belongs_to_the_dataset_a_job_reads_by_name(tmp_path, tiny_model_path):
    import yaml

    out = tmp_path / "out"
    jobs = {}
    for name, n in (("a", 5), ("b", 3)):
        (tmp_path / name).mkdir()
        (tmp_path / f"ds-{name}").mkdir()
        write_jsonl(tmp_path / f"ds-{name}" / "part-0.jsonl", texts(n))
        job = write_job(tmp_path / name, tiny_model_path, tmp_path / "unused", out)
        raw = yaml.safe_load(job.read_text())
        raw["input"] = {"dataset": str(tmp_path / f"ds-{name}"), "id_column": "id"}
        job.write_text(yaml.safe_dump(raw))
        jobs[name] = job
    run(jobs["a"])
    renamed = jobs["a"].rename(jobs["a"].with_name("renamed.yaml"))  # the same job (same dataset): it resumes
    assert run(renamed).report["rows"]["resumed"] == 5
    renamed.unlink()  # gone: a job reading another dataset is still another job
    with pytest.raises(JobSpecError, match="another job"):
        run(jobs["b"])
    assert len(results(out)) == 5


def test_a_folder_of_other_files_is_refused_unless_overwrite(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(3))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out")
    with pytest.raises(JobSpecError, match=r"not mlxbatch outputs \(notes.txt\)"):
        run(job)
    run(write_job(tmp_path, tiny_model_path, data, tmp_path / "out", output={"path": str(tmp_path / "out"),
                                                                            "overwrite": True}))
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine" and len(results(tmp_path / "out")) == 3


def test_an_output_path_that_is_a_file_is_refused_by_validate_and_run(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(3))
    (tmp_path / "out").write_text("not a folder")
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out")
    res = CliRunner().invoke(main, ["validate", str(job)])
    assert res.exit_code == 2 and "output.path" in res.output and "is a file" in res.output, res.output
    with pytest.raises(JobSpecError, match="is a file"):
        run(job, check=False)


@contextlib.contextmanager
def held_by_another_process(out: Path):
    """Another process holds ``out`` (a CheckpointStore open on it) until the block ends; yields that process."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from mlxbatch.io import CheckpointStore; "
                               f"s = CheckpointStore({str(out)!r}); print('held', flush=True); "
                               "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"held"
        yield holder
    finally:
        holder.communicate(b"", timeout=30)


def test_a_locked_folder_is_left_as_it_was(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(3))
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out")
    run(job)
    with held_by_another_process(tmp_path / "out") as holder:
        res = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert res.exit_code == 1, res.output
    assert f"in use by another mlxbatch run (pid {holder.pid})" in res.output, res.output
    assert (tmp_path / "out" / "_SUCCESS").exists(), "a refused run must not touch the finished folder"


def test_validate_names_the_run_holding_the_folder_as_run_does(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(3))
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out")
    run(job)
    with held_by_another_process(tmp_path / "out") as holder:
        checked = CliRunner().invoke(main, ["validate", str(job)])
        ran = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    said = f"is in use by another mlxbatch run (pid {holder.pid})"
    assert checked.exit_code == ran.exit_code == 1, (checked.output, ran.output)
    assert said in checked.output and ": ok" not in checked.output, checked.output
    assert said in ran.output
    res = CliRunner().invoke(main, ["validate", str(job)])  # released: ok again, and validate took no lock
    assert res.exit_code == 0 and ": ok" in res.output, res.output
    assert (tmp_path / "out" / ".lock").read_text() != str(os.getpid())
    assert CliRunner().invoke(main, ["run", str(job), "--no-progress"]).exit_code == 0


def test_a_filesystem_without_locks_is_named(tmp_path, monkeypatch):
    import mlxbatch.io.lock as lock

    def no_locks(fd, op):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(lock.fcntl, "flock", no_locks)  # what flock says on an SMB mount
    with pytest.raises(CheckpointError, match="filesystem does not support file locking") as info:
        CheckpointStore(tmp_path)
    assert "another" not in str(info.value)


def test_an_edited_column_the_prompt_does_not_use_shows_its_new_value(tmp_path, tiny_model_path):
    rows = [{**r, "note": "old"} for r in texts(5)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out")
    run(job)
    before = results(tmp_path / "out")
    rows[2]["note"] = "new"
    write_jsonl(data, rows)
    report = run(job).report
    after = results(tmp_path / "out")
    assert report["rows"]["finished_this_run"] == 0  # not part of the key: the row does not run again
    assert after["row-0002"]["note"] == "new" and after["row-0002"]["text"] == before["row-0002"]["text"]
    assert [r["note"] for r in after.values()] == ["old", "old", "new", "old", "old"]


def _limit_file_size(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.parametrize("big", ["inputs", "logprobs"])  # a big input column, or big results (Parquet itself)
def test_a_full_disk_while_the_results_are_written_is_a_clear_error_and_leaves_nothing(tmp_path, tiny_model_path,
                                                                                        big):
    rows = texts(40)
    sampling = {"temperature": 0, "max_tokens": 4}
    if big == "inputs":
        rows = [{**r, "blob": base64.b64encode(os.urandom(6000)).decode()} for r in rows]
    else:
        sampling = {"temperature": 0, "max_tokens": 24, "logprobs": 20, "ignore_eos": True}
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_model_path, data, out, sampling=sampling, checkpoint={"every_rows": 4})
    cmd = [sys.executable, "-m", "mlxbatch.cli", "run", str(job), "--no-progress"]
    full = subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=_limit_file_size(120_000))
    assert full.returncode == 1, full.stderr
    assert "could not write" in full.stderr and "results.parquet" in full.stderr, full.stderr
    assert "Traceback" not in full.stderr
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp")), sorted(p.name for p in out.iterdir())
    assert not (out / "_SUCCESS").exists()
    again = CliRunner().invoke(main, ["run", str(job), "--no-progress"])  # in this process: no start-up of its own
    assert again.exit_code == 0, again.output
    assert "done: 40 rows" in again.output and len(results(out)) == 40
