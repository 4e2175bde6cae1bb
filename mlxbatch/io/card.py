"""The output folder as a Hugging Face dataset: a dataset card (README.md) naming results.parquet as its data.

Owns the card. ``datasets.load_dataset(out_dir)`` reads a folder's data files by their extension and trips on
report.json, manifest.json and the Arrow shards beside results.parquet; a card whose YAML header lists the data
files (``configs: [{config_name: default, data_files: results.parquet}]``) makes it read results.parquet only, as
the ``train`` split. A README.md the user wrote is left alone (and is not mlxbatch's: ``is_own_card``).
"""

from __future__ import annotations

import os
from pathlib import Path

from mlxbatch.io.atomic import atomic_write_bytes
from mlxbatch.io.errors import OutputError

CARD_NAME = "README.md"
_MARKER = "<!-- written by mlxbatch -->"
CARD = f"""---
configs:
- config_name: default
  data_files:
  - split: train
    path: results.parquet
---
{_MARKER}
# mlxbatch results

`results.parquet` holds one row per input row (see `report.json` for the run). Load it with
`datasets.load_dataset("<this folder>")`, `pandas.read_parquet`, `polars.read_parquet` or `duckdb`.
"""


def is_own_card(path: Path) -> bool:
    """Whether ``path`` is a card mlxbatch wrote (a README.md without the marker is the user's)."""
    try:
        return path.is_file() and _MARKER in path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def write_dataset_card(out_dir: str | Path) -> Path | None:
    """Write the card (atomically) unless the folder holds a README.md that mlxbatch did not write. A write that
    fails (a full disk) raises ``OutputError`` and leaves no temporary file."""
    path = Path(out_dir) / CARD_NAME
    if path.exists() and not is_own_card(path):
        return None
    try:
        atomic_write_bytes(path, CARD.encode())
    except OSError as exc:
        raise OutputError(f"could not write {path}: {os.strerror(exc.errno) if exc.errno else exc}") from exc
    return path
