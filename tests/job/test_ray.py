"""The Ray executor on a local Ray cluster this module starts once: the same outputs as a single-machine run, prefix
groups kept on one actor, an actor killed mid-job, a driver killed and resumed with and without Ray."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from jobkit import write_job, write_jsonl
from raykit import (
    PROMPT,
    cli,
    exactly_once,
    finish,
    grouped_rows,
    manifest_rows,
    outputs,
    processes_mentioning,
    shard_records,
    wait_for,
)

from mlxbatch.job.check.validate import validate_job
from mlxbatch.job.executors.ray.progress import read_progress
from mlxbatch.job.report.status import read_status
from mlxbatch.job.run.runner import JobFailed, JobRunner
from mlxbatch.job.spec import with_executor

ray = pytest.importorskip("ray")

ROWS_PER_TOPIC, ALONE = 24, 24
N = 4 * ROWS_PER_TOPIC + ALONE
RAY = {"kind": "ray", "actors": 2, "num_cpus": 0.5, "max_restarts": 1, "start_timeout_s": 240}
SLOW = {"max_num_seqs": 2}  # not part of the key: same outputs, a job long enough to hit mid-way


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One local cluster for the module (fractional CPUs per actor: two actors and the driver fit 2 cores)."""
    ray.init(num_cpus=2, _temp_dir=str(tmp_path_factory.mktemp("r")), include_dashboard=False,
             namespace="mlxbatch-tests", logging_level=logging.WARNING)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_model_path):
    """The input, and the outputs of an unbroken single-machine run of it."""
    root = tmp_path_factory.mktemp("rayjob")
    path = write_jsonl(root / "in.jsonl", grouped_rows(ROWS_PER_TOPIC, ALONE))
    ref = _job(root, "reference", tiny_model_path, path, executor={"kind": "local"})
    report = JobRunner(validate_job(ref), progress=False).run().report
    return root, path, outputs(ref.parent / "out", N), report


def _job(root: Path, name: str, model: Path, data: Path, **overrides) -> Path:
    d = root / name
    d.mkdir()
    return write_job(d, model, data, d / "out", prompt={"template": PROMPT}, checkpoint={"every_rows": 5},
                     **overrides)


def _topics(out: Path) -> dict[str, set[str]]:
    """The actors each prefix group's rows ran on."""
    groups: dict[str, set[str]] = {}
    for r in shard_records(out):
        groups.setdefault(r["id"].split("-")[0], set()).add(r["worker"])
    return groups


def test_two_actors_give_the_single_machine_results_with_prefix_groups_on_one_actor(cluster, data, tiny_model_path):
    root, path, expected, local_report = data
    job = _job(root, "two-actors", tiny_model_path, path, executor=RAY)
    report = JobRunner(validate_job(job), progress=False).run().report
    out = job.parent / "out"
    assert outputs(out, N) == expected  # ids, keys, texts, errors: exactly the single-machine run's
    assert pq.read_schema(out / "results.parquet") == pq.read_schema(root / "reference" / "out" / "results.parquet")
    assert set(report) == set(local_report) and (out / "_SUCCESS").exists() and read_progress(out) is None
    exactly_once(out)
    groups = _topics(out)
    assert all(len(groups[t]) == 1 for t in ("astro", "baking", "chess", "diving")), groups  # never split
    assert set().union(*groups.values()) == {"actor-0", "actor-1"}  # both actors worked
    ex = report["engine"]["executor"]
    assert [a["rows"] for a in ex["actors"]] and sum(a["rows"] for a in ex["actors"]) == N
    assert all(a["prefill_tokens"] > 0 and a["blas"] for a in ex["actors"])
    # prefix reuse survived the split: the actors' floors add up to about the single-machine plan's
    assert ex["floor_tokens"] <= 1.1 * report["plan"]["distinct_tokens"], (ex, report["plan"])

    rnd = _job(root, "random", tiny_model_path, path, executor={**RAY, "partition": "random"})
    rreport = JobRunner(validate_job(rnd), progress=False).run().report
    assert outputs(rnd.parent / "out", N) == expected
    assert any(len(w) > 1 for t, w in _topics(rnd.parent / "out").items() if t != "alone")  # groups spread
    assert rreport["engine"]["executor"]["floor_tokens"] > 1.15 * ex["floor_tokens"]  # each group prefilled twice


