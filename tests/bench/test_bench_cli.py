"""The bench as a command: ``python -m mlxbatch.bench`` / ``mlxbatch bench``, and the GPU machine's form of it.

Tiny sizes on the tiny random model: these check that sections run end to end, that the files appear with the
commit given and that the tables hold numbers; they never assert speeds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from click.testing import CliRunner

from mlxbatch.bench import cli as bench_cli
from mlxbatch.bench import options as bench_options
from mlxbatch.cli import main as mlxbatch_main

ROOT = Path(__file__).resolve().parents[2]


def _cache_with_tiny(tmp_path: Path, tiny_model_path: Path) -> Path:
    """A --cache-dir where the ``tiny`` shape is the test suite's tiny model (no second build)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tiny").symlink_to(tiny_model_path, target_is_directory=True)
    return cache


def _run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _numbers(row: list) -> list[float]:
    return [v for v in row if isinstance(v, int | float) and not isinstance(v, bool)]


def test_engine_section_as_a_module(tmp_path, tiny_model_path):
    out = tmp_path / "engine.json"
    proc = _run([sys.executable, "-m", "mlxbatch.bench", "engine", "--model", "tiny", "--cache-dir",
                 str(_cache_with_tiny(tmp_path, tiny_model_path)), "--rows", "8", "--max-tokens", "4",
                 "--decode-levels", "1", "--decode-new-tokens", "8", "--b0-rows", "2", "--repeats", "1",
                 "--json", str(out)])
    assert "- command: `python" in proc.stdout and "-m mlxbatch.bench engine" in proc.stdout
    res = json.loads(out.read_text())
    assert res["args"]["section"] == ["engine"] and res["meta"]["model"] == "tiny"
    main, split, decode = res["sections"]["engine"]["tables"]
    assert [r[0] for r in main["rows"]] == ["B0", "B1", "B2", "engine"]
    for r in main["rows"]:
        assert r[1] == (2 if r[0] == "B0" else 8) and r[3] > 0 and r[4] > 0  # rows, rows/s, gen tok/s
    by_path = {r[0]: dict(zip(split["columns"], r)) for r in split["rows"]}
    assert by_path["engine"]["prefill tok"] >= by_path["engine"]["prefill / floor"] > 0
    assert by_path["engine"]["steps"] >= 4 and by_path["B1"]["prefill tok"] > 0
    assert decode["rows"][0][0] == 1 and len(_numbers(decode["rows"][0])) == 8
    assert "### unique: 8 rows" in proc.stdout and "where the time goes" in proc.stdout


