"""The job file's sections: a dataclass and a parser for each (model, input, prompt, sampling, checkpoint, engine,
plan), each reporting its problems to a ``Checker`` (``job.spec.checker``).

Owns what each section's keys mean: their types, defaults and checks. A parser reports problems to the checker and
returns its section (with defaults where a value was bad), so every problem of a file is found in one pass.
``job.spec.job`` owns the file as a whole (top-level keys, keys given twice, the order sections are parsed in) and
assembles the ``JobSpec``; ``job.spec.task`` holds the task and output constraint, ``job.spec.executor`` the
executor section.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxbatch.config import EngineConfig
from mlxbatch.io.images import MIN_IMAGE_PIXELS
from mlxbatch.job.spec.checker import SAMPLING_KEYS, Checker
from mlxbatch.types import SamplingParams


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
    split: str | None = None  # the split of a saved Hugging Face DatasetDict (or of input.dataset)
    image_roots: tuple[str, ...] = ()  # folders images may come from besides the input file's own (resolved)
    max_image_pixels: int | None = None  # a larger image is scaled down to at most this many pixels (None: as it is)
    limit: int | None = None  # read only the first ``limit`` rows (trial runs: --limit)
    dataset: str | None = None  # a Hugging Face dataset by name (owner/name) or a local folder of data files, streamed
    config: str | None = None  # the configuration (subset) of input.dataset


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
    max_num_seqs: int | None = EngineConfig.max_num_seqs  # None: by the device and the KV budget
    max_num_batched_tokens: int | None = EngineConfig.max_num_batched_tokens  # None: the device's default
    prefill_chunk_size: int = EngineConfig.prefill_chunk_size
    kv_memory_fraction: float | None = EngineConfig.kv_memory_fraction  # None: the device's default share
    prefix_cache: bool = EngineConfig.prefix_cache
    batch_invariant: bool = EngineConfig.batch_invariant
    overlap_steps: bool | None = EngineConfig.overlap_steps  # None: by device


@dataclass(frozen=True)
class PlanSection:
    enabled: bool = True  # order rows along the token trie (off: longest first, LRU prefix cache)
    window: int = 10_000  # input rows planned together (memory holds one window)
    # the run starts with smaller windows (``window_sizes``); not a job key: off only where a resumed run follows a
    # first run that had none (``job.run.run_meta``)
    ramp: bool = True


RAMP = (8, 4, 2)  # the first windows of a run: its window / 8, / 4, / 2 ...
MIN_RAMP_ROWS = 64  # ... those of this many rows or more


def window_sizes(window: int, ramp: bool = True) -> Iterator[int]:
    """The rows of each window a run cuts its input into, in order: ``window`` rows each, after a ramp of smaller
    ones (``ramp``). The engine waits for its first window to be read, rendered, tokenized and planned; an eighth of
    it is ready in an eighth of the time, and each next window is prepared while the engine runs the one before
    (preparing is several times faster than running). Sharing across windows is kept by the prefix cache. The run's
    feed and ``mlxbatch plan`` cut by this one rule, and a resumed run cuts as its first run did."""
    if ramp:
        yield from (window // d for d in RAMP if window // d >= MIN_RAMP_ROWS)
    while True:
        yield window


_FORMATS = {"auto", "jsonl", "parquet", "hf", "openai-batch"}


def parse_model(c: Checker, raw: dict[str, Any], base: Path) -> ModelSection:
    """``model``: a folder (resolved from ``base``), a hub id or an alias; dtype, adapter, trust_remote_code."""
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
        model = dataclasses.replace(model, path=str(resolve_path(base, model.path)))
        if not Path(model.path).exists():
            c.bad("model.path", f"no such folder: {model.path}")
    if model.adapter:
        model = dataclasses.replace(model, adapter=str(resolve_path(base, model.adapter)))
        lora = Path(model.adapter)
        if not lora.exists():
            c.bad("model.adapter", f"no such folder: {model.adapter}")
        elif not (lora / "adapter_config.json").is_file() or not (lora / "adapters.safetensors").is_file():
            c.bad("model.adapter", f"{model.adapter}: expected a folder with adapter_config.json and "
                                   "adapters.safetensors (mlx-lm LoRA layout)")
    return model


def parse_input(c: Checker, raw: dict[str, Any], base: Path) -> InputSection:
    """``input``: files (``path``) or a dataset by name (``dataset``); columns, split, limit, image_roots,
    max_image_pixels."""
    i = c.section(raw, "input", shorthand="path")
    columns = c.typed(i, "input", "columns", list, None)
    if columns is not None and not all(isinstance(x, str) for x in columns):
        c.bad("input.columns", "expected a list of column names")
        columns = None
    inp = InputSection(path=c.typed(i, "input", "path", str, ""), format=c.typed(i, "input", "format", str, "auto"),
                       id_column=c.typed(i, "input", "id_column", str, None),
                       columns=tuple(columns) if columns is not None else None,
                       split=c.typed(i, "input", "split", str, None), limit=c.typed(i, "input", "limit", int, None),
                       dataset=c.typed(i, "input", "dataset", str, None),
                       config=c.typed(i, "input", "config", str, None))
    if inp.limit is not None:
        c.positive("input.limit", inp.limit)
    most = c.typed(i, "input", "max_image_pixels", int, None)
    if most is not None and most < MIN_IMAGE_PIXELS:
        c.bad("input.max_image_pixels", f"expected at least {MIN_IMAGE_PIXELS} pixels (e.g. 1003520 = 1280 x 28 x 28, "
                                        f"~1,280 image tokens on Qwen2-VL), got {most}")
        most = None
    inp = dataclasses.replace(inp, max_image_pixels=most)
    roots = c.typed(i, "input", "image_roots", list, [])
    for n, r in enumerate(roots):
        if not isinstance(r, str) or not r or not resolve_path(base, r).is_dir():
            c.bad(f"input.image_roots[{n}]", f"expected an existing folder, got {r!r}")
    inp = dataclasses.replace(inp, image_roots=tuple(str(resolve_path(base, r)) for r in roots if isinstance(r, str)))
    if inp.dataset is not None:
        if inp.path:
            c.bad("input", "give one of input.path (files) or input.dataset (a dataset by name), not both")
        if inp.format not in ("auto", "hf"):
            c.bad("input.format", f"input.dataset is read by the datasets library; format {inp.format!r} does not apply")
        local = resolve_path(base, inp.dataset)
        if inp.dataset.startswith((".", "/", "~")) or local.exists():
            if not local.exists():
                c.bad("input.dataset", f"no such folder: {local}")
            inp = dataclasses.replace(inp, dataset=str(local))
        elif inp.dataset.count("/") > 1 or not inp.dataset.strip("/"):
            c.bad("input.dataset", f"expected a Hugging Face dataset name (owner/name) or a local folder, "
                                   f"got {inp.dataset!r}")
        return inp
    if inp.config is not None:
        c.bad("input.config", "only used with input.dataset")
    if raw.get("input") is not None and not inp.path:
        c.bad("input.path", "required: a file, folder or glob (or input.dataset: a dataset by name)")
    if inp.format not in _FORMATS:
        c.bad("input.format", f"expected one of {', '.join(sorted(_FORMATS))}, got {inp.format!r}")
    if inp.path:
        inp = dataclasses.replace(inp, path=str(resolve_path(base, inp.path)))
        if not any(ch in inp.path for ch in "*?[") and not Path(inp.path).exists():
            c.bad("input.path", f"no such file or folder: {inp.path}")
    return inp


def parse_prompt(c: Checker, raw: dict[str, Any], openai: bool) -> PromptSection:
    """``prompt``: a template or chat messages (OpenAI Batch inputs: the body's prompt when none is given)."""
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
    return prompt


def parse_sampling(c: Checker, raw: dict[str, Any]) -> SamplingSection:
    """``sampling``: SamplingParams (jobs default to greedy) and per-row column overrides; every bad value named."""
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
            c.bad("sampling.constraint", "set an output constraint with output.choice, output.regex or "
                                         "output.json_schema (or per row with output.constraint_column)")
            values.pop(key)
        elif key not in SAMPLING_KEYS:
            c.unknown(f"sampling.{key}", SAMPLING_KEYS | {"overrides"})
            values.pop(key)
    for key, kind in (("stop", "strings"), ("stop_token_ids", "token ids")):
        value = values.get(key)
        if isinstance(value, list):
            values[key] = tuple(value)
        elif value is not None and not (key == "stop" and isinstance(value, str)):
            c.bad(f"sampling.{key}", f"expected a list of {kind}, got {type(value).__name__}")
            values.pop(key)
    values.setdefault("temperature", 0.0)  # offline jobs default to greedy: reproducible labels
    for key in list(values):  # each value on its own first: every bad one is reported, not only the first
        alone: dict[str, Any] = {"temperature": 0.0, key: values[key]}
        if key == "min_tokens":
            alone["max_tokens"] = 1 << 30
        try:
            SamplingParams(**alone)
        except (ValueError, TypeError) as exc:
            c.bad(f"sampling.{getattr(exc, 'field', None) or key}",
                  getattr(exc, "reason", f"invalid value {values[key]!r:.60} ({exc})"))
            values.pop(key)
    try:
        params = SamplingParams(**values)  # what is left: checks between fields (min_tokens <= max_tokens)
    except (ValueError, TypeError) as exc:
        field_name = getattr(exc, "field", None)
        c.bad(f"sampling.{field_name}" if field_name else "sampling", getattr(exc, "reason", str(exc)))
        params = SamplingParams(temperature=0.0)
    return SamplingSection(params, dict(overrides))


def parse_checkpoint(c: Checker, raw: dict[str, Any]) -> CheckpointSection:
    """``checkpoint``: how often finished rows are written."""
    ck = c.section(raw, "checkpoint")
    checkpoint = CheckpointSection(c.typed(ck, "checkpoint", "every_rows", int, 256),
                                   c.typed(ck, "checkpoint", "every_seconds", float, 60.0))
    c.positive("checkpoint.every_rows", checkpoint.every_rows)
    c.positive("checkpoint.every_seconds", checkpoint.every_seconds)
    return checkpoint


def parse_engine(c: Checker, raw: dict[str, Any]) -> EngineSection:
    """``engine``: the engine's settings (EngineConfig's defaults)."""
    e = c.section(raw, "engine")
    kinds = {"float": float, "float | None": float, "bool": bool, "bool | None": bool}
    engine = EngineSection(*(c.typed(e, "engine", f.name, kinds.get(str(f.type), int), f.default)
                             for f in dataclasses.fields(EngineSection)))
    for f in dataclasses.fields(EngineSection):
        if getattr(engine, f.name) is not None and not str(f.type).startswith("bool"):
            c.positive(f"engine.{f.name}", getattr(engine, f.name))
    if engine.kv_memory_fraction is not None and not 0 < engine.kv_memory_fraction <= 1:
        c.bad("engine.kv_memory_fraction", f"must be in (0, 1], got {engine.kv_memory_fraction}")
    return engine


def parse_plan(c: Checker, raw: dict[str, Any]) -> PlanSection:
    """``plan``: trie order on or off, and the window of rows planned together."""
    pl = c.section(raw, "plan")
    plan = PlanSection(c.typed(pl, "plan", "enabled", bool, True), c.typed(pl, "plan", "window", int, 10_000))
    c.positive("plan.window", plan.window)
    return plan


def resolve_path(base: Path, value: str) -> Path:
    """``value`` (``~`` expanded) as an absolute path, relative to ``base``."""
    p = Path(value).expanduser()
    return (p if p.is_absolute() else (base / p)).resolve()
