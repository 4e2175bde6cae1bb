"""Value types that cross module boundaries: sampling parameters and request outputs.

Owns validation of SamplingParams (raised at submission, naming the field and value). Pure Python: no mlx.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from mlxbatch.errors import InvalidRequestError

MAX_LOGPROBS = 20
CONSTRAINT_KINDS = ("choice", "regex", "json_schema")


@dataclass(frozen=True)
class OutputConstraint:
    """What a request's output must match: one of ``choices``, a ``regex`` or a JSON schema (constrained decoding).

    ``value`` is a tuple of strings for ``choice``, a pattern for ``regex``, and the schema as a canonical JSON
    string for ``json_schema`` (so the constraint stays hashable and comparable). The schema keeps its key order:
    generated objects list their properties in the schema's order, so two schemas that differ only in order
    are different constraints.
    """

    kind: str
    value: str | tuple[str, ...]

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequestError("constraint.kind", self.kind, f"must be one of {', '.join(CONSTRAINT_KINDS)}")
        if self.kind == "choice":
            if isinstance(self.value, str) or not isinstance(self.value, (list, tuple)):
                raise InvalidRequestError("constraint.choice", self.value, "must be a list of strings")
            object.__setattr__(self, "value", tuple(self.value))
            if not self.value or any(not isinstance(c, str) or not c for c in self.value):
                raise InvalidRequestError("constraint.choice", list(self.value), "must be non-empty strings, at least one")
        elif not isinstance(self.value, str) or not self.value:
            raise InvalidRequestError(f"constraint.{self.kind}", self.value, "must be a non-empty string")

    @classmethod
    def choice(cls, options: list[str] | tuple[str, ...]) -> OutputConstraint:
        return cls("choice", tuple(options))

    @classmethod
    def regex(cls, pattern: str) -> OutputConstraint:
        return cls("regex", pattern)

    @classmethod
    def json_schema(cls, schema: dict | str) -> OutputConstraint:
        import json

        text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
        return cls("json_schema", text)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller or the engine shut down
    ERROR = "error"  # the request failed (message in RequestOutput.error)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters; every field is honoured inside a mixed batch."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 256
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: plus the top-k alternatives
    n: int = 1
    constraint: OutputConstraint | None = None  # constrained decoding (choice / regex / JSON schema)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._check()

    def _check(self) -> None:
        def bad(name: str, reason: str) -> InvalidRequestError:
            return InvalidRequestError(name, getattr(self, name), reason)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        for name in ("top_k", "max_tokens", "min_tokens", "n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, "must be an integer")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", "must be >= 0 (0 or -1 disables it)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0 (1 disables it)")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens < 1:
            raise bad("max_tokens", "must be >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", "must be in [0, max_tokens]")
        if self.n < 1:
            raise bad("n", "must be >= 1")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "token ids must be >= 0")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", "must be an integer or None")
        if self.logprobs is not None and not (
            isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.constraint is not None and not isinstance(self.constraint, OutputConstraint):
            raise bad("constraint", "must be an OutputConstraint")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of one generated token under the model, with the top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True)
class RequestTimings:
    """Wall-clock instants (time.perf_counter seconds) of one request's life."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def total(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


@dataclass(frozen=True)
class Completion:
    """One sample of a request (a request with ``n`` > 1 has n of them)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: tuple[TokenLogprob, ...] | None = None
    # scoring: whether every token of the scored continuation is the model's greedy choice
    greedy: bool | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


@dataclass(frozen=True)
class RequestOutput:
    """The result of one submitted request (all its ``n`` samples)."""

    request_id: str
    prompt_tokens: int
    completions: tuple[Completion, ...]
    timings: RequestTimings
    finished: bool = True
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def text(self) -> str:
        return self.completions[0].text if self.completions else ""

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.completions[0].token_ids if self.completions else ()

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.completions[0].finish_reason if self.completions else FinishReason.ERROR

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...] | None:
        return self.completions[0].logprobs if self.completions else None

    @property
    def generated_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)


@dataclass(frozen=True)
class StreamDelta:
    """New text of one sample since the last delta; ``output`` is set when the whole request finished."""

    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    output: RequestOutput | None = field(default=None, repr=False)


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One decoded image of a request (vision-language models).

    ``image`` is an RGB ``PIL.Image.Image`` (fully decoded and verified by whoever built it: the io layer's
    ``load_image``). ``content_hash`` identifies its decoded pixels; the engine keys the vision-feature cache and the
    prefix cache's image positions by it, so the same picture shares work and two different pictures never do.
    ``source`` names where it came from (a file, or ``<row>:images[i]``) for error messages.
    """

    image: object
    content_hash: str
    source: str = ""
