"""Nothing half-made: a trial never replaces a finished job's results, `status` tells published results from
current ones, a failed start leaves no claimed folder, and what cannot work is refused before the model loads."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from jobkit import texts, write_job, write_jsonl

from mlxbatch.cli import main

ROWS = 12


def invoke(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def cli(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxbatch.cli", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def _job(tmp_path: Path, model: Path | str, **overrides) -> tuple[Path, Path]:
    data = write_jsonl(tmp_path / "in.jsonl", texts(ROWS))
    out = tmp_path / "out"
    return write_job(tmp_path, model, data, out, **overrides), out


def test_a_trial_into_a_finished_jobs_folder_is_refused_and_its_results_stay(tmp_path, tiny_model_path):
    job, out = _job(tmp_path, tiny_model_path)
    assert invoke("run", job, "--no-progress").exit_code == 0
    published = (out / "results.parquet").read_bytes()
    trial = ("--limit", 3, "--set", "prompt.template='Label it: {{ text }}'")
    for command in ("validate", "run"):
        res = invoke(command, job, *trial)
        assert res.exit_code == 2, res.output
        assert "holds the finished results of this job" in res.output and "--output DIR" in res.output, res.output
        assert "input.limit, prompt.template" in res.output, res.output
    assert (out / "results.parquet").read_bytes() == published and (out / "_SUCCESS").exists()
    assert "complete" in invoke("status", job).output.splitlines()[0]
    assert invoke("plan", job, *trial, "--no-calibrate").exit_code == 0  # a dry run writes nothing: not refused
    res = invoke("run", job, "--no-progress", *trial, "--output", tmp_path / "trial")  # beside them: fine
    assert res.exit_code == 0 and pq.read_table(tmp_path / "trial" / "results.parquet").num_rows == 3, res.output
    # run settings change no result: not a trial
    res = invoke("run", job, "--no-progress", "--set", "engine.max_num_seqs=4", "--set", "checkpoint.every_rows=3")
    assert res.exit_code == 0 and f"(0 run now, {ROWS} resumed)" in res.output, res.output


def test_a_trial_into_the_jobs_own_new_folder_is_resumed_by_the_full_run(tmp_path, tiny_model_path):
    job, out = _job(tmp_path, tiny_model_path)
    res = invoke("run", job, "--no-progress", "--limit", 3)
    assert res.exit_code == 0, res.output
    assert invoke("status", job).output.startswith(f"{out}: outdated")  # the trial's 3 rows are published
    res = invoke("run", job, "--no-progress", "--limit", 5)  # the folder holds a trial's results: another trial may
    assert res.exit_code == 0 and "(2 run now, 3 resumed)" in res.output, res.output
    res = invoke("run", job, "--no-progress")
    assert res.exit_code == 0 and f"({ROWS - 5} run now, 5 resumed)" in res.output, res.output
    report = json.loads((out / "report.json").read_text())
    assert report["trial"] is None and report["status"] == "complete"


def test_status_says_outdated_when_the_published_results_are_not_the_jobs_now(tmp_path, tiny_model_path):
    """Every current key is checkpointed, but results.parquet holds another version of the job's rows."""
    job, out = _job(tmp_path, tiny_model_path)
    original = job.read_text()
    assert invoke("run", job, "--no-progress").exit_code == 0
    job.write_text(original.replace("max_tokens: 8", "max_tokens: 4"))
    assert invoke("run", job, "--no-progress").exit_code == 0
    job.write_text(original)  # back to the first version: its records are all in the shards
    st = invoke("status", job, "--json")
    assert st.exit_code == 0, st.output
    got = json.loads(st.output)
    assert got["rows_done"] == ROWS and got["outdated"] and not got["complete"], got["summary"]
    assert got["summary"].startswith(f"{out}: outdated: results.parquet was written under other parameters")
    assert invoke("run", job, "--no-progress").exit_code == 0  # rewritten from the shards: 0 rows run
    assert invoke("status", job).output.startswith(f"{out}: complete")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed: connections are refused at once


def test_an_uncached_hub_model_that_cannot_be_reached_is_refused_before_any_work(tmp_path, tiny_model_path):
    job, out = _job(tmp_path, "nobody/no-such-model")
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}", "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_HUB_OFFLINE": ""}
    for command in ("validate", "run"):
        res = cli(command, job, "--no-progress" if command == "run" else "--limit=1", env=env)
        assert res.returncode == 2, res.stderr
        for needle in ("model.path: 'nobody/no-such-model' is not in the local Hugging Face cache",
                       "the Hub cannot be reached", "smollm2", "HF_HUB_OFFLINE", "local folder"):
            assert needle in res.stderr, (needle, res.stderr)
        assert "Traceback" not in res.stderr and "LocalEntryNotFoundError" not in res.stderr
    assert not out.exists()
    env["HF_HUB_OFFLINE"] = "1"  # said so, with the same fixes
    res = cli("validate", job, env=env)
    assert res.returncode == 2 and "HF_HUB_OFFLINE is set" in res.stderr, res.stderr


