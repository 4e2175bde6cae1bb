"""Row preparation: an input row -> its prompt, its sampling parameters, its result key (or its error).

Owns the per-row decisions that must be identical on every pass over the input (the run, a resume, the final
Parquet's row list): rendering, per-row parameter overrides (from columns or an OpenAI Batch body), the row's
seed (derived from the job seed and the row id, so it does not depend on order or on where a resume started)
and the key that makes resume exactly-once. A row whose prompt is far beyond the model's context (more than
``CHARS_PER_TOKEN_BOUND`` characters per token of context) is refused here, before anything tokenizes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

from mlxbatch.errors import InvalidRequestError
from mlxbatch.io import DuplicateIdTracker, InputRow, canonical_params, result_key
from mlxbatch.io.jsonl import openai_constraint
from mlxbatch.job.rows.media import ImageError, row_images
from mlxbatch.job.rows.prompts import DEFAULT_MAX_CHARS, PromptRenderer, PromptTooLongError, RenderError
from mlxbatch.job.spec import JobSpec, constraint_from
from mlxbatch.types import SamplingParams

CHARS_PER_TOKEN_BOUND = 64  # no tokenizer packs more characters into a token on average, even on whitespace runs
_INT_PARAMS = frozenset(("top_k", "max_tokens", "min_tokens", "n", "seed", "logprobs"))
# A score row's ``params`` column: it samples nothing, so no generation parameter applies to it. Its key keeps the
# job's sampling parameters as before (a folder written earlier resumes as it is).
SCORE_PARAMS = "{}"


@dataclass(frozen=True)
class PreparedRow:
    row_id: str
    key: str
    inputs: dict[str, Any]  # the input columns kept in the output
    prompt: str | list[dict[str, Any]] | None
    params: SamplingParams
    params_json: str  # canonical JSON of ``params`` (once per distinct set); a score row's: SCORE_PARAMS
    error: str | None = None
    error_kind: str | None = None
    candidates: tuple[str, ...] | None = None  # task score: the continuations to score
    answer: Any = None  # task score: the right candidate (index or text), when the job names an answer column
    images: tuple[Any, ...] = ()  # io.images.ImageRef of the row's images (decoded when it runs)
    # an OpenAI Batch request: its output is the reply the API gives (one cut by max_tokens is a reply, not an error)
    api_request: bool = False


def row_seed(job_seed: int, row_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{job_seed}:{row_id}".encode()).digest()[:7], "big")


def _openai_logprobs(body: dict[str, Any]) -> int | None:
    """The alternatives a body asks for per token (None: no logprobs). Chat (a body with ``messages``):
    ``logprobs: true`` and ``top_logprobs: k``. Completions (a ``prompt``): ``logprobs: N``, the N alternatives
    (0: only the sampled token's logprob)."""
    asked = body.get("logprobs")
    if body.get("messages") or isinstance(asked, bool):
        return int(body.get("top_logprobs") or 0) if asked else None
    if asked is None:
        return None
    if not isinstance(asked, int):
        raise ValueError(f"logprobs of a completions request must be an integer (the alternatives per token), "
                         f"got {asked!r:.40}")
    return asked


def _openai_params(body: dict[str, Any]) -> dict[str, Any]:
    """Sampling parameters of an OpenAI chat/completions body."""
    out: dict[str, Any] = {}
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "n"):
        if body.get(name) is not None:
            out[name] = body[name]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        out["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
    logprobs = _openai_logprobs(body)
    if logprobs is not None:
        out["logprobs"] = logprobs
    constraint = openai_constraint(body)  # response_format / guided_*: InvalidRequestError -> a params row error
    if constraint is not None:
        out["constraint"] = constraint
    return out


def max_prompt_chars(context_length: int | None) -> int:
    """The character bound of a prompt for a model with this context (tokens); beyond it no tokenizer is asked."""
    return context_length * CHARS_PER_TOKEN_BOUND if context_length else DEFAULT_MAX_CHARS


class RowPreparer:
    def __init__(self, spec: JobSpec, model_identity: str, openai_batch: bool = False,
                 takes_images: bool = False, context_length: int | None = None) -> None:
        self.spec = spec
        self.model_identity = model_identity
        self.takes_images = takes_images  # a vision-language model: image paths may be opened
        self.context_length = context_length
        self.renderer = PromptRenderer(spec.prompt, openai_batch, max_prompt_chars(context_length))
        self.duplicates = DuplicateIdTracker()
        self._json: dict[SamplingParams, str] = {}

    def _canonical(self, params: SamplingParams) -> str:
        text = self._json.get(params)
        if text is None:
            if len(self._json) > 10_000:  # per-row seeds make every set distinct: keep the cache bounded
                self._json.clear()
            text = self._json[params] = canonical_params(params)
        return text

    def _keep(self, fields: dict[str, Any]) -> dict[str, Any]:
        cols = self.spec.input.columns
        if cols is None:  # all columns but the id, which is the output's ``id`` already
            return {k: v for k, v in fields.items() if k != self.spec.input.id_column}
        return {c: fields.get(c) for c in cols}

    def _params(self, row: InputRow) -> SamplingParams:
        base = self.spec.sampling.params
        changes: dict[str, Any] = {}
        for name, column in self.spec.sampling.overrides.items():
            value = row.fields.get(column)
            if isinstance(value, float) and value.is_integer() and name in _INT_PARAMS:
                value = int(value)  # an integer column with nulls, as pandas stores it (float64)
            if value is not None:
                changes[name] = tuple(value) if name in ("stop", "stop_token_ids") and isinstance(value, list) \
                    else value
        if row.request is not None:
            changes.setdefault("temperature", 1.0)  # the OpenAI API's default, not the job's greedy one
            changes.update(_openai_params(row.request))
        task = self.spec.task
        if task.constraint is not None:
            changes.setdefault("constraint", task.constraint)
        if task.constraint_column is not None and row.fields.get(task.constraint_column) is not None:
            changes["constraint"] = constraint_from(row.fields[task.constraint_column], task.constraint_column)
        params = dataclasses.replace(base, **changes) if changes else base
        if params.seed is None and not params.greedy:  # greedy rows need no seed: it stays out of their key
            params = dataclasses.replace(params, seed=row_seed(self.spec.seed, row.row_id))
        return params

    def _failed(self, row: InputRow, error: str, kind: str, params: SamplingParams | None = None) -> PreparedRow:
        p = params or self.spec.sampling.params
        pj = self._canonical(p)
        key = result_key(row.row_id, f"<error {row.source}:{row.position}> {error}", self.model_identity, pj, p.seed)
        return PreparedRow(row.row_id, key, self._keep(row.fields), None, p, self._shown(pj), error, kind)

    def _shown(self, params_json: str) -> str:
        return SCORE_PARAMS if self.spec.task.kind == "score" else params_json

    @property
    def args(self) -> tuple[JobSpec, str, bool, bool, int | None]:
        """What builds an equal preparer elsewhere (a feed worker process: ``job.rows.workers``)."""
        return self.spec, self.model_identity, self.renderer.openai_batch, self.takes_images, self.context_length

    def prepare(self, row: InputRow) -> PreparedRow:
        admitted = self.admit(row)
        return admitted if isinstance(admitted, PreparedRow) else self.prepare_admitted(admitted)

    def admit(self, row: InputRow) -> InputRow | PreparedRow:
        """The row under its unique id, or its error row when its id was taken. The one step that depends on the
        rows before it (the ids seen): done in input order by the run's one reader, before ``prepare_admitted``."""
        if row.generated_id:  # made up by the reader: never a real row's id, never a duplicate
            unique = self.duplicates.generated(row.row_id)
            return dataclasses.replace(row, row_id=unique) if unique != row.row_id else row
        if not self.duplicates.add(row.row_id):  # written under an id of its own: results ids are unique
            taken = row.row_id
            why = " (given to an earlier row that had no id of its own, or to a duplicate)" \
                if self.duplicates.is_generated(taken) else ""
            row = dataclasses.replace(row, row_id=self.duplicates.generated(taken))
            return self._failed(row, f"{row.source}:{row.position}: duplicate id {taken!r}{why}; written as "
                                     f"{row.row_id!r}", "duplicate_id")
        return row

    def prepare_admitted(self, row: InputRow) -> PreparedRow:
        """An admitted row's prompt, parameters and key (or its error): a function of the row alone, so any process
        holding an equal preparer computes the same."""
        if row.error is not None:
            return self._failed(row, row.error, "input")
        try:
            params = self._params(row)
        except (InvalidRequestError, TypeError, ValueError) as exc:
            return self._failed(row, f"{row.source}:{row.position}: sampling override: {exc}", "params")
        try:
            rendered = self.renderer.render(row.fields, row.request)
        except PromptTooLongError as exc:
            context = f"the model's context of {self.context_length:,} tokens" if self.context_length else \
                "any model's context"
            return self._failed(row, f"{row.source}:{row.position}: row {row.row_id!r}: the prompt is longer than "
                                     f"{exc.max_chars:,} characters, far beyond {context}; refused before "
                                     "tokenizing", "request", params)
        except RenderError as exc:
            return self._failed(row, f"{row.source}:{row.position}: {exc}", "render", params)
        try:
            images, image_identity = row_images(row, self.takes_images, self.spec.input.image_roots,
                                                self.spec.input.max_image_pixels)
        except ImageError as exc:
            return self._failed(row, f"{row.source}:{row.position}: {exc}", "image", params)
        except InvalidRequestError as exc:  # images for a text-only model
            return self._failed(row, f"{row.source}:{row.position}: {exc}", "request", params)
        pj = self._canonical(params)
        identity, candidates, answer = rendered.identity + image_identity, None, None
        if self.spec.task.kind == "score":
            task = self.spec.task
            candidates = task.candidates or row.fields.get(task.candidates_column or "")
            if not isinstance(candidates, (list, tuple)) or not candidates \
                    or not all(isinstance(x, str) and x for x in candidates):
                return self._failed(row, f"{row.source}:{row.position}: candidates must be a non-empty list of "
                                         f"non-empty strings, got {candidates!r:.80}", "candidates", params)
            candidates = tuple(candidates)
            identity += "\x00candidates:" + "\x00".join(candidates)  # other candidates: another result
            answer = row.fields.get(task.answer_column) if task.answer_column else None
        key = result_key(row.row_id, identity, self.model_identity, pj, params.seed)
        return PreparedRow(row.row_id, key, self._keep(row.fields), rendered.prompt, params, self._shown(pj),
                           candidates=candidates, answer=answer, images=images, api_request=row.request is not None)
