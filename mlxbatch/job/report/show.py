"""``mlxbatch show``: a look at a job's results: a few rows and a summary.

Owns what a user checks first after a run: for a few rows, the prompt (when ``output.keep_prompt`` kept it; a long
one as its start and its end, where the row's own text is; else the row's input columns), the output, whether a graded
row is correct, and the error; then the rows' finish reasons, error kinds, the distribution of labels (the ``parsed``
values of choice / regex outputs, or the chosen candidate of a score task) and the evaluation figures of a graded job (``report.metrics``: accuracy over every row,
its standard error, acc_norm, the majority baseline). Reads results.parquet (streamed by row group) or, before a
run has written it (stopped, killed, or still going), the current rows checkpointed so far
(``status.current_records``), marked partial; loads no model.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mlxbatch.errors import MlxbatchError
from mlxbatch.io import input_column_names
from mlxbatch.io.output_folder import RESULTS_NAME
from mlxbatch.job.report.metrics import evaluate, summary_line
from mlxbatch.job.report.status import current_records

TOP_LABELS = 12
_WIDTH = 400


_PROMPT_HEAD, _PROMPT_TAIL = 100, 400  # a kept prompt's start, and its end: the row's own part
_INPUT_WIDTH = 200  # an input column's value, shown when the prompt is not kept


def _cut(value: Any, width: int = _WIDTH) -> str:
    text = str(value)
    return text if len(text) <= width else text[:width] + f"... ({len(text)} characters)"


def _cut_prompt(prompt: str) -> str:
    """A long prompt's head and its tail: a shared system prompt comes first, the row's own text last (before the
    chat template's assistant header), so the tail is what tells the rows apart."""
    left_out = len(prompt) - _PROMPT_HEAD - _PROMPT_TAIL
    if left_out <= 0:
        return prompt
    return f"{prompt[:_PROMPT_HEAD]} [... {left_out} of {len(prompt)} characters ...] {prompt[-_PROMPT_TAIL:]}"


def _job_output(target: Path) -> Path:
    """The output folder a job file names; any other target as it is."""
    if target.is_file() and target.suffix in (".yaml", ".yml"):
        from mlxbatch.job.spec import load_job

        return load_job(target).output
    return target


def results_path(target: Path) -> Path:
    """results.parquet of an output folder, or of the output folder a job file names."""
    target = _job_output(target)
    path = target / RESULTS_NAME if target.is_dir() else target
    if not path.exists():
        raise MlxbatchError(f"{path}: no results yet (a run writes them when every row is done; "
                            "`mlxbatch status` shows how far it got)")
    return path


def _row_lines(r: dict[str, Any], inputs: Mapping[str, Any] | None = None) -> list[str]:
    """A shown row: its prompt if kept, else its ``inputs`` (column -> value); its output, whether it is correct, its
    error."""
    lines = [f"--- {r['id']}"]
    if r.get("rendered_prompt") is not None:
        lines.append(f"prompt: {_cut_prompt(str(r['rendered_prompt']))}")
    elif inputs:
        lines.append("input: " + " | ".join(f"{c}: {_cut(v, _INPUT_WIDTH)}" for c, v in inputs.items()))
    correct = "" if r.get("correct") is None else f"  correct: {'yes' if r['correct'] else 'no'}"
    lines.append(f"output: {_cut(r.get('text'))!s}  [{r.get('finish_reason')}]{correct}")
    if r.get("error") is not None:
        lines.append(f"error ({r.get('error_kind')}): {_cut(r['error'], 240)}")
    return lines


def show(target: Path, n: int = 5) -> str:
    folder = _job_output(target)
    if folder.is_dir() and not (folder / RESULTS_NAME).exists() and (
            (folder / "manifest.json").exists() or (folder / "shards").is_dir()):
        return _show_partial(target, n)
    path = results_path(target)
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    label_col = "parsed" if "parsed" in names and pa.types.is_string(pf.schema_arrow.field("parsed").type) else \
        "text" if "choice" in names else None
    inputs = [] if "rendered_prompt" in names else input_column_names(names)
    wanted = [c for c in ("id", "rendered_prompt", *inputs, "text", "finish_reason", "correct", "error", "error_kind",
                          label_col) if c is not None and c in names]
    rows = finish = 0
    finishes: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    labels: collections.Counter[str] = collections.Counter()
    lines: list[str] = []
    for batch in pf.iter_batches(columns=list(dict.fromkeys(wanted))):
        for r in batch.to_pylist():
            rows += 1
            finishes[r.get("finish_reason") or "?"] += 1
            if r.get("error") is not None:
                kinds[r.get("error_kind") or "error"] += 1
            elif label_col is not None and r.get(label_col) is not None:
                labels[str(r[label_col])] += 1
            if rows <= n:
                lines += _row_lines(r, {c: r[c] for c in inputs})
    finish = sum(finishes.values())
    lines.append(f"=== {path}: {rows} rows")
    lines.append("finish reasons: " + ", ".join(f"{k} {v}" for k, v in finishes.most_common()) if finish else
                 "finish reasons: -")
    lines.append("errors: " + (", ".join(f"{k} {v}" for k, v in kinds.most_common()) if kinds else "none"))
    acc = evaluate(path)
    if acc is not None and acc["rows"]:  # a graded job: its answers' labels (a score row's by position when the
        # rows' candidates differ), its figures and its warning
        lines.append("labels: " + ", ".join(f"{k!r} {v}" for k, v in acc["predicted_labels"].items()))
        lines.append(summary_line(acc))
        if acc.get("warning"):
            lines.append(f"warning: {acc['warning']}")
    elif labels:
        top = labels.most_common(TOP_LABELS)
        rest = sum(labels.values()) - sum(v for _, v in top)
        lines.append("labels: " + ", ".join(f"{k!r} {v}" for k, v in top) + (f", others {rest}" if rest else ""))
    if "rendered_prompt" not in names:
        lines.append("(prompts are not kept: set output.keep_prompt: true to store what the model saw)")
    folder = path.parent  # an output folder (its manifest) whose last run did not complete
    if (folder / "manifest.json").exists() and not (folder / "_SUCCESS").exists():
        lines.insert(0, f"note: no _SUCCESS in {folder}: its last run did not complete (stopped, failed or still "
                        "going), so these results may be an earlier run's (other parameters or input); "
                        "`mlxbatch status` counts the current rows")
    return "\n".join(lines)


def _show_partial(target: Path, n: int) -> str:
    """A folder whose run has not written results.parquet yet (stopped, killed, or still going): the current rows
    checkpointed so far, in input order, under "partial"; finish reasons, error kinds and labels over them (the
    evaluation figures come with the results). Read-only, like ``status``."""
    c = current_records(target, detail=True)
    finishes: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    labels: collections.Counter[str] = collections.Counter()
    lines: list[str] = []
    kept_prompts = False
    for i, r in enumerate(c.current):
        extra = json.loads(r.extra) if r.extra else {}
        kept_prompts = kept_prompts or "rendered_prompt" in extra
        finishes[r.finish_reason or "?"] += 1
        label = extra.get("parsed") if isinstance(extra.get("parsed"), str) else r.text if "choice" in extra else None
        if r.error is not None:
            kinds[r.error_kind or "error"] += 1
        elif label is not None:
            labels[str(label)] += 1
        if i < n:
            lines += _row_lines({"id": r.row_id, "rendered_prompt": extra.get("rendered_prompt"), "text": r.text,
                                 "finish_reason": r.finish_reason, "correct": extra.get("correct"), "error": r.error,
                                 "error_kind": r.error_kind}, json.loads(r.inputs) if r.inputs else None)
    total = c.total if c.total is not None else "?"
    lines.insert(0, f"partial: {len(c.current)} of {total} rows finished (no results.parquet yet: the run stopped or "
                    f"is still going; these are the rows it checkpointed, counted against {c.against}; "
                    "`mlxbatch status` says more)")
    lines.append(f"=== {c.out_dir}: {len(c.current)} rows (partial)")
    lines.append("finish reasons: " + (", ".join(f"{k} {v}" for k, v in finishes.most_common()) or "-"))
    lines.append("errors: " + (", ".join(f"{k} {v}" for k, v in kinds.most_common()) if kinds else "none"))
    if labels:
        top = labels.most_common(TOP_LABELS)
        lines.append("labels: " + ", ".join(f"{k!r} {v}" for k, v in top))
    if not kept_prompts:
        lines.append("(prompts are not kept: set output.keep_prompt: true to store what the model saw)")
    return "\n".join(lines)
