"""``mlxbatch export --format lm-eval OUT``: a graded job's results in lm-evaluation-harness's shapes, so the
dashboards and scripts that read lm-eval's output read our runs (written under ``OUT/lm-eval`` unless ``--to``
says where).

Owns the mapping, which follows lm-eval's ``lm_eval/result_schema.py`` (``EvalResults``, ``_TaskMetrics``,
``_SampleCount``, ``SampleResult``) and how ``lm_eval/loggers/evaluation_tracker.py`` writes them
(EleutherAI/lm-evaluation-harness at 4e7e0d47f):

- ``<to>/<model, sanitized>/results_<date>.json``: ``results`` -> task -> ``name``, ``alias``, ``sample_len`` and the
  ``metric,filter`` keys (``acc,none``, ``acc_stderr,none``, ``acc_norm,none``, ``acc_norm_stderr,none`` of a score
  job; ``exact_match,<filter>`` of a generate job, the filter ``extract`` with ``output.extract``, else ``none``),
  a stderr of "N/A" below two rows as lm-eval writes it; ``configs``, ``versions``, ``n-shot``, ``higher_is_better``,
  ``n-samples``, ``config``, the model's names, ``date``, ``task_hashes``; and an ``mlxbatch`` block (answered rows,
  errors, majority baseline: lm-eval has no such figures).
- ``<to>/<model>/samples_<task>_<date>.jsonl``: one line per graded row: ``doc_id`` (its position in
  results.parquet), ``doc`` (its id and input columns), ``target``, ``arguments`` (``gen_args_<i>`` ->
  ``arg_0`` the prompt, ``arg_1`` candidate i / the sampling parameters), ``resps`` / ``filtered_resps`` (a
  candidate's ``[logprob, is_greedy]``, a generated text; strings, as lm-eval's ``sanitize_list`` writes them),
  ``filter``, ``metrics``, the three hashes and the per-row metrics (1.0 / 0.0). An error row has empty ``resps``
  and scores 0: lm-eval has no error rows, and every row counts (``report.metrics``).

The figures are ``report.metrics``'s, so the export, report.json and ``run`` agree. The prompt is the kept one
(``output.keep_prompt``), else re-rendered from the job the folder recorded: a chat prompt then is its messages as
JSON, the chat template not applied (keep the prompt for the exact text).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from mlxbatch.errors import MlxbatchError
from mlxbatch.io.atomic import atomic_write_json, atomic_writer
from mlxbatch.job.report.metrics import evaluate
from mlxbatch.job.report.show import results_path
from mlxbatch.job.report.status import prepared_rows, recorded_job

FORMATS = ("lm-eval",)
_INVALID = "[invalid]"  # lm-eval's regex filter fallback: nothing extracted


@dataclass(frozen=True)
class Exported:
    results: Path
    samples: Path
    rows: int  # sample lines: the graded rows


def hash_string(text: str) -> str:
    """lm-eval's ``hash_string`` (``lm_eval/utils.py``)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sanitize_model_name(name: str) -> str:
    return re.sub(r"[\"<>:/|\\?*\[\]]+", "__", name)


def _date_id(report: dict[str, Any]) -> tuple[str, float]:
    """lm-eval's ``date_id`` (ISO time, ':' as '-') and timestamp of the run that wrote the results."""
    try:
        when = dt.datetime.strptime(str(report.get("finished_at")), "%Y-%m-%dT%H:%M:%S%z")
    except ValueError:
        when = dt.datetime.now().astimezone()
    return when.replace(tzinfo=None).isoformat().replace(":", "-"), when.timestamp()


def _prompts(out_dir: Path, keys: set[str]) -> dict[str, str]:
    """The prompts of these rows re-rendered from the job the folder recorded ({} when it recorded none)."""
    spec, recorded = recorded_job(out_dir)
    if spec is None:
        return {}
    found: dict[str, str] = {}
    for prep in prepared_rows(spec, str(recorded.get("model_identity") or ""), recorded):
        if prep.key in keys and prep.prompt is not None:
            found[prep.key] = prep.prompt if isinstance(prep.prompt, str) else \
                json.dumps(list(prep.prompt), ensure_ascii=False)
    return found


def _sample(i: int, r: dict[str, Any], doc_columns: list[str], prompt: str, score: bool,
            filter_name: str) -> dict[str, Any]:
    doc = {c: r[c] for c in doc_columns}
    target = str(r.get("target"))
    right = 1.0 if r.get("correct") else 0.0
    if score:
        cands = r.get("candidates") or []
        pairs = [[str(s), str(g)] for s, g in zip(r.get("scores") or [], r.get("greedy") or [])]
        arguments = {f"gen_args_{j}": {"arg_0": prompt, "arg_1": c} for j, c in enumerate(cands)}
        resps, filtered = [[p] for p in pairs], pairs
        metrics = {"acc": right, "acc_norm": 1.0 if r.get("correct_norm") else 0.0}
    else:
        ran = r.get("text") is not None  # an error row of an unparsed output still has its text
        arguments = {"gen_args_0": {"arg_0": prompt, "arg_1": json.loads(r.get("params") or "{}")}}
        answer = r.get("extracted") if "extracted" in r else r.get("text")
        resps = [list(r.get("samples") or [r.get("text")])] if ran else []
        filtered = [_INVALID if answer is None else answer] if ran else []
        metrics = {"exact_match": right}
    return {"doc_id": i, "doc": doc, "target": target, "arguments": arguments, "resps": resps,
            "filtered_resps": filtered, "filter": filter_name, "metrics": list(metrics),
            "doc_hash": hash_string(json.dumps(doc, indent=2, ensure_ascii=False, default=str)),
            "prompt_hash": hash_string(prompt), "target_hash": hash_string(target), **metrics}


