"""``mlxbatch validate``: bad job files are rejected before any work, naming the key and the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from jobkit import texts, write_job, write_jsonl

from mlxbatch.cli import main


def _validate(path):
    return CliRunner().invoke(main, ["validate", str(path)])


def test_a_good_job_validates(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(5))
    res = _validate(write_job(tmp_path, tiny_model_path, data, tmp_path / "out"))
    assert res.exit_code == 0, res.output
    assert "ok" in res.output


def test_problems_are_reported_with_key_paths(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(5))
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out")
    raw = yaml.safe_load(job.read_text())
    raw["inptu"] = {}
    raw["sampling"]["temperature"] = -1
    raw["sampling"]["top_q"] = 0.5
    raw["engine"]["max_num_seqs"] = "many"
    raw["engine"]["batch_invariant"] = "yes"
    raw["checkpoint"]["every_rows"] = 0
    raw["input"]["format"] = "csv"
    raw["max_error_rate"] = 2
    job.write_text(yaml.safe_dump(raw))
    res = _validate(job)
    assert res.exit_code == 2
    for needle in ["inptu: unknown key", "sampling.temperature: must be >= 0", "sampling.top_q: unknown key",
                   "engine.max_num_seqs: expected int, got str", "engine.batch_invariant: expected bool, got str",
                   "checkpoint.every_rows: must be > 0",
                   "input.format: expected one of", "max_error_rate: must be in [0, 1]"]:
        assert needle in res.output, (needle, res.output)


def test_missing_files_and_template_fields_no_row_provides(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(5))
    res = _validate(write_job(tmp_path, tiny_model_path, tmp_path / "nope.jsonl", tmp_path / "out"))
    assert res.exit_code == 2 and "input.path: no such file" in res.output
    res = _validate(write_job(tmp_path, tmp_path / "no-model", data, tmp_path / "out"))
    assert res.exit_code == 2 and "model.path: no such folder" in res.output
    res = _validate(write_job(tmp_path, tiny_model_path, data, tmp_path / "out",
                              prompt={"template": "{{ text }} and {{ title }}"}))
    assert res.exit_code == 2 and "template field 'title' is in none of the first 5 rows" in res.output
    res = _validate(write_job(tmp_path, tiny_model_path, data, tmp_path / "out",
                              prompt={"template": "{{ text "}))
    assert res.exit_code == 2 and "template syntax error" in res.output
    res = _validate(write_job(tmp_path, tiny_model_path, data, tmp_path / "out",
                              sampling={"overrides": {"max_tokens": "budget"}}))
    assert res.exit_code == 2 and "column 'budget' is in none" in res.output


def test_templates_cannot_run_code(tmp_path, tiny_model_path):
    from mlxbatch.job.rows.prompts import PromptRenderer, RenderError
    from mlxbatch.job.spec import PromptSection

    r = PromptRenderer(PromptSection(template="{{ text.__class__.__mro__[1].__subclasses__() }}"))
    try:
        out = r.render({"text": "x"})
    except RenderError:
        return
    raise AssertionError(f"sandbox let a template reach Python internals: {out.prompt[:80]}")


def test_invalid_yaml_and_not_a_mapping(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    res = _validate(bad)
    assert res.exit_code == 2 and "not valid YAML" in res.output
    bad.write_text("- a\n- b\n")
    assert "must be a YAML mapping" in _validate(bad).output


def test_a_key_given_twice_is_refused_with_its_path(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(5))
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out")
    text = job.read_text().replace("sampling:\n", "sampling:\n  temperature: 0.5\n", 1)
    job.write_text(text + "seed: 3\n")
    res = _validate(job)
    assert res.exit_code == 2, res.output
    assert "sampling.temperature: given twice (lines" in res.output and "seed: given twice" in res.output


def test_messages_name_the_key_as_written(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(5))
    res = _validate(write_job(tmp_path, tiny_model_path, data, tmp_path / "out", output={
        "path": str(tmp_path / "out"), "choice": []}))
    assert res.exit_code == 2 and "output.choice" in res.output and "constraint.choice" not in res.output
    res = _validate(write_job(tmp_path, tiny_model_path, data, tmp_path / "out",
                              sampling={"stop": 5, "temperature": -1, "top_p": 7, "constraint": {"choice": ["a"]}}))
    assert res.exit_code == 2, res.output
    assert "sampling.stop: expected a list of strings, got int" in res.output
    assert "not iterable" not in res.output
    assert "sampling.temperature: must be >= 0" in res.output and "sampling.top_p: must be in (0, 1]" in res.output
    assert "sampling.constraint: set an output constraint with output.choice" in res.output


def test_an_id_column_no_row_has_is_refused(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(5))
    res = _validate(write_job(tmp_path, tiny_model_path, data, tmp_path / "out",
                              input={"path": str(data), "id_column": "uid"}))
    assert res.exit_code == 2 and "input.id_column: column 'uid' is in none of the first 5 rows" in res.output


@pytest.mark.parametrize("template, fields, fine", [
    ("{{ text }} {{ 10 / d }}", {"d": 0}, {"d": 2}),
    ("{{ text }} {{ range(n)|length }}", {"n": 10**9}, {"n": 2}),
    ("{{ text }} {{ n + m }}", {"n": 1, "m": "x"}, {"n": 1, "m": 2}),
    ("Echo exactly: [{{ note }}]", {"note": None}, {"note": "ok"}),
])
def test_rows_that_would_not_render_are_reported(tmp_path, tiny_model_path, caplog, template, fields, fine):
    rows = [{**r, **fields} for r in texts(6)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    res = _validate(write_job(tmp_path, tiny_model_path, data, tmp_path / "out", prompt={"template": template}))
    assert res.exit_code == 2 and "6 of the first 6 rows do not render" in res.output, res.output
    assert "in.jsonl:1" in res.output  # the first example names its row
    # some rows only: a warning with the count and an example, the job is valid
    rows = [{**r, **(fields if i == 4 else fine)} for i, r in enumerate(rows)]
    write_jsonl(data, rows)
    from mlxbatch.job.check.validate import validate_job

    with caplog.at_level("WARNING"):
        validate_job(tmp_path / "job.yaml")
    assert "1 of the first 6 rows do not render" in caplog.text and "in.jsonl:5" in caplog.text


def test_a_mistyped_alias_gets_the_close_match(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(5))
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out")
    raw = yaml.safe_load(job.read_text())
    raw["model"] = "smolm2"
    job.write_text(yaml.safe_dump(raw))
    res = _validate(job)
    assert res.exit_code == 2 and "model.path" in res.output and "did you mean 'smollm2'?" in res.output


def test_an_uncached_hub_id_while_offline_names_the_setting(tmp_path, tiny_model_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    data = write_jsonl(tmp_path / "in.jsonl", texts(5))
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out")
    raw = yaml.safe_load(job.read_text())
    raw["model"] = "someone/not-downloaded"
    job.write_text(yaml.safe_dump(raw))
    res = _validate(job)
    assert res.exit_code == 2 and "not in the local Hugging Face cache" in res.output, res.output
    assert "HF_HUB_OFFLINE is set" in res.output


def test_a_field_some_rows_lack_is_counted(tmp_path, tiny_model_path):
    rows = texts(31)
    for r in rows[::7]:
        del r["text"]  # 5 of 31
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    res = _validate(write_job(tmp_path, tiny_model_path, data, tmp_path / "out", max_error_rate=0.5))
    assert res.exit_code == 0, res.output
    assert "template field 'text' is missing (or null) in 5 of the first 31 rows" in res.output
    assert "row-0000, row-0007, row-0014" in res.output
    # a template that handles the missing field is fine
    res = _validate(write_job(tmp_path, tiny_model_path, data, tmp_path / "out",
                              prompt={"template": "Say: {{ text | default('nothing') }}"}))
    assert res.exit_code == 0 and "missing" not in res.output


def test_every_sampling_problem_at_once_and_the_constraint_key(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(5))
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out",
                    sampling={"temperature": -1, "top_p": 2, "max_tokens": 0, "n": "two",
                              "constraint": {"choice": ["a", "b"]}})
    res = _validate(job)
    assert res.exit_code == 2
    for needle in ["sampling.temperature: must be >= 0", "sampling.top_p: must be in (0, 1]",
                   "sampling.max_tokens: must be >= 1", "sampling.n: must be an integer",
                   "sampling.constraint: set an output constraint with output.choice"]:
        assert needle in res.output, (needle, res.output)
    assert "5 problem(s)" in res.output


def test_max_tokens_too_small_for_the_shortest_output(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(5))
    schema = {"type": "object", "properties": {"label": {"enum": ["positive", "negative"]},
                                               "score": {"type": "integer", "minimum": 0}},
              "required": ["label", "score"]}
    res = _validate(write_job(tmp_path, tiny_model_path, data, tmp_path / "out", sampling={"max_tokens": 4},
                              output={"path": str(tmp_path / "out"), "json_schema": schema}))
    assert res.exit_code == 2 and "sampling.max_tokens: 4 is too small" in res.output
    assert '{"label":"positive","score":0}' in res.output
    from mlx_lm.utils import load_tokenizer

    from mlxbatch.engine import GrammarCompiler
    from mlxbatch.job.check.shortest import shortest_output
    from mlxbatch.types import OutputConstraint

    tok = load_tokenizer(tiny_model_path)
    shortest = shortest_output(OutputConstraint.json_schema(schema), tok,
                               GrammarCompiler(tok, len(tok._tokenizer), tok.eos_token_ids))
    res = _validate(write_job(tmp_path, tiny_model_path, data, tmp_path / "out",
                              sampling={"max_tokens": shortest.tokens},
                              output={"path": str(tmp_path / "out"), "json_schema": schema}))
    assert res.exit_code == 0, res.output
    res = _validate(write_job(tmp_path, tiny_model_path, data, tmp_path / "out", sampling={"max_tokens": 1},
                              output={"path": str(tmp_path / "out"), "choice": ["extraordinary", "b"]}))
    assert res.exit_code == 0, res.output  # the choice "b" fits in one token


def test_usage_errors_and_invalid_jobs_have_their_own_exit_codes(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(5))
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", sampling={"temperature": -1})
    assert CliRunner().invoke(main, ["run", str(job), "--no-such-option"]).exit_code == 64
    assert CliRunner().invoke(main, ["run", str(job), "--limit", "many"]).exit_code == 64
    assert CliRunner().invoke(main, ["nonsense"]).exit_code == 64
    assert CliRunner().invoke(main, ["run", str(job)]).exit_code == 2


def test_a_locked_output_folder_fails_before_the_model_loads(tmp_path, tiny_model_path):
    import shutil

    from mlxbatch.io import CheckpointStore

    no_weights = tmp_path / "tokenizer-only"  # loading it would fail: the lock must be found first
    no_weights.mkdir()
    for f in tiny_model_path.iterdir():
        if f.suffix in (".json", ".jinja"):
            shutil.copy(f, no_weights / f.name)
    data = write_jsonl(tmp_path / "in.jsonl", texts(5))
    job = write_job(tmp_path, no_weights, data, tmp_path / "out")
    (tmp_path / "out").mkdir()
    with CheckpointStore(tmp_path / "out"):  # another run holds the folder
        res = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert res.exit_code == 1
    assert "is in use by another mlxbatch run" in res.output and "--output" in res.output
    assert "CheckpointStore" not in res.output and "could not be loaded" not in res.output


def test_an_adapter_folder_without_the_lora_files_is_refused_before_the_model_loads(tmp_path, tiny_model_path):
    """validate said ok to an adapter folder without adapter_config.json / adapters.safetensors; `run` then
    claimed the output folder and failed only when the model loaded."""
    data = write_jsonl(tmp_path / "in.jsonl", texts(5))
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "adapter_config.json").write_text("{}")
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out")
    raw = yaml.safe_load(job.read_text())
    raw["model"] = {"path": str(tiny_model_path), "adapter": str(tmp_path / "lora")}
    job.write_text(yaml.safe_dump(raw))
    for command in ("validate", "run"):
        res = CliRunner().invoke(main, [command, str(job)])
        assert res.exit_code == 2, res.output
        assert "model.adapter" in res.output and "adapters.safetensors" in res.output, res.output
    assert not (tmp_path / "out").exists()


def test_the_checker_knows_every_engine_key_and_only_those():
    """The engine section's keys have one definition, ``EngineSection``'s fields (their defaults are EngineConfig's):
    the checker's known keys must be those, or a new setting is refused as unknown (or a removed one accepted)."""
    import dataclasses

    from mlxbatch.job.spec.checker import _SECTIONS
    from mlxbatch.job.spec.sections import EngineSection

    assert _SECTIONS["engine"] == {f.name for f in dataclasses.fields(EngineSection)}


JOBS = Path(__file__).resolve().parents[2] / "jobs"


@pytest.mark.parametrize("job", sorted(p.name for p in JOBS.glob("*.yaml")))
def test_the_shipped_jobs_validate_without_a_warning(job):
    """A newcomer's first commands print no warning: every shipped job checks clean (the demo's input column was
    ``text``, a result column's name: every run of it warned that the column is written as ``input_text``)."""
    res = _validate(JOBS / job)
    assert res.exit_code == 0 and "warning" not in res.output.lower(), res.output
