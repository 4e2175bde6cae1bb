"""The evaluation figures of a job's results: accuracy over every graded row with its standard error, acc_norm,
the answers' label distribution and the majority-class baseline.

Owns what the figures mean and how they read, so report.json, the ``run`` line, ``show``, ``status`` and ``export``
agree: all are computed here from results.parquet (streamed by row group) and worded by ``summary_line``.

- **Over every row.** ``accuracy`` = correct / ``rows``, the rows graded: every row with a gold answer, and every
  error row, counted wrong (``rows.grade``). lm-evaluation-harness scores every document; a model that fails the
  format more often must not score higher. ``answered`` (graded rows without an error) and
  ``accuracy_of_answered`` (correct / answered) stand beside it, named as what they are.
- **Standard error.** lm-eval's sample standard error of a mean (``mean_stderr``: the sample standard deviation,
  n - 1, over sqrt(n); ``lm_eval/api/metrics.py``), None for fewer than two rows.
- **acc_norm** (score jobs): ``correct_norm``, the pick by log-likelihood per character of the candidate's label.
- **Labels.** The predicted labels of the answered rows (a score row's chosen candidate; a generate row's graded
  text), the gold labels' majority class and its share of the graded rows (``majority_baseline``: what always
  answering it scores), and a warning when more than 90% of 10 or more answers are one label.
"""

from __future__ import annotations

import collections
import math
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from mlxbatch.job.rows.grade import label

COLLAPSE_SHARE = 0.9  # more of the answers than this are one label: the predictions collapsed
COLLAPSE_MIN_ROWS = 10  # fewer answers say nothing about a collapse
TOP_LABELS = 12
NO_ANSWER = "(nothing extracted)"  # a generate row whose output.extract found no answer


def mean_stderr(correct: int, n: int) -> float | None:
    """lm-eval's ``mean_stderr`` of n values of which ``correct`` are 1 and the rest 0."""
    if n < 2:
        return None
    p = correct / n
    return math.sqrt(p * (1 - p) / (n - 1))


def _answer_key(r: dict[str, Any]) -> Any:
    """A row's answer as a label: a score row's choice (an index), a generate row's graded text (case-folded)."""
    if "choice" in r:
        return r.get("choice")
    value = r.get("extracted") if "extracted" in r else r.get("text")
    return NO_ANSWER if value is None else str(value).strip().casefold()


def _gold_key(r: dict[str, Any]) -> Any:
    value = r.get("target")
    return value if value is None or "choice" in r else str(value).strip().casefold()


def _named(counts: collections.Counter[Any], shared: list[str] | None) -> collections.Counter[str]:
    """Labels by name: a score row's choice as its candidate's label when every row has the same candidates,
    else as its position."""
    out: collections.Counter[str] = collections.Counter()
    for key, n in counts.items():
        if not isinstance(key, int):
            out[key] += n
        else:
            out[label(shared[key]) if shared is not None and 0 <= key < len(shared) else f"choice {key}"] += n
    return out


def evaluate(results: Path, *, with_missing: bool = True) -> dict[str, Any] | None:
    """The evaluation figures of a results file (None when its job grades nothing). ``with_missing`` False: rows
    without a result (error_kind "missing") are left out, as ``report.summarize_results`` leaves them."""
    names = pq.read_schema(results).names
    if "correct" not in names:
        return None
    wanted = [c for c in ("text", "finish_reason", "error", "error_kind", "correct", "correct_norm", "choice",
                          "candidates", "target", "extracted") if c in names]
    rows = right = right_norm = answered = cut = ungraded = 0
    predicted: collections.Counter[Any] = collections.Counter()
    gold: collections.Counter[Any] = collections.Counter()
    shared: list[str] | None = None
    mixed = False
    with pq.ParquetFile(results) as pf:
        for batch in pf.iter_batches(columns=wanted):
            for r in batch.to_pylist():
                if r.get("error_kind") == "missing" and not with_missing:
                    continue
                if r.get("correct") is None:
                    ungraded += r.get("error_kind") != "missing"
                    continue
                rows += 1
                right += bool(r["correct"])
                right_norm += bool(r.get("correct_norm"))
                if _gold_key(r) is not None:
                    gold[_gold_key(r)] += 1
                if r.get("error") is None:
                    answered += 1
                    cut += r.get("finish_reason") == "length"
                    predicted[_answer_key(r)] += 1
                if r.get("candidates") is not None:
                    shared = r["candidates"] if shared is None else shared
                    mixed = mixed or r["candidates"] != shared
    if not rows and not ungraded:
        return None
    shared = None if mixed else shared
    return _figures(rows, right, right_norm if "correct_norm" in names else None, answered, cut, ungraded,
                    _named(predicted, shared), _named(gold, shared), score="choice" in names)


def _figures(rows: int, right: int, right_norm: int | None, answered: int, cut: int, ungraded: int,
             predicted: collections.Counter[str], gold: collections.Counter[str], score: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"metric": "acc" if score else "exact_match", "rows": rows, "correct": right,
                           "accuracy": right / rows if rows else None, "accuracy_stderr": mean_stderr(right, rows)}
    if right_norm is not None:
        out |= {"correct_norm": right_norm, "acc_norm": right_norm / rows if rows else None,
                "acc_norm_stderr": mean_stderr(right_norm, rows)}
    out |= {"answered": answered, "accuracy_of_answered": right / answered if answered else None,
            "errors": rows - answered}
    if not score:
        out["cut_by_max_tokens"] = cut
    out["not_graded"] = ungraded  # rows that ran without a gold answer
    top = predicted.most_common(TOP_LABELS)
    out["predicted_labels"] = dict(top) | ({"(others)": sum(predicted.values()) - sum(v for _, v in top)}
                                           if len(predicted) > TOP_LABELS else {})
    if gold:
        majority, count = gold.most_common(1)[0]
        out |= {"majority_label": majority, "majority_baseline": count / rows}
    if answered >= COLLAPSE_MIN_ROWS and top and top[0][1] > COLLAPSE_SHARE * answered:
        out["warning"] = (f"{top[0][1] / answered:.0%} of the answers are {top[0][0]!r}: the predictions collapsed "
                          f"to one label" + (f" (majority baseline {out['majority_baseline']:.1%})"
                                             if "majority_baseline" in out else ""))
    return out


def _pm(value: float | None, err: float | None) -> str:
    return "-" if value is None else f"{value:.1%}" + (f" ± {err:.1%}" if err is not None else "")


def summary_line(acc: dict[str, Any]) -> str:
    """The figures in one line (the ``run`` line, ``show``, ``status``): ``accuracy`` whatever the job's metric
    (a generate job's is lm-eval's exact_match)."""
    parts = [f"accuracy {_pm(acc.get('accuracy'), acc.get('accuracy_stderr'))} ({acc['correct']}/{acc['rows']} rows"
             + (f", errors counted wrong; {_pm(acc.get('accuracy_of_answered'), None)} of the {acc['answered']} "
                f"answered" if acc.get("errors") else "") + ")"]
    if "acc_norm" in acc:
        parts.append(f"acc_norm {_pm(acc['acc_norm'], acc.get('acc_norm_stderr'))}")
    if acc.get("majority_baseline") is not None:
        parts.append(f"majority baseline {acc['majority_baseline']:.1%}")
    if acc.get("cut_by_max_tokens"):
        parts.append(f"{acc['cut_by_max_tokens']} cut by max_tokens")
    return ", ".join(parts)