def _rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with pq.ParquetFile(path) as pf:
        i = 0
        for batch in pf.iter_batches():
            for r in batch.to_pylist():
                yield i, r
                i += 1


def export_lm_eval(target: Path, out: Path | None = None, task: str | None = None) -> Exported:
    """Write the lm-eval results and samples files of an output folder (or of a job file's) under ``out``
    (default: the folder's ``lm-eval``); ``task``: the task's name (default: the job file's name)."""
    path = results_path(target)
    folder = path.parent
    out = out if out is not None else folder / "lm-eval"
    acc = evaluate(path)
    if acc is None or not acc["rows"]:
        raise MlxbatchError(f"{path}: no graded rows to export: an eval job names its answers (score.answer, or "
                            "output.gold for a generate job)")
    try:
        report = json.loads((folder / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        report = {}
    names = pq.read_schema(path).names
    score = "choice" in names
    task = re.sub(r"\W", "_", task or Path(str(report.get("job") or folder.name)).stem)
    model = (report.get("model") or {}).get("path") or "mlxbatch"
    date_id, stamp = _date_id(report)
    doc_columns = names[:1] + names[2:names.index("text")]  # id, then the input columns
    filter_name = "extract" if "extracted" in names else "none"
    metric_names = ["acc", "acc_norm"] if score else ["exact_match"]

    kept: dict[str, str] = {}
    if "rendered_prompt" not in names:
        keys = {r["key"] for _, r in _rows(path) if r.get("correct") is not None}
        kept = _prompts(folder, keys)
    dest = out / sanitize_model_name(model)
    dest.mkdir(parents=True, exist_ok=True)
    samples_path = dest / f"samples_{task}_{date_id}.jsonl"
    hashes, lines = [], 0
    with atomic_writer(samples_path, text=True) as f:
        for i, r in _rows(path):
            if r.get("correct") is None:  # not graded: no gold answer, or no result
                continue
            prompt = r.get("rendered_prompt") if "rendered_prompt" in names else kept.get(r["key"])
            s = _sample(i, r, doc_columns, prompt or "", score, filter_name)
            hashes.append(s["doc_hash"] + s["prompt_hash"] + s["target_hash"])
            f.write(json.dumps(s, ensure_ascii=False, default=str) + "\n")
            lines += 1

    figures = {"acc": ("accuracy", "accuracy_stderr"), "acc_norm": ("acc_norm", "acc_norm_stderr"),
               "exact_match": ("accuracy", "accuracy_stderr")}
    metrics: dict[str, Any] = {"name": task, "alias": task, "sample_len": acc["rows"]}
    for m in metric_names:
        value, err = figures[m]
        metrics[f"{m},{filter_name}"] = acc[value]
        metrics[f"{m}_stderr,{filter_name}"] = acc[err] if acc[err] is not None else "N/A"
    results = {
        "results": {task: metrics},
        "group_subtasks": {task: []},
        "configs": {task: {"task": task, "output_type": "multiple_choice" if score else "generate_until",
                           "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                                           for m in metric_names],
                           "metadata": {"mlxbatch_job": report.get("job")}}},
        "versions": {task: None},
        "n-shot": {task: 0},  # a job's few-shot examples are part of its prompt: mlxbatch does not count them
        "higher_is_better": {task: {m: True for m in metric_names}},
        "n-samples": {task: {"original": pq.read_metadata(path).num_rows, "effective": acc["rows"]}},
        "config": {"model": "mlxbatch", "model_args": f"pretrained={model}",
                   "model_dtype": (report.get("model") or {}).get("dtype"), "device": report.get("device"),
                   "batch_size": None, "limit": None, "bootstrap_iters": 0},
        "model_source": "mlxbatch", "model_name": model, "model_name_sanitized": sanitize_model_name(model),
        "date": stamp,
        "task_hashes": {task: hash_string("".join(hashes))},
        "total_evaluation_time_seconds": str((report.get("last_work_run") or {}).get("wall_s", "")),
        "mlxbatch": {"results": str(path), **{k: acc.get(k) for k in (
            "rows", "answered", "accuracy_of_answered", "errors", "not_graded", "majority_label",
            "majority_baseline", "warning") if k in acc}},
    }
    results_file = dest / f"results_{date_id}.json"
    atomic_write_json(results_file, results)
    return Exported(results_file, samples_path, lines)
