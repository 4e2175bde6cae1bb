"""One engine actor per GPU, on a local Ray cluster whose node declares two GPUs (Ray schedules GPUs as logical
resources and sets each actor's CUDA_VISIBLE_DEVICES; no GPU is needed): the default pool is one actor per GPU, each
with its own device, the results are a single-machine run's, and the driver keeps the actors working while its feed
prepares the next window."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from jobkit import write_job, write_jsonl
from raykit import PROMPT, grouped_rows, outputs

from mlxbatch.io import open_reader
from mlxbatch.job.check.validate import input_spec, validate_job
from mlxbatch.job.executors.ray.cluster import NodeFacts, plan_actors
from mlxbatch.job.rows.feed import RowFeed
from mlxbatch.job.rows.prepare import RowPreparer
from mlxbatch.job.run.runner import JobRunner
from mlxbatch.job.spec import ExecutorSection

ray = pytest.importorskip("ray")

GREEDY = {"temperature": 0, "max_tokens": 8}
DEFAULT_RAY = {"kind": "ray", "num_cpus": 0.5, "start_timeout_s": 240}  # no actors, no num_gpus: the defaults


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory):
    """One node with 2 CPUs and 2 declared GPUs: half a CPU an actor would fit 4 actors, the GPUs fit 2."""
    ray.init(num_cpus=2, num_gpus=2, _temp_dir=str(tmp_path_factory.mktemp("r")), include_dashboard=False,
             namespace="mlxbatch-tests", logging_level=logging.WARNING)
    yield
    ray.shutdown()


def _job(root, name, model, data, **overrides):
    d = root / name
    d.mkdir()
    return write_job(d, model, data, d / "out", prompt={"template": PROMPT}, sampling=GREEDY, **overrides)


def test_one_engine_actor_per_gpu_is_the_default_where_nodes_have_gpus(caplog):
    def node(i: int, gpus: float, cpus: float = 32.0, platform: str = "linux") -> NodeFacts:
        return NodeFacts(f"n{i}", platform, {"CPU": cpus, **({"GPU": gpus} if gpus else {})})

    x = ExecutorSection(kind="ray")
    host = plan_actors(x, [node(0, 2)])
    assert (host.count, host.num_gpus, host.options(x)) == (2, 1.0, {"num_cpus": 1.0, "num_gpus": 1.0})
    hosts = plan_actors(x, [node(0, 0, cpus=8), node(1, 4), node(2, 4)])  # a CPU-only head and two 4-GPU hosts
    assert (hosts.count, hosts.num_gpus, hosts.gpus) == (8, 1.0, 8.0)
    cpus = plan_actors(x, [node(0, 0, cpus=4)])  # no GPU anywhere: as many as the CPUs fit, as before
    assert (cpus.count, cpus.num_gpus) == (4, 0.0)
    one = plan_actors(ExecutorSection(kind="ray", actors=1), [node(0, 2)])  # a count asked for: each its own GPU
    assert (one.count, one.num_gpus) == (1, 1.0)
    half = plan_actors(ExecutorSection(kind="ray", num_gpus=0.5), [node(0, 2)])  # asked to share: two a GPU
    assert (half.count, half.num_gpus) == (4, 0.5)
    with caplog.at_level(logging.WARNING):
        zero = plan_actors(ExecutorSection(kind="ray", num_gpus=0), [node(0, 2, cpus=4)])
    assert (zero.count, zero.num_gpus) == (4, 0.0) and "runs on the first" in caplog.text
    macs = plan_actors(x, [node(0, 1, 10.0, "darwin"), node(1, 1, 10.0, "darwin")])  # the Mac case as it was
    assert (macs.count, macs.num_gpus, macs.bundles) == (2, 0.0, [{"CPU": 1.0}, {"CPU": 1.0}])


def test_a_node_with_two_gpus_runs_one_actor_on_each_with_the_single_machine_results(gpu_cluster, tmp_path,
                                                                                       tiny_model_path):
    rows = grouped_rows(8, 16)
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    local = _job(tmp_path, "local", tiny_model_path, data, executor={"kind": "local"})
    JobRunner(validate_job(local), progress=False).run()
    job = _job(tmp_path, "gpus", tiny_model_path, data, executor=DEFAULT_RAY)
    report = JobRunner(validate_job(job), progress=False).run().report
    assert outputs(job.parent / "out", len(rows)) == outputs(local.parent / "out", len(rows))
    actors = report["engine"]["executor"]["actors"]
    # Ray gave each actor one GPU of its own (num_gpus=1: CUDA_VISIBLE_DEVICES a single, different id each)
    assert sorted(a["gpus"] for a in actors) == ["0", "1"], actors
    assert all(a["rows"] > 0 and a["kv_budget_bytes"] > 0 for a in actors)


def test_actors_keep_working_while_the_feed_prepares_the_next_window(gpu_cluster, tmp_path, tiny_model_path):
    """The input stalls after its first window (a slow disk, a network file): the driver does not wait for the
    next window while the actors hold rows, so the first window's rows all finish while the input is stalled."""
    from mlxbatch.job.executors.ray.executor import open_ray_executor

    window = 12
    data = write_jsonl(tmp_path / "in.jsonl", grouped_rows(4, 12))
    spec = validate_job(_job(tmp_path, "stall", tiny_model_path, data, plan={"window": window},
                             executor=DEFAULT_RAY))
    spec.output.mkdir(parents=True)  # the runner makes it; the executor writes progress.json there
    released = threading.Event()

    def stalled_input():
        for i, row in enumerate(open_reader(input_spec(spec))):
            if i == window:
                released.wait(120)
            yield row

    with open_ray_executor(spec) as ex:
        m = ex.model
        feed = RowFeed(stalled_input(), RowPreparer(spec, m.identity, False, m.takes_images, m.context_length),
                       m.tokenizer, set(), window=window, min_step_tokens=m.reuse_step, background=True)
        seen: list[tuple[str, bool]] = []
        deadline = time.monotonic() + 300
        try:
            while not (feed.finished and not ex.busy) and time.monotonic() < deadline:
                ex.take(feed)
                seen += [(f.prep.row_id, released.is_set()) for f in ex.poll()]
                if len(seen) >= window:
                    released.set()
        finally:
            released.set()
            feed.close()
    assert sorted(r for r, _ in seen) == sorted(r["id"] for r in grouped_rows(4, 12))  # every row, once
    assert sum(not after for _, after in seen) == window  # the whole first window finished while the input stalled
