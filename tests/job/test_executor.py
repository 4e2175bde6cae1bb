"""Executors without Ray: prefix-local partitions, merged engine counters, the executor section, the progress file,
a single-machine run that never imports Ray, and the plan's retention reaching the engine for every row kind."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from jobkit import texts, write_job, write_jsonl

from mlxbatch.job.executors.engine_stats import merge_engine_stats
from mlxbatch.job.executors.ray.partition import (
    prefix_groups,
    prefix_units,
    random_units,
    span_cost,
    split_for_steal,
    split_group,
)
from mlxbatch.job.executors.ray.progress import progress_lines, read_progress, write_progress
from mlxbatch.job.spec import JobSpecError, load_job, parse_job

BASE = {"model": "m", "input": "in.jsonl", "prompt": "{{ x }}", "output": "out"}


def test_prefix_groups_end_at_rows_that_share_nothing_with_the_next():
    assert prefix_groups([30, 30, 0, 0, 20, 0]) == [(0, 3), (3, 4), (4, 6)]
    assert prefix_groups([5, 5]) == [(0, 2)]  # a window may end inside a group (images come after)


def test_a_group_larger_than_a_share_is_cut_at_its_weakest_link():
    # 12 rows: two sub-groups of 6 sharing 100 tokens each, joined by a 20-token system prompt at row 5 -> 6
    links = [100] * 5 + [20] + [100] * 5 + [0]
    assert split_group(links, 0, 12, share=7) == [(0, 6), (6, 12)]  # not at 7 (the middle of a sub-group)
    assert split_group(links, 0, 12, share=12) == [(0, 12)]
    pieces = split_group([50] * 99 + [0], 0, 100, share=30)
    assert len(pieces) == 4 and pieces[0][0] == 0 and pieces[-1][1] == 100
    assert all(b[0] == a[1] for a, b in zip(pieces, pieces[1:])) and max(e - s for s, e in pieces) <= 30


def test_units_keep_groups_whole_and_come_largest_first():
    links = [40, 40, 40, 0, 0, 10, 0, 0]
    costs = [100, 60, 60, 60, 80, 50, 50, 90]
    units = prefix_units(links, costs, engines=2)
    assert sorted(r for u in units for r in u.rows) == list(range(8))
    assert units[0].rows == (0, 1, 2, 3) and [u.cost for u in units] == sorted((u.cost for u in units), reverse=True)
    assert all(list(u.rows) == list(range(u.rows[0], u.rows[-1] + 1)) for u in units)  # contiguous, plan order
    assert span_cost(links, costs, 2, 4) == 60 + 60 + 40  # a cut-out piece recomputes what it shared


@given(st.lists(st.integers(0, 64), min_size=1, max_size=300), st.integers(1, 16))
def test_units_cover_every_row_once_and_split_only_groups_larger_than_a_share(links, engines):
    units = prefix_units(links, [1] * len(links), engines)
    assert sorted(r for u in units for r in u.rows) == list(range(len(links)))
    share = -(-len(links) // engines)
    for s, e in prefix_groups(links):
        holders = {i for i, u in enumerate(units) if s in u.rows or e - 1 in u.rows}
        if e - s <= share:
            assert len(holders) == 1
    assert max(len(u.rows) for u in units) <= share


def test_random_units_deal_by_key_and_keep_plan_order():
    keys = [f"k{i}" for i in range(200)]
    units = random_units(keys, [1] * 200, engines=4)
    assert len(units) == 4 and sorted(r for u in units for r in u.rows) == list(range(200))
    assert all(list(u.rows) == sorted(u.rows) for u in units)
    assert units == random_units(keys, [1] * 200, engines=4)  # deterministic


def test_a_steal_cuts_near_the_middle_at_a_weak_link():
    assert split_for_steal([9, 9, 9, 9, 1, 9, 9, 9, 9, 0]) == 5
    assert split_for_steal([0, 0]) == 1


def test_engine_counters_of_actors_merge_into_one_report():
    a = {"profile": {"prefill_tokens": 10, "decode_s": 1.5}, "kv_budget_bytes": 100, "kv_bytes": 10, "preemptions": 1,
         "prefix_cache": {"tokens_reused": 5, "block_size": 16}, "vision_cache": None, "device": "cpu"}
    b = {**a, "profile": {"prefill_tokens": 32, "decode_s": 0.5}, "vision_cache": {"hits": 3, "misses": 1,
                                                                                  "hit_rate": 0.75}}
    m = merge_engine_stats([{**a, "peak_memory_bytes": 70}, {**b, "peak_memory_bytes": 90}])
    assert m["profile"] == {"prefill_tokens": 42, "decode_s": 2.0} and m["kv_budget_bytes"] == 200
    assert m["peak_memory_bytes"] == 90  # each actor's own device: the largest, not a sum
    assert m["prefix_cache"] == {"tokens_reused": 10, "block_size": 16} and m["device"] == "cpu"
    assert m["vision_cache"] == {"hits": 3, "misses": 1, "hit_rate": 0.75} and merge_engine_stats([]) == {}
    # each engine's batch: once when every actor runs the same, else each distinct one
    cpu, gpu = {"max_num_seqs": 128, "max_num_seqs_from": "device"}, {"max_num_seqs": 512, "max_num_seqs_from": "device"}
    assert merge_engine_stats([{**a, "batch": cpu}, {**b, "batch": cpu}])["batch"] == cpu
    assert merge_engine_stats([{**a, "batch": cpu}, {**b, "batch": gpu}])["batch"] == [cpu, gpu]


def test_the_hint_of_a_row_s_length_is_the_job_s_max_tokens_where_every_row_reserves_it(tmp_path):
    from mlxbatch.job.executors.base import row_tokens_hint

    (tmp_path / "in.jsonl").write_text("{}\n")
    assert row_tokens_hint(parse_job({**BASE, "sampling": {"max_tokens": 24}}, base_dir=tmp_path)) == 24
    per_row = {**BASE, "sampling": {"max_tokens": 24, "overrides": {"max_tokens": "budget"}}}
    assert row_tokens_hint(parse_job(per_row, base_dir=tmp_path)) is None  # each row says its own
    score = {**BASE, "task": "score", "score": {"candidates": ["a", "b"]}}
    assert row_tokens_hint(parse_job(score, base_dir=tmp_path)) is None  # score rows generate nothing


def test_the_executor_section_is_checked_with_key_paths(tmp_path):
    (tmp_path / "in.jsonl").write_text("{}\n")
    spec = parse_job({**BASE, "executor": {"kind": "ray", "actors": 3, "num_gpus": 1, "resources": {"mac": 1}}},
                     base_dir=tmp_path)
    x = spec.executor
    assert (x.kind, x.actors, x.num_gpus, x.resources, x.partition) == ("ray", 3, 1.0, {"mac": 1}, "prefix")
    assert parse_job(BASE, base_dir=tmp_path).executor.kind == "local"
    with pytest.raises(JobSpecError) as err:
        parse_job({**BASE, "executor": {"kind": "spark", "actors": 0, "num_cpus": -1, "partition": "hash",
                                        "resources": {"mac": "one"}, "workers": 2}}, base_dir=tmp_path)
    keys = {k for k, _ in err.value.problems}
    assert keys == {"executor.kind", "executor.actors", "executor.num_cpus", "executor.partition",
                    "executor.resources.mac", "executor.workers"}


def test_the_progress_file_says_when_its_driver_stopped_updating_or_stopped(tmp_path):
    actor = {"name": "actor-0", "state": "ready", "host": "h", "pid": 7, "rows": 3, "errors": 1, "in_flight": 2,
             "queued": 4, "generated_tokens": 9, "prefill_tokens": 30, "floor_tokens": 20}
    write_progress(tmp_path, {"executor": "ray", "state": "running", "actors": [actor]})
    lines = progress_lines(read_progress(tmp_path))
    assert "1/1 actors live" in lines[0] and "may have stopped" not in lines[0]
    assert "actor-0" in lines[2] and "3 rows (1 errors), 2 in flight" in lines[2] and "prefill/floor 1.50" in lines[2]
    old = {**read_progress(tmp_path), "updated_at": time.time() - 3600}
    assert "may be stuck" in progress_lines(old)[0]  # its driver still holds the folder
    gone = progress_lines({**old, "driver": {"host": "h", "pid": 99}}, running=False)[0]
    assert "stopped, the driver (pid 99 on h) is not running" in gone and "actors live" not in gone


def test_a_single_machine_run_never_imports_ray(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(6))
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", executor={"actors": 2})  # kind: local
    code = ("import sys; from mlxbatch.cli import main; sys.argv = ['mlxbatch', 'run', sys.argv[1], '--no-progress']\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "assert 'ray' not in sys.modules, 'ray was imported'\nprint('no ray')")
    res = subprocess.run([sys.executable, "-c", code, str(job)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "no ray" in res.stdout, res.stderr
    assert (tmp_path / "out" / "_SUCCESS").exists()


def test_the_plan_s_retention_reaches_the_engine_for_generate_and_score_rows(tiny_model_path):
    """A RowTask's ``cache_tokens`` goes to ``add_request`` and to ``add_score_request`` alike, on the engine every
    executor uses (``RowEngine``: the local executor's, and an engine actor's, run here in process as Ray runs it)."""
    from mlxbatch.job.executors.ray.actor import EngineActor
    from mlxbatch.job.rows.tasks import RowTask
    from mlxbatch.job.spec import EngineSection, ModelSection
    from mlxbatch.types import SamplingParams

    actor = EngineActor("actor-0", ModelSection(str(tiny_model_path)), EngineSection(max_num_seqs=4), seed=0)
    actor.info()  # loads the model
    core, seen = actor.engine.core, {}

    def spying(name):
        real = getattr(core, name)

        def spy(*args, **kwargs):
            seen[kwargs["request_id"]] = (name, kwargs.get("cache_tokens"))
            return real(*args, **kwargs)

        return spy

    for name in ("add_request", "add_score_request"):
        setattr(core, name, spying(name))  # an instance attribute of our own engine: records, then calls the real one
    ids = actor.loaded.tokenizer.encode("Is the sky blue? Answer:")
    tasks = [RowTask("gen", "gen", ids, SamplingParams(max_tokens=2), cache_tokens=len(ids) - 2),
             RowTask("score", "score", ids, SamplingParams(), cache_tokens=len(ids) - 1, candidates=(" yes", " no"))]
    done = actor.advance(tasks, budget_s=30.0, return_after=2).done
    while len(done) < 2:
        done += actor.advance([], budget_s=30.0, return_after=2).done
    assert seen == {"gen": ("add_request", len(ids) - 2), "score": ("add_score_request", len(ids) - 1)}
    by_key = {d.key: d for d in done}
    assert by_key["gen"].error is None and by_key["gen"].output.generated_tokens == 2
    assert by_key["score"].error is None and len(by_key["score"].output.completions) == 2
    actor.engine.shutdown()


def test_an_actor_reports_its_engines_reuse_step(tmp_path, tiny_model_path):
    """A Ray actor tells the driver its engine's reuse step (a block where prefill passes are packed, 1 here), and the
    driver's feed plans with it (``ModelInfo.reuse_step``), as the single-machine executor's does."""
    from mlxbatch.job.check.validate import validate_job
    from mlxbatch.job.executors.ray.actor import EngineActor

    data = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "text": "hello"}])
    spec = validate_job(write_job(tmp_path, tiny_model_path, data, tmp_path / "out"))
    actor = EngineActor("a0", spec.model, spec.engine, spec.seed)
    assert actor.info().reuse_step == actor.engine.core.reuse_step == 1
    assert actor.info().max_num_seqs == 8 and "set in the config" in actor.info().batch  # the job's engine section
    actor.engine.core.shutdown()


def test_a_job_without_an_engine_section_runs_and_reports_the_batch_its_device_chose(tmp_path, tiny_model_path):
    """No ``engine:`` section: the engine sizes its batch (this device's default: 128 rows on a CPU; the hint of a
    row's length is the job's max_tokens), the local executor keeps 4 x that many rows in flight, and report.json says
    what ran."""
    import json

    from mlxbatch.engine import REGISTRY, device_info
    from mlxbatch.job.check.validate import validate_job
    from mlxbatch.job.executors.base import model_spec
    from mlxbatch.job.executors.local import LocalExecutor
    from mlxbatch.job.run.runner import JobRunner

    data = write_jsonl(tmp_path / "in.jsonl", texts(6))
    spec = validate_job(write_job(tmp_path, tiny_model_path, data, tmp_path / "out", engine=None))
    assert spec.engine.max_num_seqs is None and spec.engine.max_num_batched_tokens is None
    here = device_info().batch_defaults
    seqs, tokens = here.max_num_seqs, here.max_num_batched_tokens
    loaded = REGISTRY.acquire(model_spec(spec.model), "test")
    try:
        ex = LocalExecutor(spec, loaded)
        core = ex.engine.core
        assert core.config.expected_row_tokens == 8 and core.config.max_num_seqs == seqs
        assert ex.rows.most == 4 * seqs and "the device's default" in ex.model.batch
        ex.shutdown()
    finally:
        REGISTRY.release(model_spec(spec.model), "test")
    JobRunner(spec, progress=False).run()
    batch = json.loads((tmp_path / "out" / "report.json").read_text())["engine"]["batch"]
    assert batch["max_num_seqs"] == seqs and batch["max_num_batched_tokens"] == tokens
    assert batch["max_num_seqs_from"] == "device" and batch["rows_in_kv_budget"] >= seqs


def test_a_run_warms_its_engine_up_once_while_its_feed_prepares_the_first_window(tmp_path, tiny_model_path,
                                                                                 monkeypatch):
    """The feed starts reading before the engine's warm-up, so the first window is prepared meanwhile (on a GPU the
    warm-up compiles kernels for seconds; the engine used to wait for the window after it); the engine is warmed up
    once, before its first step."""
    from mlxbatch.engine import EngineCore
    from mlxbatch.job.check.validate import validate_job
    from mlxbatch.job.rows.feed import RowFeed
    from mlxbatch.job.run.runner import JobRunner

    events: list[str] = []
    real_start, real_warm_up, real_step = RowFeed.start, EngineCore.warm_up, EngineCore.step

    def start(self):
        if self._thread is None:
            events.append("feed started")
        return real_start(self)

    def warm_up(self):
        events.append("warm-up")
        return real_warm_up(self)

    def step(self):
        if not events or events[-1] != "step":
            events.append("step")
        return real_step(self)

    monkeypatch.setattr(RowFeed, "start", start)
    monkeypatch.setattr(EngineCore, "warm_up", warm_up)
    monkeypatch.setattr(EngineCore, "step", step)
    data = write_jsonl(tmp_path / "in.jsonl", texts(12))
    spec = validate_job(write_job(tmp_path, tiny_model_path, data, tmp_path / "out"))
    JobRunner(spec, progress=False).run()
    assert events == ["feed started", "warm-up", "step"]
    assert (tmp_path / "out" / "_SUCCESS").exists()


def test_rows_reach_the_engine_a_step_s_worth_at_a_time(tmp_path, tiny_model_path, monkeypatch):
    """The local executor tops its rows in flight up to 4 x max_num_seqs after every step, taking what finished:
    never a burst of half its rows at once (2,048 rows between two steps at an H100's defaults, while the GPU's launch
    thread waited for the next step), so no take submits more rows than one step can finish (max_num_seqs)."""
    from mlxbatch.job.check.validate import validate_job
    from mlxbatch.job.executors.local import LocalExecutor
    from mlxbatch.job.run.runner import JobRunner

    taken: list[tuple[int, int]] = []  # (rows submitted by a take, rows in flight after it)
    real_take = LocalExecutor.take

    def take(self, feed):
        before = len(self.rows)
        out = real_take(self, feed)
        taken.append((len(self.rows) - before, len(self.rows)))
        return out

    monkeypatch.setattr(LocalExecutor, "take", take)
    rows, seqs = 80, 4
    data = write_jsonl(tmp_path / "in.jsonl", texts(rows))
    spec = validate_job(write_job(tmp_path, tiny_model_path, data, tmp_path / "out", engine={"max_num_seqs": seqs},
                                  sampling={"temperature": 0, "max_tokens": 3, "ignore_eos": True}))
    JobRunner(spec, progress=False).run()
    submits = [n for n, _ in taken if n]
    assert sum(submits) == rows and submits[0] == 4 * seqs  # the first take fills the rows in flight
    assert max(submits[1:]) <= seqs  # then a step's worth (or less) at a time
    full = [after for n, after in taken if n][: (rows - 4 * seqs) // seqs]
    assert all(after == 4 * seqs for after in full)  # topped up to 4 x max_num_seqs while rows remain


def test_where_a_single_machine_job_runs_its_engine(tmp_path, tiny_model_path, monkeypatch):
    """In a process of its own for a big job (its GIL is then the engine's alone), in the run's for a short one (an
    interpreter's start would cost more), and in the run's where this process holds the model already (a second copy
    would double its memory); ``MLXBATCH_ENGINE_PROCESS`` decides when set."""
    from mlxbatch.engine import REGISTRY
    from mlxbatch.errors import MlxbatchError
    from mlxbatch.job.executors import ENGINE_PROCESS_ENV, engine_process, open_executor
    from mlxbatch.job.executors import ENGINE_PROCESS_MIN_ROWS as MIN_ROWS
    from mlxbatch.job.executors.base import model_spec

    monkeypatch.delenv(ENGINE_PROCESS_ENV, raising=False)
    data = write_jsonl(tmp_path / "in.jsonl", texts(4))
    spec = load_job(write_job(tmp_path, tiny_model_path, data, tmp_path / "out"))
    assert engine_process(spec, MIN_ROWS) and engine_process(spec, None)  # (a count not known: a big job's rule)
    assert not engine_process(spec, MIN_ROWS - 1) and not engine_process(spec, MIN_ROWS, held_here=True)
    ms = model_spec(spec.model)
    REGISTRY.acquire(ms, "a notebook's engine")
    try:
        with open_executor(spec, MIN_ROWS) as executor:  # the notebook's model: this process holds it
            assert not executor.engine_process
    finally:
        REGISTRY.release(ms, "a notebook's engine")
    monkeypatch.setenv(ENGINE_PROCESS_ENV, "1")
    assert engine_process(spec, 10)
    monkeypatch.setenv(ENGINE_PROCESS_ENV, "0")
    assert not engine_process(spec, None)
    monkeypatch.setenv(ENGINE_PROCESS_ENV, "yes")
    with pytest.raises(MlxbatchError, match=ENGINE_PROCESS_ENV):
        engine_process(spec, 10)


def test_a_stuck_engine_process_is_killed_at_shutdown_not_waited_for(tmp_path, tiny_model_path, monkeypatch):
    """An engine process that reads nothing (stopped here: stuck in a step, say) while the run's writer waits on its
    full pipe: the run's shutdown kills it after the wait, rather than hang closing the pipe under that write."""
    import os
    import signal

    from mlxbatch.job.executors import process

    monkeypatch.setattr(process, "CLOSE_WAIT_S", 1.0)
    data = write_jsonl(tmp_path / "in.jsonl", texts(4))
    spec = load_job(write_job(tmp_path, tiny_model_path, data, tmp_path / "out"))
    executor = process.ProcessExecutor(spec)
    executor.warm_up()
    os.kill(executor._proc.pid, signal.SIGSTOP)
    for _ in range(8):  # 8 MB: more than the pipe and the child's reader hold before it stopped
        executor._send(("stats", bytes(1 << 20)))
    t0 = time.monotonic()
    executor.shutdown()
    assert time.monotonic() - t0 < 10 and executor._proc.poll() is not None


def test_an_engine_process_whose_rows_are_done_exits_while_the_run_writes_its_results(tmp_path, tiny_model_path,
                                                                                     monkeypatch):
    """Once every row is in, the run tells its executor (``rows_done``) before it writes results.parquet: the engine's
    own process then exits by itself (its teardown overlaps the results' writing), and ``shutdown`` only waits."""
    from mlxbatch.job.check.validate import validate_job
    from mlxbatch.job.executors import ENGINE_PROCESS_ENV, process
    from mlxbatch.job.run import runner as runner_mod

    data = write_jsonl(tmp_path / "in.jsonl", texts(6))
    spec = load_job(write_job(tmp_path, tiny_model_path, data, tmp_path / "out"))
    executor = process.ProcessExecutor(spec)
    try:
        executor.warm_up()
        executor.rows_done()
        assert executor._proc.wait(timeout=30) == 0  # gone before any shutdown
    finally:
        executor.shutdown()

    events: list[str] = []
    real_done, real_finalize = process.ProcessExecutor.rows_done, runner_mod.finalize

    def rows_done(self):
        events.append("rows done")
        real_done(self)

    def finalize(*args, **kwargs):
        events.append("results")
        return real_finalize(*args, **kwargs)

    monkeypatch.setattr(process.ProcessExecutor, "rows_done", rows_done)
    monkeypatch.setattr(runner_mod, "finalize", finalize)
    monkeypatch.setenv(ENGINE_PROCESS_ENV, "1")
    runner_mod.JobRunner(validate_job(write_job(tmp_path, tiny_model_path, data, tmp_path / "out2")),
                         progress=False).run()
    assert events == ["rows done", "results"] and (tmp_path / "out2" / "_SUCCESS").exists()


def test_a_frame_the_engine_process_cannot_read_fails_the_run_with_the_reason(tmp_path, tiny_model_path):
    """The engine process unpickles the run's frames on its input thread (its stepping thread only takes them): a
    frame that does not unpickle reaches the run as the engine's error, never as a child waiting for input forever."""
    from mlxbatch.job.executors import process

    data = write_jsonl(tmp_path / "in.jsonl", texts(4))
    spec = load_job(write_job(tmp_path, tiny_model_path, data, tmp_path / "out"))
    executor = process.ProcessExecutor(spec)
    try:
        executor.warm_up()
        executor._writer._stream.write(b"\x05" + bytes(7) + b"junk!")  # a frame of 5 bytes that are no pickle
        executor._writer._stream.flush()
        with pytest.raises(process.ExecutorError, match="UnpicklingError|pickle"):
            executor._expect("stats", timeout=60)
    finally:
        executor.shutdown()
