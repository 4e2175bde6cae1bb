"""What a row asks of the engine, and what the engine's output becomes in the results.

Owns the two task kinds of a job, and ``RowTask``: what one row asks of an engine (it crosses to an engine in
another process; ``submit`` queues it, the plan's retention included for both kinds). ``generate``: text, with ``n``
samples as a list column and, under an output constraint, a check that the text really matches (the match in a
``parsed`` column: the JSON value, a struct typed from the schema, or the text of a choice / regex); a row whose
output still does not match (cut by ``max_tokens``) is an error row of kind ``truncated`` or ``unparsed`` that keeps
its text (an OpenAI Batch request cut by ``max_tokens`` is a reply, as the API gives it: its text, finish reason
``length``); with ``output.gold``, ``correct`` grades the text (``rows.grade``). ``score``: the log-likelihood of
each candidate continuation, with what any metric needs kept per row (``candidates`` as scored, ``scores``: their
sums, ``candidate_tokens``, ``candidate_bytes``, ``token_logprobs``, ``greedy``), the best candidate's index as
``choice`` (``choice_norm``: the best per character, for acc_norm) and its label as ``text``, and ``correct`` /
``correct_norm`` / ``target`` when the row names its answer. Also the result columns' declared types
(``output_columns``: ``cached_tokens`` for every row, the prompt tokens whose KV was reused) and the prompt text a
row's model saw (``output.keep_prompt``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from mlxbatch.engine import EngineCore
from mlxbatch.errors import InvalidRequestError
from mlxbatch.io import ResultRecord
from mlxbatch.job.rows import grade
from mlxbatch.job.rows.media import encode_row
from mlxbatch.job.rows.prepare import PreparedRow
from mlxbatch.job.spec import JobSpec, TaskSection
from mlxbatch.types import FinishReason, OutputConstraint, RequestOutput, SamplingParams

_MAX_DEPTH = 16


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
    block_hashes: list[int] | None = None  # the prompt's ``engine.prompt_block_hashes`` (text rows), made by the feed

    @classmethod
    def of(cls, prep: PreparedRow, token_ids: list[int] | None, cache_tokens: int | None,
           block_hashes: list[int] | None = None) -> RowTask:
        return cls(prep.key, prep.row_id, token_ids, prep.params, cache_tokens, prep.candidates,
                   prep.prompt if prep.images else None, prep.images, block_hashes)


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
        core.add_score_request(task.token_ids, task.candidates, request_id=task.key, cache_tokens=task.cache_tokens)
    else:
        core.add_request(task.token_ids, task.params, request_id=task.key, cache_tokens=task.cache_tokens,
                         block_hashes=task.block_hashes)


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


def _score_extra(prep: PreparedRow, out: RequestOutput) -> dict[str, Any]:
    """A score row's columns: everything a metric needs, per candidate, and the picks."""
    cands = prep.candidates or ()
    sums = [c.cumulative_logprob or 0.0 for c in out.completions]
    choice, choice_norm = grade.choices(cands, sums)
    extra: dict[str, Any] = {
        "candidates": list(cands), "scores": sums,
        "candidate_tokens": [len(c.logprobs or ()) for c in out.completions],
        "candidate_bytes": [len(c.encode("utf-8")) for c in cands],
        "token_logprobs": [[lp.logprob for lp in c.logprobs or ()] for c in out.completions],
        "greedy": [bool(c.greedy) for c in out.completions], "choice": choice, "choice_norm": choice_norm}
    if prep.answer is not None:
        result = {**extra, "text": grade.label(cands[choice]), "error": None}
        extra |= {"target": grade.score_target(prep.answer, result),
                  "correct": grade.score_correct(prep.answer, result),
                  "correct_norm": grade.score_correct(prep.answer, result, "choice_norm")}
    return extra


def record_for(prep: PreparedRow, out: RequestOutput, model: str, task: TaskSection | None = None,
               prompt: str | None = None) -> ResultRecord:
    """The result record of a finished row (``prompt``: the text the model saw, kept with output.keep_prompt).
    A score row's ``params`` is ``{}``: it samples nothing (its key still holds the job's sampling parameters, as
    it always did, so folders written before resume as they are)."""
    t = out.timings
    common = dict(row_id=prep.row_id, key=prep.key, inputs=prep.inputs, prompt_tokens=out.prompt_tokens,
                  latency_s=t.total, ttft_s=t.time_to_first_token, model=model, params=prep.params_json)
    extra: dict[str, Any] = {"cached_tokens": out.cached_tokens}  # its prompt tokens whose KV was reused
    if prompt is not None:
        extra["rendered_prompt"] = prompt
    if prep.candidates is not None:
        extra |= _score_extra(prep, out)
        return ResultRecord(**common, text=grade.label(prep.candidates[extra["choice"]]), finish_reason="stop",
                            extra=extra)
    error = kind = None
    if len(out.completions) > 1:
        extra["samples"] = [c.text for c in out.completions]
        extra["sample_finish_reasons"] = [c.finish_reason.value if c.finish_reason else None for c in out.completions]
    constraint = prep.params.constraint
    if constraint is not None:
        parsed, error, kind = _check(out.text, constraint, out.finish_reason, prep.params.max_tokens)
        if error is None:
            extra["parsed"] = parsed if constraint.kind == "json_schema" else out.text
        elif kind == "truncated" and prep.api_request:  # the API's reply: its text, finish_reason length
            error = kind = None
    finish = out.finish_reason.value if out.finish_reason else None
    if task is not None and task.gold_column is not None:
        result = {"text": out.text, "error": error, "finish_reason": finish}
        for name, value in grade.recompute_columns("generate", task.gold_column, task.extract,
                                                   task.grade_truncated).items():
            extra[name] = result[name] = value(prep.inputs, result)
    return ResultRecord(**common, text=out.text, finish_reason=finish, generated_tokens=out.generated_tokens,
                        logprobs=out.logprobs, error=error, error_kind=kind, extra=extra)


