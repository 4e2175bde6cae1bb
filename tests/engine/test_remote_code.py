"""A model folder whose config asks for remote code: nothing prompts, and its code runs only when the job says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

LOAD = """
import sys
import mlxbatch
from mlxbatch.engine import ModelSpec, load_model
try:
    load_model(ModelSpec(sys.argv[1], trust_remote_code=sys.argv[2] == "true"))
    print("LOADED")
except Exception as exc:
    print("REFUSED", type(exc).__name__, exc)
"""


@pytest.fixture(scope="module")
def remote_code_model(tmp_path_factory, tiny_model_path) -> tuple[Path, Path]:
    """The tiny model as an ``xverse`` checkpoint (mlx-lm runs it as llama; transformers does not know the type),
    whose config.json points at a Python file in the folder, as trust_remote_code checkpoints do."""
    import mlx.core as mx

    root = tmp_path_factory.mktemp("remote-code")
    folder, marker = root / "model", root / "RAN"
    folder.mkdir()
    weights = mx.load(str(tiny_model_path / "model.safetensors"))
    mx.save_safetensors(str(folder / "model.safetensors"), {k: v for k, v in weights.items() if not k.endswith(".bias")})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).write_bytes((tiny_model_path / name).read_bytes())
    config = json.loads((tiny_model_path / "config.json").read_text())
    config.update(model_type="xverse", architectures=["XverseForCausalLM"],
                  auto_map={"AutoConfig": "configuration_xverse.XverseConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_xverse.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('the model folder ran its code')\n"
        "from transformers import PretrainedConfig\n\n\n"
        "class XverseConfig(PretrainedConfig):\n    model_type = 'xverse'\n")
    return folder, marker


def load(folder: Path, trust: bool, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "hf-modules")}
    return subprocess.run([sys.executable, "-c", LOAD, str(folder), "true" if trust else "false"], input="y\ny\n",
                          capture_output=True, text=True, timeout=180, env=env)


def test_the_default_never_asks_and_never_runs_the_folders_code(remote_code_model, tmp_path):
    folder, marker = remote_code_model
    marker.unlink(missing_ok=True)
    res = load(folder, False, tmp_path)
    assert "custom code" not in res.stdout + res.stderr, res.stdout + res.stderr  # no "[y/N]" question
    assert not marker.exists(), "the model folder's Python code ran although trust_remote_code was false"
    assert "LOADED" in res.stdout or "REFUSED" in res.stdout, res.stderr  # mlx-lm needs no remote code for it


def test_trust_remote_code_true_runs_it(remote_code_model, tmp_path):
    folder, marker = remote_code_model
    marker.unlink(missing_ok=True)
    load(folder, True, tmp_path)
    assert marker.exists()  # the fixture's code is real: only the flag keeps it from running
