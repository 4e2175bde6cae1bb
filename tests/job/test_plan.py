"""``mlxbatch plan``: the dry run tokenizes and plans without model weights."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from jobkit import write_job, write_jsonl

from mlxbatch.cli import main


def test_plan_reports_the_floor_without_weights(tmp_path, tiny_model_path):
    no_weights = tmp_path / "tokenizer-only"
    no_weights.mkdir()
    for f in tiny_model_path.iterdir():
        if f.suffix in (".json", ".jinja"):
            shutil.copy(f, no_weights / f.name)
    assert not list(no_weights.glob("*.safetensors"))
    instruction = "Label the following text as alpha or beta, carefully and with care. " * 4
    rows = [{"id": f"r{i}", "text": f"item number {i} " * (1 + i % 3)} for i in range(40)]
    rows.append({"id": "bad"})  # a render error: counted, not planned
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    job = write_job(tmp_path, no_weights, data, tmp_path / "out",
                    prompt={"template": instruction + "{{ text }}"})
    res = CliRunner().invoke(main, ["plan", str(job), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["rows"] == 41 and rep["planned_rows"] == 40 and rep["skipped_rows"] == 1
    assert rep["distinct_tokens"] < rep["prompt_tokens"] * 0.5 and rep["saving"] > 0.5
    assert rep["peak_retained_tokens"] >= 16 and rep["kv_bytes_per_token"] > 0
    eta = rep["eta"]
    assert eta["prefill_s"] > 0 and eta["decode_s"] > 0 and eta["matmul_gflops"] > 0
    assert eta["total_s"] == pytest.approx(eta["prefill_s"] + eta["decode_s"], abs=1e-3)
    text = CliRunner().invoke(main, ["plan", str(job)]).output
    assert "distinct trie tokens (prefill floor)" in text and "expected prefill saving" in text and "ETA" in text
    # more tokens to generate: a longer decode estimate; scoring generates nothing
    longer = write_job(tmp_path, no_weights, data, tmp_path / "out", prompt={"template": instruction + "{{ text }}"},
                       sampling={"max_tokens": 64})
    rep2 = json.loads(CliRunner().invoke(main, ["plan", str(longer), "--json"]).output)
    assert rep2["eta"]["decode_s"] > 2 * eta["decode_s"]
    scored = write_job(tmp_path, no_weights, data, tmp_path / "out", prompt={"template": instruction + "{{ text }}"},
                       task="score", score={"candidates": [" alpha", " beta"]})
    assert json.loads(CliRunner().invoke(main, ["plan", str(scored), "--json"]).output)["eta"]["decode_s"] == 0


def test_plan_tokenizes_exactly_as_the_engine(tmp_path, tiny_model_path, tiny_loaded):
    from mlxbatch.engine.inputs import encode_prompt
    from mlxbatch.job.check.validate import validate_job
    from mlxbatch.job.plan.predict import plan_job
    from mlxbatch.job.rows.prepare import RowPreparer

    rows = [{"id": f"r{i}", "text": f"row {i}: " + "word " * (i % 7)} for i in range(30)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    for prompt in ({"template": "Say: {{ text }}"},
                   {"template": None, "system": "Be brief.", "messages": [{"role": "user", "content": "{{ text }}"}]}):
        job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", prompt=prompt)
        spec = validate_job(job)
        report = plan_job(spec, with_eta=False)  # no ETA: the tokenizer files only, not the loaded model's
        prep = RowPreparer(spec, "x")
        from mlxbatch.io import InputSpec, open_reader

        expected = sum(len(encode_prompt(tiny_loaded.tokenizer, prep.prepare(r).prompt))
                       for r in open_reader(InputSpec(str(data), id_column="id")))
        assert report.prompt_tokens == expected


def test_windowed_plan_sums_its_windows(tmp_path, tiny_model_path):
    from mlxbatch.job.check.validate import validate_job
    from mlxbatch.job.plan.predict import plan_job

    rows = [{"id": f"r{i}", "text": f"shared start {'x ' * 20} then {i}"} for i in range(50)]
    job = write_job(tmp_path, tiny_model_path, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out")
    whole = plan_job(validate_job(job), with_eta=False)  # the plan's counts, no ETA (its probe runs the model)
    windowed = plan_job(validate_job(job), window=10, with_eta=False)
    assert windowed.windowed and not whole.windowed
    assert windowed.prompt_tokens == whole.prompt_tokens and windowed.planned_rows == 50
    # each of the 5 windows computes the shared start once: 4 more times than the whole plan
    assert whole.distinct_tokens < windowed.distinct_tokens < whole.prompt_tokens


def test_calibration_generates_under_the_jobs_output_constraint(tmp_path, tiny_model_path):
    """The length probe runs the first rows with their own sampling, the output constraint included: a choice job's
    rows are a token or two, not free text cut by the probe's cap and counted at max_tokens."""
    from mlxbatch.job.check.validate import validate_job
    from mlxbatch.job.plan.predict import plan_job

    rows = [{"id": f"r{i}", "text": f"sentence number {i}", "only": {"choice": ["maybe", "never"]}}
            for i in range(6)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)

    def tokens_per_row(**output):
        job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", sampling={"max_tokens": 200},
                        output={"path": str(tmp_path / "out"), **output})
        eta = plan_job(validate_job(job), calibrate=True).eta
        assert eta is not None and eta.method == "measured", eta
        return eta.tokens_per_row

    assert tokens_per_row() > 24  # free text: cut by the probe's cap, counted at max_tokens
    assert tokens_per_row(choice=["yes", "no"]) <= 4
    assert tokens_per_row(constraint_column="only") <= 4  # each row's own constraint