def test_gpu_command_on_a_bare_copy_of_the_tree(tmp_path, tiny_model_path):
    """The GPU machine's command line on a copy with no .git and no installed package: ``python3 -m mlxbatch.bench``
    with the tree on PYTHONPATH (site-packages for the dependencies only)."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "mlxbatch", tree / "mlxbatch", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GIT_SHA")}
    paths = sysconfig.get_paths()  # the dependencies, without the editable install's hook (.pth files need site)
    deps = os.pathsep.join(dict.fromkeys([paths["purelib"], paths["platlib"]]))
    env["PYTHONPATH"] = deps
    out = tmp_path / "out"
    cmd = [sys.executable, "-S", "-m", "mlxbatch.bench", "--section", "gpu", "--model", "tiny", "--commit", "abc1234",
           "--out", str(out), "--cache-dir", str(_cache_with_tiny(tmp_path, tiny_model_path)),
           "--suite-workloads", "label", "--suite-rows", "4", "--decode-levels", "1", "--decode-new-tokens", "16",
           "--decode-repeats", "2", "--json", str(out / "all.json")]
    check = "import importlib.util as u; print(u.find_spec('mlxbatch') is None)"
    assert _run([sys.executable, "-S", "-c", check], env=env, cwd=tmp_path).stdout.strip() == "True"
    env["PYTHONPATH"] = os.pathsep.join([str(tree), deps])
    proc = _run(cmd, env=env, cwd=tmp_path)
    assert "(git abc1234 (given))" in proc.stdout
    suite = json.loads((out / "gpu_suite.json").read_text())
    assert suite["commit"] == "abc1234" and suite["meta"]["git"] == "abc1234 (given)"
    assert suite["meta"]["model"] == "tiny" and suite["meta"]["cuda_kernel_launch"] == ""  # CPU: no CUDA launch
    label = suite["figures"]["label"]
    assert label["rows"] == 4 and label["floor"] > 0 and label["x_b1"] > 0 and label["prefill_over_floor"] >= 1
    assert label["x_b1_again"] > 0 and "engine-again" in label["runs"]
    assert label["x_b1_generic"] > 0 and "engine-generic" in label["runs"]  # the path a Mac's GPU takes, beside
    assert label["x_b1_generic_again"] > 0 and "engine-generic-again" in label["runs"]  # and its second run
    decode = suite["figures"]["decode"]["1"]
    assert set(decode) >= {"engine_step", "mlx_lm", "bare", "engine_host_ms", "engine_wait_ms", "bare_host_ms"}
    assert decode["bare_host_ms"] > 0 and decode["engine_host_ms"] > 0 and "host / wait ms a step" in (out / "gpu_suite.md").read_text()
    # each decode path ran twice, interleaved; the table gives the medians and the engine's spread
    assert len(decode["engine_steps"]) == len(decode["mlx_lm_runs"]) == len(decode["bare_runs"]) == 2
    assert len(decode["generic_runs"]) == 2 and all(g["engine_step"] > 0 for g in decode["generic_runs"])
    assert min(decode["engine_steps"]) <= decode["engine_step"] <= max(decode["engine_steps"])
    assert "median of 2" in (out / "gpu_suite.md").read_text()
    md = (out / "gpu_suite.md").read_text()
    assert md.startswith("GPU figures measured at commit abc1234") and "### label: 4 rows" in md
    assert "- software: python" in md and "(git abc1234 (given))" in md  # the machine header
    summary = json.loads((out / "all.json").read_text())["sections"]["gpu"]["tables"][0]
    assert summary["rows"][0][0] == "label" and len(_numbers(summary["rows"][0])) == 8
    assert json.loads((out / "all.json").read_text())["meta"]["git"] == "abc1234 (given)"


def test_mlxbatch_bench_forwards_to_the_package(monkeypatch):
    seen = []
    monkeypatch.setattr(bench_cli, "run", lambda args: seen.append(args) or 0)
    result = CliRunner().invoke(mlxbatch_main, ["bench", "--model", "small", "engine", "job", "--section", "gpu",
                                                "--decode-levels", ""])
    assert result.exit_code == 0, result.output
    (args,) = seen
    assert args.section == ["engine", "job", "gpu"] and args.model == "small" and args.decode_levels == ""
    assert not args.repeats_given
    help_ = CliRunner().invoke(mlxbatch_main, ["bench", "--help"])
    assert help_.exit_code == 0 and "--rows-scale" in help_.output and "constraints" in help_.output


def test_unknown_and_misplaced_sections_are_refused(capsys):
    for argv, says in ((["nope"], "unknown section(s) nope"), (["engine", "vlm"], "a stand-alone bench")):
        try:
            bench_options.parse_args(argv)
        except SystemExit as exc:
            assert exc.code == 64  # bad usage, as every mlxbatch command (README)
        else:
            raise AssertionError(f"{argv} was accepted")
        assert says in capsys.readouterr().err


def test_section_names_match_the_registry_and_shapes():
    import importlib

    from mlxbatch.bench.harness import SECTIONS
    from mlxbatch.models.random_model import SHAPES

    for name, module in bench_options.SECTION_MODULES.items():
        importlib.import_module(f"mlxbatch.bench.{module}")
        assert SECTIONS[name].__module__ == f"mlxbatch.bench.{module}"
    assert set(SECTIONS) == set(bench_options.IN_PROCESS)
    assert tuple(SHAPES) == bench_options.SHAPES


def test_the_streaming_child_does_not_import_mlx():
    code = "import sys, mlxbatch.bench.stream_child; print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlx'))"
    assert _run([sys.executable, "-c", code]).stdout.strip() == "[]"


def test_score_section_scores_both_candidate_forms(tmp_path, tiny_model_path):
    out = tmp_path / "score.json"
    _run([sys.executable, "-m", "mlxbatch.bench", "score", "--model", "tiny", "--cache-dir",
          str(_cache_with_tiny(tmp_path, tiny_model_path)), "--rows", "4", "--repeats", "1", "--json", str(out)])
    tables = json.loads(out.read_text())["sections"]["score"]["tables"]
    assert ["1-6 tokens" in tables[0]["title"], "one-token" in tables[1]["title"]] == [True, True]
    for tab in tables:
        direct, cache_on, cache_off = (dict(zip(tab["columns"], r)) for r in tab["rows"])
        assert direct["path"].startswith("direct") and cache_on["path"] == "Engine.score, cache on"
        assert max(cache_on["max |diff| vs direct"], cache_off["max |diff| vs direct"]) < 1e-3
        assert 0 < cache_on["prefill tok"] <= cache_off["prefill tok"] <= direct["prefill tok"]


def test_job_section_times_the_jobs_stages(tmp_path, tiny_model_path):
    """The job section at tiny sizes: the job and the engine alone both run, and the job's stages (engine build,
    count rows, checkpoint appends, finalize) were timed by wrapping what the run calls."""
    out = tmp_path / "job.json"
    _run([sys.executable, "-m", "mlxbatch.bench", "job", "--model", "tiny", "--cache-dir",
          str(_cache_with_tiny(tmp_path, tiny_model_path)), "--job-rows", "24", "--job-max-tokens", "4",
          "--job-checkpoint-rows", "8", "--stream-rows", "", "--repeats", "1", "--json", str(out)])
    tables = json.loads(out.read_text())["sections"]["job"]["tables"]
    split = next(t for t in tables if "where the time goes" in t["title"])
    job = dict(zip(split["columns"], next(r for r in split["rows"] if r[0] == "job")))
    for stage in ("engine build", "count rows", "finalize (Parquet)"):
        assert isinstance(job[stage], int | float) and job[stage] > 0, (stage, job)
    assert job["checkpoint appends"].endswith(" shards)") and float(job["checkpoint appends"].split()[0]) > 0, job


def test_bad_usage_exits_64_as_the_readme_says():
    """QA: `mlxbatch bench --bogus` exited 2 (argparse's code, which the README gives to an invalid job file); the
    other commands exit 64 on bad usage. The stand-alone benches too: their own parsers."""
    for args in (["bench", "--bogus"], ["bench", "nosuchsection"], ["bench", "engine", "--rows", "many"],
                 ["bench", "constraints", "--bogus"], ["bench", "vlm", "--bogus"], ["bench", "runs", "--bogus"],
                 ["bench", "ray", "--bogus"], ["bench", "invariance", "--rounds", "x"]):
        res = CliRunner().invoke(mlxbatch_main, args)
        assert res.exit_code == 64, (args, res.exit_code, res.output)
        assert "Traceback" not in res.output
    assert CliRunner().invoke(mlxbatch_main, ["run", "--bogus", "x.yaml"]).exit_code == 64  # as the rest of the CLI


def test_bench_help_exits_0():
    res = CliRunner().invoke(mlxbatch_main, ["bench", "--help"])
    assert res.exit_code == 0 and "SECTION" in res.output, res.output
