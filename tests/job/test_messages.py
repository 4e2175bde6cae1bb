"""Messages and reports a careful user reads: errors that name the file, the key and the fix; the Ctrl-C notice
and exit codes; what report.json, results.parquet and `mlxbatch info` say about what made the results."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
from click.testing import CliRunner
from jobkit import texts, write_job, write_jsonl

from mlxbatch.cli import main


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _job(tmp_path: Path, model: Path, rows: int = 6, **overrides) -> Path:
    data = write_jsonl(tmp_path / "in.jsonl", texts(rows))
    return write_job(tmp_path, model, data, tmp_path / "out", **overrides)


def test_a_template_syntax_error_names_its_key_once(tmp_path, tiny_model_path):
    job = _job(tmp_path, tiny_model_path)
    res = invoke("validate", job, "--set", "prompt.template='Hi {{ text }'")
    assert res.exit_code == 2 and "  prompt.template: template syntax error on line 1" in res.output, res.output
    assert "prompt: prompt:" not in res.output
    res = invoke("validate", job, "--set", "prompt.template=null", "--set",
                 "prompt.messages=[{role: user, content: 'ok'}, {role: user, content: '{% if x %}'}]")
    assert res.exit_code == 2 and "prompt.messages[1].content: template syntax error" in res.output, res.output


def test_yaml_errors_name_the_file(tmp_path, tiny_model_path):
    job = tmp_path / "broken.yaml"
    job.write_text("model: x\ninput: [a\n")
    res = invoke("validate", job)
    assert res.exit_code == 2 and f'in "{job}", line 2, column 8' in res.output, res.output
    assert "<unicode string>" not in res.output
    res = invoke("validate", _job(tmp_path, tiny_model_path), "--set", "sampling.stop=[a")
    assert res.exit_code == 2 and 'in "--set sampling.stop", line 1' in res.output, res.output


def test_unknown_keys_get_the_close_key_or_the_section_they_belong_under(tmp_path, tiny_model_path):
    res = invoke("validate", _job(tmp_path, tiny_model_path), "--set", "sampling.temprature=1", "--set", "promt=x",
                 "--set", "sampling.choice=[a, b]", "--set", "max_tokens=3", "--set", "output.choise=[a]")
    assert res.exit_code == 2
    for needle in ("sampling.temprature: unknown key; did you mean 'temperature'?",
                   "promt: unknown key; did you mean 'prompt'?",
                   "sampling.choice: unknown key: it belongs under output (output.choice)",
                   "max_tokens: unknown key: it belongs under sampling (sampling.max_tokens)",
                   "output.choise: unknown key; did you mean 'choice'?"):
        assert needle in res.output, (needle, res.output)
    assert res.output.count("sampling.choice") == 1, res.output  # said once


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]")  # 9^9: 387 M values from 10 lines
    job = tmp_path / "bomb.yaml"
    job.write_text("\n".join(lines) + "\n")
    start = time.monotonic()
    res = invoke("validate", job)
    assert time.monotonic() - start < 10  # was 50 s before it was refused
    assert res.exit_code == 2 and "aliases (*name) expand it to more than 100,000 values" in res.output, res.output


def _start(job: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mlxbatch.cli", "run", str(job), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _once_rows_are_checkpointed(proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + 120
    while not list((out / "shards").glob("shard-*.arrow")) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_ctrl_c_says_interrupted_and_its_notice_is_written_above_the_progress_bar(tmp_path, tiny_model_path):
    job = _job(tmp_path, tiny_model_path, rows=400, sampling={"max_tokens": 48},
               checkpoint={"every_rows": 8, "every_seconds": 600})
    proc = _start(job, "--progress")
    _once_rows_are_checkpointed(proc, tmp_path / "out")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "mlxbatch: interrupted (Ctrl-C);" in err and "signal 2" not in err, err[-3000:]
    notice = [line for line in err.split("\n") if "finishing the current shard" in line]
    assert len(notice) == 1 and "Ctrl-C: finishing the current shard, then stopping (Ctrl-C again to exit at once)" \
        in notice[0], err[-3000:]
    # what the terminal shows of that line: the text after its last carriage return (the bar redraws with "\r")
    assert re.match(r"\d{4}-\d\d-\d\d ", notice[0].rsplit("\r", 1)[-1]), repr(notice[0][-400:])


def test_a_second_sigterm_exits_with_the_interrupted_code(tmp_path, tiny_model_path):
    job = _job(tmp_path, tiny_model_path, rows=400, sampling={"max_tokens": 48},
               checkpoint={"every_rows": 8, "every_seconds": 600})
    proc = _start(job, "--no-progress")
    _once_rows_are_checkpointed(proc, tmp_path / "out")
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (proc.returncode, err[-3000:])  # was 128 + 15
    assert "SIGTERM: finishing the current shard" in err, err[-3000:]


def test_versions_and_the_job_snapshot_in_info_report_and_parquet(tmp_path, tiny_model_path, monkeypatch):
    res = invoke("info")
    assert res.exit_code == 0, res.output
    versions = json.loads(res.output)["versions"]
    assert set(versions) >= {"mlxbatch", "mlx", "mlx-lm", "python"} and versions["mlx"] and versions["mlx-lm"]
    job = _job(tmp_path, tiny_model_path)
    monkeypatch.chdir(tmp_path)
    res = invoke("run", job.name, "--no-progress", "--limit", 4)  # a relative job path
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["status"] == "complete" and report["job"] == str(job.resolve()) and report["versions"] == versions
    snapshot = report["job_snapshot"]
    assert snapshot["file"] == str(job.resolve()) and snapshot["job"]["input"]["limit"] == 4
    assert snapshot["job"]["sampling"]["max_tokens"] == 8 and snapshot["trial"] == ["input.limit"]
    assert report["trial"] == ["input.limit"]
    meta = pq.read_schema(tmp_path / "out" / "results.parquet").metadata
    assert json.loads(meta[b"mlxbatch.versions"]) == versions
    assert json.loads(meta[b"mlxbatch.job"]) == snapshot


def test_each_row_says_how_many_of_its_prompt_tokens_were_reused(tmp_path, tiny_model_path):
    system = "You label tickets for the support team. " * 20  # a long shared prefix: cache hits
    rows = texts(16)
    rows[3].pop("text")  # a render error: no prompt ran
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", max_error_rate=0.5,
                    prompt={"template": None, "system": system, "messages": [{"role": "user", "content": "{{ text }}"}]},
                    sampling={"max_tokens": 2}, engine={"max_num_seqs": 4})
    assert invoke("run", job, "--no-progress").exit_code == 0
    table = pq.read_table(tmp_path / "out" / "results.parquet")
    assert str(table.schema.field("cached_tokens").type) == "int64"
    got = table.to_pylist()
    assert got[3]["cached_tokens"] is None and got[3]["error_kind"] == "render"
    ok = [r for r in got if r["error"] is None]
    assert all(0 <= r["cached_tokens"] <= r["prompt_tokens"] for r in ok)
    assert sum(r["cached_tokens"] > 0 for r in ok) >= len(ok) // 2, [r["cached_tokens"] for r in ok]


def test_an_input_column_renamed_in_the_results_is_said(tmp_path, tiny_model_path):
    res = invoke("validate", _job(tmp_path, tiny_model_path))
    assert res.exit_code == 0, res.output
    assert "input column 'text' is written to results.parquet as 'input_text' ('text' is a result column)" \
        in res.output, res.output
