"""Line-oriented JSON inputs: plain JSONL and OpenAI Batch JSONL, parsed one line at a time.

Owns the per-line rules: blank lines are skipped; invalid UTF-8, invalid JSON, a value that is not an object, or
(OpenAI batch) a request without ``custom_id`` / ``body`` becomes an error row naming ``file:line``, and reading
goes on. Memory is bounded by the longest line. Does not own file discovery or format choice (``readers``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxbatch.io.records import InputRow, generated_id, input_row_from_object

logger = logging.getLogger(__name__)

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
SUPPORTED_URLS = (CHAT_URL, COMPLETIONS_URL)
_BOM = b"\xef\xbb\xbf"
_COUNT_CHUNK = 1 << 20


@dataclass(frozen=True)
class _Line:
    lineno: int
    value: Any = None  # the parsed JSON value (when error is None)
    error: str | None = None


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
            try:
                value = json.loads(text.rstrip("\r\n"))  # an unterminated string ends at the line, not at "\n"
            except json.JSONDecodeError as exc:
                yield _Line(lineno, error=f"{where_file}:{lineno}: invalid JSON: {exc.msg} (column {exc.colno})")
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
        body: dict[str, Any] = value["body"]
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
