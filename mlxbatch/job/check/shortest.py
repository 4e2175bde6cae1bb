"""The shortest output an output constraint allows, in tokens: so ``validate`` can refuse a ``max_tokens`` that
would cut every row (each one an error row of kind ``truncated``).

Owns the shortest instance of a JSON schema (required properties only, ``minItems`` items, the shortest enum
value, ``0`` within bounds, ``minLength`` characters, ``$ref`` followed), written compactly as constrained decoding
writes JSON, and its token count under the model's tokenizer. Every count is checked against the real grammar
(llguidance, through the engine's ``GrammarCompiler``): an instance the grammar does not accept (a keyword this
module does not model, such as ``pattern`` or ``format``) gives no answer rather than a wrong one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mlxbatch.types import OutputConstraint

_UNKNOWN = object()  # a schema whose shortest instance this module cannot tell
_MAX_DEPTH = 32


@dataclass(frozen=True)
class ShortestOutput:
    text: str
    tokens: int  # generated tokens, an end-of-sequence token included when the grammar does not end by itself


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _resolve(schema: dict[str, Any], root: dict[str, Any]) -> Any:
    ref = schema.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return schema if ref is None else _UNKNOWN
    node: Any = root
    for part in ref[2:].split("/"):
        if not isinstance(node, dict) or part not in node:
            return _UNKNOWN
        node = node[part]
    return node


def _shortest(schema: Any, root: dict[str, Any], depth: int) -> Any:
    if schema is True or schema == {}:
        return None  # anything: null is the shortest JSON value
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return _UNKNOWN
    schema = _resolve(schema, root)
    if schema is _UNKNOWN:
        return _UNKNOWN
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return min(schema["enum"], key=lambda v: len(_dumps(v)))
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            options = [_shortest(s, root, depth + 1) for s in schema[key]]
            known = [o for o in options if o is not _UNKNOWN]
            return min(known, key=lambda v: len(_dumps(v))) if known else _UNKNOWN
    if any(k in schema for k in ("allOf", "not", "if", "pattern", "format", "patternProperties", "multipleOf")):
        return _UNKNOWN
    kinds = schema.get("type")
    if isinstance(kinds, list):
        options = [_shortest({**schema, "type": t}, root, depth + 1) for t in kinds]
        known = [o for o in options if o is not _UNKNOWN]
        return min(known, key=lambda v: len(_dumps(v))) if known else _UNKNOWN
    return _of_type(kinds, schema, root, depth)


def _of_type(kind: Any, schema: dict[str, Any], root: dict[str, Any], depth: int) -> Any:
    if kind == "object" or (kind is None and "properties" in schema):
        props = schema.get("properties") or {}
        out = {}
        for name in [p for p in props if p in (schema.get("required") or [])] + \
                [r for r in schema.get("required") or [] if r not in props]:
            value = _shortest(props.get(name, schema.get("additionalProperties", True)), root, depth + 1)
            if value is _UNKNOWN:
                return _UNKNOWN
            out[name] = value
        return out
    if kind == "array":
        prefix = schema.get("prefixItems") or []
        n = max(int(schema.get("minItems") or 0), 0)
        items = [_shortest(s, root, depth + 1) for s in prefix[:n]]
        items += [_shortest(schema.get("items", True), root, depth + 1) for _ in range(n - len(items))]
        return _UNKNOWN if any(i is _UNKNOWN for i in items) else items
    if kind == "string":
        return "a" * int(schema.get("minLength") or 0)
    if kind in ("integer", "number"):
        lo, xlo = schema.get("minimum"), schema.get("exclusiveMinimum")
        hi, xhi = schema.get("maximum"), schema.get("exclusiveMaximum")
        zero_ok = (lo is None or lo <= 0) and (xlo is None or xlo < 0) and (hi is None or hi >= 0) \
            and (xhi is None or xhi > 0)
        return 0 if zero_ok else _UNKNOWN  # bounds away from zero: the shortest number is not obvious
    if kind == "boolean":
        return True
    if kind == "null" or kind is None:
        return None
    return _UNKNOWN


def shortest_json(schema: dict[str, Any]) -> str | None:
    """The shortest instance of ``schema`` as compact JSON text, or None when this module cannot tell it."""
    value = _shortest(schema, schema, 0)
    return None if value is _UNKNOWN else _dumps(value)


def shortest_output(constraint: OutputConstraint, tokenizer: Any, compiler: Any) -> ShortestOutput | None:
    """The shortest output ``constraint`` allows and its length in tokens, checked by the grammar itself (None when
    unknown). ``compiler`` is the engine's ``GrammarCompiler`` for ``tokenizer``."""
    if constraint.kind == "choice":
        texts = list(constraint.value)
    elif constraint.kind == "json_schema":
        text = shortest_json(json.loads(str(constraint.value)))
        texts = [text] if text is not None else []
    else:
        return None
    best: ShortestOutput | None = None
    for text in texts:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        matcher = compiler.matcher(constraint)
        if not all(matcher.consume(t) for t in ids) or not matcher.accepting:
            continue
        n = len(ids) + (0 if matcher.done else 1)
        if best is None or n < best.tokens:
            best = ShortestOutput(text, n)
    return best
