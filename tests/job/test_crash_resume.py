"""Crash and resume with real processes: kill -9 at several points, run again, compare with an unbroken run.

The runs that crash are processes of their own (``mlxbatch run``); the unbroken references and the resumes run in this
process (``mlxbatch.run_job``), which saves a Python and MLX start-up each."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from jobkit import texts, write_job, write_jsonl

from mlxbatch import run_job
from mlxbatch.cli import main
from mlxbatch.io import CheckpointStore

ROWS = 120


def start(job: Path, env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "mlxbatch.cli", "run", str(job), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def finish(job: Path, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = start(job, env_extra)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode())


def manifest_rows(out: Path) -> int:
    try:
        return sum(s["rows"] for s in json.loads((out / "manifest.json").read_text())["shards"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return 0


def start_until(job: Path, out: Path, rows: int, env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a run and return once at least ``rows`` rows are checkpointed (or it ended)."""
    proc = start(job, env_extra)
    deadline = time.monotonic() + 120
    while manifest_rows(out) < rows and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return proc


def outputs(out: Path) -> dict[str, tuple]:
    rows = pq.read_table(out / "results.parquet").to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == ROWS, "every id exactly once"
    return {r["id"]: (r["text"], r["generated_tokens"], r["finish_reason"], r["error"]) for r in rows}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_path):
    root = tmp_path_factory.mktemp("crash")
    data = write_jsonl(root / "in.jsonl", texts(ROWS))
    ref_job = write_job(root, tiny_model_path, data, root / "reference")
    ref_job = ref_job.rename(root / "reference.yaml")
    run_job(ref_job)
    return root, data, outputs(root / "reference")


def _job(root: Path, data: Path, model: Path, name: str) -> Path:
    d = root / name
    d.mkdir()
    return write_job(d, model, data, d / "out")


def test_kill_9_after_some_shards_then_resume(setup, tiny_model_path):
    root, data, expected = setup
    job = _job(root, data, tiny_model_path, "kill-after-shards")
    out = job.parent / "out"
    for target in (20, 60):  # two crashes at different points
        proc = start_until(job, out, target)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not (out / "_SUCCESS").exists()
    assert run_job(job).report["status"] == "complete"
    assert outputs(out) == expected


@pytest.mark.parametrize("fault", ["mid-shard:3", "after-rename:2"])
def test_kill_9_while_a_shard_is_written_then_resume(setup, tiny_model_path, fault):
    root, data, expected = setup
    job = _job(root, data, tiny_model_path, f"fault-{fault.replace(':', '-')}")
    out = job.parent / "out"
    crashed = finish(job, {"MLXBATCH_FAULT": fault})
    assert crashed.returncode == -signal.SIGKILL
    shards = sorted(p.name for p in (out / "shards").iterdir())
    if fault.startswith("mid-shard"):
        assert any(name.endswith(".tmp") for name in shards)  # the torn write is on disk
    assert run_job(job).report["status"] == "complete"
    assert outputs(out) == expected
    st = CliRunner().invoke(main, ["status", str(out)])
    assert st.exit_code == 0 and "complete" in st.output, st.output


