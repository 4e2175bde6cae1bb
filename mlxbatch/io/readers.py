"""Input selection and streaming: ``InputSpec`` -> files -> ``InputRow`` stream, with bounded memory.

Owns the input spec, glob / folder expansion (sorted, so the row order is deterministic; hidden files in a folder
are not input: macOS Finder's ``.DS_Store`` and the AppleDouble ``._name`` files it writes beside every file copied
to an exFAT or network drive), format detection and the cheap row count for progress bars. The per-format parsing lives in ``jsonl`` and ``tabular``. Rows are never
deduplicated here (see ``keys.DuplicateIdTracker``).
"""

from __future__ import annotations

import enum
import glob
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from mlxbatch.io.errors import InputError
from mlxbatch.io.jsonl import (
    OPENAI_JSON_TEXT_FIELDS,
    count_lines,
    is_json_array_document,
    iter_jsonl,
    iter_openai_batch,
    sniff_openai_batch,
)
from mlxbatch.io.records import InputRow
from mlxbatch.io.tabular import (
    PARQUET_SUFFIXES,
    arrow_schema,
    count_hf,
    count_parquet,
    iter_hf,
    iter_hub,
    iter_parquet,
)

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
_GLOB_CHARS = frozenset("*?[")


class InputFormat(str, enum.Enum):
    AUTO = "auto"  # by extension: .parquet/.pq, .jsonl/.ndjson/.json (OpenAI batch if its first row looks so), folder: hf
    JSONL = "jsonl"
    PARQUET = "parquet"
    HF = "hf"
    OPENAI_BATCH = "openai-batch"
    HUB = "hf-hub"  # a Hugging Face dataset by name (or a local dataset folder), streamed by ``datasets``


@dataclass(frozen=True)
class InputSpec:
    """What to read. ``path`` is a file, a folder or a glob (``**`` allowed; matches are read in sorted order).

    ``id_column`` names the column holding row ids (ignored for openai-batch, whose id is ``custom_id``);
    without it a row's id is ``"<file stem>:<position>"``. ``columns`` limits ``InputRow.fields`` (None: all).
    ``split`` picks the split of a saved ``DatasetDict``. ``batch_size`` rows are converted from Arrow at a time.
    With format ``hf-hub``, ``path`` is a dataset name (``owner/name``) or a local dataset folder given to
    ``datasets.load_dataset``, with ``config`` (its subset) and ``split``.
    """

    path: str
    format: InputFormat = InputFormat.AUTO
    id_column: str | None = None
    columns: tuple[str, ...] | None = None
    split: str | None = None
    batch_size: int = 1024
    config: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", os.fspath(self.path))
        try:
            object.__setattr__(self, "format", InputFormat(self.format))
        except ValueError:
            names = ", ".join(f.value for f in InputFormat)
            raise InputError(f"unknown input format {self.format!r} (one of: {names})") from None
        if self.columns is not None:
            if isinstance(self.columns, str):
                raise InputError("InputSpec.columns must be a list of column names, not a string")
            object.__setattr__(self, "columns", tuple(self.columns))
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise InputError(f"InputSpec.batch_size must be an integer >= 1, got {self.batch_size!r}")
        if not self.path:
            raise InputError("InputSpec.path is empty")


@dataclass(frozen=True)
class ResolvedInput:
    """One file (or HF dataset folder) to read, with its format decided."""

    path: Path
    format: InputFormat


def detect_format(path: Path) -> InputFormat:
    """The format of one path by its kind and extension (JSONL files are sniffed for OpenAI batch requests)."""
    if path.is_dir():
        return InputFormat.HF
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        return InputFormat.PARQUET
    if suffix in JSONL_SUFFIXES:
        if is_json_array_document(path):
            raise InputError(f"{path}: a JSON array document, not JSON Lines; convert it to JSONL (one object a "
                             "line) to stream it, or read it with format 'hf' (loads it whole)")
        return InputFormat.OPENAI_BATCH if sniff_openai_batch(path) else InputFormat.JSONL
    raise InputError(f"{path}: cannot tell the input format from the extension {suffix!r}; set the format")


def _suffixes(fmt: InputFormat) -> tuple[str, ...]:
    return PARQUET_SUFFIXES if fmt is InputFormat.PARQUET else JSONL_SUFFIXES


