"""Parity with a plain mlx-lm forward: a multiple-choice job's scores, acc, acc_norm and stderr are what a reference
computes from each prompt alone (float32, CPU), with the rows batched and the prefix cache on."""

from __future__ import annotations

import json
import math
import statistics

import mlx.core as mx
import pyarrow.parquet as pq
import pytest
from jobkit import write_job, write_jsonl
from mlx_lm import load

from mlxbatch.job.check.validate import validate_job
from mlxbatch.job.run.runner import JobRunner

SHOTS = "Answer the question.\nQ: Is water wet?\nA: yes, it is\nQ: Is fire cold?\nA: no\n"
QUESTIONS = [  # candidates of different lengths in tokens and characters, so acc_norm can pick another one
    ("Is the sky blue?", [" yes", " no", " maybe not today"], 0),
    ("Is ice hot?", [" no", " yes indeed", " it depends"], " no"),
    ("Do fish swim?", [" yes", " no"], 0),
    ("Is two more than three?", [" no", " yes", " only on Sundays"], "no"),
    ("Can birds fly?", [" mostly yes", " no", " yes"], 2),
    ("Is a cat a plant?", [" no", " yes", " partly"], 0),
    ("Is snow white?", [" white as milk", " no", " yes"], "yes"),
    ("Do trees have roots?", [" yes", " no, never"], 0),
]


def _reference(model, tok, context: str, candidate: str) -> float:
    """The candidate's summed token log-probabilities after the context: one forward of that one prompt."""
    ctx = tok.encode(context)
    cont = tok.encode(candidate, add_special_tokens=False)
    logits = model(mx.array([ctx + cont]))[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sum(logp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont))


def test_scores_and_metrics_match_a_plain_mlx_lm_forward(tmp_path, tiny_model_path):
    rows = [{"id": f"q{i}", "q": q, "options": opts, "gold": gold} for i, (q, opts, gold) in enumerate(QUESTIONS)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out",
                    prompt={"template": SHOTS + "Q: {{ q }}\nA:"}, task="score",
                    score={"candidates": "options", "answer": "gold"},
                    engine={"max_num_seqs": 8, "prefill_chunk_size": 16, "prefix_cache": True})
    job.write_text(job.read_text().replace(f"model: {tiny_model_path}",
                                           f"model: {{path: {tiny_model_path}, dtype: float32}}"))
    report = JobRunner(validate_job(job), progress=False).run().report
    assert report["prefix_reuse"]["cached_tokens"] > 0  # the few-shot prefix came from the cache
    results = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()}

    model, tok = load(str(tiny_model_path))
    model.set_dtype(mx.float32)
    acc, acc_norm = [], []
    for row in rows:
        got = results[row["id"]]
        want = [_reference(model, tok, SHOTS + f"Q: {row['q']}\nA:", c) for c in row["options"]]
        assert got["scores"] == pytest.approx(want, abs=1e-4), row["id"]
        gold = row["gold"] if isinstance(row["gold"], int) else \
            [c.strip() for c in row["options"]].index(row["gold"].strip())
        pred = max(range(len(want)), key=want.__getitem__)
        # lm-eval's acc_norm: the log-likelihood over the choice's length in characters (no target delimiter)
        pred_norm = max(range(len(want)), key=lambda i: want[i] / len(row["options"][i].strip()))
        acc.append(float(pred == gold))
        acc_norm.append(float(pred_norm == gold))
        assert (got["choice"], got["choice_norm"], got["target"]) == (pred, pred_norm, gold)
    figures = json.loads((tmp_path / "out" / "report.json").read_text())["accuracy"]
    n = len(rows)
    assert figures["accuracy"] == pytest.approx(statistics.mean(acc), abs=1e-12)
    assert figures["acc_norm"] == pytest.approx(statistics.mean(acc_norm), abs=1e-12)
    assert figures["accuracy_stderr"] == pytest.approx(statistics.stdev(acc) / math.sqrt(n), abs=1e-12)
    assert figures["acc_norm_stderr"] == pytest.approx(statistics.stdev(acc_norm) / math.sqrt(n), abs=1e-12)
