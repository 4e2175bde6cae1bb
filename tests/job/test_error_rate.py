"""``max_error_rate`` judged on rows in input order, across runs, and on every row at the end (small jobs too)."""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from jobkit import texts, write_job, write_jsonl

from mlxbatch.cli import main
from mlxbatch.job.check.validate import validate_job
from mlxbatch.job.run.error_rate import ErrorRate
from mlxbatch.job.run.runner import JobFailed, JobRunner
from mlxbatch.job.spec import load_job


def run(job):
    return JobRunner(validate_job(job), progress=False).run()


def rows_with_bad(n: int, bad: set[int]) -> list[dict]:
    rows = texts(n)
    for i in bad:
        del rows[i]["text"]  # a render error, found before any generation
    return rows


def test_the_prefix_in_input_order_decides():
    rate = ErrorRate(0.5)
    for i in range(1, 30):  # everything but row 0 finished: nothing is decided yet
        rate.finished(i, True)
    assert rate.rows == 0 and not rate.exceeded()
    rate.finished(0, False)
    assert rate.rows == 30 and rate.errors == 29 and rate.exceeded()
    assert ErrorRate(0.1).exceeded_at_end(5, 1) and not ErrorRate(0.5).exceeded_at_end(5, 1)
    assert not ErrorRate(0.1).exceeded_at_end(0, 0)


def test_errors_found_before_generation_do_not_stop_a_job_within_its_limit(tmp_path, tiny_model_path):
    """21 bad rows of 61 under a 0.9 limit: errors found before generation used to be counted first (21 of 21)."""
    data = write_jsonl(tmp_path / "in.jsonl", rows_with_bad(61, set(range(0, 61, 3))))
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", max_error_rate=0.9)
    report = run(job).report
    assert report["rows"]["output"] == 61 and report["errors_by_kind"] == {"render": 21}
    assert (tmp_path / "out" / "_SUCCESS").exists()


def test_a_rerun_counts_the_errors_of_earlier_runs(tmp_path, tiny_model_path):
    """26 bad rows of 31 stop the job; running it again must not succeed on the strength of the last run alone."""
    data = write_jsonl(tmp_path / "in.jsonl", rows_with_bad(31, set(range(5, 31))))
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", checkpoint={"every_rows": 4})
    with pytest.raises(JobFailed, match="max_error_rate"):
        run(job)
    with pytest.raises(JobFailed, match=r"earlier runs included") as again:
        run(job)
    failed, counted = map(int, re.search(r"(\d+) of (\d+) rows failed", str(again.value)).groups())
    assert counted >= 20 and failed > 0.1 * counted  # rows of the first run count too
    assert not (tmp_path / "out" / "_SUCCESS").exists()
    res = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert res.exit_code == 3, res.output
    done = run(write_job(tmp_path, tiny_model_path, data, tmp_path / "out", max_error_rate=1.0)).report
    assert done["rows"]["output"] == 31
    table = pq.read_table(tmp_path / "out" / "results.parquet")
    assert table.num_rows - table.column("error").null_count == 26


def test_a_stopped_run_writes_the_report_of_every_run_and_counts_their_errors_by_kind(tmp_path, tiny_model_path):
    """A run stopped by max_error_rate wrote no report.json, so the next run reported zeros as "this run" figures,
    and its message counted only its own errors by kind ({} when it computed nothing)."""
    data = write_jsonl(tmp_path / "in.jsonl", rows_with_bad(40, set(range(30))))  # stopped before rows 30-39 ran
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_model_path, data, out, checkpoint={"every_rows": 4})

    def stopped():
        with pytest.raises(JobFailed, match="max_error_rate") as failed:
            run(job)
        status = json.loads(CliRunner().invoke(main, ["status", str(out), "--json"]).output)
        report = json.loads((out / "report.json").read_text())
        assert status["errors_by_kind"]["render"] > 0  # the checkpointed current rows, all runs
        assert f"Errors by kind (all runs): {status['errors_by_kind']}" in str(failed.value)
        assert report["stopped"] == str(failed.value) and report["status"] == "stopped"
        assert report["errors_by_kind"] == status["errors_by_kind"]
        assert (report["rows"]["output"], report["rows"]["errors"]) == (status["rows_done"], status["errors"])
        assert not (out / "results.parquet").exists() and not (out / "_SUCCESS").exists()
        assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
        return report

    first = stopped()
    assert first["this_run"]["finished"] == first["rows"]["output"] > 0
    again = stopped()  # the earlier errors are enough to stop it at once
    assert again["this_run"]["finished"] == 0 and again["last_work_run"] == first["this_run"]
    assert again["generated_tokens_per_s"] == first["generated_tokens_per_s"]


