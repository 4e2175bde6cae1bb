"""Line-oriented JSON inputs: plain JSONL and OpenAI Batch JSONL, parsed one line at a time.

Owns the per-line rules: blank lines are skipped; invalid UTF-8, invalid JSON, an object that gives a key twice, a
value that is not an object, or (OpenAI batch) a request without ``custom_id`` / ``body`` (or with a content part
other than text and image_url) becomes an error row naming ``file:line``, and reading goes on. OpenAI Batch bodies
are read as vLLM's run-batch reads them: text content parts are joined, ``image_url`` parts are the request's images
(``request_images``), and
``response_format`` (or vLLM's ``guided_*``) is the request's structured-output constraint (``openai_constraint``).
Memory is bounded by the longest line. Does not own file discovery or format choice (``readers``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from mlxbatch.errors import InvalidRequestError
from mlxbatch.io.records import InputRow, generated_id, input_row_from_object
from mlxbatch.types import OutputConstraint

logger = logging.getLogger(__name__)

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
SUPPORTED_URLS = (CHAT_URL, COMPLETIONS_URL)
# Body fields the API lets take several shapes (a message's content as text or parts, ``stop`` a string or a list,
# ``logprobs`` a flag in chat and a count in completions, ...): their results column is text, the same for every
# file (a value that is not a string is written as JSON text), never a type guessed from the rows at hand.
OPENAI_JSON_TEXT_FIELDS = ("messages", "prompt", "stop", "logprobs", "response_format", "tools", "tool_choice",
                           "logit_bias", "guided_json", "guided_choice")
_BOM = b"\xef\xbb\xbf"
_COUNT_CHUNK = 1 << 20


@dataclass(frozen=True)
class _Line:
    lineno: int
    value: Any = None  # the parsed JSON value (when error is None)
    error: str | None = None


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused when it gives a key twice: ``json`` would keep the last value silently, and the row
    would run on a value nobody chose."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return obj


def _decode_lines(path: Path) -> Iterator[_Line]:
    """Every non-blank line, parsed, or with the message saying why it could not be."""
    where_file = str(path)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield _Line(lineno, error=f"{where_file}:{lineno}: invalid UTF-8 at byte {exc.start}: {exc.reason}")
                continue
            try:  # an unterminated string ends at the line, not at "\n"
                value = json.loads(text.rstrip("\r\n"), object_pairs_hook=_object)
            except json.JSONDecodeError as exc:
                yield _Line(lineno, error=f"{where_file}:{lineno}: invalid JSON: {exc.msg} (column {exc.colno})")
            except _DuplicateKey as exc:
                yield _Line(lineno, error=f"{where_file}:{lineno}: the key {exc.key!r} is given twice in one "
                                          "object (JSON would keep the last)")
            except RecursionError:
                yield _Line(lineno, error=f"{where_file}:{lineno}: invalid JSON: nested too deeply")
            else:
                yield _Line(lineno, value)


def _error_row(path: Path, lineno: int, message: str, has_ids: bool, row_id: str | None = None) -> InputRow:
    """A line that is not a row; without a usable id of its own it gets a generated one (never a real row's)."""
    if row_id is not None:
        return InputRow(row_id=row_id, source=str(path), position=lineno, error=message)
    return InputRow(row_id=generated_id(str(path), path.stem, lineno, has_ids), source=str(path), position=lineno,
                    error=message, generated_id=True)


def iter_jsonl(path: Path, *, id_column: str | None, columns: tuple[str, ...] | None) -> Iterator[InputRow]:
    """The rows of one JSONL file, in line order (``position`` is the 1-based line number)."""
    source, stem, has_ids = str(path), path.stem, id_column is not None
    for line in _decode_lines(path):
        lineno, value = line.lineno, line.value
        if line.error is not None:
            yield _error_row(path, lineno, line.error, has_ids)
        elif not isinstance(value, dict):
            yield _error_row(path, lineno, f"{path}:{lineno}: expected a JSON object, got {type(value).__name__}",
                             has_ids)
        else:
            yield input_row_from_object(value, source=source, stem=stem, position=lineno, id_column=id_column,
                                        columns=columns)


def _openai_problem(obj: dict[str, Any]) -> str | None:
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing or empty 'custom_id'"
    body = obj.get("body")
    if not isinstance(body, dict):
        return "missing 'body' object"
    method = obj.get("method", "POST")
    if method != "POST":
        return f"unsupported method {method!r} (only POST)"
    url = obj.get("url")
    if url is not None and url not in SUPPORTED_URLS:
        return f"unsupported url {url!r} (supported: {', '.join(SUPPORTED_URLS)})"
    if url == COMPLETIONS_URL or (url is None and "messages" not in body):
        if not isinstance(body.get("prompt"), (str, list)):
            return "body has neither 'messages' (a list) nor 'prompt'"
    elif not isinstance(body.get("messages"), list):
        return "body.messages must be a list of messages"
    else:
        return _parts_problem(body["messages"])
    return None


def _image_url(part: dict[str, Any]) -> Any:
    """The URL of an ``image_url`` part: ``{"image_url": {"url": ...}}`` (the API's), or a bare string."""
    value = part.get("image_url")
    return value.get("url") if isinstance(value, dict) else value


def _parts_problem(messages: list[Any]) -> str | None:
    """What is wrong with a message's content parts: only text and image_url parts can be used."""
    for i, m in enumerate(messages):
        parts = m.get("content") if isinstance(m, dict) else None
        if not isinstance(parts, list):
            continue
        for j, p in enumerate(parts):
            kind = p.get("type") if isinstance(p, dict) else None
            where = f"body.messages[{i}].content[{j}]"
            if kind == "text" and not isinstance(p.get("text"), str):
                return f"{where}: a text part needs a 'text' string"
            if kind == "image_url" and not (isinstance(_image_url(p), str) and _image_url(p)):
                return f"{where}: an image_url part needs {{\"url\": ...}} (a data URL or a local path)"
            if kind not in ("text", "image_url"):
                return f"{where}: unsupported content part type {kind!r:.40} (supported: text, image_url)"
    return None


def request_images(body: dict[str, Any]) -> list[str]:
    """The images of a chat request, in order: its ``image_url`` parts' URLs (a ``file://`` URL as its path)."""
    urls = []
    for m in body.get("messages") or ():
        parts = m.get("content") if isinstance(m, dict) else None
        for p in parts if isinstance(parts, list) else ():
            if isinstance(p, dict) and p.get("type") == "image_url":
                url = str(_image_url(p))
                urls.append(unquote(urlsplit(url).path) if url.startswith("file://") else url)
    return urls


def _text_parts_joined(body: dict[str, Any]) -> dict[str, Any]:
    """A body whose messages' text content parts (``[{"type": "text", "text": ...}]``) are joined into one string
    with newlines, as vLLM's run-batch does. Messages with image parts are left as they are (``request_images``)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return body
    joined = []
    for m in messages:
        parts = m.get("content") if isinstance(m, dict) else None
        if isinstance(parts, list) and parts and all(isinstance(p, dict) and p.get("type") == "text"
                                                       and isinstance(p.get("text"), str) for p in parts):
            m = {**m, "content": "\n".join(p["text"] for p in parts)}
        joined.append(m)
    return {**body, "messages": joined}


def openai_constraint(body: dict[str, Any]) -> OutputConstraint | None:
    """The structured-output constraint a request body asks for: ``response_format`` (``json_schema`` with its
    ``schema``, or ``json_object``) or vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice``. Raises
    InvalidRequestError naming the field for one that cannot be used."""
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return OutputConstraint.json_schema({"type": "object"})
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise InvalidRequestError("body.response_format.json_schema.schema", schema, "expected a JSON schema")
            return OutputConstraint.json_schema(schema)
        raise InvalidRequestError("body.response_format", fmt, "expected type text, json_object or json_schema")
    if body.get("guided_json") is not None:
        schema = body["guided_json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError("body.guided_json", schema[:60], f"not valid JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise InvalidRequestError("body.guided_json", schema, "expected a JSON schema")
        return OutputConstraint.json_schema(schema)
    if body.get("guided_regex") is not None:
        return OutputConstraint.regex(body["guided_regex"])
    if body.get("guided_choice") is not None:
        return OutputConstraint.choice(body["guided_choice"])
    return None


def iter_openai_batch(path: Path, *, columns: tuple[str, ...] | None) -> Iterator[InputRow]:
    """The requests of one OpenAI Batch input file: ``row_id`` is ``custom_id``, ``request`` the ``body``.

    ``fields`` holds ``custom_id``, ``url`` (inferred from the body when absent) and every body entry
    (``messages`` or ``prompt``, ``model``, ``max_tokens``, ``temperature``, ...).
    """
    source = str(path)
    for line in _decode_lines(path):
        lineno, value = line.lineno, line.value
        where = f"{source}:{lineno}"
        if line.error is not None:
            yield _error_row(path, lineno, line.error, True)
            continue
        if not isinstance(value, dict):
            yield _error_row(path, lineno, f"{where}: expected a JSON object, got {type(value).__name__}", True)
            continue
        problem = _openai_problem(value)
        custom_id = value.get("custom_id")
        usable_id = custom_id if isinstance(custom_id, str) and custom_id else None
        if problem is not None:
            yield _error_row(path, lineno, f"{where}: invalid batch request: {problem}", True, row_id=usable_id)
            continue
        body: dict[str, Any] = _text_parts_joined(value["body"])
        url = value.get("url") or (CHAT_URL if "messages" in body else COMPLETIONS_URL)
        flat: dict[str, Any] = {"custom_id": custom_id, "url": url}
        flat.update((k, v) for k, v in body.items() if k not in flat)
        fields = flat if columns is None else {name: flat.get(name) for name in columns}
        yield InputRow(row_id=custom_id, source=source, position=lineno, fields=fields, request=body)


def sniff_openai_batch(path: Path, max_lines: int = 100) -> bool:
    """True when the first non-blank line of a JSONL file is an object with ``custom_id`` and ``body``."""
    with open(path, "rb") as f:
        for _, raw in zip(range(max_lines), f):
            if raw.strip():
                try:
                    value = json.loads(raw.removeprefix(_BOM).decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                    return False
                return isinstance(value, dict) and "custom_id" in value and "body" in value
    return False


def is_json_array_document(path: Path) -> bool:
    """True when the file's first non-blank byte is ``[``: one JSON array, not JSON Lines."""
    with open(path, "rb") as f:
        while chunk := f.read(4096):
            stripped = chunk.removeprefix(_BOM).lstrip()
            if stripped:
                return stripped.startswith(b"[")
    return False


def count_lines(path: Path) -> int:
    """Lines in a file, counted in binary chunks (blank lines included: an upper bound on its rows)."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(_COUNT_CHUNK):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")
