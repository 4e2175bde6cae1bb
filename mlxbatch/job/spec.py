"""JobSpec: the job file, parsed and validated in exactly one place.

Owns the YAML schema. Every problem is reported with its key path and reason (all of them at once) before
any model loads; a key given twice in one mapping is a problem too (YAML would silently keep the last). Structural checks live here; checks that need the input data (template fields no row
provides) live in ``job.validate``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mlxbatch.config import EngineConfig
from mlxbatch.errors import InvalidRequestError, MlxbatchError
from mlxbatch.types import CONSTRAINT_KINDS, OutputConstraint, SamplingParams

SAMPLING_KEYS = {f.name for f in dataclasses.fields(SamplingParams)}


class JobSpecError(MlxbatchError):
    """A job file that cannot run; ``problems`` lists (key path, reason)."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source, self.problems = source, problems
        lines = "\n".join(f"  {key}: {reason}" for key, reason in problems)
        super().__init__(f"{source}: {len(problems)} problem(s) in the job file:\n{lines}")


@dataclass(frozen=True)
class ModelSection:
    path: str
    dtype: str = "auto"
    adapter: str | None = None
    trust_remote_code: bool = False


@dataclass(frozen=True)
class InputSection:
    path: str
    format: str = "auto"
    id_column: str | None = None
    columns: tuple[str, ...] | None = None  # input columns to keep in the output (None: all)
    split: str | None = None  # the split of a saved Hugging Face DatasetDict
    image_roots: tuple[str, ...] = ()  # folders images may come from besides the input file's own (resolved)


@dataclass(frozen=True)
class PromptSection:
    template: str | None = None  # a plain-text prompt (Jinja over row fields)
    messages: tuple[dict[str, str], ...] | None = None  # chat messages; content is a template
    system: str | None = None  # a system message prepended to ``messages`` (or to the template as a chat)
    chat_template: bool = True  # render messages with the model's chat template


@dataclass(frozen=True)
class SamplingSection:
    params: SamplingParams
    overrides: dict[str, str] = field(default_factory=dict)  # SamplingParams field -> row column


@dataclass(frozen=True)
class CheckpointSection:
    every_rows: int = 256
    every_seconds: float = 60.0


@dataclass(frozen=True)
class EngineSection:  # the defaults are EngineConfig's (one definition)
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_num_batched_tokens: int | None = EngineConfig.max_num_batched_tokens  # None: the device's default
    prefill_chunk_size: int = EngineConfig.prefill_chunk_size
    kv_memory_fraction: float = EngineConfig.kv_memory_fraction
    prefix_cache: bool = EngineConfig.prefix_cache
    batch_invariant: bool = EngineConfig.batch_invariant


@dataclass(frozen=True)
class PlanSection:
    enabled: bool = True  # order rows along the token trie (off: longest first, LRU prefix cache)
    window: int = 10_000  # input rows planned together (memory holds one window)


@dataclass(frozen=True)
class TaskSection:
    """What each row asks for: generated text (optionally constrained) or scores of candidate continuations."""

    kind: str = "generate"  # generate | score
    constraint: OutputConstraint | None = None  # output.choice / output.regex / output.json_schema
    constraint_column: str | None = None  # a row column holding {choice: [...]} | {regex: ...} | {json_schema: ...}
    candidates: tuple[str, ...] | None = None  # score.candidates given as a list
    candidates_column: str | None = None  # score.candidates given as a column name
    answer_column: str | None = None  # score.answer: the right candidate (its index or its text), for accuracy


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
    max_error_rate: float = 0.1
    plan: PlanSection = PlanSection()
    task: TaskSection = TaskSection()
    overwrite: bool = False  # output.overwrite: take over a folder holding another job's results or other files


_TOP = {"model", "input", "prompt", "sampling", "output", "checkpoint", "engine", "seed", "max_error_rate", "plan", "task",
        "score"}
_SECTIONS: dict[str, set[str]] = {
    "model": {"path", "dtype", "adapter", "trust_remote_code"},
    "input": {"path", "format", "id_column", "columns", "split", "image_roots"},
    "prompt": {"template", "messages", "system", "chat_template"},
    "output": {"path", "choice", "regex", "json_schema", "constraint_column", "overwrite"},
    "score": {"candidates", "answer"},
    "checkpoint": {"every_rows", "every_seconds"},
    "engine": {"max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size", "kv_memory_fraction", "prefix_cache",
               "batch_invariant"},
    "plan": {"enabled", "window"},
}
_FORMATS = {"auto", "jsonl", "parquet", "hf", "openai-batch"}


