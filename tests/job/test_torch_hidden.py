"""A text model's job never imports torch (``mlxbatch._torch``): transformers would import it wherever it is
installed, seconds before a run's first row. A torch that records its import stands in for an installed one (the
test machines have none); a vision-language model's job keeps torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
from jobkit import texts, write_job, write_jsonl

from mlxbatch.job.check.model_ref import model_kind


def _fake_torch(tmp_path: Path) -> tuple[Path, Path]:
    """A folder holding a ``torch`` package that writes ``mark`` when imported (transformers finds it and, without
    its metadata, imports it to read its version), and that mark's path."""
    site, mark = tmp_path / "site", tmp_path / "torch-imported"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(
        f"import traceback\nopen({str(mark)!r}, 'a').write(''.join(traceback.format_stack()))\n__version__ = '2.9.0'\n")
    return site, mark


def _cli(site: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-m", "mlxbatch.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path, **env})


def test_a_text_models_commands_never_import_torch(tmp_path, tiny_model_path):
    site, mark = _fake_torch(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import mlx_lm.tokenizer_utils"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(site)})
    assert probe.returncode == 0 and mark.exists(), "the stand-in torch is not imported by transformers: no test"
    mark.unlink()
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_model_path, write_jsonl(tmp_path / "in.jsonl", texts(12)), out,
                    sampling={"temperature": 0.0, "max_tokens": 4})
    for args in (("validate", str(job)), ("plan", str(job), "--no-calibrate"),
                 ("generate", "-m", str(tiny_model_path), "--max-tokens", "2", "hello")):
        res = _cli(site, *args)
        assert res.returncode == 0, res.stderr
    ran = _cli(site, "run", str(job), "--no-progress", MLXBATCH_ENGINE_PROCESS="1")  # the engine's process too
    assert ran.returncode == 0, ran.stderr
    assert not mark.exists(), mark.read_text()
    assert "PyTorch was not found" not in ran.stderr  # (transformers' advice, untrue here)
    assert pq.read_table(out / "results.parquet").num_rows == 12


def test_which_models_are_known_to_be_text_models(tmp_path, tiny_model_path):
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": {"depth": 1}}))
    assert model_kind(str(tiny_model_path)) == "text" and model_kind("smollm2") == "text"
    assert model_kind(str(vlm)) == "vision" and model_kind("tiny-random-vlm") == "vision"
    assert model_kind(str(tmp_path)) is None  # no config.json
    assert model_kind("nobody-here/no-such-model") is None  # not in the cache: not known


def test_transformers_runs_without_torch_and_a_later_import_of_torch_still_works(tmp_path):
    site, mark = _fake_torch(tmp_path)
    code = ("import sys; from mlxbatch._torch import without_torch; first = without_torch(); again = without_torch()\n"
            "import mlx_lm.tokenizer_utils; import transformers; before = 'torch' in sys.modules\n"
            "import torch; print(first, again, transformers.is_torch_available(), before, torch.__version__)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(site)})
    assert res.stdout.split() == ["True", "True", "False", "False", "2.9.0"], res.stderr
    late = "import transformers; from mlxbatch._torch import without_torch; print(without_torch())"
    res = subprocess.run([sys.executable, "-c", late], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(site)})
    assert res.stdout.strip() == "False", res.stderr  # transformers had found the stand-in: it stays found


def test_a_text_job_reading_a_folder_through_datasets_runs_from_the_command_line(tmp_path, tiny_model_path):
    """``datasets`` imports torch whenever ``"torch"`` is in ``sys.modules``: a mark left there failed these runs."""
    folder = tmp_path / "local-ds"
    folder.mkdir()
    write_jsonl(folder / "part-0.jsonl", texts(3))
    write_jsonl(folder / "part-1.jsonl", texts(5)[3:])
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_model_path, tmp_path / "unused", out, sampling={"temperature": 0.0, "max_tokens": 2})
    job.write_text(job.read_text().replace(f"path: {tmp_path / 'unused'}", f"dataset: {folder}"))
    res = _cli(tmp_path / "no-site", "run", str(job), "--no-progress")
    assert res.returncode == 0, res.stderr
    assert pq.read_table(out / "results.parquet").column("id").to_pylist() == [f"row-{i:04d}" for i in range(5)]
