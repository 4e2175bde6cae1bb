r"""Grammar-constrained token masks: structured outputs (choice / regex / JSON schema), per row of a mixed batch.

Owns turning an ``OutputConstraint`` into a per-sequence ``Matcher`` (``GrammarCompiler``, one per tokenizer,
caches each compiled grammar) and masking the logits of a batch's constrained rows (``constrain_logits``): the
allowed-token bitmasks of all constrained rows are filled in one parallel call, then applied by ``masks`` (portable
MLX ops; llguidance's Metal kernel on a Metal default device). Unconstrained rows are left bit-identical.

The grammar engine is llguidance, chosen over outlines-core by ``mlxbatch bench constraints`` (Linux CPU,
2 shared cores; SmolLM2's 49,152-id tokenizer and a synthetic 151,646-id byte-level BPE of Qwen2's size):
- compile (until the first mask): llguidance 1-2 ms for a 5-label choice, ``\d{3}-\d{4}`` and a 4-field JSON
  schema at either size; outlines-core builds a full vocabulary index per constraint: 10 / 55 / 757 ms at 49k,
  116 / 617 / 7,661 ms at 151k, paid per distinct constraint (rows may each carry their own);
- mask per step, 64 rows: JSON 1.35 vs 1.20 ms (49k), 18.6 vs 5.2 ms (151k); choice / regex 0.2-4 ms vs
  < 0.2 ms (outlines-core reads precomputed tables; llguidance walks the token trie, ``fill_..._par`` fills a
  batch in one call); RSS after all of it: +35 vs +49 MB (49k), +104 vs +181 MB (151k);
- JSON Schema: outlines-core silently ignores integer/number bounds, ``uniqueItems`` and ``if``/``then`` (its
  output can break the schema); llguidance enforces bounds, ``$ref`` (recursive too), ``anyOf``/``allOf``,
  ``additionalProperties``, ``patternProperties``, ``prefixItems``, formats, and rejects what it does not
  implement with a reason, which ``check`` returns.
JSON is compact (no free whitespace, so a model cannot stall in it) and ``oneOf`` is read as ``anyOf``; a
schema's own ``x-guidance`` options override both. Regexes use Rust ``regex`` syntax, where ``\d`` and ``\w``
are Unicode-aware as in Python's ``re`` (write ``[0-9]`` for ASCII digits).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from mlxbatch.engine.decoding import masks
from mlxbatch.errors import InvalidRequestError
from mlxbatch.types import OutputConstraint

if TYPE_CHECKING:
    import llguidance


def _llg() -> Any:
    """llguidance, imported when a constraint is first used (engines without constraints never load it)."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    return llguidance

__all__ = ["GrammarCompiler", "Matcher", "SequenceGrammars", "constrain_logits"]

log = logging.getLogger(__name__)

JSON_DEFAULTS = {"whitespace_flexible": False, "coerce_one_of": True}  # see the module docstring
MAX_CACHED = 512  # compiled constraints kept per compiler (least recently used go first)
_MAX_REASON = 600

_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def _get_executor() -> llguidance.LLExecutor:
    """The process-wide thread pool that fills a batch's masks in parallel (llguidance sizes it to the CPUs)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = _llg().LLExecutor()
        return _executor


def _hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face fast tokenizer behind ``tokenizer`` (an mlx-lm TokenizerWrapper is unwrapped)."""
    inner = getattr(tokenizer, "_tokenizer", None)
    return inner if inner is not None and hasattr(inner, "backend_tokenizer") else tokenizer


def grammar_text(constraint: OutputConstraint) -> str:
    """The llguidance grammar of a constraint (raises ValueError on a schema that is not JSON)."""
    if constraint.kind == "choice":
        # Lark string literals take JSON string syntax: json.dumps escapes quotes, backslashes and controls,
        # so every option is matched literally (no regex is built from user text).
        lark = "start: " + " | ".join(json.dumps(c) for c in constraint.value)
        return _llg().LLMatcher.grammar_from_lark(lark)
    if constraint.kind == "regex":
        return _llg().LLMatcher.grammar_from_regex(str(constraint.value))
    return _llg().LLMatcher.grammar_from_json_schema(str(constraint.value), defaults=JSON_DEFAULTS)


def short_value(constraint: OutputConstraint) -> object:
    """The constraint's value as an error message shows it (a long schema is cut)."""
    value = constraint.value
    if isinstance(value, str) and len(value) > 200:
        return value[:200] + "..."
    return list(value) if isinstance(value, tuple) else value