def test_a_small_job_whose_rows_all_fail_does_not_succeed(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", [{**r, "d": 0} for r in texts(5)])
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", prompt={"template": "{{ text }} {{ 10 // d }}"})
    # validate already says no sampled row renders
    res = CliRunner().invoke(main, ["validate", str(job)])
    assert res.exit_code == 2 and "5 of the first 5 rows do not render" in res.output, res.output
    with pytest.raises(JobFailed, match="5 of 5 rows failed"):
        JobRunner(load_job(job), progress=False).run()  # past validate: the run itself must not succeed
    assert (tmp_path / "out" / "results.parquet").exists() and not (tmp_path / "out" / "_SUCCESS").exists()


def test_a_small_job_with_a_share_of_errors_over_the_limit_fails_and_under_it_succeeds(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", rows_with_bad(8, {3}))
    res = CliRunner().invoke(main, ["run", str(write_job(tmp_path, tiny_model_path, data, tmp_path / "a",
                                                         max_error_rate=0.1)), "--no-progress"])
    assert res.exit_code == 3 and "1 of 8 rows failed" in res.output, res.output
    res = CliRunner().invoke(main, ["run", str(write_job(tmp_path, tiny_model_path, data, tmp_path / "b",
                                                         max_error_rate=0.2)), "--no-progress"])
    assert res.exit_code == 0, res.output


def test_a_job_whose_rows_all_finished_writes_its_results_even_past_the_limit(tmp_path, tiny_model_path):
    """Over max_error_rate with every row finished, a job of 20 rows or more stopped as if rows were still to
    run: no results.parquet (a job of 10 rows got one), `show` said "no results yet", and a re-run stopped again
    at once, so its finished rows could never be read."""
    data = write_jsonl(tmp_path / "in.jsonl", rows_with_bad(30, set(range(5, 30))))
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_model_path, data, out)
    for _ in range(2):  # the run that computes the rows, then a re-run that resumes them all
        res = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
        assert res.exit_code == 3 and "25 of 30 rows failed" in res.output, res.output
        assert "results.parquet holds every row" in res.output, res.output
        assert pq.read_table(out / "results.parquet").num_rows == 30 and not (out / "_SUCCESS").exists()
        report = json.loads((out / "report.json").read_text())
        assert report["rows"]["errors"] == 25 and "stopped" not in report and report["status"] == "failed"
        assert report["failed"] in res.output
        shown = CliRunner().invoke(main, ["show", str(out)])
        assert shown.exit_code == 0 and "errors: render 25" in shown.output, shown.output


def test_status_of_a_job_that_failed_on_its_errors_does_not_say_it_is_running(tmp_path, tiny_model_path):
    """Every row done, exit 3 (max_error_rate): status said "incomplete (running, or run the job again to
    resume)", though nothing runs and running it again resumes nothing."""
    data = write_jsonl(tmp_path / "in.jsonl", rows_with_bad(8, {3}))
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_model_path, data, out)
    assert CliRunner().invoke(main, ["run", str(job), "--no-progress"]).exit_code == 3
    status = CliRunner().invoke(main, ["status", str(out)])
    first = status.output.splitlines()[0]
    assert status.exit_code == 0 and "running" not in first and "max_error_rate" in first, status.output
    assert "rows done: 8 of 8" in status.output


def test_status_of_a_run_killed_while_writing_its_results_does_not_blame_errors(tmp_path, tiny_model_path):
    import os
    import subprocess
    import sys

    data = write_jsonl(tmp_path / "in.jsonl", texts(8))
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_model_path, data, out)
    killed = subprocess.run([sys.executable, "-m", "mlxbatch.cli", "run", str(job), "--no-progress"],
                            capture_output=True, env={**os.environ, "MLXBATCH_FAULT": "mid-results:1"}, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    first = CliRunner().invoke(main, ["status", str(out)]).output.splitlines()[0]
    assert "running" not in first and "max_error_rate" not in first and "killed" in first, first