def test_truncated_shard_is_detected_and_its_rows_redone(setup, tiny_model_path):
    root, data, expected = setup
    job = _job(root, data, tiny_model_path, "truncated")
    out = job.parent / "out"
    proc = start_until(job, out, 30)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    shard = sorted((out / "shards").glob("shard-*.arrow"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a disk that lost the tail
    assert run_job(job).report["status"] == "complete"
    assert outputs(out) == expected
    assert list((out / "shards" / "corrupt").iterdir())


@pytest.mark.parametrize("engine", ["here", "own process"])
def test_sigterm_finishes_the_shard_and_exits_cleanly(setup, tiny_model_path, engine):
    root, data, expected = setup
    job = _job(root, data, tiny_model_path, f"sigterm-{engine.replace(' ', '-')}")
    out = job.parent / "out"
    proc = start_until(job, out, 10, {"MLXBATCH_ENGINE_PROCESS": "1" if engine == "own process" else "0"})
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:  # it had already finished: nothing to interrupt
        return
    assert proc.returncode == 130, err.decode()
    assert b"resume" in err
    assert run_job(job).report["status"] == "complete"
    assert outputs(out) == expected


def test_status_reads_a_folder_while_a_run_holds_it(setup, tiny_model_path):
    root, data, _ = setup
    job = _job(root, data, tiny_model_path, "status-live")
    out = job.parent / "out"
    proc = start_until(job, out, 10)
    st = CliRunner().invoke(main, ["status", str(out), "--json"])
    proc.communicate(timeout=120)
    assert st.exit_code == 0, st.output
    assert json.loads(st.output)["checkpointed_rows"] >= 10


# -- kills at the moments the shards, the manifest and the final Parquet are written (greedy rows) --------------

def greedy_job(root: Path, data: Path, model: Path, name: str, every_rows: int = 10) -> Path:
    d = root / name
    d.mkdir()
    return write_job(d, model, data, d / "out", sampling={"temperature": 0, "max_tokens": 8},
                     checkpoint={"every_rows": every_rows, "every_seconds": 600})


@pytest.fixture(scope="module")
def greedy(setup, tiny_model_path):
    root, data, _ = setup
    job = greedy_job(root, data, tiny_model_path, "greedy-reference")
    run_job(job)
    return outputs(job.parent / "out")


@pytest.mark.parametrize("fault", ["mid-manifest:3", "mid-results:1", "before-success:1"])  # shards: above
def test_kill_9_while_the_checkpoint_or_the_results_are_written(setup, greedy, tiny_model_path, fault):
    root, data, _ = setup
    job = greedy_job(root, data, tiny_model_path, f"greedy-{fault.replace(':', '-')}")
    out = job.parent / "out"
    crashed = finish(job, {"MLXBATCH_FAULT": fault})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert not (out / "_SUCCESS").exists()
    if fault.startswith("mid-manifest"):
        assert (out / "manifest.json.tmp").exists()  # the torn manifest write is on disk
    if fault.startswith("mid-results"):
        assert (out / "results.parquet.tmp").exists() and not (out / "results.parquet").exists()
    assert run_job(job).report["status"] == "complete"
    assert outputs(out) == greedy
    assert not list(out.glob("*.tmp")) and not list((out / "shards").glob("*.tmp"))


def test_many_kills_at_random_moments_lose_and_duplicate_nothing(setup, greedy, tiny_model_path):
    """A real race: kill -9 at random moments of a run that writes a shard every 2 rows, then resume."""
    root, data, _ = setup
    job = greedy_job(root, data, tiny_model_path, "greedy-random-kills", every_rows=2)
    out = job.parent / "out"
    rng = random.Random(12)
    kills = 0
    for _ in range(6):
        target = manifest_rows(out) + rng.randint(1, 25)
        proc = start_until(job, out, target)
        time.sleep(rng.uniform(0, 0.05))  # land anywhere: inside a shard, manifest or results write, or between
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
    assert kills >= 3
    assert run_job(job).report["status"] == "complete"
    assert outputs(out) == greedy
    with CheckpointStore(out) as store:
        keys = [k for t in store.iter_tables() for k in t.column("key").to_pylist()]
    assert len(keys) == len(set(keys)) == ROWS  # every row checkpointed exactly once


# -- the engine in a process of its own (``job.executors.process``) ------------------------------------------------

ENGINE_PROCESS = {"MLXBATCH_ENGINE_PROCESS": "1"}


def _engine_children(pid: int) -> list[int]:
    """The engine processes a run started (its children running ``job.executors.process.serve``), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"executors.process import serve" in cmd:
            found.append(int(stat.parent.name))
    return found


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie (its parent gone, not reaped yet) is gone too
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_a_job_with_the_engine_in_its_own_process_gives_the_same_rows(setup, tiny_model_path):
    root, data, expected = setup
    job = _job(root, data, tiny_model_path, "engine-process")
    out = job.parent / "out"
    done = finish(job, ENGINE_PROCESS)
    assert done.returncode == 0, done.stderr
    assert outputs(out) == expected
    report = json.loads((out / "report.json").read_text())
    profile = report["engine"]["profile"]  # the child's engine counters reach the report
    assert profile["steps"] > 0 and profile["stepping_s"] > 0
    assert report["this_run"]["engine_process"] and report["engine"]["engine_thread_cpu_s"] > 0
    assert report["this_run"]["cpu_s"]["run_thread"] < profile["stepping_s"]  # the steps ran in the child


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the engine process through /proc")
def test_kill_9_with_the_engine_in_its_own_process_leaves_no_engine_and_resumes(setup, tiny_model_path):
    """The run killed: its engine process sees its input end and exits (no orphan holding the model); the rows it
    finished that were checkpointed stay, and a resume in the run's own process completes the rest."""
    root, data, expected = setup
    job = _job(root, data, tiny_model_path, "engine-process-kill")
    out = job.parent / "out"
    proc = start_until(job, out, 30, ENGINE_PROCESS)
    engines = _engine_children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(engines) == 1 and _gone(engines[0], 30), "the engine process outlived the run"
    assert run_job(job).report["status"] == "complete"
    assert outputs(out) == expected


def test_a_model_that_does_not_load_in_the_engine_process_fails_the_start(setup, tmp_path):
    root, data, _ = setup
    broken = tmp_path / "model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    job = _job(root, data, broken, "engine-process-broken")
    failed = finish(job, ENGINE_PROCESS)
    assert failed.returncode != 0 and str(broken) in failed.stderr, failed.stderr
    assert "Traceback" not in failed.stderr  # the loader's own error, as the run's process would give it
    assert not (job.parent / "out" / "manifest.json").exists()  # the folder was not claimed


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the engine process through /proc")
def test_an_engine_process_killed_mid_run_stops_the_run_and_a_resume_completes(setup, tiny_model_path):
    """The engine's process killed (the kernel's OOM killer, say): the run stops with an error naming it, what finished
    is checkpointed, and running the job again completes it."""
    root, data, expected = setup
    job = _job(root, data, tiny_model_path, "engine-process-dies")
    out = job.parent / "out"
    proc = start_until(job, out, 30, ENGINE_PROCESS)
    engines = _engine_children(proc.pid)
    assert len(engines) == 1
    os.kill(engines[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:  # it had finished every row already: nothing was lost
        return
    assert "the engine process" in err.decode() and "resume" in err.decode(), err.decode()
    assert not (out / "_SUCCESS").exists() and manifest_rows(out) >= 30
    assert run_job(job).report["status"] == "complete"
    assert outputs(out) == expected


def test_the_engine_process_starts_before_the_jobs_checks_and_a_job_that_fails_them_leaves_none(
        setup, tiny_model_path, monkeypatch):
    """The command line starts a job's engine process as soon as it has read the job file (its imports and the
    model's load overlap the run's own and its checks), the run adopts it; a job its checks refuse stops it."""
    import yaml
    from click.testing import CliRunner

    from mlxbatch.job.executors import placement

    root, data, _ = setup
    job = _job(root, data, tiny_model_path, "engine-process-early")
    proc = subprocess.Popen([sys.executable, "-m", "mlxbatch.cli", "-vv", "run", str(job), "--no-progress",
                             "--limit", "12"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **ENGINE_PROCESS})
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()
    assert "started before the job's checks" in err.decode()  # adopted, not started again
    raw = yaml.safe_load(job.read_text())
    raw["prompt"] = {"template": "{{ no_such_field }}"}  # refused by the checks, after the engine started
    job.write_text(yaml.safe_dump(raw))
    started = []
    spawn = placement.spawn_engine
    monkeypatch.setattr(placement, "spawn_engine", lambda spec: started.append(spawn(spec)) or started[-1])
    monkeypatch.setenv("MLXBATCH_ENGINE_PROCESS", "1")
    res = CliRunner().invoke(main, ["run", str(job), "--no-progress"])  # (this process lives on: the pipe stays open)
    assert res.exit_code == 2 and "no_such_field" in res.output, res.output
    assert len(started) == 1 and started[0].poll() is not None, "the engine process outlived a refused job"