def test_a_failed_start_leaves_no_claimed_folder_and_keeps_a_finished_ones_success(tmp_path, tiny_model_path):
    broken = tmp_path / "broken-model"  # a config and a tokenizer (validate is content) but no weights
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_path / name, broken / name)
    job, out = _job(tmp_path, broken)
    res = invoke("run", job, "--no-progress")
    assert res.exit_code == 1 and "could not be loaded" in res.output, res.output
    assert not out.exists()  # no .lock, manifest.json or shards/ left to claim it
    out.mkdir()  # an empty folder made by the user stays, and stays empty
    assert invoke("run", job, "--no-progress").exit_code == 1 and list(out.iterdir()) == []
    shutil.rmtree(out)
    job, out = _job(tmp_path, tiny_model_path)
    assert invoke("run", job, "--no-progress").exit_code == 0
    text = job.read_text()
    job.write_text(text.replace(str(tiny_model_path), str(broken)))  # the model moved: the next start fails
    assert invoke("run", job, "--no-progress").exit_code == 1
    assert (out / "_SUCCESS").exists()  # the finished results are still published


@contextlib.contextmanager
def read_only(folder: Path):
    """``folder`` read-only for this process: a read-only mount as root (permissions do not stop root), else the
    permission bits."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(folder), str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot make a read-only folder as root here: {mounted.stderr.decode()[:200]}")
    try:
        if os.access(folder, os.W_OK):  # older kernels ignore ro on the first bind
            subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize("state", ["empty", "complete"])
def test_a_read_only_output_folder_is_refused_before_the_model_loads(tmp_path, tiny_model_path, state):
    job, out = _job(tmp_path, tiny_model_path)
    out.mkdir()
    if state == "complete":
        assert invoke("run", job, "--no-progress").exit_code == 0
    before = sorted(p.name for p in out.iterdir())
    with read_only(out):
        for command in ("validate", "run"):
            res = cli(command, job)
            assert res.returncode == 2, res.stderr
            assert f"output.path: {out} is not writable" in res.stderr, res.stderr
            assert "Traceback" not in res.stderr and "loading model" not in res.stderr
    assert sorted(p.name for p in out.iterdir()) == before


def test_max_tokens_beyond_the_models_context_is_refused_before_the_model_loads(tmp_path, tiny_model_path):
    job, out = _job(tmp_path, tiny_model_path, sampling={"max_tokens": 100_000})
    for command in ("validate", "run"):
        res = invoke(command, job)
        assert res.exit_code == 2, res.output
        assert "sampling.max_tokens: 100000 is more than the model's context, 4096 tokens" in res.output, res.output
    assert not out.exists()


def test_a_template_that_guards_a_missing_field_is_not_refused(tmp_path, tiny_model_path):
    job, _ = _job(tmp_path, tiny_model_path, prompt={"template": "{{ text }}{{ note | default('') }}"
                                                                "{% if hint is defined %} {{ hint }}{% endif %}"})
    res = invoke("validate", job)
    assert res.exit_code == 0, res.output
    job, _ = _job(tmp_path, tiny_model_path, prompt={"template": "{{ text }} {{ note }}"})
    res = invoke("validate", job)  # not guarded: every row would fail
    assert res.exit_code == 2 and "template field 'note' is in none of the first 12 rows" in res.output, res.output


def test_an_input_whose_rows_cannot_be_read_is_refused_with_why(tmp_path, tiny_model_path):
    job, _ = _job(tmp_path, tiny_model_path)
    (tmp_path / "in.jsonl").write_text('{bad\n{"id": "a", "text": \n')
    res = invoke("validate", job)
    assert res.exit_code == 2, res.output
    assert "input.path: none of the first 2 rows can be read" in res.output and "in.jsonl:1: invalid JSON" \
        in res.output, res.output
    write_jsonl(tmp_path / "in.jsonl", texts(3), extra_lines=[b"{bad"])
    res = invoke("validate", job)
    assert res.exit_code == 0 and "1 of the first 4 rows cannot be read" in res.output, res.output


def test_show_and_status_after_a_kill_9(tmp_path, tiny_model_path):
    """Killed (SIGKILL, at a fixed point: once its first shard is in place): ``status`` does not say running, and
    ``show`` prints the rows that finished, marked partial."""
    job, out = _job(tmp_path, tiny_model_path, checkpoint={"every_rows": 4, "every_seconds": 600},
                    engine={"max_num_seqs": 4})
    res = cli("run", job, "--no-progress", env={"MLXBATCH_FAULT": "after-rename:1"})
    assert res.returncode == -signal.SIGKILL, res.stderr
    done = sum(pq.ParquetFile(p).metadata.num_rows if p.suffix == ".parquet" else
               _shard_rows(p) for p in (out / "shards").glob("shard-*.arrow"))
    assert 4 <= done < ROWS
    st = invoke("status", job)
    assert st.exit_code == 0, st.output
    first = st.output.splitlines()[0]
    assert first == f"{out}: incomplete: the last run stopped before it finished (killed, or it failed); run the " \
                    "job again to resume", st.output
    shown = invoke("show", out, "-n", 2)
    assert shown.exit_code == 0, shown.output
    assert shown.output.startswith(f"partial: {done} of {ROWS} rows finished"), shown.output
    assert shown.output.count("--- row-") == 2 and "output: " in shown.output
    assert shown.output.count("\ninput: text: ") == 2, shown.output  # each row's input, from its shard
    assert f"=== {out}: {done} rows (partial)" in shown.output and "finish reasons: " in shown.output, shown.output
    assert not (out / "results.parquet").exists()
    with open(out / ".lock") as lock:  # while a run holds the folder, status says so (with the holder's pid)
        import fcntl

        fcntl.flock(lock, fcntl.LOCK_EX)
        (out / ".lock").write_text(str(os.getpid()))
        assert invoke("status", job).output.splitlines()[0] == f"{out}: running (pid {os.getpid()})"


def _shard_rows(path: Path) -> int:
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all().num_rows
