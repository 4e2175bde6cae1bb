"""The feed's worker processes: the same items as the run's own thread, errors as error rows, a dead worker raised
where rows are taken, and no worker left behind after a run, a SIGKILL or a Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobkit import texts, write_job, write_jsonl
from test_feed import _items

import mlxbatch.job.rows.workers as workers_mod
from mlxbatch.errors import MlxbatchError
from mlxbatch.io import open_reader
from mlxbatch.io.expected import ExpectedSpool
from mlxbatch.job.check.validate import input_spec, validate_job
from mlxbatch.job.rows.feed import RowFeed
from mlxbatch.job.rows.prepare import RowPreparer
from mlxbatch.job.rows.workers import (
    DEFAULT_WORKERS,
    MIN_ROWS,
    WORKERS_ENV,
    FeedWorkerError,
    default_workers,
    feed_workers,
)

CHAT = {"template": None, "messages": [{"role": "system", "content": "Label this."}, {"role": "user", "content": "{{ text }}"}]}


def children(pid: int) -> list[int]:
    """The feed workers ``pid`` started (and has not reaped)."""
    ps = subprocess.run(["ps", "-ww", "-A", "-o", "pid=,ppid=,args="], capture_output=True, text=True, check=True).stdout
    return [int(p) for p, pp, args in (line.split(None, 2) for line in ps.splitlines())
            if int(pp) == pid and "mlxbatch.job.rows.workers" in args]


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by a container's init, is not)."""
    stat = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(stat) and not stat.startswith("Z")


def gone(pids: list[int], within: float = 15.0) -> bool:
    deadline = time.monotonic() + within
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(map(alive, pids))


def test_workers_hand_out_what_the_run_thread_does(tmp_path, tiny_model_path, tiny_loaded, monkeypatch):
    monkeypatch.setattr(workers_mod, "CHUNK_ROWS", 4)  # many chunks over two workers: the order is the input's
    rows = texts(40)
    rows[3] = {"id": "row-0003", "text": None}  # a null the template prints: a render error
    rows[7] = {"id": "row-0004", "text": "a duplicate id"}
    del rows[11]["text"]  # a missing field
    path = write_jsonl(tmp_path / "in.jsonl", rows, extra_lines=[b"{not json"])
    spec = validate_job(write_job(tmp_path, tiny_model_path, path, tmp_path / "out", prompt=CHAT, plan={"window": 9}))
    done_keys = {RowPreparer(spec, "identity").prepare(r).key for r in list(open_reader(input_spec(spec)))[20:25]}

    def feed(workers: int, spool: ExpectedSpool | None = None) -> RowFeed:
        return RowFeed(open_reader(input_spec(spec)), RowPreparer(spec, "identity"), tiny_loaded.tokenizer,
                       done_keys, window=9, spool=spool, background=True, workers=workers)

    spool = ExpectedSpool(tmp_path)
    inline, pooled = _items(feed(0)), _items(feed(2, spool))
    assert pooled == inline
    assert sum(i[0] == "resumed" for i in inline) == 5 and sum(i[0] == "failed" for i in inline) == 4
    cols, again = spool.columns(), RowPreparer(spec, "identity")
    assert list(zip(cols.row_ids.to_pylist(), cols.keys.to_pylist())) == [
        (p.row_id, p.key) for p in map(again.prepare, open_reader(input_spec(spec)))]
    assert children(os.getpid()) == []  # close() stopped them


def test_a_worker_never_imports_torch_and_prepares_the_same_rows(tmp_path, tiny_model_path, tiny_loaded, monkeypatch):
    """transformers imports torch wherever it is installed (15-21 s a worker on an H100 host, which the first window
    waited for): a worker marks it absent. Here a stand-in ``torch`` package, installed as far as transformers can
    tell, records each process that imports it."""
    fake = tmp_path / "site"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text(
        "import os\nopen(os.environ['FAKE_TORCH_MARK'], 'a').write(f'{os.getpid()}\\n')\n__version__ = '2.9.0'\n")
    (fake / "torch-2.9.0.dist-info").mkdir()
    (fake / "torch-2.9.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.9.0\n")
    mark = tmp_path / "imported"
    monkeypatch.setenv("FAKE_TORCH_MARK", str(mark))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")]))
    # the stand-in is found: a process importing mlx-lm's tokenizer module without the mark imports it
    subprocess.run([sys.executable, "-c", "import mlx_lm.tokenizer_utils"], check=True)
    assert mark.exists()
    mark.unlink()
    path = write_jsonl(tmp_path / "in.jsonl", texts(12))
    spec = validate_job(write_job(tmp_path, tiny_model_path, path, tmp_path / "out", prompt=CHAT, plan={"window": 5}))

    def feed(workers: int) -> RowFeed:
        return RowFeed(open_reader(input_spec(spec)), RowPreparer(spec, "identity"), tiny_loaded.tokenizer, set(),
                       window=5, workers=workers)

    assert _items(feed(2)) == _items(feed(0))
    assert not mark.exists()


