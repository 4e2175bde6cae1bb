#!/usr/bin/env python
"""Shim: the benchmarks are the ``mlxbatch.bench`` package (``mlxbatch bench ...``, ``python -m mlxbatch.bench``).

Kept because the GPU machine runs ``python3 scripts/bench.py --section gpu --model 0.5b --commit <sha> --out DIR``
on a copy of the tree with no ``.git`` and no installed package: there the repository root is put on ``sys.path``,
only when ``mlxbatch`` cannot be imported otherwise.
"""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("mlxbatch") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxbatch.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
