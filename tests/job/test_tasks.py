"""Job tasks: scoring candidates (with accuracy), n > 1 samples as a list column, bad task input as row errors."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jobkit import write_job, write_jsonl

from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.job.check.validate import validate_job
from mlxbatch.job.run.runner import JobRunner
from mlxbatch.job.spec import JobSpecError

QUESTIONS = [
    {"id": "a", "q": "Two plus two is", "options": [" four", " five", " six"], "gold": 0},
    {"id": "b", "q": "The sky is", "options": [" blue", " green"], "gold": " green"},
    {"id": "c", "q": "Water is", "options": [" wet", " dry", " cold", " hot"], "gold": "wet"},
    {"id": "d", "q": "Fire is", "options": [], "gold": 0},  # no candidates: a row error
    {"id": "e", "q": "Ice is", "options": [" " + "very " * 3000 + "cold"], "gold": 0},  # too long: a row error
]


def test_score_job_scores_candidates_and_reports_accuracy(tmp_path, tiny_model_path, tiny_loaded):
    data = write_jsonl(tmp_path / "in.jsonl", QUESTIONS)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", prompt={"template": "Q: {{ q }}"},
                    task="score", score={"candidates": "options", "answer": "gold"}, max_error_rate=1.0,
                    input={"columns": ["q", "gold"]})
    report = JobRunner(validate_job(job), progress=False).run().report
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()}
    assert rows["d"]["error_kind"] == "candidates" and "non-empty list" in rows["d"]["error"]
    assert rows["e"]["error_kind"] == "request" and "context" in rows["e"]["error"]
    assert rows["d"]["correct"] is False and rows["e"]["correct"] is False  # error rows are graded wrong
    assert rows["d"]["target"] == 0 and rows["e"]["target"] == 0
    assert all(r["params"] == "{}" for r in rows.values())  # a score row samples nothing
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False))
    right = right_norm = 0
    for q in QUESTIONS[:3]:
        r = rows[q["id"]]
        outs = eng.score([("Q: " + q["q"], q["options"])])[0].completions
        want = [c.cumulative_logprob for c in outs]
        assert r["scores"] == pytest.approx(want, abs=1e-4)
        assert r["candidates"] == q["options"] and r["candidate_tokens"] == [len(c.logprobs) for c in outs]
        assert r["candidate_bytes"] == [len(o.encode()) for o in q["options"]]
        best = max(range(len(want)), key=want.__getitem__)
        norm = max(range(len(want)), key=lambda i: want[i] / len(q["options"][i].strip()))  # lm-eval's acc_norm
        assert r["choice"] == best and r["choice_norm"] == norm and len(r["greedy"]) == len(want)
        assert r["text"] == q["options"][best].strip()  # comparable with a text answer
        gold = q["gold"] if isinstance(q["gold"], int) else [o.strip() for o in q["options"]].index(q["gold"].strip())
        assert r["target"] == gold and r["correct"] == (best == gold) and r["correct_norm"] == (norm == gold)
        right += best == gold
        right_norm += norm == gold
    acc = report["accuracy"]
    assert (acc["rows"], acc["correct"], acc["answered"], acc["errors"]) == (5, right, 3, 2)
    assert acc["accuracy"] == right / 5 and acc["accuracy_of_answered"] == right / 3
    assert acc["acc_norm"] == right_norm / 5


def test_n_samples_become_a_list_column(tmp_path, tiny_model_path):
    rows = [{"id": f"r{i}", "text": f"sentence number {i}"} for i in range(4)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out",
                    sampling={"temperature": 1.0, "n": 3, "max_tokens": 6})
    JobRunner(validate_job(job), progress=False).run()
    table = pq.read_table(tmp_path / "out" / "results.parquet")
    assert table.schema.field("samples").type == pa.list_(pa.string())
    for r in table.to_pylist():
        assert len(r["samples"]) == 3 and r["samples"][0] == r["text"]


def test_bad_task_sections_are_rejected_before_any_work(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", QUESTIONS[:1])
    cases = [
        ({"task": "score"}, "score.candidates"),
        ({"task": "score", "score": {"candidates": []}}, "score.candidates"),
        ({"task": "classify"}, "task"),
        ({"score": {"candidates": [" a"]}}, "score"),
        ({"output": {"path": str(tmp_path / "o"), "choice": ["a"], "regex": "a"}}, "output"),
        ({"output": {"path": str(tmp_path / "o"), "json_schema": "{not json"}}, "output.json_schema"),
        ({"task": "score", "score": {"candidates": [" a"]}, "output": {"path": str(tmp_path / "o"), "regex": "x"}},
         "output"),
        ({"output": {"path": str(tmp_path / "o"), "gold": "id", "extract": "(unclosed"}}, "output.extract.regex"),
        ({"output": {"path": str(tmp_path / "o"), "gold": "id", "extract": {"regex": "x", "match": "middle"}}},
         "output.extract.match"),
        ({"output": {"path": str(tmp_path / "o"), "extract": "x"}}, "output.extract"),  # grades against a gold
        ({"output": {"path": str(tmp_path / "o"), "grade_truncated": True}}, "output.grade_truncated"),
    ]
    for overrides, key in cases:
        job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", **overrides)
        with pytest.raises(JobSpecError) as info:
            validate_job(job)
        assert key in [k for k, _ in info.value.problems], (overrides, info.value.problems)


def test_token_strings_keep_their_leading_space_with_a_sentencepiece_tokenizer(tiny_loaded):
    """Logprob token strings read as inside a text (OpenAI's " Paris"): a SentencePiece-style tokenizer (Metaspace,
    built here: no hub) decodes ``▁the`` alone as "the"; byte-level BPE (the tiny model's) keeps the space anyway."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mlxbatch.job.rows.tasks import token_text_of

    vocab = {"<unk>": 0, "▁the": 1, "▁cat": 2, "▁x": 3, "s": 4, "<0xE2>": 5}
    sp = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    sp.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    hf = PreTrainedTokenizerFast(tokenizer_object=sp, unk_token="<unk>")
    assert hf.decode([1]) == "the"  # what decoding a token alone gave
    text = token_text_of(hf)
    assert [text(i) for i in (1, 2, 4)] == [" the", " cat", "s"]
    tok = tiny_loaded.tokenizer
    ids = tok.encode(" hello world", add_special_tokens=False)
    assert "".join(token_text_of(tok)(i) for i in ids) == tok.decode(ids)
