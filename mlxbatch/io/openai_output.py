"""OpenAI Batch API output files, written from ``results.parquet`` for a job whose input was an OpenAI batch file.

Owns the two JSONL layouts: ``openai_output.jsonl`` (one line per successful request, a chat.completion or
text_completion object as the ``response.body``) and ``errors.jsonl`` (one line per failed request with
``error: {message, code}``). ``custom_id`` is the results' ``id``; ids derive from the row's result key, so
a re-run writes identical lines (except ``created``). A request that asked for logprobs gets them in the API's
layout (chat: ``logprobs.content[]`` of ``{token, logprob, bytes, top_logprobs}``; completions: ``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``), from the results' logprobs with their token strings.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import pyarrow.parquet as pq

from mlxbatch.io.atomic import atomic_writer
from mlxbatch.io.jsonl import CHAT_URL, COMPLETIONS_URL

logger = logging.getLogger(__name__)

OUTPUT_NAME = "openai_output.jsonl"
ERRORS_NAME = "errors.jsonl"
_COLUMNS = ["id", "key", "text", "finish_reason", "prompt_tokens", "generated_tokens", "error", "error_kind",
            "model"]


@dataclass(frozen=True)
class OpenAIBatchOutputs:
    output_path: Path
    errors_path: Path
    ok_rows: int
    error_rows: int


def _token(entry: dict[str, Any]) -> str:
    return entry.get("token") if entry.get("token") is not None else f"<token {entry['token_id']}>"


def _chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    def one(e: dict[str, Any]) -> dict[str, Any]:
        tok = _token(e)
        return {"token": tok, "logprob": e["logprob"], "bytes": list(tok.encode("utf-8"))}

    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e.get("top") or ()]} for e in entries]}


def _completion_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = [_token(e) for e in entries]
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{_token(t): t["logprob"] for t in e.get("top") or ()} for e in entries],
            "text_offset": offsets}


def _samples(row: dict[str, Any]) -> list[tuple[str, str | None]]:
    """Each choice's text and finish reason: the row's ``n > 1`` samples (the first is ``text``), else ``text``."""
    texts = row.get("samples")
    if not texts:
        return [(row["text"] or "", row["finish_reason"])]
    reasons = list(row.get("sample_finish_reasons") or ())
    reasons += [None] * (len(texts) - len(reasons))  # rows checkpointed before the reasons were recorded
    reasons[0] = row["finish_reason"]
    return [(t or "", r) for t, r in zip(texts, reasons)]


def _response_body(row: dict[str, Any], url: str, created: int) -> dict[str, Any]:
    prompt, completion = row["prompt_tokens"] or 0, row["generated_tokens"] or 0
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    entries = row.get("logprobs")  # None: the request did not ask for logprobs (kept for the first sample only)
    if url == COMPLETIONS_URL:
        logprobs = _completion_logprobs(entries) if entries is not None else None
        return {"id": f"cmpl-{row['key']}", "object": "text_completion", "created": created, "model": row["model"],
                "choices": [{"index": i, "text": text, "logprobs": logprobs if i == 0 else None,
                             "finish_reason": reason} for i, (text, reason) in enumerate(_samples(row))],
                "usage": usage}
    logprobs = _chat_logprobs(entries) if entries is not None else None
    return {"id": f"chatcmpl-{row['key']}", "object": "chat.completion", "created": created, "model": row["model"],
            "choices": [{"index": i, "message": {"role": "assistant", "content": text},
                         "logprobs": logprobs if i == 0 else None, "finish_reason": reason}
                        for i, (text, reason) in enumerate(_samples(row))],
            "usage": usage}


def _write_line(f: TextIO, obj: dict[str, Any]) -> None:
    f.write(json.dumps(obj, ensure_ascii=False, separators=(",", ":")))
    f.write("\n")


def write_openai_batch_output(results_path: str | Path, out_dir: str | Path, *, url_column: str = "url",
                              default_url: str = CHAT_URL, created: int | None = None,
                              batch_size: int = 10_000, urls: Iterable[str | None] | None = None
                              ) -> OpenAIBatchOutputs:
    """Stream ``results_path`` (written by ``finalize``) into OpenAI Batch output and error files, in row order.

    A row's endpoint (chat vs. completions format) comes from ``urls`` (one per results row, in order: the
    input's, since ``input.columns`` may leave it out of the results), else from its ``url_column`` when the
    results kept it (the openai-batch reader puts ``url`` in the fields), else ``default_url``. ``errors.jsonl``
    is always written, empty when no row failed.
    """
    out = Path(out_dir)
    endpoints = iter(urls) if urls is not None else None
    created = int(time.time()) if created is None else created
    with pq.ParquetFile(results_path) as pf:
        names = pf.schema_arrow.names
        columns = _COLUMNS + [c for c in (url_column, "logprobs", "samples", "sample_finish_reasons") if c in names]
        ok = failed = 0
        with atomic_writer(out / OUTPUT_NAME, text=True) as f_ok, atomic_writer(out / ERRORS_NAME, text=True) as f_err:
            for batch in pf.iter_batches(batch_size=batch_size, columns=columns):
                for row in batch.to_pylist():
                    endpoint = next(endpoints, None) if endpoints is not None else None
                    line: dict[str, Any] = {"id": f"batch_req_{row['key']}", "custom_id": row["id"]}
                    if row["error"] is None:
                        url = endpoint or row.get(url_column) or default_url
                        line["response"] = {"status_code": 200, "request_id": f"req_{row['key']}",
                                            "body": _response_body(row, url, created)}
                        line["error"] = None
                        _write_line(f_ok, line)
                        ok += 1
                    else:
                        line["response"] = None
                        line["error"] = {"message": row["error"], "code": row["error_kind"] or "error"}
                        _write_line(f_err, line)
                        failed += 1
    logger.info("wrote OpenAI batch output: %d responses, %d errors", ok, failed)
    return OpenAIBatchOutputs(out / OUTPUT_NAME, out / ERRORS_NAME, ok, failed)
