"""Validation that needs the input: every template field must be provided by some row, and rows must render.

Owns the pre-flight check of ``mlxbatch validate`` and ``mlxbatch run``: the job file's structure (``spec``),
the input files (they resolve and open), the output folder (``outdir``: not a file, not another job's), and the
templates against a sample of rows: fields no row provides, an id column no row has, and rows that do not render
(a null or missing field, a division by zero, a template limit): a problem when no sampled row renders, a logged
warning (with the count and the first reason) when some do not. Loads no model.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

from mlxbatch.io import InputFormat, InputRow, InputSpec, open_reader, resolve_inputs
from mlxbatch.io.errors import InputError
from mlxbatch.job.outdir import output_problems
from mlxbatch.job.prompts import PromptRenderer, RenderError
from mlxbatch.job.spec import JobSpec, JobSpecError, load_job

log = logging.getLogger(__name__)

SAMPLE_ROWS = 200


def validate_job(path: str | Path) -> JobSpec:
    spec = load_job(path)
    problems: list[tuple[str, str]] = []
    try:
        renderer = PromptRenderer(spec.prompt)
    except RenderError as exc:
        raise JobSpecError(spec.source, [("prompt", str(exc))]) from exc
    ispec = InputSpec(spec.input.path, format=spec.input.format, id_column=spec.input.id_column,
                      split=spec.input.split)
    try:
        sources = resolve_inputs(ispec)
        rows = list(itertools.islice(open_reader(ispec), SAMPLE_ROWS))
    except InputError as exc:
        raise JobSpecError(spec.source, [("input.path", str(exc))]) from exc
    if not sources:
        problems.append(("input.path", "matches no files"))
    openai = any(s.format is InputFormat.OPENAI_BATCH for s in sources)
    good = [r for r in rows if r.ok]
    if good and not openai:
        seen = set().union(*(r.fields for r in good))
        for name in sorted(renderer.fields() - seen):
            problems.append(("prompt", f"template field {name!r} is in none of the first {len(good)} rows "
                                       f"(columns: {', '.join(sorted(seen))})"))
        for col in spec.sampling.overrides.values():
            if col not in seen:
                problems.append(("sampling.overrides", f"column {col!r} is in none of the first {len(good)} rows"))
        for col in spec.input.columns or ():
            if col not in seen:
                problems.append(("input.columns", f"column {col!r} is in none of the first {len(good)} rows"))
        if not problems:
            problems += _render_problems(spec, renderer, good)
    problems += _id_problems(spec, rows, openai)
    problems += output_problems(spec)
    problems += _constraint_problems(spec)
    if problems:
        raise JobSpecError(spec.source, problems)
    return spec


def _id_problems(spec: JobSpec, rows: list[InputRow], openai: bool) -> list[tuple[str, str]]:
    """An id column that no sampled row has (every row would fail), or that some rows lack (a warning)."""
    column = spec.input.id_column
    readable = [r for r in rows if r.fields]
    if not column or openai or not readable:
        return []
    lacking = sum(1 for r in readable if r.fields.get(column) is None)
    if lacking == len(readable):
        columns = sorted(set().union(*(r.fields for r in readable)))
        return [("input.id_column", f"column {column!r} is in none of the first {len(readable)} rows "
                                    f"(columns: {', '.join(columns)})")]
    if lacking:
        log.warning("input.id_column: %d of the first %d rows have no %r (they will be error rows)", lacking,
                    len(readable), column)
    return []


def _render_problems(spec: JobSpec, renderer: PromptRenderer, rows: list[InputRow]) -> list[tuple[str, str]]:
    """Render the sampled rows as the run will; report how many fail and the first reason."""
    failed = 0
    first = ""
    for row in rows:
        try:
            renderer.render(row.fields, row.request)
        except RenderError as exc:
            failed += 1
            first = first or f"{row.source}:{row.position} (id {row.row_id!r}): {exc}"
    if not failed:
        return []
    summary = f"{failed} of the first {len(rows)} rows do not render, e.g. {first}"
    if failed == len(rows):
        return [("prompt", summary)]
    log.warning("prompt: %s (they will be error rows%s)", summary,
                f"; more than max_error_rate={spec.max_error_rate}: the run will stop"
                if failed > spec.max_error_rate * len(rows) else "")
    return []


def _constraint_problems(spec: JobSpec) -> list[tuple[str, str]]:
    """The job's output constraint compiled against the model's tokenizer (tokenizer files only, no weights)."""
    c = spec.task.constraint
    if c is None:
        return []
    import json

    from mlx_lm.utils import load_tokenizer

    from mlxbatch.engine import GrammarCompiler, resolve_path
    from mlxbatch.errors import MlxbatchError

    try:
        path = Path(resolve_path(spec.model.path))
        tok = load_tokenizer(path, {"trust_remote_code": spec.model.trust_remote_code})
        cfg = json.loads((path / "config.json").read_text())
    except (MlxbatchError, OSError, ValueError):
        return []  # not a local model (a hub id): the run checks the constraint when the model is loaded
    vocab = int(cfg.get("text_config", cfg).get("vocab_size") or len(tok._tokenizer))
    reason = GrammarCompiler(tok, vocab, tok.eos_token_ids).check(c)
    return [] if reason is None else [(f"output.{c.kind}", reason)]
