"""Jobs run in the plan's order (windows of input rows, trie order inside), and a killed run resumes in it."""

from __future__ import annotations

import json
import signal

import pyarrow as pa
from jobkit import write_job, write_jsonl
from test_crash_resume import start_until

from mlxbatch.engine import plan
from mlxbatch.job.check.validate import validate_job
from mlxbatch.job.run.runner import JobRunner

INSTRUCTION = ("You label short product reviews. Answer with one word: positive, negative or neutral. "
               "Think about tone, not topic. Review: ")


def rows(n: int) -> list[dict]:
    words = ["great", "awful", "fine", "broke", "love", "meh", "returned", "perfect", "slow", "cheap"]
    return [{"id": f"r{i:03d}", "text": " ".join(words[(i * 7 + k * 3) % 10] for k in range(1 + i % 6))}
            for i in range(n)]


def expected_order(loaded, data: list[dict], window: int) -> list[str]:
    """The planner's order of the rendered prompts' token ids (``tests/engine/test_planner.py`` checks it is the
    trie's, larger subtrees first), window by window of input rows: every row of a window planned together."""
    out = []
    for w in range(0, len(data), window):
        chunk = data[w : w + window]
        ids = [loaded.tokenizer.encode(INSTRUCTION + r["text"] + "\n") for r in chunk]
        out += [chunk[i]["id"] for i in plan(ids).order]
    return out


def shard_order(out) -> list[str]:
    manifest = json.loads((out / "manifest.json").read_text())
    order = []
    for s in manifest["shards"]:
        with pa.memory_map(str(out / "shards" / s["name"])) as f:
            order += pa.ipc.open_file(f).read_all().column("row_id").to_pylist()
    return order


def job_for(tmp_path, model, n: int, window: int, **kw):
    data = rows(n)
    path = write_jsonl(tmp_path / "in.jsonl", data)
    job = write_job(tmp_path, model, path, tmp_path / "out", prompt={"template": INSTRUCTION + "{{ text }}\n"},
                    sampling={"temperature": 0, "max_tokens": 3}, engine={"max_num_seqs": 1},
                    plan={"window": window}, checkpoint={"every_rows": 4}, **kw)
    return data, job


def test_rows_run_in_trie_order_per_window_and_reuse_the_instruction(tmp_path, tiny_model_path, tiny_loaded):
    data, job = job_for(tmp_path, tiny_model_path, 30, window=12)
    report = JobRunner(validate_job(job), progress=False).run().report
    # one sequence at a time: rows finish in the order they were submitted
    assert shard_order(tmp_path / "out") == expected_order(tiny_loaded, data, 12)
    plan = report["plan"]
    assert plan["windows"] == 3 and plan["windowed"] and plan["rows"] == 30
    reuse = report["prefix_reuse"]
    assert reuse["cached_tokens"] > 0.5 * (reuse["prompt_tokens"] - plan["distinct_tokens"])
    assert reuse["prefill_tokens_computed"] <= plan["distinct_tokens"] + 30 * 15  # block granularity
    saved = json.loads((tmp_path / "out" / "manifest.json").read_text())["meta"]["plan"]
    assert saved == {"window": 12, "enabled": True, "order": "trie-largest-first", "ramp": True}


def test_a_killed_run_resumes_in_the_same_plan_order(tmp_path, tiny_model_path, tiny_loaded, caplog):
    data, job = job_for(tmp_path, tiny_model_path, 40, window=16)
    out = tmp_path / "out"
    proc = start_until(job, out, 12)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # the job file's window changed since: the resumed run still plans with the saved one
    text = job.read_text().replace("window: 16", "window: 5")
    assert text != job.read_text()
    job.write_text(text)
    with caplog.at_level("WARNING"):  # the resume in this process: no Python and MLX start-up of its own
        assert JobRunner(validate_job(job), progress=False).run().report["status"] == "complete"
    order = shard_order(out)
    assert len(order) == len(set(order)) == 40
    assert order == expected_order(tiny_loaded, data, 16)
    assert "resuming with the plan of the first run" in caplog.text


