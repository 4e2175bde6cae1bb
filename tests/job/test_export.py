"""`mlxbatch export --format lm-eval`: the files and shapes lm-evaluation-harness writes, checked against its
``lm_eval/result_schema.py`` (EvalResults, _TaskMetrics, _SampleCount, SampleResult) and the file names its
``evaluation_tracker.py`` writes and ``lm_eval/utils.py`` reads back (EleutherAI/lm-evaluation-harness 4e7e0d47f)."""

from __future__ import annotations

import hashlib
import json

import pyarrow.parquet as pq
from click.testing import CliRunner
from jobkit import write_job, write_jsonl

from mlxbatch.cli import main

SAMPLE_KEYS = {"doc_id", "doc", "target", "arguments", "resps", "filtered_resps", "filter", "metrics", "doc_hash",
               "prompt_hash", "target_hash"}  # SampleResult's fixed keys; the per-row metrics come beside them
RESULTS_KEYS = {"results", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples",
                "config", "model_source", "model_name", "model_name_sanitized", "date", "task_hashes",
                "total_evaluation_time_seconds"}  # EvalResults keys a single-task run without groups writes


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _files(folder):
    (model_dir,) = [p for p in folder.iterdir() if p.is_dir()]
    (results,) = model_dir.glob("results_*.json")
    (samples,) = model_dir.glob("samples_*.jsonl")
    return model_dir, json.loads(results.read_text()), [json.loads(line) for line in samples.read_text().splitlines()]


def test_score_job_exports_lm_eval_results_and_samples(tmp_path, tiny_model_path):
    rows = [{"id": f"q{i}", "q": f"question {i}", "answer": "ABCD"[i % 4]} for i in range(6)]
    rows.append({"id": "q6", "q": None, "answer": "A"})  # a render error: a sample scored 0
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_model_path, data, out, prompt={"template": "Q: {{ q }}\nA:"}, task="score",
                    score={"candidates": [" A", " B", " C", " D"], "answer": "answer"}, max_error_rate=0.5)
    assert invoke("run", job, "--no-progress").exit_code == 0
    res = invoke("export", "--format", "lm-eval", out)
    assert res.exit_code == 0, res.output
    model_dir, results, samples = _files(out / "lm-eval")
    report = json.loads((out / "report.json").read_text())
    acc = report["accuracy"]
    assert model_dir.name == str(tiny_model_path).replace("/", "__")  # lm-eval's sanitize_model_name
    # lm_eval/utils.py reads the task back from the samples file name: between the first and the last "_"
    name = next(model_dir.glob("samples_*.jsonl")).name
    assert name[name.find("_") + 1:name.rfind("_")] == "job"
    assert RESULTS_KEYS <= set(results)
    assert results["results"]["job"] == {"name": "job", "alias": "job", "sample_len": 7,
                                         "acc,none": acc["accuracy"], "acc_stderr,none": acc["accuracy_stderr"],
                                         "acc_norm,none": acc["acc_norm"],
                                         "acc_norm_stderr,none": acc["acc_norm_stderr"]}
    assert results["n-samples"]["job"] == {"original": 7, "effective": 7}
    assert results["higher_is_better"]["job"] == {"acc": True, "acc_norm": True}
    assert results["configs"]["job"]["output_type"] == "multiple_choice"
    assert results["task_hashes"]["job"] == sha("".join(s["doc_hash"] + s["prompt_hash"] + s["target_hash"]
                                                        for s in samples))
    table = {r["id"]: r for r in pq.read_table(out / "results.parquet").to_pylist()}
    assert [s["doc_id"] for s in samples] == list(range(7))
    for s in samples:
        assert set(s) == SAMPLE_KEYS | {"acc", "acc_norm"} and s["metrics"] == ["acc", "acc_norm"]
        r = table[s["doc"]["id"]]
        assert s["doc"] == {"id": r["id"], "q": r["q"], "answer": r["answer"]}
        assert s["filter"] == "none" and s["target"] == str(r["target"])
        assert s["acc"] == float(r["correct"]) and s["acc_norm"] == float(r["correct_norm"])
        assert s["doc_hash"] == sha(json.dumps(s["doc"], indent=2, ensure_ascii=False))
        assert s["target_hash"] == sha(s["target"])
        if r["error"] is not None:
            assert s["resps"] == [] and s["filtered_resps"] == [] and s["acc"] == 0.0
            continue
        prompt = f"Q: {r['q']}\nA:"  # re-rendered from the job the folder recorded (no kept prompt)
        assert s["arguments"] == {f"gen_args_{j}": {"arg_0": prompt, "arg_1": c} for j, c in enumerate(r["candidates"])}
        assert s["prompt_hash"] == sha(prompt)
        pairs = [[str(v), str(g)] for v, g in zip(r["scores"], r["greedy"])]  # sanitize_list: strings
        assert s["resps"] == [[p] for p in pairs] and s["filtered_resps"] == pairs
    assert sum(s["acc"] for s in samples) / len(samples) == results["results"]["job"]["acc,none"]


def test_generate_job_with_extraction_exports_exact_match_under_its_filter(tmp_path, tiny_model_path):
    rows = [{"id": f"r{i}", "text": f"number {i}", "gold": str(i % 3)} for i in range(4)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_model_path, data, out, sampling={"temperature": 0, "max_tokens": 3},
                    output={"path": str(out), "regex": "[0-9]{1,2}", "gold": "gold", "keep_prompt": True,
                            "extract": {"regex": "([0-9])", "match": "last"}})
    assert invoke("run", job, "--no-progress").exit_code == 0
    to = tmp_path / "exported"
    res = invoke("export", out, "--to", to, "--task", "digits")
    assert res.exit_code == 0, res.output
    _, results, samples = _files(to)
    acc = json.loads((out / "report.json").read_text())["accuracy"]
    assert set(results["results"]["digits"]) == {"name", "alias", "sample_len", "exact_match,extract",
                                                 "exact_match_stderr,extract"}
    assert results["results"]["digits"]["exact_match,extract"] == acc["accuracy"]
    assert results["configs"]["digits"]["output_type"] == "generate_until"
    table = pq.read_table(out / "results.parquet").to_pylist()
    for s, r in zip(samples, table):
        assert set(s) == SAMPLE_KEYS | {"exact_match"} and s["filter"] == "extract"
        assert s["arguments"]["gen_args_0"]["arg_0"] == r["rendered_prompt"]
        assert s["arguments"]["gen_args_0"]["arg_1"] == json.loads(r["params"])
        assert s["resps"] == [[r["text"]]] and s["filtered_resps"] == [r["extracted"] or "[invalid]"]
        assert s["target"] == r["gold"] and s["exact_match"] == float(r["correct"])