class _Checker:
    def __init__(self) -> None:
        self.problems: list[tuple[str, str]] = []

    def bad(self, key: str, reason: str) -> None:
        self.problems.append((key, reason))

    def section(self, raw: dict[str, Any], name: str, shorthand: str | None = None) -> dict[str, Any]:
        value = raw.get(name)
        if value is None:
            return {}
        if shorthand and isinstance(value, str):
            return {shorthand: value}
        if not isinstance(value, dict):
            self.bad(name, f"expected a mapping, got {type(value).__name__}")
            return {}
        for key in value:
            if name in _SECTIONS and key not in _SECTIONS[name]:
                self.bad(f"{name}.{key}", f"unknown key (expected one of: {', '.join(sorted(_SECTIONS[name]))})")
        return value

    def typed(self, sec: dict[str, Any], path: str, key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        if key not in sec or sec[key] is None:
            return default
        value = sec[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            self.bad(f"{path}.{key}", f"expected {'/'.join(k.__name__ for k in kinds)}, got bool")
            return default
        if float in kinds and isinstance(value, int):
            return float(value)
        if not isinstance(value, kinds):
            self.bad(f"{path}.{key}", f"expected {'/'.join(k.__name__ for k in kinds)}, got {type(value).__name__}")
            return default
        return value

    def positive(self, path: str, value: float) -> None:
        if value <= 0:
            self.bad(path, f"must be > 0, got {value}")


def load_job(path: str | Path) -> JobSpec:
    """Read and validate a job file; raises JobSpecError listing every problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        duplicates = _duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader))
        raw = yaml.safe_load(text)
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
    return parse_job(raw, source=str(path), base_dir=path.parent)


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


def parse_job(raw: dict[str, Any], source: str = "<job>", base_dir: Path | None = None) -> JobSpec:
    c = _Checker()
    base = base_dir or Path.cwd()
    for key in raw:
        if key not in _TOP:
            c.bad(key, f"unknown key (expected one of: {', '.join(sorted(_TOP))})")
    openai = isinstance(raw.get("input"), dict) and raw["input"].get("format") == "openai-batch"
    for key in ("model", "input", "output") + (() if openai else ("prompt",)):
        if raw.get(key) is None:
            c.bad(key, "required" + ("" if key != "prompt" else " (unless input.format is openai-batch)"))

    m = c.section(raw, "model", shorthand="path")
    model = ModelSection(
        path=c.typed(m, "model", "path", str, ""), dtype=c.typed(m, "model", "dtype", str, "auto"),
        adapter=c.typed(m, "model", "adapter", str, None),
        trust_remote_code=c.typed(m, "model", "trust_remote_code", bool, False))
    if raw.get("model") is not None and not model.path:
        c.bad("model.path", "required: a local folder, a hub id or the alias smollm2")
    if model.dtype not in ("auto", "float32", "float16", "bfloat16"):
        c.bad("model.dtype", f"expected auto, float32, float16 or bfloat16, got {model.dtype!r}")
    if model.path and (model.path.startswith((".", "/", "~")) or (base / model.path).exists()):
        model = dataclasses.replace(model, path=str(_resolve(base, model.path)))
        if not Path(model.path).exists():
            c.bad("model.path", f"no such folder: {model.path}")
    if model.adapter:
        model = dataclasses.replace(model, adapter=str(_resolve(base, model.adapter)))
        if not Path(model.adapter).exists():
            c.bad("model.adapter", f"no such folder: {model.adapter}")

    i = c.section(raw, "input", shorthand="path")
    columns = c.typed(i, "input", "columns", list, None)
    if columns is not None and not all(isinstance(x, str) for x in columns):
        c.bad("input.columns", "expected a list of column names")
        columns = None
    inp = InputSection(path=c.typed(i, "input", "path", str, ""), format=c.typed(i, "input", "format", str, "auto"),
                       id_column=c.typed(i, "input", "id_column", str, None),
                       columns=tuple(columns) if columns is not None else None,
                       split=c.typed(i, "input", "split", str, None))
    roots = c.typed(i, "input", "image_roots", list, [])
    for n, r in enumerate(roots):
        if not isinstance(r, str) or not r or not _resolve(base, r).is_dir():
            c.bad(f"input.image_roots[{n}]", f"expected an existing folder, got {r!r}")
    inp = dataclasses.replace(inp, image_roots=tuple(str(_resolve(base, r)) for r in roots if isinstance(r, str)))
    if raw.get("input") is not None and not inp.path:
        c.bad("input.path", "required: a file, folder or glob")
    if inp.format not in _FORMATS:
        c.bad("input.format", f"expected one of {', '.join(sorted(_FORMATS))}, got {inp.format!r}")
    if inp.path:
        inp = dataclasses.replace(inp, path=str(_resolve(base, inp.path)))
        if not any(ch in inp.path for ch in "*?[") and not Path(inp.path).exists():
            c.bad("input.path", f"no such file or folder: {inp.path}")

    p = c.section(raw, "prompt", shorthand="template")
    messages = c.typed(p, "prompt", "messages", list, None)
    if messages is not None:
        for n, msg in enumerate(messages):
            if not isinstance(msg, dict) or set(msg) - {"role", "content"} or not isinstance(msg.get("content"), str) \
                    or msg.get("role") not in ("system", "user", "assistant"):
                c.bad(f"prompt.messages[{n}]", "expected {role: system|user|assistant, content: <template>}")
    prompt = PromptSection(template=c.typed(p, "prompt", "template", str, None),
                           messages=tuple(messages) if messages else None,
                           system=c.typed(p, "prompt", "system", str, None),
                           chat_template=c.typed(p, "prompt", "chat_template", bool, True))
    if openai and raw.get("prompt") is None:
        prompt = PromptSection(template="{{ prompt }}")  # rows without messages use their body's prompt
    elif raw.get("prompt") is not None and (prompt.template is None) == (prompt.messages is None):
        c.bad("prompt", "give exactly one of prompt.template or prompt.messages")

    sampling = _sampling(c, raw)
    o = c.section(raw, "output", shorthand="path")
    out_path = c.typed(o, "output", "path", str, "")
    if raw.get("output") is not None and not out_path:
        c.bad("output.path", "required: the output folder")
    overwrite = c.typed(o, "output", "overwrite", bool, False)
    task = _task(c, raw, o)
    ck = c.section(raw, "checkpoint")
    checkpoint = CheckpointSection(c.typed(ck, "checkpoint", "every_rows", int, 256),
                                   c.typed(ck, "checkpoint", "every_seconds", float, 60.0))
    c.positive("checkpoint.every_rows", checkpoint.every_rows)
    c.positive("checkpoint.every_seconds", checkpoint.every_seconds)
    e = c.section(raw, "engine")
    kinds = {"float": float, "bool": bool}
    engine = EngineSection(*(c.typed(e, "engine", f.name, kinds.get(str(f.type), int), f.default)
                             for f in dataclasses.fields(EngineSection)))
    for f in dataclasses.fields(EngineSection):
        if getattr(engine, f.name) is not None and str(f.type) != "bool":
            c.positive(f"engine.{f.name}", getattr(engine, f.name))
    if not 0 < engine.kv_memory_fraction <= 1:
        c.bad("engine.kv_memory_fraction", f"must be in (0, 1], got {engine.kv_memory_fraction}")
    pl = c.section(raw, "plan")
    plan = PlanSection(c.typed(pl, "plan", "enabled", bool, True), c.typed(pl, "plan", "window", int, 10_000))
    c.positive("plan.window", plan.window)
    seed = c.typed(raw, "<top>", "seed", int, 0)
    max_error_rate = c.typed(raw, "<top>", "max_error_rate", float, 0.1)
    if not 0 <= max_error_rate <= 1:
        c.bad("max_error_rate", f"must be in [0, 1], got {max_error_rate}")
    c.problems = [(k.replace("<top>.", ""), r) for k, r in c.problems]
    if c.problems:
        raise JobSpecError(source, c.problems)
    return JobSpec(source, model, inp, prompt, sampling, _resolve(base, out_path), checkpoint, engine, seed,
                   max_error_rate, plan, task, overwrite)


def _sampling(c: _Checker, raw: dict[str, Any]) -> SamplingSection:
    s = c.section(raw, "sampling")
    overrides = s.get("overrides") or {}
    if not isinstance(overrides, dict) or not all(isinstance(v, str) for v in overrides.values()):
        c.bad("sampling.overrides", "expected a mapping of sampling parameter -> column name")
        overrides = {}
    for key in overrides:
        if key not in SAMPLING_KEYS:
            c.bad(f"sampling.overrides.{key}", "not a sampling parameter")
    values = {k: v for k, v in s.items() if k != "overrides"}
    for key in list(values):
        if key == "constraint":
            c.bad("sampling.constraint", "set output.choice, output.regex or output.json_schema instead")
            values.pop(key)
        elif key not in SAMPLING_KEYS:
            c.bad(f"sampling.{key}", f"unknown key (expected one of: {', '.join(sorted(SAMPLING_KEYS - {'constraint'}))},"
                                     " overrides)")
            values.pop(key)
    for key, kind in (("stop", "strings"), ("stop_token_ids", "token ids")):
        value = values.get(key)
        if isinstance(value, list):
            values[key] = tuple(value)
        elif value is not None and not (key == "stop" and isinstance(value, str)):
            c.bad(f"sampling.{key}", f"expected a list of {kind}, got {type(value).__name__}")
            values.pop(key)
    values.setdefault("temperature", 0.0)  # offline jobs default to greedy: reproducible labels
    bad = False
    for key, value in values.items():  # each value alone first: every bad key is named, all at once
        try:
            SamplingParams(**{"temperature": 0.0, key: value})
        except (ValueError, TypeError) as exc:
            if getattr(exc, "field", key) == key:
                c.bad(f"sampling.{key}", getattr(exc, "reason", f"invalid value {value!r:.60} ({exc})"))
                bad = True
    try:
        params = SamplingParams(**values)
    except (ValueError, TypeError) as exc:  # a combination (min_tokens > max_tokens, ...)
        if not bad:
            field_name = getattr(exc, "field", None)
            c.bad(f"sampling.{field_name}" if field_name else "sampling", getattr(exc, "reason", str(exc)))
        params = SamplingParams(temperature=0.0)
    return SamplingSection(params, dict(overrides))


def constraint_from(value: Any, where: str) -> OutputConstraint:
    """An OutputConstraint from a mapping with exactly one of choice / regex / json_schema (job file or row)."""
    if not isinstance(value, dict):
        raise InvalidRequestError(where, value, "expected a mapping with one of choice, regex, json_schema")
    given = [k for k in CONSTRAINT_KINDS if value.get(k) is not None]
    if len(given) != 1:
        raise InvalidRequestError(where, sorted(value), "give exactly one of choice, regex, json_schema")
    kind = given[0]
    v = value[kind]
    if kind == "json_schema":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"{where}.json_schema", v[:60], f"not valid JSON: {exc}") from exc
        if not isinstance(v, dict):
            raise InvalidRequestError(f"{where}.json_schema", v, "expected a JSON schema object")
        return OutputConstraint.json_schema(v)
    try:
        return OutputConstraint(kind, v)
    except InvalidRequestError as exc:  # name the key as the user wrote it, not the engine's field
        raise InvalidRequestError(f"{where}.{kind}", exc.value, exc.reason) from None


def _task(c: _Checker, raw: dict[str, Any], out: dict[str, Any]) -> TaskSection:
    kind = c.typed(raw, "<top>", "task", str, "generate")
    if kind not in ("generate", "score"):
        c.bad("task", f"expected generate or score, got {kind!r}")
    constraint = None
    if any(out.get(k) is not None for k in CONSTRAINT_KINDS):
        try:
            constraint = constraint_from({k: out.get(k) for k in CONSTRAINT_KINDS}, "output")
        except InvalidRequestError as exc:
            c.bad(exc.field, exc.reason)
    column = c.typed(out, "output", "constraint_column", str, None)
    s = c.section(raw, "score")
    cands = s.get("candidates")
    candidates = candidates_column = None
    if isinstance(cands, str):
        candidates_column = cands
    elif isinstance(cands, list) and cands and all(isinstance(x, str) and x for x in cands):
        candidates = tuple(cands)
    elif cands is not None:
        c.bad("score.candidates", "expected a non-empty list of non-empty strings, or a column name")
    answer = c.typed(s, "score", "answer", str, None)
    if kind == "score":
        if cands is None:
            c.bad("score.candidates", "required when task is score (a list, or the column holding each row's list)")
        if constraint is not None or column is not None:
            c.bad("output", "choice / regex / json_schema constrain generated text; task score generates none")
    elif s:
        c.bad("score", "only used with task: score")
    return TaskSection(kind, constraint, column, candidates, candidates_column, answer)


def _resolve(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return (p if p.is_absolute() else (base / p)).resolve()
