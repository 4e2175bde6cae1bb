"""The in-process API (``mlxbatch.run_job``): from a thread, from a mapping, interrupted twice without exiting."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
from jobkit import texts, write_job, write_jsonl

import mlxbatch


def test_run_job_off_the_main_thread_with_overrides(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(10))
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out")
    got: dict = {}

    def work():
        try:
            got["result"] = mlxbatch.run_job(job, limit=4, output=tmp_path / "trial", sampling={"max_tokens": 2})
        except BaseException as exc:  # noqa: BLE001 - reported below
            got["error"] = exc

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=300)
    assert "error" not in got, repr(got.get("error"))
    result = got["result"]
    assert result.out_dir == (tmp_path / "trial").resolve() and result.report["rows"]["output"] == 4
    table = result.table()
    assert table.num_rows == 4 and max(table.column("generated_tokens").to_pylist()) <= 2
    assert list(result.to_pandas()["id"]) == [f"row-{i:04d}" for i in range(4)]


def test_run_job_from_a_mapping_and_its_errors(tmp_path, tiny_model_path, monkeypatch):
    from mlxbatch.job.spec import JobSpecError

    write_jsonl(tmp_path / "in.jsonl", texts(3))
    monkeypatch.chdir(tmp_path)
    job = {"model": str(tiny_model_path), "input": {"path": "in.jsonl", "id_column": "id"},
           "prompt": "Say {{ text }}", "sampling": {"max_tokens": 2}, "output": "out"}
    result = mlxbatch.run_job(job)
    assert result.results_path == tmp_path / "out" / "results.parquet" and result.table().num_rows == 3
    with pytest.raises(JobSpecError, match="sampling.top_p"):
        mlxbatch.run_job(job, sampling={"top_p": 5})


def _interrupted(tmp_path, model, signals: int):
    """``run_job`` of a 120-row job in a child process, sent ``signals`` SIGINTs once its first shard is written;
    returns the child (it prints the ``JobInterrupted`` message, then "alive") and the job's path."""
    data = write_jsonl(tmp_path / "in.jsonl", texts(120))
    job = write_job(tmp_path, model, data, tmp_path / "out", sampling={"max_tokens": 48},
                    checkpoint={"every_rows": 8, "every_seconds": 600})
    script = textwrap.dedent(f"""
        import os, signal, threading, time
        from pathlib import Path
        import mlxbatch
        out = Path({str(tmp_path / "out")!r})
        def interrupt():
            while not list((out / "shards").glob("shard-*.arrow")):  # rows are being written: the run is going
                time.sleep(0.05)
            for _ in range({signals}):
                os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=interrupt, daemon=True).start()
        try:
            mlxbatch.run_job({str(job)!r})
        except mlxbatch.JobInterrupted as exc:
            print("interrupted:", exc)
        print("alive")
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return res, job


def test_a_second_interrupt_stops_the_run_but_not_the_process(tmp_path, tiny_model_path):
    res, job = _interrupted(tmp_path, tiny_model_path, 2)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "interrupted:" in res.stdout and "alive" in res.stdout
    # worded for the API, not the command line
    assert "call run_job again with the same job and changes" in res.stdout and "command" not in res.stdout, res.stdout
    from mlxbatch.io import CheckpointStore

    with CheckpointStore(tmp_path / "out") as store:  # what finished is checkpointed, and a resume completes
        kept = store.num_records
    assert 0 < kept < 120
    assert mlxbatch.run_job(job).report["rows"]["resumed"] == kept


def test_two_mapping_jobs_with_different_inputs_do_not_share_an_output_folder(tmp_path, tiny_model_path, monkeypatch):
    """Jobs given as a mapping have no file to tell them apart ("<dict>" both): their input does. Another input's
    job is refused (its results would be replaced); the same input resumes."""
    from mlxbatch.job.spec import JobSpecError

    write_jsonl(tmp_path / "a.jsonl", texts(3))
    write_jsonl(tmp_path / "b.jsonl", texts(2))
    monkeypatch.chdir(tmp_path)

    def job(path):
        return {"model": str(tiny_model_path), "input": {"path": path, "id_column": "id"},
                "prompt": "Say {{ text }}", "sampling": {"max_tokens": 2}, "output": "out"}

    assert mlxbatch.run_job(job("a.jsonl")).table().num_rows == 3
    before = (tmp_path / "out" / "results.parquet").read_bytes()
    with pytest.raises(JobSpecError, match="another job"):
        mlxbatch.run_job(job("b.jsonl"))
    assert (tmp_path / "out" / "results.parquet").read_bytes() == before
    assert mlxbatch.run_job(job("a.jsonl")).report["rows"]["resumed"] == 3


def test_the_exceptions_the_readme_names_are_on_the_package(tmp_path, tiny_model_path):
    """README: run_job raises JobSpecError, JobInterrupted, JobFailed; `except mlxbatch.JobFailed:` was an
    AttributeError raised inside the except clause, hiding the job's own error."""
    from mlxbatch.job.run.runner import JobFailed, JobInterrupted
    from mlxbatch.job.spec import JobSpecError

    assert (mlxbatch.JobSpecError, mlxbatch.JobInterrupted, mlxbatch.JobFailed) == \
        (JobSpecError, JobInterrupted, JobFailed)
    assert {"JobSpecError", "JobInterrupted", "JobFailed"} <= set(mlxbatch.__all__)
    rows = texts(6)
    for r in rows[1:]:
        del r["text"]  # 5 render errors of 6
    job = write_job(tmp_path, tiny_model_path, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out")
    with pytest.raises(mlxbatch.JobFailed):
        try:
            mlxbatch.run_job(job)
        except mlxbatch.JobSpecError:
            pytest.fail("the job is valid")


def test_a_first_interrupt_says_how_to_resume_from_python(tmp_path, tiny_model_path):
    """QA: an interrupted run_job said "Run the same command to resume" (the command line's words) in a notebook."""
    res, _ = _interrupted(tmp_path, tiny_model_path, 1)  # one: the run checkpoints what finished and stops
    assert res.returncode == 0, res.stderr[-2000:]
    assert "interrupted: interrupted (Ctrl-C);" in res.stdout and "signal 2" not in res.stdout, res.stdout
    assert "again to stop at once" in res.stderr and "exit" not in res.stderr, res.stderr  # it never exits
    assert "call run_job again with the same job and changes" in res.stdout and "command" not in res.stdout, res.stdout
