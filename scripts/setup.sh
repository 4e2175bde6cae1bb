#!/usr/bin/env bash
# Sets up mlxbatch in ./.venv: system OpenBLAS (Linux, for MLX's CPU backend), then the package with the
# right MLX backend for this machine. Usage: bash scripts/setup.sh   (MLXBATCH_BACKEND=cpu|cuda13|metal to force)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

backend=${MLXBATCH_BACKEND:-}
if [ -z "$backend" ]; then
  if [ "$(uname -s)" = "Darwin" ]; then backend=metal
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then backend=cuda13
  else backend=cpu; fi
fi

if [ "$(uname -s)" = "Linux" ] && ! ldconfig -p 2>/dev/null | grep -q 'libopenblas.so.0'; then
  echo "mlxbatch setup: installing OpenBLAS (MLX's CPU backend is ~40x slower without it)"
  SUDO=""; [ "$(id -u)" != 0 ] && command -v sudo >/dev/null && SUDO=sudo
  if command -v apt-get >/dev/null; then
    $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread \
      || echo "mlxbatch setup: could not install libopenblas0-pthread; install it by hand for fast CPU runs"
  elif command -v dnf >/dev/null; then
    $SUDO dnf install -y openblas-threads || echo "mlxbatch setup: could not install OpenBLAS"
  else
    echo "mlxbatch setup: no apt-get/dnf; install OpenBLAS (libopenblas.so.0) by hand for fast CPU runs"
  fi
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
case "$backend" in
  metal) extra="dev,vlm,ray" ;;
  cuda13) extra="cuda13,dev,vlm,ray" ;;
  *) extra="cpu,dev,vlm,ray" ;;
esac
.venv/bin/python -m pip install -q -e ".[$extra]"
echo "mlxbatch setup: done (backend: $backend). Try: .venv/bin/mlxbatch generate --model smollm2 'Name three colours.'"
