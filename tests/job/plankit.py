"""Helpers for the plan-vs-run tests: the shipped jobs planned and run on their first rows, and the agreement checks
both test modules make (``test_plan_matches_run``: the eval jobs and the caption job; ``test_plan_eta``: the demo and
label jobs, whose runs the ETA tests time)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from click.testing import CliRunner

from mlxbatch.cli import main
from mlxbatch.job.check.validate import validate_job
from mlxbatch.job.plan.predict import PlanReport, plan_job
from mlxbatch.job.run.runner import JobRunner
from mlxbatch.job.spec.overrides import JobOverrides

ROOT = Path(__file__).resolve().parents[2]

# the shipped jobs' first rows (of demo 300, label 120, eval 125, eval_generate 125, caption 48; a job-form: its own
# size or its job's). At their full sizes these runs were over a third of the whole suite's time (850 of 2370 s);
# SmolLM2's prefill (~50 tokens/s on one CPU core) is what they cost. label's ~480-token shared head is most of its
# prefill at any row count, so it keeps 40 rows (25 of them repeat another row's ticket: forks and whole-prompt reuse).
# The eval jobs' checks (prefill within 2%, the floor within 7%) hold at 16 rows as at 24 (1.018 and 1.05).
SIZES = {"demo": 24, "demo-sentences": 16, "label": 40, "eval": 16, "eval_generate": 16, "caption": 16}
# job-form: the job with settings changed. demo-sentences: the demo's prompts answered in sentences, not its
# one-token labels; eval-letters: the eval's rows scored on one-token candidates (one sequence a row: the context's
# last logits score them)
FORMS = {"sentences": ("output.choice=null", "sampling.max_tokens=12"),
         "letters": ('score.candidates=[" A", " B", " C", " D"]', "score.answer=null")}
CALIBRATED = ("caption", "demo", "label")  # image rows (the processor expands each image); demo, label: ETAs checked


def prefill_of(report: dict[str, Any]) -> int:
    return report["prefix_reuse"]["prefill_tokens_computed"]


def plan_and_run(job: Path, overrides: JobOverrides | None = None,
                 calibrate: bool = False) -> tuple[PlanReport, dict[str, Any]]:
    spec = validate_job(job, overrides)
    planned = plan_job(spec, calibrate=calibrate)
    report = JobRunner(spec, progress=False).run().report
    return planned, report


class Shipped(NamedTuple):
    planned: PlanReport
    report: dict[str, Any]  # the run's report.json
    out: Path  # the run's output folder
    said: str  # what ``mlxbatch run`` printed


def shipped_runs(tmp_path_factory: pytest.TempPathFactory):
    """``get(name)``: the shipped job ``name`` (``job`` or ``job-form``) planned, then run with ``mlxbatch run`` on its
    first rows (``SIZES``), once per test module."""
    done: dict[str, Shipped] = {}

    def get(name: str) -> Shipped:
        if name not in done:
            out = tmp_path_factory.mktemp(name) / "out"
            job, _, form = name.partition("-")
            path, sets, rows = ROOT / "jobs" / f"{job}.yaml", FORMS.get(form, ()), SIZES.get(name, SIZES[job])
            planned = plan_job(validate_job(path, JobOverrides(sets=sets, output=out, limit=rows)),
                               calibrate=job in CALIBRATED and not form)
            args = ["run", str(path), "--no-progress", "--limit", str(rows), "-o", str(out)]
            res = CliRunner().invoke(main, args + [a for s in sets for a in ("--set", s)])
            assert res.exit_code == 0, res.output
            done[name] = Shipped(planned, json.loads((out / "report.json").read_text()), out, res.output)
        return done[name]

    return get


def assert_prefill_predicted(run: Shipped) -> None:
    """The plan's predicted prefill tokens are the run's, within 2%."""
    assert run.planned.prefill_tokens == pytest.approx(prefill_of(run.report), rel=0.02), (
        run.planned, run.report["prefix_reuse"])


def assert_close_to_floor(run: Shipped, bound: float) -> None:
    """report.json says how far from the floor (the plan's trie node count) the run's prefill was, and it is within
    ``bound``; every engine sequence's prompt is computed or reused: one sequence a row (a score row of one-token
    candidates: its context, whose last logits score them all)."""
    planned, reuse = run.planned, run.report["prefix_reuse"]
    assert reuse["floor_tokens"] == planned.distinct_tokens
    assert reuse["floor_ratio"] == round(prefill_of(run.report) / planned.distinct_tokens, 4)
    assert reuse["floor_ratio"] <= bound, reuse
    assert reuse["sequence_prompt_tokens"] == reuse["prefill_tokens_computed"] + reuse["cached_tokens"]
    assert reuse["sequence_prompt_tokens"] == reuse["prompt_tokens"], reuse
