"""Evaluation figures a pipeline can trust: every row counted (error rows wrong), the standard error, acc_norm, the
`run` line, `show`, `status` and report.json agreeing; generate-then-grade with extraction and cut rows."""

from __future__ import annotations

import json
import math
import re

import pyarrow.parquet as pq
import yaml
from click.testing import CliRunner
from jobkit import write_job, write_jsonl

from mlxbatch.cli import main
from mlxbatch.job.report.metrics import summary_line

LETTERS = [" A", " B", " C", " D"]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _twenty_rows() -> tuple[list[dict], list[bytes]]:
    """14 rows that run and 6 that fail: null and missing fields, a bad line, a duplicate id, a prompt beyond the
    model's context."""
    rows = [{"id": f"q{i:02d}", "question": f"question number {i} about {'abcdefgh'[i % 8]}"} for i in range(17)]
    rows[3]["question"] = rows[13]["question"] = None  # render: a null field
    rows[7].pop("question")  # render: a missing field
    rows[11]["question"] = "long " * 20000  # request: far beyond the context
    rows.append({"id": "q05", "question": "a duplicate id"})
    rows.append({"id": "q17", "question": "the last one"})
    return rows, [b'{"id": "q18", "question": "a bad line"']


def test_twenty_rows_with_six_errors_report_accuracy_over_every_row(tmp_path, tiny_model_path):
    rows, bad = _twenty_rows()
    data = write_jsonl(tmp_path / "in.jsonl", rows, bad)
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_model_path, data, out, prompt={"template": "Q: {{ question }}\nAnswer:"},
                    task="score", score={"candidates": LETTERS}, max_error_rate=0.5)
    res = invoke("run", job, "--no-progress")
    assert res.exit_code == 0, res.output
    table = pq.read_table(out / "results.parquet").to_pylist()
    assert len(table) == 20 and sum(r["error"] is not None for r in table) == 6
    # the answers, added after the rows ran (not part of the key: nothing reruns): the first row that ran is
    # answered right, the other 13 wrong
    ran = [r for r in table if r["error"] is None]
    gold = {r["id"]: "ABCD"[(r["choice"] + (i > 0)) % 4] for i, r in enumerate(ran)}
    for r in rows:
        r["answer"] = gold.get(r["id"], "A")
    write_jsonl(data, rows, bad)
    spec = yaml.safe_load(job.read_text())
    spec["score"]["answer"] = "answer"
    job.write_text(yaml.safe_dump(spec))
    res = invoke("run", job, "--no-progress")
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert report["rows"]["finished_this_run"] == 0
    acc = report["accuracy"]
    assert (acc["rows"], acc["correct"], acc["answered"], acc["errors"]) == (20, 1, 14, 6)
    assert acc["accuracy"] == 0.05 and acc["accuracy_of_answered"] == 1 / 14
    assert acc["accuracy_stderr"] == math.sqrt(0.05 * 0.95 / 19)  # lm-eval's sample standard error
    assert "acc_norm" in acc and acc["acc_norm_stderr"] is not None
    line = summary_line(acc)
    assert line.startswith("accuracy 5.0% ± 5.0% (1/20 rows, errors counted wrong; 7.1% of the 14 answered)")
    assert line in res.output
    shown = invoke("show", out, "-n", "3").output
    assert line in shown
    for r in table[:3]:  # each shown row with its input columns (no prompts kept) and whether it is correct
        got = shown.split(f"--- {r['id']}\n", 1)[1].split("\n---", 1)[0]
        assert f"input: question: {r['question']} | answer: {gold.get(r['id'], 'A')}" in got, got
        want = "correct: yes" if r["id"] == ran[0]["id"] else "correct: no"
        assert want in got, got
    assert line in invoke("status", out).output
    results = pq.read_table(out / "results.parquet").to_pandas()
    assert results["correct"].mean() == 0.05  # a pipeline's own mean of the column says the same
    assert results.loc[results["error"].notna(), "correct"].eq(False).all()