def test_calibration_runs_again_only_the_rows_that_go_on(tmp_path, tiny_model_path, monkeypatch):
    """The prefill phase gives each probe row its own sampling and one token: a row that ended there (a one-token
    choice) is not run again for its length, and where every row did, no decode step is timed (none would run). The
    demo's one-token rows recomputed 376 of their 416 prompt tokens in a length phase before, then timed a decode
    step that no row took. The warm-up runs the first row's start only; the step probe's rows are 2 tokens."""
    from mlxbatch.job.check.validate import validate_job
    from mlxbatch.job.plan import calibrate
    from mlxbatch.job.plan.predict import plan_job

    phases: list[list[int]] = []  # each probe run: its prompts' lengths
    real = calibrate._run

    def recorded(core, prompts, params, cache_tokens=None):
        phases.append([len(p) for p in prompts])
        return real(core, prompts, params, cache_tokens)

    monkeypatch.setattr(calibrate, "_run", recorded)
    long_choice = {"regex": "[a-z]{30}"}  # many tokens whatever the model picks
    rows = [{"id": f"r{i}", "text": f"sentence number {i} with a few more words in it",
             "only": long_choice if i % 3 == 0 else {"choice": ["a", "b"]}} for i in range(6)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)

    def calibrated(**output):
        phases.clear()
        job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", sampling={"max_tokens": 40},
                        output={"path": str(tmp_path / "out"), **output})
        eta = plan_job(validate_job(job), calibrate=True).eta
        assert eta is not None and eta.method == "measured", eta
        return eta

    eta = calibrated(choice=["a", "b"])  # one token each (a letter: one spelling)
    warm, prefill = phases  # no length phase, no step probe
    assert warm[0] == calibrate.WARM_UP_TOKENS < prefill[0] and len(prefill) == 6
    assert eta.tokens_per_row == 1 and eta.decode_s == 0 and not eta.decode_s_per_step
    assert "no decode steps" in eta.summary()

    eta = calibrated(constraint_column="only")  # rows 0 and 3 go on, the others are one token
    warm, prefill, length, step = phases
    assert len(prefill) == 6 and sorted(length) == sorted(prefill[i] for i in (0, 3)) == sorted(length)
    assert len(length) == 2 and set(step) == {calibrate.STEP_PROBE_PROMPT}
    assert eta.tokens_per_row > 4 * 2 / 6 and eta.decode_s > 0 and eta.decode_s_per_step > 0


def test_plan_follows_the_reuse_step_of_cuda(tmp_path, tiny_model_path, monkeypatch):
    """On CUDA's text path the engine reuses by the block (``EngineCore.reuse_step``), and ``mlxbatch plan`` plans and
    predicts with the step its dry run of the engine builds on this machine (a CPU's is 1, so CUDA's text path is
    set here), and says so. (The dry run against the engine at that step: ``tests/engine/test_dry_run.py``.)"""
    import mlxbatch.engine.dry_run as dry_run

    instruction = "Label the following review as positive or negative, carefully and with care. " * 3
    words = ["great", "awful", "fine"]
    rows = [{"id": f"r{i}", "text": f"{words[i % 3]} {words[(i // 3) % 3]} item {i}"} for i in range(36)]
    job = write_job(tmp_path, tiny_model_path, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out",
                    prompt={"template": instruction + "{{ text }}"})
    reports = {}
    for step in (1, 16):
        monkeypatch.setattr(dry_run, "cuda_text_path", lambda backend, vision, batch_invariant, s=step: s > 1)
        res = CliRunner().invoke(main, ["plan", str(job), "--json", "--no-calibrate"])
        assert res.exit_code == 0, res.output
        reports[step] = json.loads(res.output)
    assert reports[1]["distinct_tokens"] == reports[16]["distinct_tokens"]  # the floor is the trie's
    assert reports[16]["prefill_tokens"] >= reports[1]["prefill_tokens"]  # keeping less never computes less
    assert any("16-token reuse step" in n for n in reports[16]["notes"])
    assert not any("reuse step" in n for n in reports[1]["notes"])
