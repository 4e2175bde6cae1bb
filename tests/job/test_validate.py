"""``mlxbatch validate``: bad job files are rejected before any work, naming the key and the reason."""

from __future__ import annotations

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
    raw["checkpoint"]["every_rows"] = 0
    raw["input"]["format"] = "csv"
    raw["max_error_rate"] = 2
    job.write_text(yaml.safe_dump(raw))
    res = _validate(job)
    assert res.exit_code == 2
    for needle in ["inptu: unknown key", "sampling.temperature: must be >= 0", "sampling.top_q: unknown key",
                   "engine.max_num_seqs: expected int, got str", "checkpoint.every_rows: must be > 0",
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
    from mlxbatch.job.prompts import PromptRenderer, RenderError
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