def _run(job, **output):
    spec = yaml.safe_load(job.read_text())
    spec["output"] = {"path": spec["output"]["path"], "constraint_column": "c", **output}
    job.write_text(yaml.safe_dump(spec))
    res = invoke("run", job, "--no-progress")
    assert res.exit_code == 0, res.output
    out = spec["output"]["path"]
    return pq.read_table(f"{out}/results.parquet").to_pylist(), json.loads(open(f"{out}/report.json").read())


def test_generate_then_grade_extracts_the_answer_and_counts_cut_rows_wrong(tmp_path, tiny_model_path):
    """The issue's case: a regex-constrained row cut by max_tokens (text "201802", finish_reason length) is not a
    normal answer. Rows whose regex ends early finish with "stop"; rows whose regex never ends are cut."""
    rows = [{"id": f"r{i}", "text": f"number {i}", "c": {"regex": "[0-9]{1,2}" if i % 2 else "[0-9]+"}}
            for i in range(8)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_model_path, data, out, sampling={"temperature": 0, "max_tokens": 4},
                    output={"path": str(out)})
    table, _ = _run(job)
    cut = {r["id"] for r in table if r["finish_reason"] == "length"}
    assert cut == {"r0", "r2", "r4", "r6"}, [(r["id"], r["text"], r["finish_reason"]) for r in table]
    assert all(r["error"] is None and re.fullmatch(r"[0-9]+", r["text"]) for r in table)  # matches: not errors
    texts = {r["id"]: r["text"] for r in table}
    for r in rows:
        r["gold"] = texts[r["id"]]
    write_jsonl(data, rows)

    table, report = _run(job, gold="gold")  # every text is its gold, but the cut ones are graded wrong
    assert report["rows"]["finished_this_run"] == 0
    assert {r["id"] for r in table if not r["correct"]} == cut
    acc = report["accuracy"]
    assert (acc["metric"], acc["rows"], acc["correct"], acc["cut_by_max_tokens"]) == ("exact_match", 8, 4, 4)
    assert all(r["target"] == texts[r["id"]] for r in table)

    table, report = _run(job, gold="gold", grade_truncated=True)  # the job says otherwise
    assert all(r["correct"] for r in table) and report["accuracy"]["accuracy"] == 1.0

    for r in rows:
        r["gold"] = texts[r["id"]][-1]  # the last digit
    write_jsonl(data, rows)
    for match, pick in (("last", -1), ("first", 0)):
        table, report = _run(job, gold="gold", grade_truncated=True, extract={"regex": "([0-9])", "match": match})
        assert report["rows"]["finished_this_run"] == 0
        for r in table:
            assert r["extracted"] == texts[r["id"]][pick]
            assert r["correct"] == (texts[r["id"]][pick] == texts[r["id"]][-1])
    table, _ = _run(job, gold="gold", extract="(x)")  # nothing to extract: wrong
    assert all(r["extracted"] is None and r["correct"] is False for r in table)


def test_a_collapse_to_one_label_is_flagged_beside_the_majority_baseline(tmp_path, tiny_model_path):
    rows = [{"id": f"r{i:02d}", "q": f"item {i}", "answer": 1 if i % 3 else 0} for i in range(12)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    unlikely = " B" * 40  # 40 tokens: always far less likely than " A"
    job = write_job(tmp_path, tiny_model_path, data, out, prompt={"template": "{{ q }}"}, task="score",
                    score={"candidates": [" A", unlikely], "answer": "answer"})
    res = invoke("run", job, "--no-progress")
    assert res.exit_code == 0, res.output
    acc = json.loads((out / "report.json").read_text())["accuracy"]
    assert acc["predicted_labels"] == {"A": 12}
    assert acc["majority_label"] == unlikely.strip() and acc["majority_baseline"] == 8 / 12
    assert acc["accuracy"] == 4 / 12  # always answering A: below the baseline
    assert acc["warning"] == "100% of the answers are 'A': the predictions collapsed to one label (majority " \
                             "baseline 66.7%)"
    assert f"warning: {acc['warning']}" in res.output and f"warning: {acc['warning']}" in invoke("show", out).output