def test_row_errors_and_max_error_rate_work_across_actors(cluster, tmp_path, tiny_model_path):
    rows = grouped_rows(4, 12)
    rows[2] = {"id": "no-field", "preamble": "x"}  # render error (on the driver)
    rows[5] = {**rows[5], "q": "word " * 6000}  # longer than the context: refused by an actor's engine
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    local = _job(tmp_path, "local", tiny_model_path, data, max_error_rate=0.5)
    distributed = _job(tmp_path, "ray", tiny_model_path, data, executor=RAY, max_error_rate=0.5)
    JobRunner(validate_job(local), progress=False).run()
    report = JobRunner(validate_job(distributed), progress=False).run().report
    got, want = outputs(distributed.parent / "out", len(rows)), outputs(local.parent / "out", len(rows))
    assert got == want
    assert {v[5] for v in got.values() if v[4]} == {"render", "request"} and report["rows"]["errors"] == 2

    bad = [{**r, "q": "word " * 6000} if i % 2 else r for i, r in enumerate(grouped_rows(10, 20))]
    job = _job(tmp_path, "too-many", tiny_model_path, write_jsonl(tmp_path / "bad.jsonl", bad), executor=RAY)
    with pytest.raises(JobFailed, match="max_error_rate"):
        JobRunner(validate_job(job), progress=False).run()
    out = job.parent / "out"
    assert manifest_rows(out) >= 20 and not (out / "_SUCCESS").exists()
    # the limit is judged on the finished prefix of the input in input order; the actors finish rows out of order, so
    # whether that prefix passes it before the last row finishes depends on timing: stopped while rows were running,
    # the actors were let go and status shows where it stopped; with every row finished, the run is judged at the end
    # like a single-machine run (results.parquet holds every row, no progress.json: a complete folder)
    if "stopped" in json.loads((out / "report.json").read_text()):
        assert read_progress(out)["state"] == "stopped" and not (out / "results.parquet").exists()
    else:
        assert read_progress(out) is None and pq.read_table(out / "results.parquet").num_rows == len(bad)


def test_an_actor_killed_mid_job_loses_only_its_unfinished_rows(cluster, tmp_path, tiny_model_path):
    # 4x the module's input: its rows ran in ~1.3 s once the actors were up, and the progress file that names a busy
    # actor is written once a second (the victim was missed in about 1 run of 3)
    n = 4 * N
    path = write_jsonl(tmp_path / "in.jsonl", grouped_rows(4 * ROWS_PER_TOPIC, 4 * ALONE))
    ref = _job(tmp_path, "reference", tiny_model_path, path, executor={"kind": "local"})
    JobRunner(validate_job(ref), progress=False).run()
    expected = outputs(ref.parent / "out", n)
    job = _job(tmp_path, "kill-actor", tiny_model_path, path, executor=RAY, engine=SLOW)
    out = job.parent / "out"
    proc = cli(["run", str(job), "--ray", cluster, "--no-progress"])

    def victim():
        p = read_progress(out)
        busy = [a for a in (p or {}).get("actors", []) if a["state"] == "ready" and a["rows"] >= 5 and a["in_flight"]]
        return busy[0] if busy and manifest_rows(out) >= 10 else None

    target = wait_for(victim, proc)
    assert target is not None, finish(proc)[1]
    status = read_status(out)  # while it runs: one line per actor
    assert "distributed run" in status["summary"] and "actor-0" in status["summary"] and "actor-1" in status["summary"]
    os.kill(target["pid"], signal.SIGKILL)
    rc, err = finish(proc)
    assert rc == 0, err
    assert outputs(out, n) == expected
    exactly_once(out)
    actors = {a["name"]: a for a in json.loads((out / "report.json").read_text())["engine"]["executor"]["actors"]}
    dead = actors[target["name"]]
    assert dead["state"] == "dead" and "Died" in dead["error"] and "actor-2" in actors  # a replacement started
    kept = sum(r["worker"] == target["name"] for r in shard_records(out))
    assert kept == dead["rows"] > 0  # what it finished before dying was kept, not redone


