#!/usr/bin/env bash
# The test command: lint, layer contracts, then the test suite. pytest runs on two worker processes (pytest-xdist),
# a test module (or class) on one worker, so that a module's fixtures (a reference run, a Ray cluster) are made once.
# MLXBATCH_TEST_WORKERS=N for another count, 0 for one process. Arguments go to pytest, e.g.
# `bash scripts/test.sh tests/job/test_run.py`.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check mlxbatch tests scripts
.venv/bin/lint-imports
.venv/bin/python -m pytest -q -n "${MLXBATCH_TEST_WORKERS:-2}" --dist loadscope "$@"