def test_a_dead_worker_is_raised_where_rows_are_taken(tmp_path, tiny_model_path, tiny_loaded, monkeypatch):
    monkeypatch.setattr(workers_mod, "CHUNK_ROWS", 2)
    path = write_jsonl(tmp_path / "in.jsonl", texts(30))
    spec = validate_job(write_job(tmp_path, tiny_model_path, path, tmp_path / "out"))
    feed = RowFeed(open_reader(input_spec(spec)), RowPreparer(spec, "identity"), tiny_loaded.tokenizer, set(),
                   window=5, background=False, workers=1)
    assert len(feed.take_window()) == 5
    (worker,) = children(os.getpid())
    os.kill(worker, signal.SIGKILL)
    with pytest.raises(FeedWorkerError, match=f"{WORKERS_ENV}=0"):
        while not feed.finished:
            feed.take_window()
    feed.close()
    assert children(os.getpid()) == []


def test_how_many_workers(monkeypatch):
    monkeypatch.delenv(WORKERS_ENV, raising=False)
    assert feed_workers() == 0  # this machine runs MLX on its CPU: the feed stays on the run's thread
    assert default_workers(gpu=True, cores=16) == DEFAULT_WORKERS > 0  # a GPU's host-bound step loop: off its GIL
    assert default_workers(gpu=True, cores=4) == 0  # too few cores for the engine's threads and the workers
    assert default_workers(gpu=False, cores=64) == 0  # the CPU's cores compute the model
    # a small job prepares its rows on the feed's thread: starting the workers would cost more than they save
    assert default_workers(gpu=True, cores=16, rows=MIN_ROWS - 1) == 0
    assert default_workers(gpu=True, cores=16, rows=MIN_ROWS) == DEFAULT_WORKERS
    assert default_workers(gpu=True, cores=16, rows=None) == DEFAULT_WORKERS  # (a count not known: a big job's rule)
    monkeypatch.setenv(WORKERS_ENV, "0")
    assert feed_workers() == 0
    monkeypatch.setenv(WORKERS_ENV, "3")
    assert feed_workers() == 3 and feed_workers(rows=10) == 3  # (asked for: a small job too)
    monkeypatch.setenv(WORKERS_ENV, "many")
    with pytest.raises(MlxbatchError, match=WORKERS_ENV):
        feed_workers()


def test_workers_start_before_the_model_loads_and_a_failed_load_leaves_none(tmp_path, tiny_model_path, monkeypatch):
    """A run starts its workers before it loads the model (their imports overlap the load); the load failing, they
    are stopped at once, with the run's failure raised as it was."""
    import shutil

    from mlxbatch.errors import ModelLoadError
    from mlxbatch.job.run.runner import JobRunner

    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    for f in model.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:200])  # a cut download: the header says more than the file holds
    monkeypatch.setenv(WORKERS_ENV, "2")
    spawned = []
    monkeypatch.setattr("mlxbatch.job.run.runner.spawn", lambda n: spawned.extend(workers_mod.spawn(n)) or spawned)
    spec = validate_job(write_job(tmp_path, str(model), write_jsonl(tmp_path / "in.jsonl", texts(10)),
                                  tmp_path / "out"))
    with pytest.raises(ModelLoadError):
        JobRunner(spec, progress=False).run()
    assert len(spawned) == 2 and all(p.poll() is not None for p in spawned)
    assert children(os.getpid()) == []


def _run(job: Path, workers: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mlxbatch.cli", "run", str(job), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, WORKERS_ENV: str(workers)}, start_new_session=True)


def _workers_of(proc: subprocess.Popen, out: Path) -> list[int]:
    """The run's worker processes, once it has checkpointed rows (its feed is running)."""
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if list((out / "shards").glob("shard-*.arrow")) and (pids := children(proc.pid)):
            return pids
        time.sleep(0.05)
    raise AssertionError(f"no worker seen (exit {proc.poll()})")


def _ids(out: Path) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_table(out / "results.parquet", columns=["id"]).column("id").to_pylist()


@pytest.mark.parametrize("how", ["sigkill", "ctrl-c"])
def test_no_worker_survives_a_killed_or_stopped_run_and_the_resume_completes(tmp_path, tiny_model_path, how):
    rows = texts(200)  # 4 windows: running for seconds after the first shard (the kill comes then); 400 ran twice as long
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", prompt=CHAT, plan={"window": 50},
                    sampling={"temperature": 0, "max_tokens": 6})
    proc = _run(job, 1)
    pids = _workers_of(proc, tmp_path / "out")
    if how == "sigkill":
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    else:  # Ctrl-C reaches the run's process group (its workers have a session of their own): it stops at once
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode in (0, 130), err.decode()
    assert gone(pids), "a feed worker outlived its run"
    again = _run(job, 1)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err.decode()
    assert _ids(tmp_path / "out") == [r["id"] for r in rows]  # every row once, in input order
    assert children(again.pid) == []
    assert json.loads((tmp_path / "out" / "report.json").read_text())["this_run"]["feed_workers"] == 1
