"""What a user reaches for: trial runs and tweaks from the command line, `show`, kept prompts, accuracy."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
from click.testing import CliRunner
from jobkit import texts, write_job, write_jsonl

from mlxbatch.cli import main
from mlxbatch.job.report.metrics import summary_line


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_limit_set_and_output_change_a_run_without_editing_the_file(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(30))
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out")
    trial = tmp_path / "trial"
    res = invoke("run", job, "--no-progress", "--limit", 5, "--set", "sampling.max_tokens=3",
                 "--set", "sampling.stop=[zz]", "--output", trial)
    assert res.exit_code == 0, res.output
    table = pq.read_table(trial / "results.parquet").to_pylist()
    assert [r["id"] for r in table] == [f"row-{i:04d}" for i in range(5)]
    assert all(r["generated_tokens"] <= 3 for r in table) and all('"stop":["zz"]' in r["params"] for r in table)
    assert not (tmp_path / "out").exists()  # the job's own output folder is untouched
    # values are typed and checked by the job parser: errors name the key path
    res = invoke("run", job, "--set", "sampling.temperature=hot", "--set", "sampling.temprature=1",
                 "--set", "plan.window=0")
    assert res.exit_code == 2
    for needle in ("sampling.temperature: must be a finite number", "sampling.temprature: unknown key",
                   "plan.window: must be > 0"):
        assert needle in res.output, (needle, res.output)
    assert "--set: expected key.path=value" in invoke("validate", job, "--set", "nonsense").output
    # a shorthand section is expanded: output is a plain path in this job file
    res = invoke("validate", job, "--set", "output.choice=[a, b]")
    assert res.exit_code == 0, res.output


def test_show_prints_rows_and_a_summary_with_kept_prompts_and_accuracy(tmp_path, tiny_model_path):
    rows = texts(12)
    for i, r in enumerate(rows):
        r["gold"] = "yes" if i % 2 else "no"
    rows[4].pop("text")  # one render error
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", max_error_rate=0.5,
                    input={"path": str(data), "id_column": "id", "columns": ["text"]},
                    prompt={"template": None, "system": "Answer yes or no.",
                            "messages": [{"role": "user", "content": "{{ text }}"}]},
                    output={"path": str(tmp_path / "out"), "choice": ["yes", "no"], "gold": "gold",
                            "keep_prompt": True})
    res = invoke("run", job, "--no-progress")
    assert res.exit_code == 0, res.output
    table = pq.read_table(tmp_path / "out" / "results.parquet")
    out = table.to_pylist()
    assert "gold" in table.column_names  # the gold column is kept even though input.columns leaves it out
    assert table.schema.field("parsed").type == "string" and table.schema.field("correct").type == "bool"
    ok = [r for r in out if r["error"] is None]
    assert all(r["parsed"] == r["text"] and r["text"] in ("yes", "no") for r in ok)
    assert all(r["correct"] == (r["text"] == r["gold"]) for r in ok)
    prompt = out[0]["rendered_prompt"]
    assert "Answer yes or no." in prompt and rows[0]["text"] in prompt and prompt.rstrip().endswith("assistant")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    right = sum(r["correct"] for r in ok)
    acc = report["accuracy"]  # over every row: the render error counts wrong
    assert (acc["rows"], acc["correct"], acc["answered"], acc["accuracy"]) == (12, right, 11, right / 12)
    assert acc["accuracy_of_answered"] == right / 11 and summary_line(acc) in res.output
    shown = invoke("show", tmp_path / "out", "--n", 2).output
    assert shown.count("--- row-") == 2 and "prompt: " in shown and "output: " in shown
    labels = {v: sum(r["text"] == v for r in ok) for v in ("yes", "no")}
    assert "labels: " in shown and all(f"'{k}' {v}" in shown for k, v in labels.items() if v)
    assert "errors: render 1" in shown and "finish reasons: " in shown and summary_line(acc) in shown
    assert invoke("show", job, "-n", 0).output.count("--- row-") == 0  # the job file works too


def test_gold_added_or_edited_after_the_rows_ran_is_checked_against_the_input_as_it_is_now(tmp_path,
                                                                                          tiny_model_path):
    rows = texts(10)
    for i, r in enumerate(rows):
        r["gold"] = "yes" if i % 3 else "no"
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    output = {"path": str(out), "choice": ["yes", "no"]}
    job = write_job(tmp_path, tiny_model_path, data, out, output=output)
    assert invoke("run", job, "--no-progress").exit_code == 0
    write_job(tmp_path, tiny_model_path, data, out, output={**output, "gold": "gold"})  # gold: not in the key

    def check(expected_gold):
        res = invoke("run", job, "--no-progress")
        assert res.exit_code == 0 and "(0 run now, 10 resumed)" in res.output, res.output
        table = pq.read_table(out / "results.parquet").to_pylist()
        assert [r["gold"] for r in table] == expected_gold
        assert all(r["correct"] == (r["text"] == r["gold"]) for r in table), table
        right = sum(r["correct"] for r in table)
        report = json.loads((out / "report.json").read_text())
        acc = report["accuracy"]
        assert (acc["rows"], acc["correct"], acc["answered"], acc["accuracy"]) == (10, right, 10, right / 10)
        assert summary_line(acc) in res.output and summary_line(acc) in invoke("show", out).output
        return [r["correct"] for r in table]

    before = check([r["gold"] for r in rows])  # output.gold added to a finished folder
    for r in rows:
        r["gold"] = "no" if r["gold"] == "yes" else "yes"
    write_jsonl(data, rows)
    after = check([r["gold"] for r in rows])  # every gold value flipped in the input
    assert after == [not c for c in before]


def test_score_answers_added_or_edited_after_the_rows_ran_are_checked_against_the_input_as_it_is_now(
        tmp_path, tiny_model_path):
    rows = [{"id": f"q{i}", "question": f"Is {i} even?", "answer": (" yes", "no", 0, 1)[i % 4]} for i in range(8)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    kw = dict(prompt={"template": "{{ question }}"}, task="score", input={"columns": ["question"]})
    job = write_job(tmp_path, tiny_model_path, data, out, score={"candidates": [" yes", " no"]}, **kw)
    assert invoke("run", job, "--no-progress").exit_code == 0
    write_job(tmp_path, tiny_model_path, data, out, score={"candidates": [" yes", " no"], "answer": "answer"},
              **kw)  # score.answer added to a finished folder: not in the key (nor in input.columns)

    def right(row, answer):
        return row["choice"] == answer if isinstance(answer, int) else row["text"].strip() == answer.strip()

    def check():
        res = invoke("run", job, "--no-progress")
        assert res.exit_code == 0 and "(0 run now, 8 resumed)" in res.output, res.output
        table = pq.read_table(out / "results.parquet").to_pylist()
        assert all("answer" in r for r in table)  # kept: correct is checked on it (mixed types: as JSON text)
        assert [r["correct"] for r in table] == [right(t, r["answer"]) for t, r in zip(table, rows)], table
        n = sum(r["correct"] for r in table)
        report = json.loads((out / "report.json").read_text())
        acc = report["accuracy"]
        assert (acc["rows"], acc["correct"], acc["answered"], acc["accuracy"]) == (8, n, 8, n / 8)
        assert f"accuracy {n / 8:.1%}" in res.output and summary_line(acc) in res.output
        return [r["correct"] for r in table]

    before = check()
    flip = {" yes": "no", "no": " yes", 0: 1, 1: 0}
    for r in rows:
        r["answer"] = flip[r["answer"]]
    write_jsonl(data, rows)
    after = check()  # every answer flipped in the input (two candidates: every correct flips)
    assert after == [not c for c in before]


def test_show_keeps_the_end_of_a_long_prompt_where_the_rows_own_text_is(tmp_path, tiny_model_path):
    rows = [{"id": f"t{i}", "text": f"ticket number {i}: the printer on floor {i} is on fire"} for i in range(3)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    policy = "You route support tickets. " + "Rules: be brief, be kind, cite the policy. " * 40  # ~1,800 chars
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", sampling={"max_tokens": 2},
                    prompt={"template": None, "system": policy,
                            "messages": [{"role": "user", "content": "{{ text }}"}]},
                    output={"path": str(tmp_path / "out"), "keep_prompt": True})
    assert invoke("run", job, "--no-progress").exit_code == 0
    shown = invoke("show", tmp_path / "out", "-n", 3).output
    prompts = [block.split("prompt: ", 1)[1].split("\noutput: ", 1)[0] for block in shown.split("--- t")[1:]]
    assert len(prompts) == 3
    for row, prompt in zip(rows, prompts):
        assert row["text"] in prompt, prompt  # the row's own text, after the long shared system prompt
        assert "You route support tickets." in prompt[:100] and "characters ...]" in prompt
        assert len(prompt) < 600


def test_score_jobs_print_their_speed_and_accuracy(tmp_path, tiny_model_path):
    rows = [{"id": f"q{i}", "question": f"Is {i} even?", "answer": " yes" if i % 2 == 0 else " no"}
            for i in range(8)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", prompt={"template": "{{ question }}"},
                    task="score", score={"candidates": [" yes", " no"], "answer": "answer"})
    res = invoke("run", job, "--no-progress")
    assert res.exit_code == 0, res.output
    assert "0.0 tok/s" not in res.output and "rows/s" in res.output and "prompt tok/s" in res.output
    acc = json.loads((tmp_path / "out" / "report.json").read_text())["accuracy"]
    assert acc["answered"] == 8 and f"accuracy {acc['accuracy']:.1%}" in res.output


def test_show_says_when_the_results_may_be_an_earlier_runs(tmp_path, tiny_model_path):
    """After a finished run, a run with a new prompt that was killed left the first run's results.parquet in place
    (only _SUCCESS goes), and `show` printed those rows and their summary as the job's, with no word of it."""
    import os
    import subprocess
    import sys

    data = write_jsonl(tmp_path / "in.jsonl", texts(30))
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", checkpoint={"every_rows": 4})
    assert invoke("run", job, "--no-progress").exit_code == 0
    shown = invoke("show", tmp_path / "out")
    assert shown.exit_code == 0 and "no _SUCCESS" not in shown.output
    write_job(tmp_path, tiny_model_path, data, tmp_path / "out", checkpoint={"every_rows": 4},
              prompt={"template": "Retell: {{ text }}"})  # the job file edited (a --set trial would be refused)
    killed = subprocess.run([sys.executable, "-m", "mlxbatch.cli", "run", str(job), "--no-progress"],
                            capture_output=True, env={**os.environ, "MLXBATCH_FAULT": "mid-shard:1"}, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    shown = invoke("show", tmp_path / "out")
    assert shown.exit_code == 0 and "=== " in shown.output
    assert "no _SUCCESS" in shown.output and "mlxbatch status" in shown.output, shown.output
