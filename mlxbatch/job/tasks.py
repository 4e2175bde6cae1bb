"""What a row asks of the engine, and what the engine's output becomes in the results.

Owns the two task kinds of a job. ``generate``: text, with ``n`` samples as a list column and, under an output
constraint, a check that the text really matches (JSON parsed into a ``parsed`` column); a row whose output
still does not parse (cut by ``max_tokens``) is an error row of kind ``truncated`` or ``unparsed`` that keeps
its text. ``score``: the log-likelihood of each candidate continuation (``scores``: sums, ``token_logprobs``,
``greedy``), the best candidate as ``text`` and its index as ``choice``, and ``correct`` when the row names
its answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from mlxbatch.engine import EngineCore
from mlxbatch.errors import InvalidRequestError
from mlxbatch.io import ResultRecord
from mlxbatch.job.media import encode_row
from mlxbatch.job.prepare import PreparedRow
from mlxbatch.types import FinishReason, OutputConstraint, RequestOutput, SamplingParams


@dataclass(frozen=True)
class RowTask:
    """What one row asks of an engine: everything the engine needs and nothing more (no input columns), so it
    can cross to an engine in another process. The engine's request id is the row's result key."""

    key: str
    row_id: str  # for error messages
    token_ids: list[int] | None  # None for a row with images: it is encoded when submitted
    params: SamplingParams
    cache_tokens: int | None = None  # the plan's retention (None when planning is off)
    candidates: tuple[str, ...] | None = None  # task score
    prompt: Any = None  # rows with images only: the rendered prompt the images go with
    images: tuple[Any, ...] = ()  # io.images.ImageRef

    @classmethod
    def of(cls, prep: PreparedRow, token_ids: list[int] | None, cache_tokens: int | None) -> RowTask:
        return cls(prep.key, prep.row_id, token_ids, prep.params, cache_tokens, prep.candidates,
                   prep.prompt if prep.images else None, prep.images)


def submit(core: EngineCore, task: RowTask) -> None:
    """Queue one row. Raises InvalidRequestError when the engine rejects it, ImageError when an image does not
    decode (the caller records a row error). Rows with images are encoded here, as they are submitted, so only
    the rows in flight hold decoded pictures."""
    if task.images:
        if task.candidates is not None:
            raise InvalidRequestError("images", len(task.images), "task score takes text rows only")
        core.add_request(encode_row(core, task.prompt, task.images), task.params, request_id=task.key)
        return
    assert task.token_ids is not None
    if task.candidates is not None:
        core.add_score_request(task.token_ids, task.candidates, request_id=task.key)
    else:
        core.add_request(task.token_ids, task.params, request_id=task.key, cache_tokens=task.cache_tokens)


def _check(text: str, constraint: OutputConstraint, finish: FinishReason | None,
           max_tokens: int) -> tuple[Any, str | None, str | None]:
    """(parsed value, error, error kind) of a constrained output."""
    cut = finish is FinishReason.LENGTH
    why = f"the output was cut by max_tokens={max_tokens} before it was complete" if cut else None
    if constraint.kind == "json_schema":
        try:
            return json.loads(text), None, None
        except json.JSONDecodeError as exc:
            return None, why or f"the output is not valid JSON: {exc}", "truncated" if cut else "unparsed"
    ok = text in constraint.value if constraint.kind == "choice" else re.fullmatch(str(constraint.value), text)
    if ok:
        return None, None, None
    return None, why or f"the output does not match the {constraint.kind}", "truncated" if cut else "unparsed"


def _correct(answer: Any, candidates: tuple[str, ...], choice: int) -> bool | None:
    if answer is None:
        return None
    if isinstance(answer, int) and not isinstance(answer, bool):
        return answer == choice
    return str(answer) in (candidates[choice], candidates[choice].strip())


def record_for(prep: PreparedRow, out: RequestOutput, model: str) -> ResultRecord:
    """The result record of a finished row."""
    t = out.timings
    common = dict(row_id=prep.row_id, key=prep.key, inputs=prep.inputs, prompt_tokens=out.prompt_tokens,
                  latency_s=t.total, ttft_s=t.time_to_first_token, model=model, params=prep.params_json)
    extra: dict[str, Any] = {}
    if prep.candidates is not None:
        sums = [c.cumulative_logprob or 0.0 for c in out.completions]
        choice = max(range(len(sums)), key=sums.__getitem__)
        extra = {"scores": sums, "token_logprobs": [[lp.logprob for lp in c.logprobs or ()] for c in out.completions],
                 "greedy": [bool(c.greedy) for c in out.completions], "choice": choice}
        correct = _correct(prep.answer, prep.candidates, choice)
        if correct is not None:
            extra["correct"] = correct
        return ResultRecord(**common, text=prep.candidates[choice], finish_reason="stop", extra=extra)
    error = kind = None
    if len(out.completions) > 1:
        extra["samples"] = [c.text for c in out.completions]
    constraint = prep.params.constraint
    if constraint is not None:
        parsed, error, kind = _check(out.text, constraint, out.finish_reason, prep.params.max_tokens)
        if constraint.kind == "json_schema" and parsed is not None:
            extra["parsed"] = parsed
    return ResultRecord(**common, text=out.text, finish_reason=out.finish_reason.value if out.finish_reason else None,
                        generated_tokens=out.generated_tokens, logprobs=out.logprobs, error=error, error_kind=kind,
                        extra=extra)