def test_a_killed_driver_leaves_a_job_the_next_run_resumes_with_or_without_ray(cluster, data, tiny_model_path):
    root, path, expected, _ = data
    job = _job(root, "kill-driver", tiny_model_path, path, executor={k: v for k, v in RAY.items() if k != "kind"},
               engine=SLOW)
    out = job.parent / "out"
    for target in (15, 50):  # kill a distributed driver twice: the second run resumes the first
        proc = cli(["run", str(job), "--ray", cluster, "--no-progress"])
        assert wait_for(lambda t=target: manifest_rows(out) >= t, proc), finish(proc)[1]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not (out / "_SUCCESS").exists() and read_progress(out)["state"] == "running"  # left behind
        summary = read_status(out)["summary"]  # said "2/2 actors live, running" for a minute after the kill
        assert "distributed run" in summary and "the driver" in summary and "is not running" in summary, summary
        assert "actors live" not in summary and ", running" not in summary, summary
    done_before = len(shard_records(out))  # the manifest may lag: a renamed shard is adopted on the next open
    # the job file says local: the single machine (in this process: no Python and MLX start-up of its own)
    assert JobRunner(validate_job(job), progress=False).run().report["status"] == "complete"
    assert outputs(out, N) == expected
    exactly_once(out)
    report = json.loads((out / "report.json").read_text())
    assert report["rows"]["resumed"] == done_before
    # the figures of the last run that did rows: this one's (no executor), unless the second kill came after the last
    # row was checkpointed (a loaded machine) and left it nothing to do: then the distributed run's (its executor's)
    # where that run kept them before the kill landed (a clean-clone CI run killed it in the moment between its last
    # shard and that save: this run's figures then, of no rows)
    if done_before < N:
        assert "executor" not in report["engine"] and report["engine"]["profile"]["steps"] > 0
    else:
        assert "executor" in report["engine"] or report["engine"]["profile"]["steps"] == 0
    assert read_progress(out) is None


def test_the_command_line_switches_executors(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", grouped_rows(1, 1))
    spec = validate_job(_job(tmp_path, "j", tiny_model_path, data, executor=RAY))
    assert spec.executor.kind == "ray" and with_executor(spec, "local").executor.kind == "local"
    assert with_executor(spec, "ray", "10.0.0.1:6379").executor.address == "10.0.0.1:6379"
    rc, err = finish(cli(["run", str(tmp_path / "j" / "job.yaml"), "--ray", "--local"]))
    assert rc == 64 and "not both" in err  # a usage error (exit 64 since #15)
    deep = tmp_path / ("d" * 100)  # a temp dir whose socket paths Ray cannot use: a clear error, no traceback
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(deep)}
    rc, err = finish(cli(["run", str(tmp_path / "j" / "job.yaml"), "--ray", "--no-progress"], env))
    assert rc == 1 and "could not connect to a local Ray cluster" in err and "Traceback" not in err, err


def test_image_rows_run_on_actors_as_on_one_machine(cluster, tmp_path, tiny_vlm_path):
    from test_vlm_job import ASK, image_folder

    image_folder(tmp_path)
    rows = [{"id": "a", "images": "pics/p1.png", "question": "What is it?"},
            {"id": "two", "images": ["pics/p2.png", "pics/p3.png"], "question": "Compare them."},
            {"id": "text", "question": "No picture here; name a fruit."},
            {"id": "truncated", "images": "pics/truncated.png", "question": "What is it?"}]
    data = write_jsonl(tmp_path / "data" / "in.jsonl", rows)
    want = got = None
    for name, executor in (("local", {"kind": "local"}), ("ray", RAY)):
        job = write_job(tmp_path / "data", tiny_vlm_path, data, tmp_path / name, prompt=ASK, executor=executor,
                        max_error_rate=1.0)
        job.rename(tmp_path / f"{name}.yaml")
        JobRunner(validate_job(tmp_path / f"{name}.yaml"), progress=False).run()
        want, got = got, outputs(tmp_path / name, len(rows))
    assert got == want and got["truncated"][5] == "image" and got["a"][1]


