"""Arrow-backed inputs: Parquet files (read by row group, in batches) and local Hugging Face datasets.

Owns column projection and the two HF layouts: a folder written by ``save_to_disk`` (opened memory-mapped with
``load_from_disk``) and a folder of data files (streamed with ``load_dataset(<builder>, data_files=...,
streaming=True)``). ``datasets`` is imported lazily and always offline. ``position`` is the 0-based row index
within the file / dataset. A missing requested column is an ``InputError`` (a problem of the whole input).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pyarrow.parquet as pq

from mlxbatch.io.errors import InputError
from mlxbatch.io.jsonl import count_lines
from mlxbatch.io.records import InputRow, input_row_from_object

logger = logging.getLogger(__name__)

PARQUET_SUFFIXES = (".parquet", ".pq")
# Data-file suffix -> datasets builder, for a folder that is not a save_to_disk dataset.
HF_BUILDERS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "json", ".json": "json", ".ndjson": "json",
               ".csv": "csv", ".arrow": "arrow", ".txt": "text"}


def _projection(names: list[str] | None, where: str, id_column: str | None,
                columns: tuple[str, ...] | None) -> list[str] | None:
    """The columns to read (None: all), after checking they exist."""
    wanted = list(columns) if columns is not None else []
    if id_column is not None and id_column not in wanted:
        wanted.append(id_column)
    if names is not None:
        missing = [c for c in wanted if c not in names]
        if missing:
            raise InputError(f"{where}: column(s) {missing} not found (columns: {names})")
    return None if columns is None else wanted


def iter_parquet(path: Path, *, id_column: str | None, columns: tuple[str, ...] | None,
                 batch_size: int) -> Iterator[InputRow]:
    """The rows of one Parquet file in order; memory holds one row group's pages and one batch of rows."""
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a file that is not Parquet
        raise InputError(f"{path}: cannot open as Parquet ({exc})") from exc
    with pf:
        read = _projection(pf.schema_arrow.names, str(path), id_column, columns)
        source, stem, position = str(path), path.stem, 0
        for batch in pf.iter_batches(batch_size=batch_size, columns=read):
            for obj in batch.to_pylist():
                yield input_row_from_object(obj, source=source, stem=stem, position=position, id_column=id_column,
                                            columns=columns, label="row ")
                position += 1


def count_parquet(path: Path) -> int:
    with pq.ParquetFile(path) as pf:
        return pf.metadata.num_rows


def _datasets() -> ModuleType:
    """Import ``datasets`` offline (local data only: never reach the Hub)."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets

    datasets.config.HF_HUB_OFFLINE = True  # in case it was imported before the variable was set
    datasets.config.HF_DATASETS_OFFLINE = True
    return datasets


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists())


@dataclass(frozen=True)
class _DataFiles:
    builder: str  # the datasets builder: parquet, json, csv, arrow, text
    files: tuple[Path, ...]  # sorted


def _data_files(path: Path) -> _DataFiles:
    """The data files of a file or a folder of them (hidden files and folders skipped)."""
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in HF_BUILDERS
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
    builders = {HF_BUILDERS.get(p.suffix.lower()) for p in files}
    if not files or None in builders:
        raise InputError(f"{path}: no saved dataset and no data files with suffixes {sorted(HF_BUILDERS)}")
    if len(builders) != 1:
        raise InputError(f"{path}: data files of several formats {sorted(b for b in builders if b)}; use one")
    return _DataFiles(builders.pop() or "", tuple(files))


def _pick_split(splits: list[str], split: str | None, where: str) -> str:
    if split is not None:
        if split not in splits:
            raise InputError(f"{where}: no split {split!r} (splits: {splits})")
        return split
    if "train" in splits or len(splits) == 1:
        return "train" if "train" in splits else splits[0]
    raise InputError(f"{where}: several splits {splits}; set the split")


def _open_hf(path: Path, split: str | None) -> Any:
    datasets = _datasets()
    try:
        if is_saved_dataset(path):
            ds = datasets.load_from_disk(str(path))  # memory-mapped Arrow files
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[_pick_split(list(ds.keys()), split, str(path))]
            return ds
        found = _data_files(path)
        if split not in (None, "train"):
            raise InputError(f"{path}: a folder of data files has only the split 'train', not {split!r}")
        return datasets.load_dataset(found.builder, data_files=[str(f) for f in found.files], split="train",
                                     streaming=True)
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{path}: cannot open as a local Hugging Face dataset ({exc})") from exc


def iter_hf(path: Path, *, id_column: str | None, columns: tuple[str, ...] | None, split: str | None,
            batch_size: int) -> Iterator[InputRow]:
    """The rows of a local HF dataset in its order, ``batch_size`` rows converted to Python at a time."""
    ds = _open_hf(path, split)
    datasets = _datasets()
    read = _projection(ds.column_names, str(path), id_column, columns)
    if read is not None:
        ds = ds.select_columns(read)
    if isinstance(ds, datasets.Dataset):
        rows: Iterator[dict[str, Any]] = (obj for table in ds.with_format("arrow").iter(batch_size=batch_size)
                                          for obj in table.to_pylist())
    else:
        rows = iter(ds)
    source, stem, position = str(path), (path.name if path.is_dir() else path.stem), 0
    try:
        for obj in rows:
            yield input_row_from_object(obj, source=source, stem=stem, position=position, id_column=id_column,
                                        columns=columns, label="row ")
            position += 1
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{path}: reading failed after {position} rows ({exc})") from exc


def count_hf(path: Path, split: str | None) -> int | None:
    """Rows of a local HF dataset when cheap to know (saved datasets, Parquet / JSON data files), else None."""
    if is_saved_dataset(path):
        return len(_open_hf(path, split))
    found = _data_files(path)
    if found.builder == "parquet":
        return sum(count_parquet(f) for f in found.files)
    if found.builder == "json" and all(f.suffix.lower() in (".jsonl", ".ndjson") for f in found.files):
        return sum(count_lines(f) for f in found.files)
    return None
