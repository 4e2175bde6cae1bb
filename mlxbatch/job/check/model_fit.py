"""What a job asks of its model, checked against the model's tokenizer and config.json before the weights load.

Owns two checks of ``validate`` (and so of ``run``): ``max_tokens`` against the model's context (a job asking for
more output than the context holds is refused, not run to be cut), and the output constraint compiled against the
tokenizer with ``max_tokens`` long enough for the shortest output it allows. Reads the model's folder (an alias's,
built or fetched as for a run; a hub id's cached snapshot); a model that is not there is left to the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxbatch.errors import MlxbatchError
from mlxbatch.job.check.model_ref import local_model_dir
from mlxbatch.job.spec import JobSpec


def model_fit_problems(spec: JobSpec) -> list[tuple[str, str]]:
    """(key, reason) for what the model cannot do for this job; [] when its folder is not at hand."""
    try:
        path = local_model_dir(spec.model.path)
        config = json.loads((path / "config.json").read_text())
    except (MlxbatchError, OSError, ValueError):
        return []  # not a local model (an uncached hub id): the run checks these when the model is loaded
    problems = _context_problems(spec, config)
    return problems + _constraint_problems(spec, path, config)


def context_length(config: dict[str, Any]) -> int | None:
    """The context a model's config.json states, as the engine's loader reads it (None: it states none)."""
    for section in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_sequence_length"):
            value = section.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _context_problems(spec: JobSpec, config: dict[str, Any]) -> list[tuple[str, str]]:
    context = context_length(config)
    max_tokens = spec.sampling.params.max_tokens
    if context is None or "max_tokens" in spec.sampling.overrides or max_tokens <= context:
        return []  # rows that set their own are checked as they run
    return [("sampling.max_tokens", f"{max_tokens} is more than the model's context, {context} tokens (the prompt "
                                    f"and the output together): set it to at most {context} less the prompt's "
                                    "length")]


def _constraint_problems(spec: JobSpec, path: Path, cfg: dict[str, Any]) -> list[tuple[str, str]]:
    """The job's output constraint compiled against the model's tokenizer (tokenizer files only, no weights), and
    ``max_tokens`` against the shortest output it allows."""
    c = spec.task.constraint
    if c is None:
        return []
    from mlx_lm.utils import load_tokenizer

    from mlxbatch.engine import GrammarCompiler
    from mlxbatch.job.check.shortest import shortest_output

    try:
        tok = load_tokenizer(path, {"trust_remote_code": spec.model.trust_remote_code})
    except (OSError, ValueError):
        return []  # the run says why when the model is loaded
    vocab = int(cfg.get("text_config", cfg).get("vocab_size") or len(tok._tokenizer))
    compiler = GrammarCompiler(tok, vocab, tok.eos_token_ids)
    reason = compiler.check(c)
    if reason is not None:
        return [(f"output.{c.kind}", reason)]
    if "max_tokens" in spec.sampling.overrides:
        return []  # rows set their own
    shortest = shortest_output(c, tok, compiler)
    max_tokens = spec.sampling.params.max_tokens
    if shortest is not None and shortest.tokens > max_tokens:
        return [("sampling.max_tokens", f"{max_tokens} is too small for any output output.{c.kind} allows: the "
                                        f"shortest, {shortest.text[:120]}, takes {shortest.tokens} tokens (every "
                                        f"row would be cut: errors of kind truncated)")]
    return []
