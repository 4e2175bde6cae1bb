"""Grading: the one definition of whether a row's answer is right, for both task kinds.

Owns the rules that ``correct`` (and ``correct_norm``, ``target``, ``extracted``) follow, used when a row finishes
(``rows.tasks.record_for``) and again for every row when the results are written (``recompute_columns``: the gold and
answer columns are not part of the result key, so grading always reads the input as it is now):

- A row whose job checks answers and that failed (an error row: a bad line, a render error, no candidates, a
  constrained output cut short) is **wrong**, never left out: a model that fails the format more often must not
  score higher. A row that ran but has no gold value is not graded (``correct`` null). A row without a result
  (not run yet) is not graded either.
- ``score``: the best candidate by summed log-likelihood is ``choice``; ``choice_norm`` is the best by
  log-likelihood per character of the candidate's label (lm-evaluation-harness's ``acc_norm``: the length of
  the choice without the target delimiter, ``lm_eval/api/task.py``, ``process_results``, multiple_choice). A
  candidate's *label* is its text stripped of surrounding whitespace (``" C"`` -> ``"C"``): ``text``, and what a
  text answer is compared with. ``target`` is the right candidate's index (null when the answer names none).
- ``generate``: the graded text is the whole text, or what ``output.extract`` (a regex; its first group, at its
  first or last match) finds in it (none found: wrong). It equals the gold when both, stripped and case-folded,
  are the same. A row cut by ``max_tokens`` (``finish_reason`` ``length``) is wrong unless
  ``output.grade_truncated`` is true: its answer may be the start of another one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mlxbatch.job.spec.task import Extract

CUT = "length"  # the finish reason of a row cut by max_tokens

Row = Mapping[str, Any]  # a row's result: text, error, finish_reason and its extra values (choice, candidates...)
Recompute = dict[str, Callable[[Row, Row], Any]]  # column -> value(inputs, result), in order


def label(candidate: str) -> str:
    """A candidate as an answer reads: without the whitespace that joins it to the context."""
    return candidate.strip()


def norm_length(candidate: str) -> int:
    """The length acc_norm divides by: the label's characters (a whitespace-only candidate: its own)."""
    return len(label(candidate)) or len(candidate)


def best(values: Sequence[float]) -> int:
    """The index of the largest value, the first on a tie (``numpy.argmax``)."""
    return max(range(len(values)), key=values.__getitem__)


def choices(candidates: Sequence[str], sums: Sequence[float]) -> tuple[int, int]:
    """(choice, choice_norm) of a score row."""
    return best(sums), best([s / norm_length(c) for s, c in zip(sums, candidates)])


def answer_index(answer: Any, candidates: Sequence[str] | None) -> int | None:
    """The right candidate's index: ``answer`` is an index, or a text equal to a candidate's label."""
    if answer is None or isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return answer if candidates is None or 0 <= answer < len(candidates) else None
    if isinstance(answer, float) and answer.is_integer():  # an integer column with nulls, as pandas stores it
        return answer_index(int(answer), candidates)
    want = label(str(answer))
    return next((i for i, c in enumerate(candidates or ()) if label(c) == want), None)


def _graded(result: Row) -> bool | None:
    """False for an error row, None for a row without a result; True when it is to be graded."""
    if result.get("error") is not None:
        return False
    return None if result.get("text") is None else True


def score_target(answer: Any, result: Row) -> int | None:
    return answer_index(answer, result.get("candidates"))


def score_correct(answer: Any, result: Row, pick: str = "choice") -> bool | None:
    """Whether a score row's ``pick`` (``choice`` or ``choice_norm``) is its answer."""
    graded = _graded(result)
    if graded is not True:
        return graded
    if answer is None:
        return None
    if result.get(pick) is None:  # a row written before choice_norm existed
        return None
    return answer_index(answer, result.get("candidates")) == result[pick]


def graded_text(text: str | None, extract: Extract | None) -> str | None:
    """What a generate row's answer is taken to be."""
    if text is None:
        return None
    return extract.find(text) if extract is not None else text


def same(answer: str, gold: Any) -> bool:
    return answer.strip().casefold() == str(gold).strip().casefold()


def generate_correct(gold: Any, result: Row, extract: Extract | None, grade_truncated: bool) -> bool | None:
    graded = _graded(result)
    if graded is not True:
        return graded
    if gold is None:
        return None
    if result.get("finish_reason") == CUT and not grade_truncated:
        return False
    answer = graded_text(result.get("text"), extract)
    return answer is not None and same(answer, gold)


def recompute_columns(kind: str, column: str | None, extract: Extract | None = None,
                      grade_truncated: bool = False) -> Recompute | None:
    """finalize's recomputed columns of a job whose ``column`` (score.answer / output.gold) holds the answers
    (None: the job grades nothing). Each value is computed from the row's current inputs and its result."""
    if column is None:
        return None
    if kind == "score":
        return {"target": lambda i, r: score_target(i.get(column), r),
                "correct": lambda i, r: score_correct(i.get(column), r),
                "correct_norm": lambda i, r: score_correct(i.get(column), r, "choice_norm")}
    out: Recompute = {}
    if extract is not None:
        out["extracted"] = lambda i, r: graded_text(r.get("text"), extract)
    out["target"] = lambda i, r: None if i.get(column) is None else str(i.get(column))
    out["correct"] = lambda i, r: generate_correct(i.get(column), r, extract, grade_truncated)
    return out