class Matcher:
    """One sequence's position in its grammar: which tokens may come next, whether it may or must stop."""

    __slots__ = ("_m", "tokenizer_vocab")

    def __init__(self, matcher: llguidance.LLMatcher, tokenizer_vocab: int) -> None:
        self._m = matcher
        self.tokenizer_vocab = tokenizer_vocab

    def consume(self, token_id: int) -> bool:
        """Advance by one token; False if the grammar did not allow it (the matcher then stays in error)."""
        return bool(self._m.consume_token(int(token_id)))

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (or failed): the sequence should stop now."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        """The output so far is a complete match: EOS is allowed."""
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str | None:
        return (self._m.get_error() or "error") if self._m.is_error() else None


class GrammarCompiler:
    """Compiles constraints for one tokenizer; one per loaded model. Thread-safe; compiled grammars are cached.

    ``vocab_size`` is the model's logits width; columns past the tokenizer's vocabulary are always masked in
    constrained rows. EOS (``eos_token_ids``, else the tokenizer's EOS) is allowed exactly when the grammar
    accepts.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int] | None = None) -> None:
        hf = _hf_tokenizer(hf_tokenizer)
        eos = sorted({int(t) for t in eos_token_ids}) if eos_token_ids else None
        if not eos:
            eos_id = getattr(hf, "eos_token_id", None)
            eos = [int(eos_id)] if eos_id is not None else None
        if not eos:
            raise ValueError("constrained decoding needs an EOS token: the tokenizer has none")
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(eos)
        self.tokenizer = _llg().hf.from_tokenizer(hf, eos_token=eos if len(eos) > 1 else eos[0])
        self.tokenizer_vocab = int(self.tokenizer.vocab_size)
        self._cache: OrderedDict[OutputConstraint, llguidance.LLMatcher | str] = OrderedDict()
        self._lock = threading.Lock()

    def _compiled(self, constraint: OutputConstraint) -> llguidance.LLMatcher | str:
        """A pristine matcher for ``constraint`` (copied per sequence), or the reason it cannot compile."""
        if not isinstance(constraint, OutputConstraint):
            raise InvalidRequestError("constraint", type(constraint).__name__, "expected an OutputConstraint")
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                return hit
        try:
            template = _llg().LLMatcher(self.tokenizer, grammar_text(constraint), log_level=0)
            result: llguidance.LLMatcher | str = template
            if template.is_error():
                result = template.get_error() or "does not compile"
        except (ValueError, TypeError) as exc:  # e.g. a schema that is not a JSON object
            result = str(exc) or type(exc).__name__
        if isinstance(result, str):
            label = {"choice": "invalid choice", "regex": "invalid regex", "json_schema": "invalid JSON schema"}
            text = result.strip()
            result = f"{label[constraint.kind]}: {text[:_MAX_REASON]}{'...' if len(text) > _MAX_REASON else ''}"
        with self._lock:
            self._cache[constraint] = result
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
        return result

    def check(self, constraint: OutputConstraint) -> str | None:
        """None if ``constraint`` compiles for this tokenizer, else a clear reason (bad regex, bad schema...)."""
        compiled = self._compiled(constraint)
        return compiled if isinstance(compiled, str) else None

    def matcher(self, constraint: OutputConstraint) -> Matcher:
        """A fresh matcher for one sequence; raises InvalidRequestError("constraint", ...) if it cannot compile."""
        compiled = self._compiled(constraint)
        if isinstance(compiled, str):
            raise InvalidRequestError("constraint", short_value(constraint), compiled)
        return Matcher(compiled.deep_copy(), self.tokenizer_vocab)


def fill_masks(matchers: list[Matcher]) -> np.ndarray:
    """The packed allowed-token bitmasks [len(matchers), words] of all matchers, filled in one parallel call."""
    ntok = matchers[0].tokenizer_vocab
    assert all(m.tokenizer_vocab == ntok for m in matchers), "matchers of one batch share a tokenizer"
    mask = _llg().numpy.allocate_token_bitmask(len(matchers), ntok)
    _llg().numpy.fill_next_token_bitmask_par(_get_executor(), [(m._m, i) for i, m in enumerate(matchers)], mask)
    return mask


def constrain_logits(logits: mx.array, rows: list[int], matchers: list[Matcher], metal: bool = False) -> mx.array:
    """``logits`` [B, V] with the disallowed tokens of each constrained row (``rows[i]`` by ``matchers[i]``)
    at -inf; other rows are returned bit-identical. The input array is not modified. ``metal``: the engine runs on
    Metal (llguidance's Metal kernel may apply the masks)."""
    if not rows:
        return logits
    if len(rows) != len(matchers):
        raise ValueError(f"{len(rows)} rows but {len(matchers)} matchers")
    rows = [int(r) for r in rows]
    mask = fill_masks(matchers)  # one parallel fill for every constrained row
    ntok = matchers[0].tokenizer_vocab
    return masks.apply(logits, rows, mask, ntok, metal)


class SequenceGrammars:
    """The matchers of an engine's constrained sequences, by request id (the runner holds one of these).

    A sequence keeps its matcher across preemption (its generated tokens are kept too); the engine core
    drops it when the sequence leaves the engine. ``metal``: the engine runs on Metal (``masks.apply``).
    """

    def __init__(self, metal: bool = False) -> None:
        self._matchers: dict[str, Matcher] = {}
        self._metal = metal

    def __len__(self) -> int:
        return len(self._matchers)

    def set(self, request_id: str, matcher: Matcher | None) -> None:
        """Constrain ``request_id``'s tokens by ``matcher`` from now on; None forgets it."""
        if matcher is None:
            self._matchers.pop(request_id, None)
        else:
            self._matchers[request_id] = matcher

    def get(self, request_id: str) -> Matcher | None:
        return self._matchers.get(request_id)

    def done(self, request_id: str) -> bool:
        """Whether ``request_id``'s grammar is complete and allows nothing more (the sequence must stop)."""
        m = self._matchers.get(request_id)
        return m is not None and m.done

    def constrain(self, request_ids: list[str], logits: mx.array) -> mx.array:
        """``logits`` (row i belongs to ``request_ids[i]``) with the constrained rows masked; others untouched."""
        if not self._matchers:
            return logits
        rows = [i for i, rid in enumerate(request_ids) if rid in self._matchers]
        return constrain_logits(logits, rows, [self._matchers[request_ids[i]] for i in rows], self._metal)

    def advance(self, request_ids: list[str], token_ids: list[int]) -> None:
        """Each constrained sequence's matcher takes its sampled token."""
        for rid, tok in zip(request_ids, token_ids):
            m = self._matchers.get(rid)
            if m is not None and not m.consume(tok):  # a token outside the grammar: its matcher is done now
                log.warning("sequence %s sampled token %d outside its grammar: %s", rid, tok, m.error)