def prompt_text(spec: JobSpec, prep: PreparedRow, tokenizer: Any) -> str | None:
    """The prompt as the model saw it: a text prompt as is, chat messages through the model's chat template."""
    if prep.prompt is None:
        return None
    if isinstance(prep.prompt, str):
        return prep.prompt
    try:
        return str(tokenizer.apply_chat_template(list(prep.prompt), add_generation_prompt=True, tokenize=False))
    except Exception:  # the row failed on its template already; keep the messages readable
        return json.dumps(prep.prompt, ensure_ascii=False)


def schema_type(schema: Any, root: dict[str, Any] | None = None, depth: int = 0) -> pa.DataType:
    """The Arrow type of a JSON schema's instances: objects with properties -> structs, arrays -> lists, scalars
    -> their type; anything that cannot be one type (free objects, mixed unions) -> JSON text (string)."""
    root = root if root is not None else schema
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return pa.string()
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        node: Any = root
        for part in ref[2:].split("/"):
            node = node.get(part) if isinstance(node, dict) else None
        return schema_type(node, root, depth + 1)
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else \
        [schema["const"]] if "const" in schema else None
    if values:
        kinds = {type(v) for v in values if v is not None}
        scalar = {str: pa.string(), bool: pa.bool_(), int: pa.int64(), float: pa.float64()}
        if kinds <= {int, float} and float in kinds:
            return pa.float64()
        return scalar.get(kinds.pop(), pa.string()) if len(kinds) == 1 else pa.string()
    options = schema.get("anyOf") or schema.get("oneOf")
    kinds = schema.get("type")
    if isinstance(options, list) or isinstance(kinds, list):
        alts = [schema_type(o, root, depth + 1) for o in options] if isinstance(options, list) else \
            [schema_type({**schema, "type": k}, root, depth + 1) for k in kinds if k != "null"]
        alts = [a for i, a in enumerate(alts) if a not in alts[:i] and not (
            isinstance(options, list) and options[i] == {"type": "null"})]
        return alts[0] if len(alts) == 1 else pa.string()
    if kinds == "object" or (kinds is None and "properties" in schema):
        props = schema.get("properties")
        if not isinstance(props, dict) or not props:
            return pa.string()
        return pa.struct([(name, schema_type(sub, root, depth + 1)) for name, sub in props.items()])
    if kinds == "array":
        return pa.list_(schema_type(schema.get("items", {}), root, depth + 1))
    return {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(),
            "boolean": pa.bool_()}.get(kinds, pa.string())


def output_columns(spec: JobSpec, tokenizer: Any, input_types: dict[str, pa.DataType]) -> dict[str, Any]:
    """finalize's column declarations for this job: the input's own types, ``parsed`` typed from the constraint
    (present whenever a constraint is), the grading columns with an answer column (recomputed for every row from
    the input as it is now: the answer column is not part of the result key, so a gold value edited, or
    ``output.gold`` added, after the row ran reruns nothing), token strings next to logprob ids."""
    task = spec.task
    extra: dict[str, pa.DataType] = {"cached_tokens": pa.int64()}  # every row's (null: failed before it ran)
    if task.kind == "generate" and (task.constraint is not None or task.constraint_column is not None):
        c = task.constraint
        per_row = task.constraint_column is not None
        extra["parsed"] = schema_type(json.loads(str(c.value))) if c is not None and c.kind == "json_schema" \
            and not per_row else pa.string()
    if task.keep_prompt:
        extra["rendered_prompt"] = pa.string()
    if task.kind == "score":
        recompute = grade.recompute_columns("score", task.answer_column)
    else:
        recompute = grade.recompute_columns("generate", task.gold_column, task.extract, task.grade_truncated)
    types = {"extracted": pa.string(), "target": pa.int64() if task.kind == "score" else pa.string(),
             "correct": pa.bool_(), "correct_norm": pa.bool_()}
    extra |= {name: types[name] for name in recompute or ()}
    return {"input_types": input_types, "extra_types": extra, "token_text": token_text_of(tokenizer),
            "recompute": recompute}


def token_text_of(tokenizer: Any) -> Any:
    """id -> the token's text as it reads inside a text, leading space included (OpenAI's ``" Paris"``), cached.

    A SentencePiece-style tokenizer decodes a token alone without its leading space (``▁the`` -> ``the``), so each
    token is decoded after an anchor token and the anchor's text is cut off (``x▁the`` -> ``x the`` -> `` the``);
    byte-level BPE reads the same either way."""
    cache: dict[int, str] = {}
    try:
        anchor = int(tokenizer.encode("x", add_special_tokens=False)[-1])
        base = tokenizer.decode([anchor])
    except (IndexError, TypeError, ValueError):
        anchor, base = None, ""

    def alone(token_id: int) -> str:
        if anchor is not None and base:
            both = tokenizer.decode([anchor, token_id])
            if both.startswith(base):
                return both[len(base):]
        return tokenizer.decode([token_id])

    def text(token_id: int) -> str:
        found = cache.get(token_id)
        if found is None:
            found = cache[token_id] = alone(token_id)
        return found

    return text
