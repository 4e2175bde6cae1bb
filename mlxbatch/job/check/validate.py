"""Validation that needs more than the job file: the model reference, the input, the output folder, the
constraint's tokenizer.

Owns the pre-flight check of ``mlxbatch validate`` and ``mlxbatch run``: the job file's structure (``spec``), the
model (a known alias, a folder with config.json, a hub id that can be had: ``job.check.model_ref``), the input files
(they resolve and open), the output folder (``outdir``: not a file, not another job's), the templates against a
sample of rows (rows that cannot be read, fields no row provides and the template does not guard, fields some rows
lack, an id column no row has, input columns renamed in the results, and rows that do not render: a null or missing
field, a division by zero, a template limit), and what the job asks of the model (``model_fit``: ``max_tokens``
within its context, the output constraint compiled against its tokenizer). Loads no weights. Problems
make the job invalid (``JobSpecError``): among them a sample in which no row renders; warnings (some rows will
fail, with the count and the first reason) are returned to be shown.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path

from mlxbatch.io import InputFormat, InputRow, InputSpec, open_reader, resolve_inputs
from mlxbatch.io.columns import INPUT_PREFIX
from mlxbatch.io.errors import InputError
from mlxbatch.io.writers import RESULT_COLUMNS
from mlxbatch.job.check.model_fit import model_fit_problems
from mlxbatch.job.check.model_ref import model_problem
from mlxbatch.job.check.outdir import output_problems
from mlxbatch.job.rows.prompts import PromptRenderer, RenderError, TemplateSyntaxError
from mlxbatch.job.spec import JobSpec, JobSpecError, load_job
from mlxbatch.job.spec.overrides import JobOverrides

log = logging.getLogger(__name__)

SAMPLE_ROWS = 200


@dataclass(frozen=True)
class Validation:
    spec: JobSpec
    warnings: tuple[str, ...] = ()


def input_spec(spec: JobSpec) -> InputSpec:
    """The io layer's InputSpec of a job (files, or a dataset by name)."""
    i = spec.input
    if i.dataset is not None:
        return InputSpec(i.dataset, format=InputFormat.HUB, id_column=i.id_column, split=i.split, config=i.config)
    return InputSpec(i.path, format=i.format, id_column=i.id_column, split=i.split)


def validate_job(job: str | Path | JobSpec, overrides: JobOverrides | None = None,
                 writes_output: bool = True) -> JobSpec:
    """The checked JobSpec of a job file (or of its loaded spec; warnings are logged); raises JobSpecError listing
    every problem. ``writes_output`` False (``plan``, a dry run): the output folder is not checked."""
    spec = job if isinstance(job, JobSpec) else load_job(job, overrides)
    result = check_spec(spec, writes_output)
    for warning in result.warnings:
        log.warning("%s", warning)
    return result.spec


def check_spec(spec: JobSpec, writes_output: bool = True) -> Validation:
    problems: list[tuple[str, str]] = []
    warnings: list[str] = []
    reason = model_problem(spec.model.path)
    if reason is not None:
        problems.append(("model.path", reason))
    try:
        renderer = PromptRenderer(spec.prompt)
    except TemplateSyntaxError as exc:
        raise JobSpecError(spec.source, problems + [(exc.key, str(exc))]) from exc
    where = "input.dataset" if spec.input.dataset is not None else "input.path"
    ispec = input_spec(spec)
    try:
        sources = resolve_inputs(ispec)
        rows = list(itertools.islice(open_reader(ispec), min(SAMPLE_ROWS, spec.input.limit or SAMPLE_ROWS)))
    except InputError as exc:
        raise JobSpecError(spec.source, problems + [(where, str(exc))]) from exc
    if not sources:
        problems.append((where, "matches no files"))
    openai = any(s.format is InputFormat.OPENAI_BATCH for s in sources)
    good = [r for r in rows if r.ok]
    unreadable = [r for r in rows if not r.ok and not r.fields]  # not a row at all (rows without an id: below)
    if unreadable and len(unreadable) == len(rows):
        problems.append((where, f"none of the first {len(rows)} rows can be read, e.g. {unreadable[0].error}"))
    elif unreadable:
        warnings.append(f"{spec.source}: {where}: {len(unreadable)} of the first {len(rows)} rows cannot be read "
                        f"(they will be error rows of kind input), e.g. {unreadable[0].error}")
    if good and not openai:
        seen = set().union(*(r.fields for r in good))
        field_problems, field_warnings = _template_fields(spec, renderer, good, seen)
        problems += field_problems
        warnings += field_warnings
        for col in spec.sampling.overrides.values():
            if col not in seen:
                problems.append(("sampling.overrides", f"column {col!r} is in none of the first {len(good)} rows"))
        for col in spec.input.columns or ():
            if col not in seen:
                problems.append(("input.columns", f"column {col!r} is in none of the first {len(good)} rows"))
        kept = set(spec.input.columns) if spec.input.columns is not None else seen - {spec.input.id_column}
        for col in sorted(kept & RESULT_COLUMNS):
            warnings.append(f"{spec.source}: input column {col!r} is written to results.parquet as "
                            f"{INPUT_PREFIX + col!r} ({col!r} is a result column)")
        for key, col in (("output.gold", spec.task.gold_column), ("score.answer", spec.task.answer_column)):
            if col is not None and col not in seen:
                problems.append((key, f"column {col!r} is in none of the first {len(good)} rows"))
        if not field_problems:  # a field no row gives fails every row: no need to say so twice
            render_problems, render_warnings = _render_problems(spec, renderer, good)
            problems += render_problems
            warnings += render_warnings
    id_problems, id_warnings = _id_problems(spec, rows, openai)
    problems += id_problems
    warnings += id_warnings
    if writes_output:
        problems += output_problems(spec)
    if reason is None:
        problems += model_fit_problems(spec)
    if problems:
        raise JobSpecError(spec.source, problems)
    return Validation(spec, tuple(warnings))