def test_actors_the_cluster_cannot_place_are_given_up_with_a_clear_error(cluster, tmp_path, tiny_model_path):
    from mlxbatch.job.executors.base import ExecutorError

    data = write_jsonl(tmp_path / "in.jsonl", grouped_rows(2, 2))
    job = _job(tmp_path, "no-room", tiny_model_path, data,
               executor={**RAY, "resources": {"a-mac-we-do-not-have": 1}, "start_timeout_s": 2})
    with pytest.raises(ExecutorError, match="got no room on the cluster within 2 s"):
        JobRunner(validate_job(job), progress=False).run()
    assert not (job.parent / "out").exists()  # a failed start leaves a new output folder as it was: none


def test_a_replacement_the_cluster_cannot_place_is_logged_and_given_up(cluster, data, tiny_model_path):
    """An actor lost with its node: the replacement could not be placed and waited silently until the end. Its wait
    is logged, and it is given up after start_timeout_s like any actor (here the last one: the run stops, exit 1,
    with what finished checkpointed). The room goes to another actor that was waiting for it, as on a shrunk
    cluster."""
    root, path, _, _ = data
    # the whole cluster; start_timeout_s is waited out by the replacement (the test's length), and the first actor
    # must load the model within it on a busy machine too, so it starts once the earlier tests' actors have given
    # their CPUs back (under load that took over 20 s: the first actor got no room)
    # 24 tokens a row, 2 rows at a time: seconds of rows, so the actor is seen working before the job ends (at the
    # job's 8 tokens at most, 120 rows took 1.2 s on a quiet CPU, shorter than the driver's progress interval)
    job = _job(root, "no-room-left", tiny_model_path, path, engine=SLOW,
               sampling={"max_tokens": 24, "min_tokens": 24},
               executor={**RAY, "actors": 1, "num_cpus": 2, "start_timeout_s": 30})
    out = job.parent / "out"
    deadline = time.monotonic() + 120
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    proc = cli(["run", str(job), "--ray", cluster, "--no-progress"])

    def working():
        actors = (read_progress(out) or {}).get("actors", [])
        return next((a for a in actors if a["state"] == "ready" and a["rows"] >= 5), None)

    target = wait_for(working, proc)
    assert target is not None, finish(proc)[1]

    @ray.remote(num_cpus=2)
    class Squatter:
        def ping(self) -> int:
            return 1

    squatter = Squatter.remote()  # waits for the CPUs the actor holds, ahead of any replacement
    try:
        os.kill(target["pid"], signal.SIGKILL)
        assert ray.get(squatter.ping.remote(), timeout=120) == 1
        rc, err = finish(proc)
    finally:
        ray.kill(squatter)
    assert rc == 1, err
    assert "actor-1 (replacing actor-0) is still waiting for room on the cluster" in err, err
    assert "actor-1: got no room on the cluster within 30 s" in err and "every engine actor is gone" in err, err
    assert 5 <= manifest_rows(out) < N
    exactly_once(out)


