"""Validation that needs the input: every template field must be provided by some row.

Owns the pre-flight check of ``mlxbatch validate`` and ``mlxbatch run``: the job file's structure (``spec``),
the input files (they resolve and open), and the template fields against a sample of rows. Loads no model.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from mlxbatch.io import InputFormat, InputSpec, open_reader, resolve_inputs
from mlxbatch.io.errors import InputError
from mlxbatch.job.prompts import PromptRenderer, RenderError
from mlxbatch.job.spec import JobSpec, JobSpecError, load_job

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
    if spec.input.id_column and good and not any(spec.input.id_column in r.fields for r in good):
        problems.append(("input.id_column", f"column {spec.input.id_column!r} is in none of the first rows"))
    problems += _constraint_problems(spec)
    if problems:
        raise JobSpecError(spec.source, problems)
    return spec


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
        tok = load_tokenizer(path)
        cfg = json.loads((path / "config.json").read_text())
    except (MlxbatchError, OSError, ValueError):
        return []  # not a local model (a hub id): the run checks the constraint when the model is loaded
    vocab = int(cfg.get("text_config", cfg).get("vocab_size") or len(tok._tokenizer))
    reason = GrammarCompiler(tok, vocab, tok.eos_token_ids).check(c)
    return [] if reason is None else [(f"output.{c.kind}", reason)]
