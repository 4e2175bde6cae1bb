"""JobSpec: the job file, parsed and validated in exactly one place.

Owns the YAML schema: the file as a whole (its top-level keys, keys given twice, the order its sections are parsed
in) and the ``JobSpec`` assembled from its sections (``job.spec.sections``: each section's keys, types and checks;
``job.spec.task``: the task and output constraint; ``job.spec.executor``: the executor section).
Every problem is reported with its key path and reason (all of them at once) before any model loads; a key given
twice in one mapping is a problem too (YAML would silently keep the last). Structural checks live here; checks that
need the input data (template fields no row provides) live in ``job.check.validate``.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mlxbatch.errors import MlxbatchError
from mlxbatch.job.spec.checker import Checker
from mlxbatch.job.spec.executor import ExecutorSection, parse_executor
from mlxbatch.job.spec.overrides import JobOverrides, apply_overrides, trial_changes
from mlxbatch.job.spec.sections import (
    SAMPLING_KEYS,
    CheckpointSection,
    EngineSection,
    InputSection,
    ModelSection,
    PlanSection,
    PromptSection,
    SamplingSection,
    parse_checkpoint,
    parse_engine,
    parse_input,
    parse_model,
    parse_plan,
    parse_prompt,
    parse_sampling,
    resolve_path,
)
from mlxbatch.job.spec.task import TaskSection, constraint_from, parse_task

__all__ = ["SAMPLING_KEYS", "CheckpointSection", "EngineSection", "ExecutorSection", "InputSection", "JobSpec",
           "JobSpecError", "ModelSection", "PlanSection", "PromptSection", "SamplingSection", "TaskSection",
           "constraint_from", "load_job", "parse_job", "with_executor"]

DEFAULT_MAX_ERROR_RATE = 0.1


class JobSpecError(MlxbatchError):
    """A job file that cannot run; ``problems`` lists (key path, reason)."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source, self.problems = source, problems
        lines = "\n".join(f"  {key}: {reason}" for key, reason in problems)
        super().__init__(f"{source}: {len(problems)} problem(s) in the job file:\n{lines}")


@dataclass(frozen=True)
class JobSpec:
    source: str  # the job file
    model: ModelSection
    input: InputSection
    prompt: PromptSection
    sampling: SamplingSection
    output: Path
    checkpoint: CheckpointSection = CheckpointSection()
    engine: EngineSection = EngineSection()
    seed: int = 0
    max_error_rate: float | None = None  # None: not set in the job (``error_limit`` applies the default)
    plan: PlanSection = PlanSection()
    task: TaskSection = TaskSection()
    overwrite: bool = False  # output.overwrite: take over a folder holding another job's results or other files
    executor: ExecutorSection = ExecutorSection()  # where rows run: this process or engine actors (Ray)
    raw: dict[str, Any] | None = field(default=None, compare=False, repr=False)  # the mapping it was parsed from
    base_dir: Path | None = field(default=None, compare=False, repr=False)  # relative paths are relative to it
    # the job keys the command line (--limit, --set; run_job's changes) changes outside the run settings: a trial,
    # whose results are not the job file's (``overrides.trial_changes``); () for the job as its file says
    trial: tuple[str, ...] = field(default=(), compare=False)

    def error_limit(self, openai: bool) -> float:
        """The share of rows that may fail: the job's ``max_error_rate``; when the job does not set it,
        ``DEFAULT_MAX_ERROR_RATE``, except for OpenAI Batch input, which follows the Batch API: the batch completes
        and its failed requests are listed in ``errors.jsonl`` (1.0: no limit)."""
        if self.max_error_rate is not None:
            return self.max_error_rate
        return 1.0 if openai else DEFAULT_MAX_ERROR_RATE


MAX_VALUES = 100_000  # in one job file, aliases expanded: a short file with nested aliases can name billions
_TOP = {"model", "input", "prompt", "sampling", "output", "checkpoint", "engine", "seed", "max_error_rate", "plan", "task",
        "score", "executor"}


def load_job(path: str | Path, overrides: JobOverrides | None = None) -> JobSpec:
    """Read and validate a job file (with command-line ``overrides``); raises JobSpecError listing every problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        document = yaml.compose(named_stream(text, str(path)), Loader=yaml.SafeLoader)
        if _values(document, {}) > MAX_VALUES:
            raise JobSpecError(str(path), [("<file>", f"its aliases (*name) expand it to more than {MAX_VALUES:,} "
                                                      "values: a job file is a few hundred (an alias bomb?)")])
        duplicates = _duplicate_keys(document)
        raw = yaml.safe_load(named_stream(text, str(path)))
    except FileNotFoundError as exc:
        raise JobSpecError(str(path), [("<file>", "no such file")]) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise JobSpecError(str(path), [("<file>", f"cannot be read: {exc}")]) from exc
    except yaml.YAMLError as exc:
        raise JobSpecError(str(path), [("<file>", f"not valid YAML: {exc}")]) from exc
    if duplicates:
        raise JobSpecError(str(path), duplicates)
    if not isinstance(raw, dict):
        raise JobSpecError(str(path), [("<file>", "the job file must be a YAML mapping")])
    return parse_job(raw, source=str(path), base_dir=path.parent, overrides=overrides)


def named_stream(text: str, name: str) -> io.StringIO:
    """``text`` as a stream YAML's errors name ``name`` by (a bare string is "<unicode string>" to them)."""
    stream = io.StringIO(text)
    stream.name = name  # type: ignore[misc]
    return stream


