"""Numbers that stay true after a resume: report.json, ``mlxbatch status`` and the progress bar."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pyarrow.parquet as pq
from click.testing import CliRunner
from jobkit import texts, write_job, write_jsonl

from mlxbatch.cli import main
from mlxbatch.job.check.validate import validate_job
from mlxbatch.job.run.runner import JobRunner


def run(job, progress=False):
    return JobRunner(validate_job(job), progress=progress).run()


def test_report_describes_the_results_on_disk_and_keeps_the_working_runs_figures(tmp_path, tiny_model_path):
    rows = texts(20)
    for r in rows[::4]:
        del r["text"]  # 5 render errors
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", max_error_rate=1.0)
    first = run(job).report
    assert first["rows"]["errors"] == 5 and first["this_run"]["finished"] == 20
    assert first["generated_tokens_per_s"] > 0 and first["engine"]["profile"]["prefill_tokens"] > 0
    again = run(job).report  # nothing left to do
    table = pq.read_table(tmp_path / "out" / "results.parquet")
    on_disk = [k for k in table.column("error_kind").to_pylist() if k is not None]
    assert again["rows"]["output"] == 20 and again["rows"]["errors"] == len(on_disk) == 5
    assert again["rows"]["ok"] == 15 and again["errors_by_kind"] == {"render": 5}
    assert again["tokens"]["generated"] == sum(table.column("generated_tokens").to_pylist()) > 0
    assert again["this_run"]["finished"] == 0 and again["this_run"]["resumed"] == 20
    assert again["this_run"]["errors"] == 0 and again["this_run"]["generated_tokens_per_s"] == 0
    # the real run's speed, tokens and profile survive a run that had nothing to do
    assert again["generated_tokens_per_s"] == first["generated_tokens_per_s"]
    assert again["engine"]["profile"] == first["engine"]["profile"]
    assert again["last_work_run"] == first["this_run"] and "earlier run" in again["run_figures_from"]
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == again
    res = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "20 rows, 5 errors (0 run now, 20 resumed)" in res.output
    status = json.loads(CliRunner().invoke(main, ["status", str(tmp_path / "out"), "--json"]).output)
    assert status["report"]["generated_tokens_per_s"] == first["generated_tokens_per_s"]


def test_a_resume_with_nothing_left_keeps_the_figures_of_a_run_killed_before_its_report(tmp_path, tiny_model_path):
    """QA: a run killed after every row was checkpointed but before report.json was written; the resume computed
    nothing and reported itself (0 rows, 0 tok/s) as the last run that did work."""
    data = write_jsonl(tmp_path / "in.jsonl", texts(16))
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_model_path, data, out)
    crashed = subprocess.run([sys.executable, "-m", "mlxbatch.cli", "run", str(job), "--no-progress"],
                             env={**os.environ, "MLXBATCH_FAULT": "mid-results:1"}, capture_output=True, text=True,
                             timeout=300)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert not (out / "report.json").exists()
    report = run(job).report  # every row is checkpointed: nothing left to compute
    assert report["this_run"]["finished"] == 0 and report["this_run"]["resumed"] == 16
    work = report["last_work_run"]
    assert work["finished"] == 16 and work["generated_tokens_per_s"] > 0, work
    assert report["generated_tokens_per_s"] == work["generated_tokens_per_s"]
    assert report["engine"]["profile"]["prefill_tokens"] == report["prefix_reuse"]["prefill_tokens_computed"] > 0
    assert "earlier run" in report["run_figures_from"]
    assert "last run that did work: 16 rows" in CliRunner().invoke(main, ["status", str(out)]).output
    assert run(job).report["last_work_run"] == work  # and a second no-op run keeps them too


def test_status_counts_current_records_against_the_job(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(16))
    out = tmp_path / "out"
    run(write_job(tmp_path, tiny_model_path, data, out, sampling={"max_tokens": 4}))
    job = write_job(tmp_path, tiny_model_path, data, out, sampling={"max_tokens": 3})
    run(job)  # every key changed: the shards hold 32 records, 16 of them stale

    def status(target):
        res = CliRunner().invoke(main, ["status", str(target), "--json"])
        assert res.exit_code == 0, res.output
        return json.loads(res.output)

    for target in (out, job):  # the output folder (the last run's job) or the job file
        st = status(target)
        assert (st["rows_done"], st["total_rows"], st["percent"], st["stale_records"]) == (16, 16, 100.0, 16)
    text = CliRunner().invoke(main, ["status", str(job)]).output
    assert "rows done: 16 of 16 (100.0%)" in text and "stale records" in text
    write_job(tmp_path, tiny_model_path, data, out, sampling={"max_tokens": 2})  # changed, not run yet
    assert status(job)["rows_done"] == 0 and status(job)["percent"] == 0.0  # against the file as it is now
    assert status(out)["rows_done"] == 16  # against what the last run ran


def test_status_tells_rows_outside_the_limit_from_stale_records(tmp_path, tiny_model_path):
    """QA: after `run --limit 12` then `run --limit 8` into the same folder, status called the 4 rows past the limit
    "stale records (changed parameters, prompts or model)"; they are rows the current limit leaves out."""
    data = write_jsonl(tmp_path / "in.jsonl", texts(16))
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_model_path, data, out, sampling={"max_tokens": 3})
    for limit in (12, 8):
        res = CliRunner().invoke(main, ["run", str(job), "--no-progress", "--limit", str(limit)])
        assert res.exit_code == 0, res.output

    def status(*args):
        res = CliRunner().invoke(main, ["status", str(out), *args])
        assert res.exit_code == 0, res.output
        return res.output

    st = json.loads(status("--json"))
    assert (st["rows_done"], st["total_rows"], st["stale_records"], st["records_outside_input"]) == (8, 8, 0, 4), st
    text = status()
    assert "stale" not in text and "changed parameters" not in text, text
    assert "records of rows outside the current input (past its limit of 8 rows, or no longer in it) not counted: 4" \
        in text, text
    # a changed parameter: rows 0-7 now have stale records, rows 8-11 are still outside the limit
    write_job(tmp_path, tiny_model_path, data, out, sampling={"max_tokens": 2})
    res = CliRunner().invoke(main, ["run", str(job), "--no-progress", "--limit", "8"])
    assert res.exit_code == 0, res.output
    st = json.loads(status("--json"))
    assert (st["rows_done"], st["stale_records"], st["records_outside_input"]) == (8, 8, 4), st
    assert "stale records (earlier keys of current rows: changed parameters, prompts or model) not counted: 8" \
        in st["summary"], st["summary"]


def test_status_of_a_finished_job_whose_parameters_changed_says_outdated(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(12))
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_model_path, data, out, sampling={"max_tokens": 3})
    run(job)
    assert "complete" in CliRunner().invoke(main, ["status", str(job)]).output.splitlines()[0]
    write_job(tmp_path, tiny_model_path, data, out, sampling={"max_tokens": 2})  # _SUCCESS is from the old keys
    res = CliRunner().invoke(main, ["status", str(job)])
    head = res.output.splitlines()[0]
    assert res.exit_code == 0 and "complete" not in head, head
    assert "outdated: finished under other parameters or input; 0 of 12 current rows done" in head, head
    st = json.loads(CliRunner().invoke(main, ["status", str(job), "--json"]).output)
    assert (st["complete"], st["outdated"], st["rows_done"], st["total_rows"]) == (False, True, 0, 12)
    st = json.loads(CliRunner().invoke(main, ["status", str(out), "--json"]).output)  # the job the last run ran
    assert (st["complete"], st["outdated"], st["rows_done"]) == (True, False, 12)


def test_status_keys_a_prompt_too_long_for_the_model_as_the_run_did(tmp_path, tiny_model_path):
    rows = texts(4)
    rows[2]["text"] = "word " * 60_000  # 300,000 characters: past the tiny model's bound (4096 tokens x 64)
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_model_path, data, out, max_error_rate=1.0)
    assert run(job).report["errors_by_kind"] == {"request": 1}
    for target in (out, job):  # the refused row's key names the model's context: status must know it
        res = CliRunner().invoke(main, ["status", str(target), "--json"])
        assert res.exit_code == 0, res.output
        st = json.loads(res.output)
        assert (st["rows_done"], st["total_rows"], st["errors"], st["stale_records"]) == (4, 4, 1, 0), st


def test_progress_counts_only_rows_run_now(tmp_path, tiny_model_path, capfd, caplog, monkeypatch):
    rows = texts(24)
    for r in rows:
        r["budget"] = 6
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", sampling={"overrides": {"max_tokens": "budget"}})
    run(job)
    for r in rows[:3]:
        r["budget"] = 2
    write_jsonl(data, rows)
    capfd.readouterr()
    run(job, progress=True)
    err = capfd.readouterr().err
    assert "loading model" in err and err.index("loading model") < err.index("3/3")
    # the engine's batch, as the job's engine section set it (8 rows; the step's tokens the device's default)
    assert "mlxbatch: engine: max_num_seqs 8 (set in the config), max_num_batched_tokens 2048 (the device's" in err
    final = err.replace("\r", "\n").strip().splitlines()[-1]
    assert "3/3" in final and "resumed=21" in final and "24/24" not in err, final
    assert "in_flight=" in final and "in_tok_s=" in final and "cached=" in final
    # without a terminal, the same figures go to the log
    from mlxbatch.job.report import progress

    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    for r in rows[3:5]:
        r["budget"] = 3
    write_jsonl(data, rows)
    with caplog.at_level("INFO", logger="mlxbatch.job.report.progress"):
        run(job)
    lines = [r.getMessage() for r in caplog.records if "rows this run" in r.getMessage()]
    assert lines and lines[-1].startswith("2/2 rows this run") and "resumed 22" in lines[-1], lines


def test_status_of_a_job_with_an_empty_input(tmp_path, tiny_model_path):
    """An empty input: status printed "rows done: 0 of 0 (None%)"."""
    data = tmp_path / "in.jsonl"
    data.write_text("")
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out")
    run(job)
    res = CliRunner().invoke(main, ["status", str(tmp_path / "out")])
    assert res.exit_code == 0 and "None" not in res.output and "rows done: 0 of 0" in res.output, res.output
