"""``mlxbatch doctor``: the machine checks with a Mac's facts injected (macOS 14 and 15, Metal, a VM, Rosetta), and
the whole command on this machine (the engine against mlx-lm, forced out-of-memory steps) as CI runs it."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys

import pytest
from click.testing import CliRunner

from mlxbatch.bench import doctor as dr
from mlxbatch.cli import main
from mlxbatch.engine import DeviceInfo

GiB = 1 << 30
M2 = DeviceInfo("metal", "Apple M2", 11 * GiB, 6 * GiB, "", 16 * GiB)
VERSIONS = {"mlx": "0.32.4", "mlx-lm": "0.32.2", "mlx-vlm": None, "ray": None}
MAC_15 = dr.Facts("darwin", "macOS 15.1", (15, 1), "arm64", "3.12.4", VERSIONS, M2)
MAC_14 = dataclasses.replace(MAC_15, os_name="macOS 14.6.1", macos=(14, 6, 1))


def checks(facts: dr.Facts, kv_budget: int | None = None) -> dict[str, dr.Check]:
    return {c.name: c for c in dr.machine_checks(facts, kv_budget)}


def test_a_mac_on_macos_14_is_told_it_gets_no_wired_memory():
    c = checks(MAC_14)["wired limit"]
    assert c.verdict is dr.Verdict.WARN and "macOS 14.6.1" in c.result
    assert "macOS 15" in c.detail and "never wrong outputs" in c.detail
    c = checks(MAC_15)["wired limit"]
    assert c.verdict is dr.Verdict.OK and "11.0 GiB working set" in c.result
    raised = checks(dataclasses.replace(MAC_15, wired_sysctl_mb=14000))["wired limit"]
    assert "iogpu.wired_limit_mb=14000" in raised.result
    in_vm = checks(dataclasses.replace(MAC_15, in_vm=True))["wired limit"]
    assert in_vm.verdict is dr.Verdict.WARN and "virtual machine" in in_vm.result


def test_the_rule_is_the_setup_scripts_rule():
    from pathlib import Path

    script = (Path(__file__).resolve().parents[2] / "scripts" / "check_platform.py").read_text()
    assert f"WIRED_MACOS = {dr.WIRED_MACOS}" in script  # the script runs before mlxbatch is installed: a copy


def test_a_macs_memory_versions_and_device_read_as_a_mac_user_sees_them():
    c = checks(MAC_15, kv_budget=3 * GiB)
    assert c["memory"].result == "machine 16.0 GiB, device 11.0 GiB, free 6.0 GiB, KV budget 3.00 GiB"
    assert c["memory"].verdict is dr.Verdict.OK and "working set" in c["memory"].detail
    busy = checks(dataclasses.replace(MAC_15, device=dataclasses.replace(M2, available_memory=3 * GiB)))["memory"]
    assert busy.verdict is dr.Verdict.WARN and "close other apps" in busy.detail  # 3 of 16 GiB free
    assert c["device"].result == "metal: Apple M2" and c["blas"].result == "not used"
    assert c["os"].result == "macOS 15.1" and c["python"].result == "3.12.4 (arm64)"
    assert c["mlx-vlm"].verdict is dr.Verdict.NOTE and "MLXBATCH_EXTRAS=vlm" in c["mlx-vlm"].detail
    rosetta = checks(dataclasses.replace(MAC_15, machine="x86_64"))["python"]
    assert rosetta.verdict is dr.Verdict.FAIL and "Rosetta" in rosetta.detail


def test_linux_cpu_and_cuda_rows():
    cpu = DeviceInfo("cpu", "x86_64", 24 * GiB, 12 * GiB, "reference", 24 * GiB)
    linux = dr.Facts("linux", "Linux 6.8.0", None, "x86_64", "3.11.7", VERSIONS, cpu)
    c = checks(linux)
    assert c["blas"].verdict is dr.Verdict.WARN and "40x" in c["blas"].detail
    assert c["wired limit"].verdict is dr.Verdict.NOTE and c["python"].verdict is dr.Verdict.OK
    h100 = DeviceInfo("cuda", "NVIDIA H100", 80 * GiB, 79 * GiB, "", 128 * GiB, "direct")
    c = checks(dataclasses.replace(linux, device=h100))
    assert c["device"].detail.endswith("kernel launch direct") and c["blas"].result == "not used"
    assert "FAIL" not in dr.render(dr.machine_checks(dataclasses.replace(linux, device=h100)))


def test_mlxbatch_doctor_runs_the_engine_against_mlx_lm_and_forces_out_of_memory_steps(tiny64_model_path):
    res = CliRunner().invoke(main, ["doctor", "--quick", "--json", "--model", str(tiny64_model_path)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    by = {c["name"]: c for c in out["checks"]}
    assert out["failed"] == [] and {"mlxbatch", "python", "os", "mlx", "mlx-lm", "device", "memory", "wired limit",
                                    "blas", "engine vs mlx-lm", "forced out-of-memory"} <= set(by)
    run = by["engine vs mlx-lm"]["data"]
    assert run["engine_tps"] > 0 and run["mlx_lm_tps"] > 0 and run["engine_tokens"] == run["mlx_lm_tokens"]
    if by["device"]["data"]["kind"] == "cpu":  # float32: greedy is mlx-lm's, token for token (bfloat16 on a GPU:
        assert run["same_rows"] == run["same_first"] == run["rows"]  # near-ties may go either way in a few rows)
    oom = by["forced out-of-memory"]
    assert oom["verdict"] == "ok" and oom["data"]["equal_rows"] == [12] * 4 and min(oom["data"]["preemptions"]) >= 1
    assert oom["data"]["batch_invariant"]  # (the suite's OpenBLAS kernel is row-invariant: tests/conftest.py)
    # each launch fails at once and late (Metal's error at the next device call), one run each
    assert [f.split(", ")[1] for f in oom["data"]["failures"]] == ["at once", "late"] * 2
    assert by["memory"]["data"]["kv_budget_bytes"] == run["kv_budget_bytes"] > 0
    table = CliRunner().invoke(main, ["doctor", "--no-run"])
    assert table.exit_code == 0 and table.stdout.startswith("| check | result | verdict | detail |")
    assert "engine vs mlx-lm" not in table.stdout and "| device | " in table.stdout


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="OpenBLAS kernels of x86-64 CPUs")
def test_the_doctor_passes_on_a_cpu_whose_blas_kernel_is_not_row_invariant(tiny64_model_path):
    """A Linux user's OpenBLAS picks its CPU's own kernel (AVX2 here: Haswell), which rounds a row by the rows beside
    it, so the engine refuses ``batch_invariant`` there. The forced out-of-memory runs used the flag, and the doctor's
    whole engine run was one FAIL row on such a machine; now they run without it (the same tokens, logprobs within a
    tolerance) and say so."""
    env = {**os.environ, "OPENBLAS_CORETYPE": "Haswell"}
    proc = subprocess.run([sys.executable, "-m", "mlxbatch.cli", "doctor", "--quick", "--json", "--model",
                           str(tiny64_model_path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    by = {c["name"]: c for c in out["checks"]}
    assert out["failed"] == [] and "engine vs mlx-lm" in by, out["checks"][-1]
    oom = by["forced out-of-memory"]
    assert oom["verdict"] == "ok" and oom["data"]["equal_rows"] == [12] * 4, oom
    if not oom["data"]["batch_invariant"]:  # (a CPU without AVX2 runs a row-invariant kernel: the flag holds there)
        assert "not batch-invariant on this device" in oom["detail"] and "OPENBLAS_CORETYPE" in oom["detail"]
