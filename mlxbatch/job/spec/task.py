"""The job file's task and what it asks of each row's output: ``task``, ``score`` and ``output``'s per-row keys (the
constraint: choice / regex / json_schema, or a row column holding one; the gold column, and how a generated answer is
graded against it; keeping the prompt).

Owns the ``TaskSection``, its parser (reporting to the spec's ``Checker`` like every other section) and
``constraint_from``, which reads a constraint the same way from the job file and from a row's column (``job.rows.prepare``).
Kept apart from ``job.spec.sections`` (the other single-machine sections): the task spans three top-level keys and
the checks between them (a score task generates no text to constrain).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from mlxbatch.errors import InvalidRequestError
from mlxbatch.job.spec.checker import Checker
from mlxbatch.types import CONSTRAINT_KINDS, OutputConstraint


@dataclass(frozen=True)
class Extract:
    """``output.extract``: where the answer is in a generated text (``rows.grade`` applies it)."""

    regex: str
    last: bool = False  # the last match instead of the first

    def find(self, text: str) -> str | None:
        """The first group of the first (or last) match, or the whole match for a regex without a group."""
        pattern = re.compile(self.regex)
        if self.last:
            *_, m = [None, *pattern.finditer(text)]
        else:
            m = pattern.search(text)
        if m is None:
            return None
        return m.group(1) if pattern.groups else m.group(0)


@dataclass(frozen=True)
class TaskSection:
    """What each row asks for: generated text (optionally constrained) or scores of candidate continuations."""

    kind: str = "generate"  # generate | score
    constraint: OutputConstraint | None = None  # output.choice / output.regex / output.json_schema
    constraint_column: str | None = None  # a row column holding {choice: [...]} | {regex: ...} | {json_schema: ...}
    candidates: tuple[str, ...] | None = None  # score.candidates given as a list
    candidates_column: str | None = None  # score.candidates given as a column name
    answer_column: str | None = None  # score.answer: the right candidate (its index or its text), for accuracy
    gold_column: str | None = None  # output.gold: the expected text of a generate row, for accuracy
    keep_prompt: bool = False  # output.keep_prompt: store the prompt the model saw in a ``prompt`` column
    extract: Extract | None = None  # output.extract: the answer's place in a generated text, graded against the gold
    grade_truncated: bool = False  # output.grade_truncated: grade rows cut by max_tokens (default: they are wrong)


def constraint_from(value: Any, where: str) -> OutputConstraint:
    """An OutputConstraint from a mapping with exactly one of choice / regex / json_schema (job file or row)."""
    if not isinstance(value, dict):
        raise InvalidRequestError(where, value, "expected a mapping with one of choice, regex, json_schema")
    given = [k for k in CONSTRAINT_KINDS if value.get(k) is not None]
    if len(given) != 1:
        raise InvalidRequestError(where, sorted(value), "give exactly one of choice, regex, json_schema")
    kind = given[0]
    v = value[kind]
    if kind == "json_schema":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"{where}.json_schema", v[:60], f"not valid JSON: {exc}") from exc
        if not isinstance(v, dict):
            raise InvalidRequestError(f"{where}.json_schema", v, "expected a JSON schema object")
        return OutputConstraint.json_schema(v)
    try:
        return OutputConstraint(kind, v)
    except InvalidRequestError as exc:  # name the key as the user wrote it, not the engine's field
        raise InvalidRequestError(f"{where}.{kind}", exc.value, exc.reason) from None


def parse_task(c: Checker, raw: dict[str, Any], out: dict[str, Any]) -> TaskSection:
    """``task``, ``score`` and what ``output`` (the section ``out``) asks of each row: its constraint, gold column,
    kept prompt."""
    kind = c.typed(raw, "<top>", "task", str, "generate")
    if kind not in ("generate", "score"):
        c.bad("task", f"expected generate or score, got {kind!r}")
    constraint = None
    if any(out.get(k) is not None for k in CONSTRAINT_KINDS):
        try:
            constraint = constraint_from({k: out.get(k) for k in CONSTRAINT_KINDS}, "output")
        except InvalidRequestError as exc:
            c.bad(exc.field, exc.reason)
    column = c.typed(out, "output", "constraint_column", str, None)
    s = c.section(raw, "score")
    cands = s.get("candidates")
    candidates = candidates_column = None
    if isinstance(cands, str):
        candidates_column = cands
    elif isinstance(cands, list) and cands and all(isinstance(x, str) and x for x in cands):
        candidates = tuple(cands)
    elif cands is not None:
        c.bad("score.candidates", "expected a non-empty list of non-empty strings, or a column name")
    answer = c.typed(s, "score", "answer", str, None)
    if kind == "score":
        if cands is None:
            c.bad("score.candidates", "required when task is score (a list, or the column holding each row's list)")
        if constraint is not None or column is not None:
            c.bad("output", "choice / regex / json_schema constrain generated text; task score generates none")
    elif s:
        c.bad("score", "only used with task: score")
    gold = c.typed(out, "output", "gold", str, None)
    if kind == "score" and gold is not None:
        c.bad("output.gold", "task score names its answer column in score.answer")
    extract = _extract(c, out.get("extract"))
    grade_truncated = c.typed(out, "output", "grade_truncated", bool, False)
    for key, given in (("extract", extract is not None), ("grade_truncated", "grade_truncated" in out)):
        if given and gold is None:
            c.bad(f"output.{key}", "grades generated answers against output.gold: set output.gold (the column "
                                   "with each row's right answer)" + (" (task score grades by score.answer)"
                                                                      if kind == "score" else ""))
    return TaskSection(kind, constraint, column, candidates, candidates_column, answer, gold,
                       c.typed(out, "output", "keep_prompt", bool, False), extract, grade_truncated)


def _extract(c: Checker, value: Any) -> Extract | None:
    """``output.extract``: a regex, or ``{regex: .., match: first | last}``."""
    if value is None:
        return None
    spec = {"regex": value} if isinstance(value, str) else value
    if not isinstance(spec, dict) or not isinstance(spec.get("regex"), str) or not spec["regex"]:
        c.bad("output.extract", "expected a regex, or {regex: <regex>, match: first | last} (the answer is the "
                                "regex's first group, or the whole match when it has no group)")
        return None
    for key in spec:
        if key not in ("regex", "match"):
            c.bad(f"output.extract.{key}", "unknown key (expected one of: match, regex)")
    match = spec.get("match", "first")
    if match not in ("first", "last"):
        c.bad("output.extract.match", f"expected first or last, got {match!r}")
    try:
        re.compile(spec["regex"])
    except re.error as exc:
        c.bad("output.extract.regex", f"not a valid regular expression: {exc}")
        return None
    return Extract(spec["regex"], match == "last")
