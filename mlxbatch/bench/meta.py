"""What a benchmark ran on: machine, software, git commit, model shape; rendered as the report's header.

The commit comes from ``git`` where the package sits in a checkout; a copy of the tree without ``.git`` (the GPU
machine's) passes it with ``--commit`` (or ``$GIT_SHA``) and the header says "(given)".
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten

import mlxbatch
from mlxbatch import _blas, _cuda
from mlxbatch.bench.harness import Bench

HERE = Path(__file__).resolve().parent


def git_commit(given: str | None, cwd: Path = HERE) -> str:
    """``given`` (``--commit``) when given: a device's copy of the tree may sit in a stale checkout (the H200 copy's
    ``git`` said ``a6f40f2`` for a later tree), so a checkout that disagrees is only mentioned. Else the short commit
    of the checkout holding ``cwd`` (+ "(uncommitted changes)"), or "?"."""
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=cwd, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                               cwd=cwd, timeout=5).stdout.strip()
        git += " (uncommitted changes)" if dirty and git else ""
    except (OSError, subprocess.SubprocessError):
        git = "?"
    if given:
        seen = git.split(" ")[0] if git and git != "?" else ""
        return f"{given} (given)" + (f"; the checkout says {git}" if seen and not given.startswith(seen)
                                     and not seen.startswith(given) else "")
    return git or "?"


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed: ``python -m mlxbatch.bench ...`` when run as a module, else the script's argv."""
    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0].endswith("__main__.py"):
        argv = ["-m", "mlxbatch.bench", *argv[1:]]
    return " ".join(shlex.quote(x) for x in [Path(sys.executable).name, *argv])


def machine_meta(b: Bench) -> dict[str, Any]:
    cfg = b.loaded.config
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "device": str(mx.default_device()),
        "openblas": _blas.loaded_path or "not loaded",
        # process-wide: the baselines in this process launch the same way
        "cuda_kernel_launch": _cuda.kernel_launch() if mx.default_device() == mx.gpu and not mx.metal.is_available()
        else "",
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "mlxbatch": mlxbatch.__version__,
        "git": git_commit(b.args.commit),
        "model": b.args.model,
        "model_path": b.model_path,
        "shape": {k: cfg.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                           "num_key_value_heads", "intermediate_size", "vocab_size")},
        "params": sum(v.size for _, v in tree_flatten(b.model.parameters())),
        "dtype": b.loaded.dtype,
        "tokenizer_vocab": len(b.tokenizer),
        "concurrency": b.concurrency,
        "load_s": round(b.load_s, 2),
    }


def render_meta(m: dict[str, Any]) -> str:
    s = m["shape"]
    return "\n".join([
        f"## mlxbatch bench — {m['date']}",
        "",
        f"- command: `{m['command']}`",
        f"- machine: {m['platform']}, {m['cpu']}, {m['cpu_count']} CPUs; device {m['device']}; "
        f"OpenBLAS: {m['openblas']}" + (f"; CUDA kernel launch: {m['cuda_kernel_launch']}"
                                         if m.get("cuda_kernel_launch") else ""),
        f"- software: python {m['python']}, mlx {m['mlx']}, mlx-lm {m['mlx_lm']}, mlxbatch {m['mlxbatch']} "
        f"(git {m['git']})",
        f"- model: {m['model']} ({m['params'] / 1e6:.1f}M params, {m['dtype']}): hidden {s['hidden_size']}, "
        f"{s['num_hidden_layers']} layers, {s['num_attention_heads']} heads / {s['num_key_value_heads']} KV heads, "
        f"intermediate {s['intermediate_size']}, vocab {s['vocab_size']} (tokenizer {m['tokenizer_vocab']})",
        "",
    ])


def emit(b: Bench, tables: list[Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A subcommand's report: the header and its tables printed; ``--json`` also gets them (``Table.as_dict``),
    with ``extra``. Returns what was (or would be) written."""
    import json

    meta = machine_meta(b)
    print(render_meta(meta), flush=True)
    for t in tables:
        print(t.render(), flush=True)
    out = {"meta": meta, "args": vars(b.args), "tables": [t.as_dict() for t in tables], **(extra or {})}
    if b.args.json_path:
        Path(b.args.json_path).write_text(json.dumps(out, indent=2, default=str))
    return out