def _values(node: yaml.Node | None, seen: dict[int, int]) -> int:
    """How many values the composed document holds once its aliases are expanded (an alias is the node it names:
    counted once per use, each node's count computed once)."""
    if node is None:
        return 0
    known = seen.get(id(node))
    if known is not None:
        return known
    seen[id(node)] = 1  # a node that contains itself (a recursive alias) counts once
    if isinstance(node, yaml.MappingNode):
        total = 1 + sum(_values(k, seen) + _values(v, seen) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        total = 1 + sum(_values(item, seen) for item in node.value)
    else:
        total = 1
    seen[id(node)] = total
    return total


def _duplicate_keys(node: yaml.Node | None, path: str = "") -> list[tuple[str, str]]:
    """(key path, reason) for every key given twice in one mapping of a composed YAML document."""
    problems: list[tuple[str, str]] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            name = str(key.value) if isinstance(key, yaml.ScalarNode) else "<key>"
            where = f"{path}.{name}" if path else name
            if name in seen and name != "<<":
                problems.append((where, f"given twice (lines {seen[name]} and {key.start_mark.line + 1}); "
                                        "remove one"))
            seen.setdefault(name, key.start_mark.line + 1)
            problems += _duplicate_keys(value, where)
    elif isinstance(node, yaml.SequenceNode):
        for n, item in enumerate(node.value):
            problems += _duplicate_keys(item, f"{path}[{n}]")
    return problems


def parse_job(raw: dict[str, Any], source: str = "<job>", base_dir: Path | None = None,
              overrides: JobOverrides | None = None) -> JobSpec:
    """A JobSpec from a job mapping (with command-line ``overrides``); raises JobSpecError listing every problem.
    The sections are parsed in the file's reading order, so problems are listed in that order."""
    c = Checker()
    base = (base_dir or Path.cwd()).resolve()
    original = raw
    raw, c.problems = apply_overrides(raw, overrides)
    for key in raw:
        if key not in _TOP:
            c.unknown(key, _TOP)
    openai = isinstance(raw.get("input"), dict) and raw["input"].get("format") == "openai-batch"
    for key in ("model", "input", "output") + (() if openai else ("prompt",)):
        if raw.get(key) is None:
            c.bad(key, "required" + ("" if key != "prompt" else " (unless input.format is openai-batch)"))

    model = parse_model(c, raw, base)
    inp = parse_input(c, raw, base)
    prompt = parse_prompt(c, raw, openai)
    sampling = parse_sampling(c, raw)
    o = c.section(raw, "output", shorthand="path")
    out_path = c.typed(o, "output", "path", str, "")
    if raw.get("output") is not None and not out_path:
        c.bad("output.path", "required: the output folder")
    overwrite = c.typed(o, "output", "overwrite", bool, False)
    task = parse_task(c, raw, o)
    for answers in (task.gold_column, task.answer_column):  # kept: correct is checked on it at finalize
        if answers is not None and inp.columns is not None and answers not in inp.columns:
            inp = dataclasses.replace(inp, columns=inp.columns + (answers,))
    checkpoint = parse_checkpoint(c, raw)
    engine = parse_engine(c, raw)
    plan = parse_plan(c, raw)
    seed = c.typed(raw, "<top>", "seed", int, 0)
    max_error_rate = c.typed(raw, "<top>", "max_error_rate", float, None)
    if max_error_rate is not None and not 0 <= max_error_rate <= 1:
        c.bad("max_error_rate", f"must be in [0, 1], got {max_error_rate}")
    executor = parse_executor(c, raw)
    c.problems = [(k.replace("<top>.", ""), r) for k, r in c.problems]
    if c.problems:
        raise JobSpecError(source, c.problems)
    return JobSpec(source, model, inp, prompt, sampling, resolve_path(base, out_path), checkpoint, engine, seed,
                   max_error_rate, plan, task, overwrite, executor, raw=raw, base_dir=base,
                   trial=trial_changes(original, raw))


def with_executor(spec: JobSpec, kind: str | None, address: str | None = None) -> JobSpec:
    """``spec`` with the command line's choice of executor (``--ray [ADDRESS]`` / ``--local``) applied."""
    x = spec.executor
    if kind is None and address is None:
        return spec
    return dataclasses.replace(spec, executor=dataclasses.replace(x, kind=kind or x.kind, address=address or x.address))
