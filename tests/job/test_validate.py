"""``mlxbatch validate``: bad job files are rejected before any work, naming the key and the reason."""

from __future__ import annotations

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
    assert "sampling.constraint: set output.choice" in res.output


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
    from mlxbatch.job.validate import validate_job

    with caplog.at_level("WARNING"):
        validate_job(tmp_path / "job.yaml")
    assert "1 of the first 6 rows do not render" in caplog.text and "in.jsonl:5" in caplog.text
