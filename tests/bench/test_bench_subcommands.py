"""The bench's diagnostic subcommands run end to end on the tiny model (CPU, tiny sizes, seconds).

A GPU session has minutes of device time; a subcommand that broke when the engine's code moved costs it a run. These
check that each runs, prints its table and that what the table says holds where it must (the same greedy tokens under
configurations that may not change them, every row agreeing with its solo run under batch invariance), never speeds.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mlxbatch.bench import invariance, kernels, ray_runs, runs


def _cache(tmp_path: Path, tiny_model_path: Path) -> str:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tiny").symlink_to(tiny_model_path, target_is_directory=True)
    return str(cache)


def _table(path: Path, i: int = 0) -> list[dict]:
    t = json.loads(path.read_text())["tables"][i]
    return [dict(zip(t["columns"], r)) for r in t["rows"]]


def test_runs_compares_configurations_and_cuda_decisions(tmp_path, tiny_model_path, capsys):
    out = tmp_path / "runs.json"
    common = ["--model", "tiny", "--cache-dir", _cache(tmp_path, tiny_model_path), "--runs", "label:6,chat:8:nocache",
              "--rounds", "1", "--concurrency", "32"]
    assert runs.main([*common, "--configs", "plain:;overlap:overlap_steps=true", "--b1", "--json", str(out)]) == 0
    rows = _table(out)
    assert [(r["workload"], r["config"]) for r in rows] == [
        ("label 6", "B1 (mlx-lm)"), ("label 6", "plain"), ("label 6", "overlap"),
        ("chat 8 nocache", "B1 (mlx-lm)"), ("chat 8 nocache", "plain"), ("chat 8 nocache", "overlap")]
    by = {(r["workload"], r["config"]): r for r in rows}
    for w in ("label 6", "chat 8 nocache"):  # overlapped steps change when the host works, not what is computed
        assert by[(w, "plain")]["tokens"] == by[(w, "overlap")]["tokens"] == by[(w, "B1 (mlx-lm)")]["tokens"]
        assert by[(w, "plain")]["prefill tok"] == by[(w, "overlap")]["prefill tok"]
    assert by[("label 6", "plain")]["prefill / floor"] == pytest.approx(1.0, abs=0.05)  # the cache reaches the floor
    assert by[("chat 8 nocache", "plain")]["stored MB"] == 0  # no prefix cache: nothing stored
    # the host's work: CPU time of the thread that ran generate(), within its wall (MLX computes on its own threads)
    assert 0 < by[("label 6", "plain")]["engine's thread CPU s"] <= by[("label 6", "plain")]["wall s"] + 0.05
    assert by[("label 6", "B1 (mlx-lm)")]["engine's thread CPU s"] is None
    assert "### engine runs: concurrency 32" in capsys.readouterr().out

    cuda = tmp_path / "cuda.json"  # the CUDA text path's decisions on this CPU: the same greedy tokens
    assert runs.main([*common, "--cuda-decisions", "--json", str(cuda)]) == 0
    got = {r["workload"]: r for r in _table(cuda)}
    for w in ("label 6", "chat 8 nocache"):
        assert got[w]["tokens"] == by[(w, "plain")]["tokens"]
        assert got[w]["of it row moves MB"] == 0 < by[(w, "plain")]["of it row moves MB"]  # CUDA's rows stay put
    assert "CUDA's decisions" in json.loads(cuda.read_text())["tables"][0]["title"]

    mac = tmp_path / "mac.json"  # a Mac's decisions (a GPU's batched row moves): the same greedy tokens again
    assert runs.main([*common, "--mac-decisions", "--json", str(mac)]) == 0
    got = {r["workload"]: r for r in _table(mac)}
    for w in ("label 6", "chat 8 nocache"):
        assert got[w]["tokens"] == by[(w, "plain")]["tokens"]
    assert "a Mac's decisions" in json.loads(mac.read_text())["tables"][0]["title"]


def test_runs_refuses_bad_items():
    for argv, says in ((["--runs", "label"], "expected workload:rows"), (["--runs", "nope:4"], "expected"),
                       (["--configs", "a:max_num_seqs"], "expected field=value"),
                       (["--cuda-decisions", "--mac-decisions"], "one device's decisions")):
        with pytest.raises(SystemExit, match=says):
            runs.main(["--model", "/nonexistent", *argv])  # refused before any model is loaded


def test_invariance_rows_agree_with_their_solo_runs(tmp_path, tiny_model_path):
    out = tmp_path / "inv.json"
    assert invariance.main(["--model", "tiny", "--cache-dir", _cache(tmp_path, tiny_model_path), "--workloads",
                            "unique", "--rows", "6", "--repeats", "1", "--solo-rows", "3", "--json", str(out)]) == 0
    (row,) = _table(out)
    assert row["workload"] == "unique" and row["solo agreement invariant"] == "3/3"
    assert row["default tok/s"] > 0 and row["invariant tok/s"] > 0


def test_ray_bench_local_run_and_simulation(tmp_path, tiny_model_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its job folder (kept for a user to read) goes there
    out = tmp_path / "ray.json"
    assert ray_runs.main(["--model", str(tiny_model_path), "--configs", "local", "--rows", "12", "--max-tokens", "2",
                          "--data", "reviews", "--sim-rows", "20000", "--json", str(out)]) == 0
    run, = _table(out, 0)
    assert run["run"] == "local" and run["prefill / plan floor"] >= 1.0 and run["rows/s"] > 0
    sim = _table(out, 1)
    assert {(r["shape"], r["actors"]) for r in sim} == {(s, a) for s in ("system", "templates", "unique")
                                                         for a in (8, 64)}
    for r in sim:
        assert r["prefix-local: balance"] >= 1.0 and r["floor ratio"] >= 1.0  # nobody beats the ideal or the floor
    assert "results equal to the first run's in every run: True" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").exists(), reason="stops the Ray cluster it started by its pids (/proc)")
def test_ray_bench_userjob_runs_the_job_on_one_engine_and_on_a_ray_start_cluster(tmp_path, tiny_model_path,
                                                                                   monkeypatch):
    """The issue-51 device command on a CPU: the user's job through ``mlxbatch run``, then with ``--ray`` on a cluster
    ``ray start --head`` declares two (fake) GPUs on: one actor on each, every id once with the same text."""
    pytest.importorskip("ray")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its job folder (kept for a user to read) goes there
    out = tmp_path / "ray.json"
    assert ray_runs.main(["--userjob", "--model", "tiny", "--cache-dir", _cache(tmp_path, tiny_model_path), "--rows",
                          "24", "--gpus", "2", "--skip-sim", "--json", str(out)]) == 0
    one, ray = _table(out)
    assert one["speed-up"] == 1.0 and one["driver CPU s"] is None
    per_actor = ray["per actor: GPU, rows (share), prefill / floor, busy s, idle s"]
    assert ray["rows/s"] > 0 and ray["driver CPU s"] > 0 and "GPU 0" in per_actor and "GPU 1" in per_actor
    res = json.loads(out.read_text())["tables"][0]["raw"]
    assert (res["result_rows"], res["distinct_ids"], res["same_text"]) == (24, 24, 24)
    assert res["feed"]["rows"] == 24 and res["feed"]["rows_per_s"] > 0  # the driver's feed alone, on those rows
    actors = res["runs"]["--ray, one actor per GPU"]["report"]["engine"]["executor"]["actors"]
    assert sorted(a["gpus"] for a in actors) == ["0", "1"] and sum(a["rows"] for a in actors) == 24


def test_ray_bench_refuses_an_unknown_config():
    with pytest.raises(SystemExit) as exc:
        ray_runs.main(["--configs", "local,ray-9"])
    assert exc.value.code == 2


def test_kernels_says_what_it_needs_before_loading_anything(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # this machine may or may not have torch: make it absent
    with pytest.raises(SystemExit, match="needs torch"):
        kernels.main(["--model", "/nonexistent"])


def test_device_busy_time_is_the_union_of_kernel_intervals():
    evs = [("a", 0.0, 10.0), ("b", 5.0, 10.0), ("c", 30.0, 5.0), ("d", 31.0, 1.0)]  # 0-15 and 30-35
    assert kernels.busy_us(evs) == 20.0
    assert kernels.busy_us([]) == 0.0


def test_userjob_runs_the_job_through_the_cli_with_and_without_an_engine_section(tmp_path, tiny_model_path):
    """The CPU version of the headline benchmark at a few hundred rows: the job with defaults (no engine section) and
    a hand-set one through ``mlxbatch run``, mlx-lm on the first rows of the same prompts, and the floor."""
    import math

    import yaml

    from mlxbatch.bench import userjob

    out, work = tmp_path / "userjob.json", tmp_path / "work"
    assert userjob.main(["--model", "tiny", "--cache-dir", _cache(tmp_path, tiny_model_path), "--rows", "120",
                         "--configs", "defaults,16x512+overlap", "--mlx-lm-rows", "24", "--matmul-n", "256",
                         "--stream-mib", "16", "--workdir", str(work), "--json", str(out)]) == 0
    assert "engine" not in yaml.safe_load((work / "job-defaults.yaml").read_text())  # what a user types
    hand = "max_num_seqs: 16, max_num_batched_tokens: 512, overlap_steps: true"
    assert yaml.safe_load((work / "job-seqs-16-512-overlap.yaml").read_text())["engine"] == {
        "max_num_seqs": 16, "max_num_batched_tokens": 512, "overlap_steps": True}
    res = json.loads(out.read_text())
    rows = _table(out)
    assert [r["engine section"] for r in rows] == ["none (defaults)", hand, "mlx-lm batch_generate, first 24 rows"]
    texts = [pq.read_table(work / name / "results.parquet", columns=["text"]).column("text").to_pylist()
             for name in ("out-defaults", "out-seqs-16-512-overlap")]
    assert texts[0] == texts[1] and len(texts[0]) == 120  # overlapped steps of another size: the same greedy rows
    for r in rows[:2]:
        assert r["rows/s"] > 0 and r["engine steps s"] > 0 and r["wall s"] >= r["engine steps s"]
        assert r["prefill / window floor"] >= 1.0
    report = res["reports"]["none (defaults)"]["report"]
    assert report["rows"]["ok"] == 120
    cpu = report["this_run"]["cpu_s"]  # the run's thread stepped the engine; the feed's prepared every row
    assert report["this_run"]["feed_workers"] == 0  # (a CPU: no workers by default)
    assert not report["this_run"]["engine_process"]  # (120 rows: the engine in the run's process)
    assert 0 < cpu["run_thread"] and 0 < cpu["feed_thread"]
    assert rows[0]["CPU s: the run's thread / the feed's / the engine process's"].endswith(" / -")
    chosen = report["engine"]["batch"]  # what the engine sized with no engine section, and the notes say it
    assert chosen["max_num_seqs_from"] == "device" and res["reports"][hand]["report"]["engine"]["batch"][
        "max_num_batched_tokens"] == 512
    assert any(f"the defaults ran max_num_seqs {chosen['max_num_seqs']} (device)" in n for n in res["tables"][0]["notes"])
    floor = res["floor"]
    assert floor["prefill_tokens"] == report["prefix_reuse"]["window_floor_tokens"]
    assert floor["decode_steps"] == math.ceil(120 * 7 / 256) and floor["seconds"] > 0
    ref = res["mlx_lm"]
    assert ref["same_prompt_length"] == 24  # mlx-lm ran the job's prompts
    assert ref["same_text"] == 24  # greedy float32 on one CPU: the same outputs
    # the same workdir again: the run runs every row (its output folder is made anew), it does not resume
    assert userjob.main(["--model", "tiny", "--cache-dir", str(tmp_path / "cache"), "--rows", "120",
                         "--configs", "defaults", "--mlx-lm-rows", "0", "--matmul-n", "256", "--stream-mib", "16",
                         "--workdir", str(work), "--json", str(out)]) == 0
    again = json.loads(out.read_text())["reports"]["none (defaults)"]["report"]["rows"]
    assert (again["finished_this_run"], again["resumed"]) == (120, 0)


def test_userjob_refuses_bad_configs_before_any_work():
    from mlxbatch.bench import userjob

    for bad, says in (("defaults,x", "'x'"), ("0", "'0'"), ("16x0", "'16x0'"), ("16+ov", "'16\\+ov'"),
                      ("", "at least one")):
        with pytest.raises(SystemExit, match=says):
            userjob.main(["--model", "/nonexistent", "--configs", bad])


def test_userjob_configs_name_engine_sections_and_feed_workers():
    from mlxbatch.bench.userjob import DEFAULTS, RunConfig, parse_configs

    got = parse_configs("defaults, defaults+workers4, 256x4096+overlap+workers2, 64")
    assert got == [RunConfig(None), RunConfig(None, 4),
                   RunConfig({"max_num_seqs": 256, "max_num_batched_tokens": 4096, "overlap_steps": True}, 2),
                   RunConfig({"max_num_seqs": 64})]
    assert [c.name for c in got] == ["defaults", "defaults-workers4", "seqs-256-4096-overlap-workers2", "seqs-64"]
    assert got[0].tag == DEFAULTS and got[1].tag == f"{DEFAULTS}; MLXBATCH_FEED_WORKERS=4"
    engine = parse_configs("defaults+engine0, 64+workers2+engine1")  # where the engine runs (an A/B of one tree)
    assert [c.env for c in engine] == [{"MLXBATCH_ENGINE_PROCESS": "0"},
                                       {"MLXBATCH_FEED_WORKERS": "2", "MLXBATCH_ENGINE_PROCESS": "1"}]
    assert [c.name for c in engine] == ["defaults-engine0", "seqs-64-workers2-engine1"]
    assert engine[0].tag == f"{DEFAULTS}; MLXBATCH_ENGINE_PROCESS=0"
    for bad in ("defaults+workers", "0x4096", "64+workers4+overlap", "defaults+engine2", "defaults+engine1+workers2"):
        with pytest.raises(SystemExit):
            parse_configs(bad)
