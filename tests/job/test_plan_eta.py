"""The shipped demo and label jobs on SmolLM2, planned with a measured ETA (``plan --calibrate``), then run with
``mlxbatch run`` on their first rows: the plan's prefill and floor match the run, its ETA the run's wall time, and the
demo's labels are sensible. Each job is planned and run once for all of them (the other shipped jobs:
``test_plan_matches_run``)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from plankit import ROOT, SIZES, assert_close_to_floor, assert_prefill_predicted, shipped_runs

# an ETA against the run's wall, both timed on a shared machine (0.47-1.88 seen under load, with the suite on two
# workers): the band catches an ETA of another order only; that the decode steps are counted is checked by their
# own figures (decode_s > 0 where rows decode), not by this ratio
ETA_BAND = (0.4, 2.5)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    return shipped_runs(tmp_path_factory)


@pytest.mark.parametrize("name", ["demo", "demo-sentences", "label"])
def test_predicted_prefill_of_the_shipped_jobs(shipped, name):
    """Issue #15: at their full sizes (before: label 696 predicted, 1450 computed; demo 3600 and 3431)."""
    assert_prefill_predicted(shipped(name))


@pytest.mark.parametrize("name, bound", [
    ("demo", 1.05),
    ("demo-sentences", 1.05),
    ("label", 1.05),  # 104 of its 120 rows repeat another row's ticket: they fork it, or reuse all but one token
])
def test_the_shipped_jobs_run_close_to_the_floor(shipped, name, bound):
    """Issue #15 (before: demo 1.334, label 2.69)."""
    assert_close_to_floor(shipped(name), bound)


def test_the_eta_is_measured_and_close_to_the_run(shipped):
    planned, report = shipped("demo")[:2]
    eta = planned.eta
    assert eta.method == "measured" and eta.prefill_s > 0
    # the demo's labels are one token: each comes from its row's prefill step, so no decode step is counted (nor
    # timed: the label job's is, test_the_eta_of_a_job_whose_rows_decode)
    assert eta.tokens_per_row == 1 and eta.decode_s == 0 and report["engine"]["profile"]["decode_tokens"] == 0
    assert not eta.decode_s_per_step
    ratio = eta.total_s / report["wall_s"]
    print(f"ETA {eta.total_s:.1f} s, run {report['wall_s']:.1f} s: ratio {ratio:.2f}")
    # the probe runs the rows as the run does (plan order and retention): 0.83-1.23 here on 2 CPU cores, in one
    # process with other tests (0.92 with plan and run in their own processes; before, in input order, the probe
    # computed 1.7x the plan's tokens: 1.16-1.64). Two timings on a shared machine (the suite runs on two workers)
    # move apart by up to ~2x, so the band only catches an ETA of another order (a missing or doubled term)
    assert ETA_BAND[0] <= ratio <= ETA_BAND[1], (eta, report["wall_s"])


def test_the_eta_of_a_job_whose_rows_decode(shipped):
    """label.yaml's rows generate a few tokens each: its decode steps attend to long contexts and move the rows that
    finish, which the short rows' step alone left out (ratio 0.70 before)."""
    planned, report = shipped("label")[:2]
    eta = planned.eta
    ratio = eta.total_s / report["wall_s"]
    print(f"label ETA {eta.total_s:.1f} s (decode {eta.decode_s:.1f} s), run {report['wall_s']:.1f} s: {ratio:.2f}")
    assert eta.method == "measured" and eta.decode_s > 0 and eta.decode_s_per_step > 0
    assert report["engine"]["profile"]["decode_tokens"] > 0
    assert ETA_BAND[0] <= ratio <= ETA_BAND[1], (eta, report["wall_s"])  # 0.95 and 1.06 here, 0.62 under load


def test_the_demo_job_labels_reviews(shipped):
    """The shipped demo job on the real SmolLM2-135M-Instruct gives sensible labels (its first rows)."""
    run = shipped("demo")
    lines = (ROOT / "jobs" / "data" / "reviews.jsonl").read_text().splitlines()[:SIZES["demo"]]
    out = pq.read_table(run.out / "results.parquet").to_pylist()
    assert [r["id"] for r in out] == [json.loads(line)["id"] for line in lines]
    assert all(r["text"] in ("positive", "negative") and r["parsed"] == r["text"] for r in out)  # output.choice
    assert all(r["correct"] == (r["text"] == r["gold"]) for r in out)  # output.gold
    right = sum(r["correct"] for r in out)
    assert right >= 0.85 * len(out)  # measured: 95% on all 300 rows (the comment in demo.yaml)
    assert f"accuracy {right / len(out):.1%} ± " in run.said and f"({right}/{len(out)} rows)" in run.said
    assert "review" in out[0]  # the input's column under its own name (``text`` would be ``input_text``)
    comment = (ROOT / "jobs" / "demo.yaml").read_text()
    assert "95%" in comment and "accuracy 95.0% ± 1.3% (285/300 rows)" in comment  # `run` on all 300 rows
