#!/usr/bin/env bash
# The test command: lint, layer contracts, then the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check mlxbatch tests scripts
.venv/bin/lint-imports
.venv/bin/python -m pytest -q "$@"
