"""Arrow-backed inputs: Parquet files (read by row group, in batches) and local Hugging Face datasets.

Owns column projection and the two HF layouts: a folder written by ``save_to_disk`` (opened memory-mapped with
``load_from_disk``) and a folder of data files (streamed with ``load_dataset(<builder>, data_files=...,
streaming=True)``), and datasets by name (``iter_hub``: streamed from the Hub unless the user set
``HF_HUB_OFFLINE``). ``datasets`` is imported lazily; local reads are always offline. ``position`` is the 0-based row index
within the file / dataset. A missing requested column is an ``InputError`` (a problem of the whole input).
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pyarrow as pa
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


_TRUE = ("1", "true", "yes", "on")
_OFFLINE_SET_HERE = False  # HF_DATASETS_OFFLINE was set by _datasets(), not by the user


def _datasets() -> ModuleType:
    """Import ``datasets`` offline (local data only: never reach the Hub)."""
    global _OFFLINE_SET_HERE
    if "HF_DATASETS_OFFLINE" not in os.environ:
        os.environ["HF_DATASETS_OFFLINE"] = "1"
        _OFFLINE_SET_HERE = True
    import datasets

    datasets.config.HF_HUB_OFFLINE = True  # in case it was imported before the variable was set
    datasets.config.HF_DATASETS_OFFLINE = True
    return datasets


def user_offline_setting() -> str | None:
    """The name of the variable by which the user keeps the Hugging Face libraries offline (None: not set)."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if name == "HF_DATASETS_OFFLINE" and _OFFLINE_SET_HERE:
            continue
        if os.environ.get(name, "").strip().lower() in _TRUE:
            return name
    return None


def _open_hub(name: str, split: str | None, config: str | None) -> Any:
    """A dataset by name through ``datasets.load_dataset``: streamed from the Hub when it may be reached, from the
    local cache when the user set the offline variable (a local folder works either way)."""
    offline = user_offline_setting()
    import datasets

    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = offline is not None
    local = Path(name).exists()
    if local and is_saved_dataset(Path(name)):  # load_dataset does not read these: input.path does
        raise InputError(f"dataset {name!r} is a folder saved with save_to_disk, which input.dataset does not read: "
                         f"give it as input.path (input.dataset is for a dataset by name, or a folder of data files)")
    try:
        if offline and not local:  # streaming reads the Hub: offline, only a cached (downloaded) copy can serve
            return datasets.load_dataset(name, config, split=split or "train")
        return datasets.load_dataset(name, config, split=split or "train", streaming=True)
    except Exception as exc:
        if offline and not local:
            raise InputError(
                f"dataset {name!r}: not in the local Hugging Face cache, and {offline} is set, so the Hub is not "
                f"reached: unset {offline} to stream it from the Hub, or download it where the Hub can be reached "
                f"and set input.path to its files ({type(exc).__name__}: {str(exc)[:200]})") from exc
        if local:  # a local folder: neither the Hub nor its cache is involved
            raise InputError(f"dataset {name!r}: the local folder cannot be opened by the datasets library "
                             f"({type(exc).__name__}: {str(exc)[:300]}); give it as input.path to read its files "
                             f"(a saved dataset, or a folder of JSONL / Parquet files)") from exc
        raise InputError(
            f"dataset {name!r}: cannot be opened ({type(exc).__name__}: {str(exc)[:300]}). Without access to the "
            "Hugging Face Hub, set HF_HUB_OFFLINE=1 to read a cached copy, or set input.path to local files") from exc
    finally:
        datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True


def iter_hub(name: str, *, id_column: str | None, columns: tuple[str, ...] | None, split: str | None,
             config: str | None) -> Iterator[InputRow]:
    """The rows of a dataset by name (``owner/name``) or of a local dataset folder, in its order."""
    ds = _open_hub(name, split, config)
    names = list(ds.column_names) if ds.column_names is not None else None
    read = _projection(names, name, id_column, columns)
    if read is not None:
        ds = ds.select_columns(read)
    yield from _rows(ds, name, name.rstrip("/").rsplit("/", 1)[-1], f"dataset {name!r}", id_column, columns)


def _release_abandoned_readers() -> None:
    """Free now the Arrow readers a ``datasets`` stream left behind when reading failed midway. ``datasets`` leaves
    its Parquet fragment's batch iterator in a reference cycle (apache/arrow#45214; its own workaround is applied
    only for pyarrow <= 24); freed only at interpreter exit, an Arrow thread then drops a Python buffer after
    Python is gone and the process aborts (exit 134) instead of exiting with its error."""
    gc.collect()


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
    if len(splits) == 1:
        return splits[0]
    raise InputError(f"{where}: several splits {splits}; set input.split (none is read by default: an eval meant "
                     "for one must not run on another)")


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
    yield from _rows(rows, str(path), path.name if path.is_dir() else path.stem, str(path), id_column, columns)


def _rows(objs: Iterable[dict[str, Any]], source: str, stem: str, what: str, id_column: str | None,
          columns: tuple[str, ...] | None) -> Iterator[InputRow]:
    """A dataset's row objects as input rows, in order; a failure of the dataset's reader becomes an InputError
    (``what`` names the dataset) that says how many rows were read."""
    position = 0
    try:
        for obj in objs:
            yield input_row_from_object(obj, source=source, stem=stem, position=position, id_column=id_column,
                                        columns=columns, label="row ")
            position += 1
    except InputError:
        raise
    except Exception as exc:
        _release_abandoned_readers()
        raise InputError(f"{what}: reading failed after {position} rows ({exc})") from exc


def arrow_schema(path: Path, fmt: str, split: str | None) -> pa.Schema | None:
    """The Arrow schema of one Parquet file or local HF dataset (None: the format has none, or it is unknown)."""
    try:
        if fmt == "parquet":
            return pq.read_schema(path)
        if fmt == "hf" and is_saved_dataset(path):
            return _open_hf(path, split).features.arrow_schema
        if fmt == "hf" and _data_files(path).builder == "parquet":
            return pq.read_schema(_data_files(path).files[0])
    except Exception as exc:  # the schema only refines types: never fail a job over it
        logger.debug("%s: no input schema (%s)", path, exc)
    return None


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