def resolve_inputs(spec: InputSpec) -> list[ResolvedInput]:
    """The inputs ``spec`` names, in reading order. A folder with a file format set means its files of that kind."""
    if spec.format is InputFormat.HUB:
        return [ResolvedInput(Path(spec.path), InputFormat.HUB)]  # a name: datasets finds it (or says why not)
    raw = os.path.expanduser(spec.path)
    if _GLOB_CHARS.intersection(raw):
        paths = [Path(p) for p in sorted(glob.glob(raw, recursive=True))]
        if not paths:
            raise InputError(f"no input matches {spec.path!r}")
    else:
        paths = [Path(raw)]
        if not paths[0].exists():
            raise InputError(f"input not found: {spec.path}")
    fmt = spec.format if spec.format is not InputFormat.AUTO else detect_format(paths[0])
    resolved: list[ResolvedInput] = []
    for path in paths:
        if path.is_dir() and fmt is not InputFormat.HF:
            files = sorted(p for p in path.iterdir()
                           if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in _suffixes(fmt))
            if not files:
                raise InputError(f"{path}: folder holds no {fmt.value} files ({', '.join(_suffixes(fmt))})")
            resolved.extend(ResolvedInput(f, fmt) for f in files)
        else:
            resolved.append(ResolvedInput(path, fmt))
    logger.debug("input %s resolves to %d %s source(s)", spec.path, len(resolved), fmt.value)
    return resolved


def _iter_one(source: ResolvedInput, spec: InputSpec) -> Iterator[InputRow]:
    if source.format is InputFormat.JSONL:
        return iter_jsonl(source.path, id_column=spec.id_column, columns=spec.columns)
    if source.format is InputFormat.OPENAI_BATCH:
        return iter_openai_batch(source.path, columns=spec.columns)
    if source.format is InputFormat.PARQUET:
        return iter_parquet(source.path, id_column=spec.id_column, columns=spec.columns, batch_size=spec.batch_size)
    if source.format is InputFormat.HUB:
        return iter_hub(str(source.path), id_column=spec.id_column, columns=spec.columns, split=spec.split,
                        config=spec.config)
    assert source.format is InputFormat.HF, source.format
    return iter_hf(source.path, id_column=spec.id_column, columns=spec.columns, split=spec.split,
                   batch_size=spec.batch_size)


def open_reader(spec: InputSpec) -> Iterator[InputRow]:
    """Stream every row of the input in a deterministic order, one source after another.

    Inputs are resolved (and missing files reported as ``InputError``) when this is called, before the first row.
    Rows that cannot be read are yielded with ``error`` set; reading goes on.
    """
    sources = resolve_inputs(spec)

    def rows() -> Iterator[InputRow]:
        for source in sources:
            yield from _iter_one(source, spec)

    return rows()


def input_schema(spec: InputSpec) -> dict[str, pa.DataType]:
    """The input's own Arrow type of each column, where the input has one (Parquet files, Hugging Face datasets;
    JSON has none: its values keep their JSON types anyway; an OpenAI Batch file's body fields that the API lets take
    several shapes are text, ``OPENAI_JSON_TEXT_FIELDS``). Columns whose types differ between files are left out
    (their type is inferred from the values)."""
    types: dict[str, pa.DataType] = {}
    conflicts: set[str] = set()
    for source in resolve_inputs(spec):
        if source.format is InputFormat.OPENAI_BATCH:
            schema = pa.schema([(name, pa.string()) for name in OPENAI_JSON_TEXT_FIELDS])
        else:
            schema = arrow_schema(source.path, source.format.value, spec.split)
        for f in schema or ():
            if types.setdefault(f.name, f.type) != f.type:
                conflicts.add(f.name)
    return {name: t for name, t in types.items() if name not in conflicts and not pa.types.is_null(t)}


def count_rows(spec: InputSpec) -> int | None:
    """A cheap row count for a progress bar (None when not cheap to know).

    Parquet: from metadata. JSONL / OpenAI batch: newlines counted in binary chunks, so blank lines count too
    (an upper bound). HF: the length of a saved dataset, or of its Parquet / JSONL data files.
    """
    total = 0
    for source in resolve_inputs(spec):
        if source.format is InputFormat.PARQUET:
            total += count_parquet(source.path)
        elif source.format is InputFormat.HUB:
            return None
        elif source.format in (InputFormat.JSONL, InputFormat.OPENAI_BATCH):
            total += count_lines(source.path)
        else:
            n = count_hf(source.path, spec.split)
            if n is None:
                return None
            total += n
    return total
