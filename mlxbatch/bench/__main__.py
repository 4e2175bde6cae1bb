"""``python -m mlxbatch.bench SECTION [options]``: the same as ``mlxbatch bench`` (see ``cli``)."""

import sys

from mlxbatch.bench.cli import main

sys.exit(main())
