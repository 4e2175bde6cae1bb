#!/usr/bin/env bash
# Sets up mlxbatch in ./.venv: system OpenBLAS (Linux, for MLX's CPU backend), then the package with the
# right MLX backend for this machine. Usage: bash scripts/setup.sh   (MLXBATCH_BACKEND=cpu|cuda13|metal to force,
# PYTHON=/path/to/python3.12 to pick the interpreter, MLXBATCH_EXTRAS=vlm,ray to add optional extras). On a Mac it
# installs what the README's first job and the tests need (mlxbatch + dev tools): mlx-vlm (images) pulls mlx-audio,
# opencv, fastapi and transformers 5.x, and Ray is 68 MB, so they come only when asked for. On Linux (CI) all come. scripts/check_platform.py picks the newest Python 3.11+ and
# says what is wrong (Python too old, Intel Mac, Rosetta, macOS older than 14) before pip can fail opaquely.
set -euo pipefail
cd "$(dirname "$0")/.."

# Any python3 >= 3.7 can run the checks (even the macOS Command Line Tools' 3.9); the checks pick the real one.
runner=""
for c in "${PYTHON:-}" python3.13 python3.12 python3.11 /opt/homebrew/bin/python3 /usr/local/bin/python3 python3; do
  if [ -n "$c" ] && [ "$("$c" -c 'import sys; print(sys.version_info >= (3, 7))' 2>/dev/null)" = True ]; then
    runner=$c; break
  fi
done
if [ -z "$runner" ]; then
  echo "mlxbatch setup: no Python 3 found. Install Python 3.11 or newer (macOS: \`brew install python@3.12\` or" \
       "https://www.python.org/downloads/ ; Debian/Ubuntu: \`sudo apt-get install python3.12 python3.12-venv\`)," \
       "then run this again." >&2
  exit 1
fi
PY=$("$runner" scripts/check_platform.py) || exit 1
extras=${MLXBATCH_EXTRAS:-}
for x in ${extras//,/ }; do  # pip only warns about an unknown extra, then goes on
  case "$x" in vlm|ray|dev|kernel-check) ;; *)
    echo "mlxbatch setup: MLXBATCH_EXTRAS: unknown extra '$x' (the extras: vlm, ray, dev, kernel-check)" >&2; exit 1 ;;
  esac
done

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

if [ -e .venv ] && ! "$PY" scripts/check_platform.py --venv .venv; then rm -rf .venv; fi  # e.g. a 3.9 venv
[ -x .venv/bin/python ] || { echo "mlxbatch setup: creating .venv with $("$PY" -V 2>&1) ($PY)"; "$PY" -m venv .venv; }
.venv/bin/python -m pip install -q --upgrade pip
case "$backend" in
  metal) extra="dev" ;;
  cuda13) extra="cuda13,dev,vlm,ray" ;;
  *) extra="cpu,dev,vlm,ray"
     # a Linux x86-64 CPU machine (CI): NVRTC, to compile the engine's CUDA kernels in the tests
     if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then extra="$extra,kernel-check"; fi ;;
esac
extra="$extra${extras:+,$extras}"
.venv/bin/python -m pip install -q -e ".[$extra]"
echo "mlxbatch setup: done (backend: $backend, extras: $extra). Try: .venv/bin/mlxbatch generate --model smollm2 'Name three colours.'"
case ",$extra," in *,vlm,*) ;; *) missing="vlm (images: Qwen2-VL through mlx-vlm, HEIC photos)" ;; esac
case ",$extra," in *,ray,*) ;; *) missing="${missing:+$missing, }ray (mlxbatch run --ray)" ;; esac
if [ -n "${missing:-}" ]; then
  echo "mlxbatch setup: not installed: $missing. Add them with MLXBATCH_EXTRAS=vlm,ray bash scripts/setup.sh"
fi