@pytest.fixture()
def short_tmp():
    """A new folder with a short path, for a cluster's ``RAY_TMPDIR``: Ray's socket paths live under it and a socket
    path stops at 107 bytes, which pytest's tmp_path passes under pytest-xdist (``popen-gw0/`` is added)."""
    folder = Path(tempfile.mkdtemp(prefix="ray-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(not Path("/proc").exists(), reason="stops the Ray processes it started by their pids (/proc)")
def test_ray_without_an_address_joins_the_cluster_ray_start_runs_on_this_machine(short_tmp, tiny_model_path):
    """``ray start --head`` then ``--ray`` with no address failed in seconds with Ray's "When connecting to an existing
    cluster, num_cpus and num_gpus must not be provided": it must join that cluster, as ``ray.init()`` does, and
    leave it running. Its actors, on a cluster that can import torch, never do (a text model: ``mlxbatch._torch``)."""
    temp = short_tmp
    site, torch_mark = temp / "site", temp / "torch-imported"  # a torch that says where it was imported
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(f"import os, traceback\nopen({str(torch_mark)!r}, 'a').write("
                                               f"str(os.getpid()) + ''.join(traceback.format_stack()))\n"
                                               "__version__ = '2.9.0'\n")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(temp), "PYTHONPATH": path}
    with socket.socket() as s:  # the dashboard's port: free, so clusters of other runs on this machine do not clash
        s.bind(("127.0.0.1", 0))
        dashboard_port = s.getsockname()[1]
    ray_cli = Path(sys.executable).parent / "ray"
    try:
        started = subprocess.run([str(ray_cli), "start", "--head", "--num-cpus=2", "--port=0",
                                  "--include-dashboard=false", f"--dashboard-port={dashboard_port}",
                                  "--disable-usage-stats"], env=env, capture_output=True, text=True, timeout=300)
        assert started.returncode == 0, started.stdout + started.stderr
        address = re.search(r"ray start --address='([^']+)'", started.stdout + started.stderr).group(1)
        data = write_jsonl(temp / "in.jsonl", grouped_rows(1, 2))
        job = _job(temp, "joins", tiny_model_path, data, executor={"actors": 1, "num_cpus": 1})
        rc, err = finish(cli(["run", str(job), "--ray", "--no-progress"], env))
        assert rc == 0, err
        report = json.loads((job.parent / "out" / "report.json").read_text())
        assert report["engine"]["executor"]["address"] == address and report["rows"]["output"] == 6
        assert processes_mentioning(str(temp))  # the cluster it joined runs on
        assert not torch_mark.exists(), torch_mark.read_text()
    finally:
        _stop_processes_mentioning(str(temp))


def _stop_processes_mentioning(text: str) -> None:
    """SIGTERM, then SIGKILL after a grace, for the processes of a cluster this test started (never ``ray stop``:
    it stops every Ray cluster of the user on this machine)."""
    for sig, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):  # gcs_server outlives SIGTERM: no long wait
        for pid in processes_mentioning(text):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while processes_mentioning(text) and time.monotonic() < deadline:
            time.sleep(0.2)


@pytest.mark.skipif(not Path("/proc").exists(), reason="looks for leftover Ray processes in /proc")
def test_a_run_on_its_own_local_cluster_stops_cleanly_on_sigterm(short_tmp, data, tiny_model_path):
    """--ray without an address starts a cluster for the run; SIGTERM still finishes the shard and exits 130 (Ray's
    own SIGTERM handler is undone), the cluster goes with the run, and the job resumes on one machine."""
    root, path, expected, _ = data
    job = _job(root, "own-cluster", tiny_model_path, path, executor={"actors": 1, "num_cpus": 1}, engine=SLOW)
    out = job.parent / "out"
    tmp_path = short_tmp
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(tmp_path)}
    proc = cli(["run", str(job), "--ray", "--no-progress"], env)
    assert wait_for(lambda: manifest_rows(out) >= 10, proc, timeout=240), finish(proc)[1]
    proc.send_signal(signal.SIGTERM)
    rc, err = finish(proc)
    assert rc == 130 and "resume" in err, err
    assert read_progress(out)["state"] == "stopped"
    deadline = time.monotonic() + 30
    while processes_mentioning(str(tmp_path)) and time.monotonic() < deadline:  # raylet, gcs, workers
        time.sleep(0.5)
    assert not processes_mentioning(str(tmp_path))
    local = with_executor(validate_job(job), "local")  # --local, in this process
    assert JobRunner(local, progress=False).run().report["status"] == "complete"
    assert outputs(out, N) == expected and read_progress(out) is None


def test_an_address_where_no_cluster_answers_fails_fast_and_says_so(monkeypatch):
    """``--ray HOST:PORT`` with nothing listening there: a clear error within seconds (Ray's own connect waited over
    two minutes, printing GCS timeouts, with no error), for plain and ray:// addresses and $RAY_ADDRESS alike."""
    import socket

    from mlxbatch.job.executors.base import ExecutorError
    from mlxbatch.job.executors.ray import cluster as ray_cluster
    from mlxbatch.job.executors.ray.cluster import connected, unreachable

    # a driver not yet connected (other tests of this module may have left this process connected to their cluster)
    monkeypatch.setattr(ray_cluster.ray, "is_initialized", lambda: False)
    init_calls = []
    monkeypatch.setattr(ray_cluster.ray, "init", lambda *a, **kw: init_calls.append(a))

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(ExecutorError, match=f"at {address}: nothing answers at 127.0.0.1:{port}"):
            with connected(address, 1, 1.0):
                pass
    os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    try:
        with pytest.raises(ExecutorError, match="ray start --head"):
            with connected(None, 1, 1.0):
                pass
    finally:
        del os.environ["RAY_ADDRESS"]
    assert time.monotonic() - t0 < 10 and init_calls == []  # refused before Ray was asked to connect
    with socket.socket() as listening:  # something answers: the probe lets Ray take over
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert unreachable(f"127.0.0.1:{listening.getsockname()[1]}") is None
    assert unreachable("auto") is None


