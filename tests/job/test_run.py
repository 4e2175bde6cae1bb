"""Running jobs in process: per-row errors, resume, parameter changes, outputs readable by pipelines."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from jobkit import texts, write_job, write_jsonl

from mlxbatch.job.check.validate import validate_job
from mlxbatch.job.run.runner import JobFailed, JobRunner


def run(job):
    return JobRunner(validate_job(job), progress=False).run()


def results(out):
    return {r["id"]: r for r in pq.read_table(out / "results.parquet").to_pylist()}


def test_bad_rows_become_error_rows_and_the_job_completes(tmp_path, tiny_model_path):
    rows = texts(30)
    rows[3] = {"id": "row-0003"}  # missing field
    rows[5] = {"id": "row-0005", "text": "word " * 6000}  # longer than the context
    rows[7] = {"id": "row-0007", "text": "x", "budget": -4}  # out-of-range override
    rows[9] = {"id": "row-0001", "text": "again"}  # duplicate id
    data = write_jsonl(tmp_path / "in.jsonl", rows, extra_lines=[b'{"id": "broken", "text": ', b"[1, 2]",
                                                                   b'{"id": "bad-utf8", "text": "\xff\xfe"}'])
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", sampling={"overrides": {"max_tokens": "budget"}},
                    max_error_rate=0.5)
    report = run(job).report
    res = pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()
    assert len(res) == 33  # one output row per input line
    errors = {r["id"]: (r["error_kind"], r["error"]) for r in res if r["error"]}
    assert errors["row-0003"][0] == "render" and "text" in errors["row-0003"][1]
    assert errors["row-0005"][0] == "request" and "context" in errors["row-0005"][1]
    assert errors["row-0007"][0] == "params" and "max_tokens" in errors["row-0007"][1]
    assert any(kind == "duplicate_id" for kind, _ in errors.values())
    line_errors = [msg for kind, msg in errors.values() if kind == "input"]
    assert any("in.jsonl:31" in m and "invalid JSON" in m for m in line_errors)
    assert any("in.jsonl:32" in m for m in line_errors) and any("in.jsonl:33" in m for m in line_errors)
    ok = [r for r in res if not r["error"]]
    assert len(ok) == 33 - len(errors) and all(r["generated_tokens"] > 0 and r["text"] is not None for r in ok)
    assert report["rows"]["errors"] == len(errors) and sum(report["errors_by_kind"].values()) == len(errors)
    assert (tmp_path / "out" / "_SUCCESS").exists()
    assert json.loads((tmp_path / "out" / "report.json").read_text())["rows"]["output"] == 33
    # the wall outside the engine's steps, in parts: the engine idle until the first window was prepared (it had
    # nothing else to do), and the results written after the last row
    t, steps = report["this_run"], report["engine"]["profile"]["total_s"]
    assert t["waiting_for_rows_s"] > 0 and t["writing_results_s"] > 0
    assert t["waiting_for_rows_s"] + t["writing_results_s"] + steps <= t["wall_s"]
    # the engine's step calls as the run made them: the profiled steps and what the profile leaves out (outputs)
    assert steps < report["engine"]["profile"]["stepping_s"] < t["wall_s"]
    # MLX's peak memory holds at least the KV buffers the run allocated
    assert report["engine"]["peak_memory_bytes"] >= report["engine"]["kv_bytes"] > 0


def test_rows_run_at_the_short_gil_switch_interval_and_quiet_collector_and_the_process_gets_its_own_back(
        tmp_path, tiny_model_path):
    """While rows run, the step loop gets the GIL back from the feed's threads within ``SWITCH_INTERVAL_S``, and the
    cyclic collector leaves the objects alive at the start alone and runs young collections rarely; after the run (a
    notebook's process lives on) the interval and the collector are what they were."""
    import gc
    import sys
    import threading

    from mlxbatch.job.executors.interpreter import SWITCH_INTERVAL_S, YOUNG_THRESHOLD

    before, threshold, seen, done = sys.getswitchinterval(), gc.get_threshold(), set(), threading.Event()
    frozen, young = [], []

    def watch() -> None:
        while not done.wait(0.005):
            seen.add(sys.getswitchinterval())
            frozen.append(gc.get_freeze_count())
            young.append(gc.get_threshold()[0])

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        run(write_job(tmp_path, tiny_model_path, write_jsonl(tmp_path / "in.jsonl", texts(24)), tmp_path / "out"))
    finally:
        done.set()
        watcher.join()
    assert SWITCH_INTERVAL_S < before and SWITCH_INTERVAL_S in seen
    assert sys.getswitchinterval() == before
    assert max(frozen) > 10_000 and YOUNG_THRESHOLD in young  # the model and the modules, frozen while rows ran
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == threshold
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert 0 <= report["this_run"]["garbage_collector_s"] < report["this_run"]["wall_s"]


def test_rerun_skips_done_rows_and_a_changed_parameter_reruns_only_its_rows(tmp_path, tiny_model_path):
    rows = texts(24)
    for r in rows:
        r["budget"] = 6
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", sampling={"overrides": {"max_tokens": "budget"}})
    first = run(job)
    before = results(tmp_path / "out")
    again = run(job)
    assert again.report["rows"]["resumed"] == 24 and again.report["rows"]["finished_this_run"] == 0
    assert results(tmp_path / "out") == before
    rows[2]["budget"] = 3
    rows[9]["budget"] = 2
    write_jsonl(data, rows)
    third = run(job)
    assert third.report["rows"]["finished_this_run"] == 2 and third.report["rows"]["resumed"] == 22
    after = results(tmp_path / "out")
    assert after["row-0002"]["generated_tokens"] <= 3 and after["row-0009"]["generated_tokens"] <= 2
    assert after["row-0002"]["text"] != before["row-0002"]["text"] or before["row-0002"]["generated_tokens"] <= 3
    assert {k: v for k, v in after.items() if k not in ("row-0002", "row-0009")} == \
        {k: v for k, v in before.items() if k not in ("row-0002", "row-0009")}
    assert first.report["rows"]["output"] == third.report["rows"]["output"] == 24


def test_parquet_reads_back_with_pyarrow_and_datasets(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(12))
    run(write_job(tmp_path, tiny_model_path, data, tmp_path / "out", sampling={"logprobs": 2}))
    table = pq.read_table(tmp_path / "out" / "results.parquet")
    assert table.num_rows == 12 and table.column("id").to_pylist() == [f"row-{i:04d}" for i in range(12)]
    for col in ("id", "text", "finish_reason", "prompt_tokens", "generated_tokens", "error", "model", "params",
                "latency_s", "logprobs"):
        assert col in table.column_names, col
    import datasets

    ds = datasets.load_dataset("parquet", data_files=str(tmp_path / "out" / "results.parquet"), split="train",
                               cache_dir=str(tmp_path / "hf-cache"))
    assert ds.num_rows == 12 and ds[0]["id"] == "row-0000" and isinstance(ds[0]["text"], str)
    assert len(ds[0]["logprobs"]) == ds[0]["generated_tokens"]


def test_openai_batch_input_gives_openai_batch_output(tmp_path, tiny_model_path):
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "x", "messages": [{"role": "user", "content": f"Say {w}"}], "max_tokens": 5,
                       "temperature": 0}} for i, w in enumerate(["hi", "bye", "ok"])]
    lines.append({"custom_id": "req-bad", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}})
    data = write_jsonl(tmp_path / "batch.jsonl", lines)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", input={"path": str(data), "id_column": None,
                                                                              "format": "openai-batch"},
                    max_error_rate=0.5)  # 1 bad request of 4
    run(job)
    out = [json.loads(line) for line in (tmp_path / "out" / "openai_output.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["req-0", "req-1", "req-2"]
    body = out[0]["response"]["body"]
    assert out[0]["response"]["status_code"] == 200 and body["usage"]["completion_tokens"] <= 5
    assert isinstance(body["choices"][0]["message"]["content"], str)
    errs = [json.loads(line) for line in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errs] == ["req-bad"] and "max_tokens" in errs[0]["error"]["message"]


def test_too_many_errors_stop_the_job_and_keep_finished_rows(tmp_path, tiny_model_path):
    rows = texts(80)
    for r in rows[1::2]:
        del r["text"]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", max_error_rate=0.2,
                    checkpoint={"every_rows": 5}, engine={"max_num_seqs": 2},
                    plan={"window": 10})  # a window's error rows are recorded before its rows run
    with pytest.raises(JobFailed, match="max_error_rate"):
        run(job)
    from mlxbatch.io import CheckpointStore

    with CheckpointStore(tmp_path / "out") as store:
        kept = {r.row_id: r for r in store.iter_records()}
    assert len(kept) >= 20 and any(r.error is None for r in kept.values())
    assert not (tmp_path / "out" / "_SUCCESS").exists()
    # raising the budget resumes from what was kept and completes
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", max_error_rate=1.0)
    done = run(job).report
    assert done["rows"]["resumed"] == len(kept) and done["rows"]["output"] == 80


def test_local_hf_dataset_with_a_chosen_split(tmp_path, tiny_model_path):
    import datasets

    rows = texts(6)
    dd = datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows[:4]),
                               "test": datasets.Dataset.from_list(rows[4:])})
    dd.save_to_disk(str(tmp_path / "ds"))
    job = write_job(tmp_path, tiny_model_path, tmp_path / "ds", tmp_path / "out",
                    input={"path": str(tmp_path / "ds"), "id_column": "id", "format": "hf", "split": "validation"})
    run(job)
    assert list(results(tmp_path / "out")) == [r["id"] for r in rows[:4]]


def test_a_short_greedy_job_on_the_head_dim_64_model_gives_mlx_lms_tokens(tmp_path, tiny64_model_path, tiny64_loaded):
    """Head dim 64 takes MLX's fused attention on Metal and CUDA (the tiny model's 32 does not): a job's greedy
    outputs there are those of mlx-lm's own generation loop on the same prompts."""
    from mlx_lm import stream_generate

    rows = texts(12)
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    job = write_job(tmp_path, tiny64_model_path, data, tmp_path / "out", prompt={"chat_template": False},
                    sampling={"temperature": 0, "max_tokens": 10})
    run(job)
    got = results(tmp_path / "out")
    for r in rows:
        prompt = f"Summarise: {r['text']}\n"
        want = list(stream_generate(tiny64_loaded.model, tiny64_loaded.tokenizer, prompt, max_tokens=10))
        assert got[r["id"]]["generated_tokens"] == len(want)
        assert got[r["id"]]["text"] == "".join(x.text for x in want), r["id"]  # mlx-lm's streamed text
