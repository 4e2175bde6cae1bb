"""The GPU session's diagnostic scripts run end to end (tiny model, CPU, tiny sizes).

A GPU session has 30 minutes of device time; a script that broke when the engine's code moved (two of these wrapped
methods that no longer existed) costs that session a run. These check only that each script runs and prints its
table, never what the table says.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(args: list[str]) -> str:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("script,args,expect", [
    ("step_phases.py", ["--rows", "12"], "prefill passes by how they attend"),
    ("step_graph.py", ["--rows", "4", "--prompt-len", "8"], "bare mlx-lm step (forward + argmax)"),
    ("step_memory.py", ["--runs", "fewshot:12", "--bounds", "2", "--tokens", "64", "--prefill-max-scores", "4096"],
     "| fewshot | 2 GiB, 64 tokens |"),
    ("engine_runs.py", ["--runs", "label:12", "--tag", "t"], "| t | label | again |"),
    ("memory_steps.py", ["--runs", "fewshot:12", "--top", "2"], "| step | peak over start GiB"),
    ("decode_ab.py", ["--levels", "2", "--decode-repeats", "1", "--decode-new-tokens", "6", "--tag", "t"], "| t | 2 |"),
    ("host_step.py", ["--rows", "4", "--prompt-len", "8", "--new", "4", "--reps", "1"], "| build the forward (Python) |"),
    ("host_step.py", ["--workloads", "label:12,label:12:nocache"], "prefill: place rows, copy prefixes in (admit)"),
    ("cuda_schedule_on_cpu.py", ["--runs", "label:12,chat:8", "--tag", "t"], "| t | chat 8 |"),
])
def test_diagnostic_script_runs(script, args, expect, tiny_model_path):
    out = _script([f"scripts/{script}", "--model", str(tiny_model_path), *args])
    assert expect in out


def test_kernel_call_cost_runs_without_cuda():
    out = _script(["scripts/kernel_call_cost.py", "--steps", "2", "--chain", "3", "--rows", "4", "--dims", "8"])
    assert "| built-in + |" in out and "| compiled (one kernel) |" in out


def test_copy_kernels_runs_and_every_way_writes_the_same():
    out = _script(["scripts/copy_kernels.py", "--blocks", "24", "--layers", "2", "--reps", "1", "--rows", "8",
                   "--capacity", "64"])
    assert out.count("| True |") == 2  # the two other ways' slots equal the way of now