def test_a_mac_without_rays_cluster_switch_is_told_to_set_it(monkeypatch):
    """Ray refuses clusters of several machines on macOS unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1: a failed
    connection from a Mac names it (macOS injected); elsewhere, or with it set, the message stays as it was."""
    import socket

    from mlxbatch.job.executors.base import ExecutorError
    from mlxbatch.job.executors.ray import cluster as ray_cluster

    monkeypatch.setattr(ray_cluster.ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    for platform, named in (("darwin", True), ("linux", False)):
        monkeypatch.setattr(ray_cluster, "_node_platform", lambda p=platform: p)
        with pytest.raises(ExecutorError) as err:
            with ray_cluster.connected(address, 1, 1.0):
                pass
        assert ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1" in str(err.value)) == named, err.value
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1")
    assert ray_cluster.mac_cluster_hint("darwin") == ""


def test_a_failed_connection_to_an_address_names_rays_token_mode_while_it_is_unset():
    """Ray 2.60's ``ray start`` turns token authentication on where ~/.ray/auth_token exists, but a driver given an
    address sends the token only with RAY_AUTH_MODE=token (else it retries, then fails with no word of why)."""
    from mlxbatch.job.executors.ray.cluster import auth_hint

    assert "RAY_AUTH_MODE=token" in auth_hint({}) and auth_hint({"RAY_AUTH_MODE": "token"}) == ""


def test_one_actor_per_mac_by_default():
    from mlxbatch.job.executors.ray.cluster import NodeFacts, plan_actors
    from mlxbatch.job.spec import ExecutorSection

    def nodes(*platforms):
        return [NodeFacts(f"n{i}", p, {"CPU": 10.0, "memory": 1e10}) for i, p in enumerate(platforms)]

    x = ExecutorSection(kind="ray")
    plan = plan_actors(x, nodes("darwin", "darwin", "darwin"))
    assert plan.count == 3 and len(plan.bundles) == 3 and plan.bundles[0] == {"CPU": 1.0}
    assert plan_actors(x, nodes("linux", "linux")).count == 20  # elsewhere: what the resources fit, as before
    assert plan_actors(ExecutorSection(kind="ray", actors=2), nodes("darwin")).count == 2  # asked for: as asked
    mixed = plan_actors(x, nodes("darwin", "linux"))
    assert mixed.count == 20 and mixed.bundles == [] and mixed.macs == 1


def test_a_mac_runs_one_engine_actor_not_one_per_core(cluster, tmp_path, tiny_model_path, monkeypatch):
    """The module's cluster has 2 CPUs: 0.5 CPU per actor fits 4 actors, one per half core. With the node's
    platform injected as macOS (its task answers "darwin"), one actor runs every row, through a placement group
    that is gone afterwards."""
    from ray.util import placement_group_table

    from mlxbatch.job.executors.ray import cluster as ray_cluster
    from mlxbatch.job.spec import ExecutorSection

    x = ExecutorSection(kind="ray", num_cpus=0.5)
    assert ray_cluster.plan_actors(x, ray_cluster.cluster_nodes()).count == 4  # this Linux node, as it is
    monkeypatch.setattr(ray_cluster, "_node_platform", lambda: "darwin")
    assert [n.platform for n in ray_cluster.cluster_nodes()] == ["darwin"]
    rows = grouped_rows(2, 4)
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    job = _job(tmp_path, "mac", tiny_model_path, data,
               executor={"kind": "ray", "num_cpus": 0.5, "start_timeout_s": 240})
    report = JobRunner(validate_job(job), progress=False).run().report
    (actor,) = report["engine"]["executor"]["actors"]
    assert actor["rows"] == len(rows) == report["rows"]["output"]
    assert all(g["state"] == "REMOVED" for g in placement_group_table().values())