def test_a_resumed_window_keeps_the_order_its_first_run_had(tmp_path, tiny_model_path, tiny_loaded):
    """The trie order puts larger subtrees first, so it depends on every row of a window: with two of the three
    'alpha' rows done, the rest planned alone would put the two 'beta' rows first. The feed plans the done rows too
    and skips them, so the rows left keep the first run's order (and their retention)."""
    from mlxbatch.engine import plan as plan_rows
    from mlxbatch.io import open_reader
    from mlxbatch.job.check.validate import input_spec
    from mlxbatch.job.rows.feed import RowFeed, Submit
    from mlxbatch.job.rows.prepare import RowPreparer

    texts = ["alpha: red", "beta: blue", "alpha: green", "beta: pink", "alpha: gray"]
    data = [{"id": f"r{i}", "text": t} for i, t in enumerate(texts)]
    path = write_jsonl(tmp_path / "in.jsonl", data)
    spec = validate_job(write_job(tmp_path, tiny_model_path, path, tmp_path / "out",
                                  prompt={"template": INSTRUCTION + "{{ text }}\n"}, plan={"window": 100}))
    preparer = RowPreparer(spec, "identity")
    keys = [preparer.prepare(r).key for r in open_reader(input_spec(spec))]

    def submitted(done: set[str]) -> list[tuple[int, int | None]]:
        feed = RowFeed(open_reader(input_spec(spec)), RowPreparer(spec, "identity"), tiny_loaded.tokenizer, done,
                       window=100)
        return [(s.index, s.cache_tokens) for s in feed.take(100) if isinstance(s, Submit)]

    first = submitted(set())
    assert sorted(i for i, _ in first[:3]) == [0, 2, 4]  # the alpha rows first: their subtree is the larger
    done = {keys[0], keys[2]}
    resumed = submitted(done)
    assert [i for i, _ in resumed] == [i for i, _ in first if i not in (0, 2)]
    ids = [tiny_loaded.tokenizer.encode(INSTRUCTION + texts[i] + "\n") for i in (1, 3, 4)]
    alone = [(1, 3, 4)[k] for k in plan_rows(ids).order]
    assert alone != [i for i, _ in resumed]  # what planning only the rest would have done


def test_the_feed_plans_with_the_engines_reuse_step(tmp_path, tiny_model_path, tiny_loaded):
    """The feed plans with the executor's reuse step (``ModelInfo.reuse_step``: the engine's, 1 on a CPU, a block
    where prefill passes are packed): at a block, reviews that start alike keep the instruction, not a word more."""
    from mlxbatch.engine import submission_order
    from mlxbatch.io import open_reader
    from mlxbatch.job.check.validate import input_spec
    from mlxbatch.job.executors.local import LocalExecutor
    from mlxbatch.job.rows.feed import RowFeed, Submit
    from mlxbatch.job.rows.prepare import RowPreparer

    texts = ["great value", "great fit", "great but slow", "awful", "awful smell", "fine"]
    data = [{"id": f"r{i}", "text": t} for i, t in enumerate(texts)]
    path = write_jsonl(tmp_path / "in.jsonl", data)
    spec = validate_job(write_job(tmp_path, tiny_model_path, path, tmp_path / "out",
                                  prompt={"template": INSTRUCTION + "{{ text }}\n"}, plan={"window": 100}))
    executor = LocalExecutor(spec, tiny_loaded)
    assert executor.model.reuse_step == executor.engine.core.reuse_step == 1
    executor.shutdown()
    ids = [tiny_loaded.tokenizer.encode(INSTRUCTION + t + "\n") for t in texts]
    for step in (1, 16):
        feed = RowFeed(open_reader(input_spec(spec)), RowPreparer(spec, "identity"), tiny_loaded.tokenizer, set(),
                       window=100, min_step_tokens=step)
        got = [(s.index, s.cache_tokens) for s in feed.take(100) if isinstance(s, Submit)]
        assert got == [(s.index, s.cache_tokens) for s in submission_order(plan(ids, min_step_tokens=step))]
        kept = {c for _, c in got if c}
        if step == 16:
            assert len(kept) == 1  # the instruction alone: "great" and "awful" are a token or two past it
        else:
            assert len(kept) > 1
