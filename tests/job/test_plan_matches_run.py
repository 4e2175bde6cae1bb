"""``mlxbatch plan`` plans what ``mlxbatch run`` runs: the job's windows and plan switch, score and image rows,
hub ids; its predicted prefill tokens match the run's report, and its ETA the run's wall time."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from jobkit import texts, write_job, write_jsonl

from mlxbatch.cli import main
from mlxbatch.job.check.validate import validate_job
from mlxbatch.job.plan.predict import plan_job
from mlxbatch.job.run.runner import JobRunner
from mlxbatch.job.spec.overrides import JobOverrides

ROOT = Path(__file__).resolve().parents[2]


def prefill_of(report):
    return report["prefix_reuse"]["prefill_tokens_computed"]


def plan_and_run(job, overrides=None, calibrate=False):
    spec = validate_job(job, overrides)
    planned = plan_job(spec, calibrate=calibrate)
    report = JobRunner(spec, progress=False).run().report
    return planned, report


# the shipped jobs' first rows (of demo 300, label 120, eval 125, eval_generate 125, caption 48): at their full sizes
# these runs were over a third of the whole suite's time (850 of 2370 s). The figures in the comments below were
# measured at the full sizes.
SIZES = {"demo": 64, "label": 40, "eval": 50, "eval_generate": 50, "caption": 24}


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """Each shipped job planned and run once on its first rows (``SIZES``): the plan's report and the run's
    report.json."""
    done: dict[str, tuple] = {}

    def get(name):
        if name not in done:
            out = tmp_path_factory.mktemp(name) / "out"
            job, _, form = name.partition("-")
            # demo-sentences: the demo's prompts answered in sentences, not its one-token labels; eval-letters: the
            # eval's rows scored on one-token candidates (one sequence a row: the context's last logits score them)
            sets = ("output.choice=null", "sampling.max_tokens=12") if form == "sentences" else \
                ('score.candidates=[" A", " B", " C", " D"]', "score.answer=null") if form == "letters" else ()
            done[name] = plan_and_run(ROOT / "jobs" / f"{job}.yaml", JobOverrides(sets=sets, output=out,
                                                                                   limit=SIZES[job]),
                                      # image rows: the processor expands each image; label: its ETA is checked
                                      calibrate=job in ("caption", "label") and not form)
        return done[name]

    return get


@pytest.mark.parametrize("name", ["demo", "demo-sentences", "label", "eval",
                                  "eval-letters", "eval_generate", "caption"])
def test_predicted_prefill_of_the_shipped_jobs(shipped, name):
    """Issue #15: at their full sizes (before: label 696 predicted, 1450 computed; demo 3600 and 3431; eval 647 and
    764)."""
    planned, report = shipped(name)
    assert planned.prefill_tokens == pytest.approx(prefill_of(report), rel=0.02), (planned, report["prefix_reuse"])


@pytest.mark.parametrize("name, bound", [
    ("demo", 1.05),
    ("demo-sentences", 1.05),
    ("label", 1.05),  # 104 of its 120 rows repeat another row's ticket: they fork it, or reuse all but one token
    # the eval questions (125 rows, ~12 tokens each after a shared ~60-token head): 1.051 and 1.056 measured; at 16
    # rows 1.018 (and 1.051 before the trie put larger subtrees first; eval 1.27 before one-token candidates became
    # one sequence)
    ("eval_generate", 1.07),
    ("eval-letters", 1.07),
])
def test_the_shipped_jobs_run_close_to_the_floor(shipped, name, bound):
    """Issue #15: report.json says how far from the floor (the plan's trie node count) the run's prefill was
    (before: demo 1.334, label 2.69, eval 1.50, eval_generate 1.051)."""
    planned, report = shipped(name)
    reuse = report["prefix_reuse"]
    assert reuse["floor_tokens"] == planned.distinct_tokens
    assert reuse["floor_ratio"] == round(prefill_of(report) / planned.distinct_tokens, 4)
    assert reuse["floor_ratio"] <= bound, reuse
    # every engine sequence's prompt is computed or reused: one sequence a row (a score row of one-token candidates:
    # its context, whose last logits score them all)
    assert reuse["sequence_prompt_tokens"] == reuse["prefill_tokens_computed"] + reuse["cached_tokens"]
    assert reuse["sequence_prompt_tokens"] == reuse["prompt_tokens"], reuse


@pytest.mark.parametrize("plan", [{"window": 8}, {"window": 8, "enabled": False}, {"enabled": False}])
@pytest.mark.parametrize("chat", [False, True])
def test_predicted_prefill_with_windows_and_without_the_plan(tmp_path, tiny_model_path, plan, chat):
    instruction = "Label the following text as alpha or beta, carefully and with care. " * 3
    rows = [{"id": f"r{i}", "text": f"item number {i} " * (1 + i % 3)} for i in range(40)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    prompt = {"template": None, "system": instruction, "messages": [{"role": "user", "content": "{{ text }}"}]} \
        if chat else {"template": instruction + "{{ text }}"}
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", plan=plan, prompt=prompt,
                    sampling={"max_tokens": 6})
    res = CliRunner().invoke(main, ["plan", str(job), "--json", "--no-calibrate"])
    assert res.exit_code == 0, res.output
    shown = json.loads(res.output)
    assert shown["window"] == plan.get("window", 10_000) and shown["enabled"] == plan.get("enabled", True)
    assert shown["windowed"] == ("window" in plan)  # the job's window, not a default of the command
    planned, report = plan_and_run(job)
    assert planned.prefill_tokens == shown["prefill_tokens"]
    # the dry run of the engine's scheduling (before: 444 predicted against 458 computed without a plan, text form)
    assert planned.prefill_tokens == pytest.approx(prefill_of(report), rel=0.01), (planned, report["prefix_reuse"])
    reuse = report["prefix_reuse"]
    assert reuse["window_floor_tokens"] == planned.distinct_tokens
    assert reuse["window_floor_ratio"] == round(prefill_of(report) / planned.distinct_tokens, 4)
    # a floor is claimed only where it is one: the whole job planned as one window
    assert reuse["floor_tokens"] == (None if "window" in plan else planned.distinct_tokens)


def test_a_sampled_chat_job_of_nested_rows_in_windows(tmp_path, tiny_model_path):
    """Issue 46: a 40-row chat job (system prompt + one user message, ``plan: {window: 8}``, sampled, rows that are
    prefixes of one another) was planned at 575 prefill tokens and computed 1029 (SmolLM2: 326 and 497): the plan
    replayed the engine's reuse rules in a second copy, which drifted. It runs the engine's own scheduler and prefix
    index now (``engine.DryRun``): 1029 and 1029 (SmolLM2: 497 and 497)."""
    data = write_jsonl(tmp_path / "in.jsonl", texts(40))
    prompt = {"template": None, "system": "You are a helpful assistant. Answer briefly.",
              "messages": [{"role": "user", "content": "{{ text }}"}]}
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", plan={"window": 8}, prompt=prompt)
    planned, report = plan_and_run(job)
    assert planned.windows == 5
    assert planned.prefill_tokens == pytest.approx(prefill_of(report), rel=0.01), (planned, report["prefix_reuse"])


def test_a_windowed_run_reports_its_floor_window_by_window(tmp_path, tiny_model_path):
    """QA: the prefix cache carries shared prefixes across windows, so a windowed run computes less than the sum of
    its windows' trie floors (jobs/label.yaml, window 5, 20 rows: 489 computed, floor_tokens 1363, floor_ratio 0.36),
    and report.json's plan.expected_saving (0.75: the windows' floors) disagreed with the saving `mlxbatch plan`
    printed (90.8%: its predicted prefill). Now each figure is named for what it is, with the same name in both."""
    instruction = "Label the following text as alpha or beta, carefully and with care. " * 3
    rows = [{"id": f"r{i}", "text": f"item number {i} " * (1 + i % 3)} for i in range(40)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", plan={"window": 8},
                    prompt={"template": instruction + "{{ text }}"}, sampling={"max_tokens": 4})
    shown = json.loads(CliRunner().invoke(main, ["plan", str(job), "--json", "--no-calibrate"]).output)
    text = CliRunner().invoke(main, ["plan", str(job), "--no-calibrate"]).output
    planned, report = plan_and_run(job)
    reuse, ran = report["prefix_reuse"], report["plan"]
    computed = prefill_of(report)
    assert computed < planned.distinct_tokens, reuse  # the case: below the sum of the windows' floors
    assert reuse["floor_tokens"] is None and reuse["floor_ratio"] is None, reuse  # no whole-job floor is claimed
    assert reuse["window_floor_tokens"] == ran["distinct_tokens"] == shown["distinct_tokens"] == planned.distinct_tokens
    assert reuse["window_floor_ratio"] == round(computed / planned.distinct_tokens, 4) < 1
    # one name, one meaning: the windows' floor saving in both, the (predicted / measured) prefill saving in both
    assert "expected_saving" not in ran
    assert ran["window_floor_saving"] == shown["window_floor_saving"] == round(
        1 - planned.distinct_tokens / planned.prompt_tokens, 4)
    assert reuse["saving"] == round(1 - computed / reuse["sequence_prompt_tokens"], 4)
    assert reuse["saving"] == pytest.approx(shown["saving"], abs=0.01) and reuse["saving"] > ran["window_floor_saving"]
    assert "prefill floor per window" in text and "5 windows" in text and "carries shared prefixes" in text, text


# an ETA against the run's wall, both timed on a shared machine (0.47-1.88 seen under load, with the suite on two
# workers): the band catches an ETA of another order only; that the decode steps are counted is checked by their
# own figures (decode_s > 0 where rows decode), not by this ratio
ETA_BAND = (0.4, 2.5)


def test_the_eta_is_measured_and_close_to_the_run(tmp_path):
    planned, report = plan_and_run(ROOT / "jobs" / "demo.yaml", JobOverrides(limit=32, output=tmp_path / "out"),
                                   calibrate=True)
    eta = planned.eta
    assert eta.method == "measured" and eta.prefill_s > 0 and eta.decode_s_per_step > 0
    # the demo's labels are one token: each comes from its row's prefill step, so no decode step is counted
    assert eta.tokens_per_row == 1 and eta.decode_s == 0 and report["engine"]["profile"]["decode_tokens"] == 0
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
    planned, report = shipped("label")
    eta = planned.eta
    ratio = eta.total_s / report["wall_s"]
    print(f"label ETA {eta.total_s:.1f} s (decode {eta.decode_s:.1f} s), run {report['wall_s']:.1f} s: {ratio:.2f}")
    assert eta.method == "measured" and eta.decode_s > 0 and report["engine"]["profile"]["decode_tokens"] > 0
    assert ETA_BAND[0] <= ratio <= ETA_BAND[1], (eta, report["wall_s"])  # 0.95 and 1.06 here, 0.62 under load


def _fake_hub_cache(cache: Path, repo: str, model: Path) -> None:
    """A Hugging Face hub cache holding ``repo`` (its config and tokenizer files), as huggingface_hub lays it out."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for f in model.iterdir():
        if f.suffix in (".json", ".jinja"):
            shutil.copy(f, snapshot / f.name)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0" * 40)


def test_plan_takes_hub_ids(tmp_path, tiny_model_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    _fake_hub_cache(tmp_path / "hub", "someone/tiny", tiny_model_path)
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "text": f"row {i}"} for i in range(6)])
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out")
    raw = yaml.safe_load(job.read_text())
    raw["model"] = "someone/tiny"
    job.write_text(yaml.safe_dump(raw))
    res = CliRunner().invoke(main, ["plan", str(job), "--json"])  # cached: read from the cache, weights or not
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["rows"] == 6
    raw["model"] = "someone/elsewhere"
    job.write_text(yaml.safe_dump(raw))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # no Hub here: refused at once
    res = CliRunner().invoke(main, ["plan", str(job)])  # not cached, and the Hub cannot be reached: invalid
    assert res.exit_code == 2 and "not in the local Hugging Face cache" in res.output and "Traceback" not in res.output
    assert "the Hub cannot be reached" in res.output
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = CliRunner().invoke(main, ["plan", str(job)])
    assert res.exit_code == 2 and "HF_HUB_OFFLINE" in res.output