def _template_fields(spec: JobSpec, renderer: PromptRenderer, good: list[InputRow],
                     seen: set[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Template fields no sampled row gives (a problem), and fields some rows lack (a warning with the count: those
    rows will be error rows of kind render, counted by ``max_error_rate``). A row counts as lacking a field only
    when it does not render: a template that handles the missing value (``default``, ``is defined``) is fine."""
    problems: list[tuple[str, str]] = []
    warnings: list[str] = []
    fields = renderer.fields()
    absent = sorted(fields - seen)
    if absent and not _renders(renderer, good):  # a template that guards them (| default, is defined) is fine
        for name in absent:
            problems.append(("prompt", f"template field {name!r} is in none of the first {len(good)} rows "
                                       f"(columns: {', '.join(sorted(seen))})"))
    lacking: dict[str, list[str]] = {name: [] for name in sorted(fields & seen)}
    for row in good:
        absent = [n for n in lacking if row.fields.get(n) is None]
        if not absent:
            continue
        try:
            renderer.render(row.fields, row.request)
        except RenderError:
            for name in absent:
                lacking[name].append(row.row_id)
    for name, ids in lacking.items():
        if not ids:
            continue
        share = " (more than max_error_rate: the run would stop)" \
            if len(ids) > spec.error_limit(openai=False) * len(good) else ""
        warnings.append(f"{spec.source}: prompt: template field {name!r} is missing (or null) in {len(ids)} of the "
                        f"first {len(good)} rows, which will be error rows of kind render{share} (e.g. "
                        f"{', '.join(ids[:3])}); fill it, or handle it in the template ({{{{ {name} | default('') }}}})")
    return problems, warnings


def _renders(renderer: PromptRenderer, rows: list[InputRow]) -> bool:
    """Whether some of the rows render."""
    for row in rows:
        try:
            renderer.render(row.fields, row.request)
        except RenderError:
            continue
        return True
    return False


def _id_problems(spec: JobSpec, rows: list[InputRow],
                 openai: bool) -> tuple[list[tuple[str, str]], list[str]]:
    """An id column that no sampled row has (a problem: every row would fail), or that some rows lack (a warning)."""
    column = spec.input.id_column
    readable = [r for r in rows if r.fields]
    if not column or openai or not readable:
        return [], []
    lacking = sum(1 for r in readable if r.fields.get(column) is None)
    if lacking == len(readable):
        columns = sorted(set().union(*(r.fields for r in readable)))
        return [("input.id_column", f"column {column!r} is in none of the first {len(readable)} rows "
                                     f"(columns: {', '.join(columns)})")], []
    if lacking:
        return [], [f"{spec.source}: input.id_column: {lacking} of the first {len(readable)} rows have no {column!r} "
                    "(they will be error rows)"]
    return [], []


def _render_problems(spec: JobSpec, renderer: PromptRenderer,
                     rows: list[InputRow]) -> tuple[list[tuple[str, str]], list[str]]:
    """Render the sampled rows as the run will: a problem when none renders, else a warning with how many fail
    and the first reason."""
    failed = 0
    first = ""
    for row in rows:
        try:
            renderer.render(row.fields, row.request)
        except RenderError as exc:
            failed += 1
            first = first or f"{row.source}:{row.position} (id {row.row_id!r}): {exc}"
    if not failed:
        return [], []
    summary = f"{failed} of the first {len(rows)} rows do not render, e.g. {first}"
    if failed == len(rows):
        return [("prompt", summary)], []
    limit = spec.error_limit(openai=False)  # OpenAI inputs are not rendered here
    stop = f"; more than max_error_rate={limit}: the run will stop" if failed > limit * len(rows) else ""
    return [], [f"{spec.source}: prompt: {summary} (they will be error rows{stop})"]
