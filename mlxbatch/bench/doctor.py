"""``mlxbatch doctor``: the checks a user runs first on a new machine and pastes into an issue.

Owns the checks, their verdicts and the table. The machine: versions (mlxbatch, Python, MLX, mlx-lm, the OS), the
device, memory (the machine's, what is free, the KV budget an engine takes), the wired limit (Metal, macOS 15+ only)
and the BLAS (Linux CPU). Then the engine, on a random-weight model built locally (``doctor_runs``): a run against
mlx-lm's ``batch_generate`` on the same prompts, and out-of-memory steps forced into a run whose outputs must equal an
unforced run's. Everything the machine checks read comes through ``Facts``, so tests give them a Mac's (macOS 14,
Metal) on Linux.
"""

from __future__ import annotations

import enum
import importlib.metadata
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlxbatch
from mlxbatch.engine import DeviceInfo, device_info

GiB = 1 << 30
# MLX wires weights and KV (mx.set_wired_limit) through Metal residency sets, a macOS 15 API; before it, and in a
# virtual machine, the call does nothing (mlx/backend/metal/resident.cpp). scripts/check_platform.py has the same rule.
WIRED_MACOS = (15, 0)
PACKAGES = ("mlx", "mlx-lm", "mlx-vlm", "ray")


class Verdict(str, enum.Enum):
    OK = "ok"
    NOTE = "note"  # nothing wrong: what this machine does differently
    WARN = "warn"  # it runs, slower or with less room than it could
    FAIL = "FAIL"  # something is broken: the detail says what to send


@dataclass(frozen=True)
class Check:
    name: str
    result: str
    verdict: Verdict
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)  # the figures, for --json


@dataclass(frozen=True)
class Facts:
    """What the machine checks read (``gather_facts``; tests inject a Mac's)."""

    platform: str  # sys.platform: "darwin", "linux"
    os_name: str  # "macOS 14.6.1", "Linux 6.8.0 (Ubuntu 24.04 LTS)"
    macos: tuple[int, ...] | None  # the macOS version, on a Mac
    machine: str  # this Python's architecture (platform.machine())
    python: str
    versions: dict[str, str | None]  # package -> version (None: not installed)
    device: DeviceInfo
    in_vm: bool = False  # macOS: kern.hv_vmm_present (MLX wires nothing in a virtual machine)
    wired_sysctl_mb: int = 0  # macOS: iogpu.wired_limit_mb (0: the system's default cap)


def _sysctl(name: str) -> str:
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def gather_facts() -> Facts:
    versions = {p: _version(p) for p in PACKAGES}
    if sys.platform == "darwin":
        mac = platform.mac_ver()[0]
        macos = tuple(int(x) for x in mac.split(".") if x.isdigit()) or None
        wired = _sysctl("iogpu.wired_limit_mb")
        return Facts("darwin", f"macOS {mac}", macos, platform.machine(), platform.python_version(), versions,
                     device_info(), _sysctl("kern.hv_vmm_present") == "1", int(wired) if wired.isdigit() else 0)
    try:
        distro = f" ({platform.freedesktop_os_release().get('PRETTY_NAME', '')})"
    except OSError:
        distro = ""
    return Facts(sys.platform, f"{platform.system()} {platform.release()}{distro}", None, platform.machine(),
                 platform.python_version(), versions, device_info())


def version_checks(f: Facts) -> list[Check]:
    from mlxbatch.bench.meta import git_commit

    # $GIT_SHA: a copy of the tree without its .git (as the bench's --commit)
    out = [Check("mlxbatch", f"{mlxbatch.__version__} (git {git_commit(os.environ.get('GIT_SHA'))})", Verdict.OK),
           Check("os", f.os_name, Verdict.OK, data={"platform": f.platform})]
    py = Check("python", f"{f.python} ({f.machine})", Verdict.OK)
    if f.platform == "darwin" and f.machine != "arm64":
        py = Check("python", py.result, Verdict.FAIL, "an Intel (x86_64) Python runs under Rosetta: MLX needs an "
                   "arm64 one (bash scripts/setup.sh picks and checks it)")
    out.insert(1, py)
    for name in PACKAGES:
        v = f.versions.get(name)
        if v is not None:
            out.append(Check(name, v, Verdict.OK))
        elif name in ("mlx", "mlx-lm"):
            out.append(Check(name, "not installed", Verdict.FAIL, "run bash scripts/setup.sh"))
        else:
            extra = "vlm" if name == "mlx-vlm" else "ray"
            out.append(Check(name, "not installed", Verdict.NOTE, f"optional: MLXBATCH_EXTRAS={extra} bash "
                             "scripts/setup.sh"))
    return out


def device_check(f: Facts) -> Check:
    d = f.device
    detail = {"metal": "the Mac's GPU", "cuda": f"NVIDIA GPU, kernel launch {d.kernel_launch or '?'}",
              "cpu": "MLX's CPU backend"}.get(d.kind, "")
    return Check("device", f"{d.kind}: {d.name}", Verdict.OK, detail, {"kind": d.kind, "name": d.name})


def memory_check(f: Facts, kv_budget: int | None) -> Check:
    """The machine's memory, what the device may use and has free, and the KV budget an engine took (if it ran)."""
    d = f.device
    host = d.host_memory or d.total_memory
    result = f"machine {host / GiB:.1f} GiB, device {d.total_memory / GiB:.1f} GiB, free {d.available_memory / GiB:.1f}"
    result += f" GiB, KV budget {kv_budget / GiB:.2f} GiB" if kv_budget else " GiB"
    data = {"host_bytes": host, "device_bytes": d.total_memory, "available_bytes": d.available_memory,
            "kv_budget_bytes": kv_budget}
    verdict, detail = Verdict.OK, ""
    if d.kind == "metal":
        detail = ("device = Metal's recommended working set (a share of the machine's memory); free = within it and "
                  "what macOS has free")
    if d.available_memory < 2 * GiB or (d.kind == "metal" and d.available_memory < host // 4):
        verdict, detail = Verdict.WARN, (f"little is free ({d.available_memory / GiB:.1f} GiB): the engine's KV "
                                         "budget is a share of it; close other apps before a long job")
    return Check("memory", result, verdict, detail, data)


def wired_check(f: Facts) -> Check:
    """Metal only: whether a run can wire its weights and KV (so macOS does not compress or swap them)."""
    if f.device.kind != "metal":
        return Check("wired limit", "not used", Verdict.NOTE, "Metal only (unified memory)")
    data = {"macos": ".".join(map(str, f.macos or ())), "iogpu_wired_limit_mb": f.wired_sysctl_mb}
    cap = f" (raised: sysctl iogpu.wired_limit_mb={f.wired_sysctl_mb})" if f.wired_sysctl_mb else ""
    if f.macos is None or tuple(f.macos[:2]) < WIRED_MACOS:
        return Check("wired limit", f"not available on {f.os_name}", Verdict.WARN,
                     "MLX wires memory only on macOS 15+: here weights and KV may be compressed or swapped out "
                     "between steps under memory pressure (slower steps, never wrong outputs). Leave memory free "
                     "or update to macOS 15 (docs/mac.md)", data)
    if f.in_vm:
        return Check("wired limit", "not available in a virtual machine", Verdict.WARN,
                     "MLX does not wire memory in a VM (kern.hv_vmm_present=1): steps may be slower under pressure",
                     data)
    return Check("wired limit", f"each run wires its weights and KV, up to the {f.device.total_memory / GiB:.1f} GiB "
                 f"working set{cap}", Verdict.OK, "", data)


def blas_check(f: Facts) -> Check:
    if f.device.kind != "cpu":
        return Check("blas", "not used", Verdict.NOTE, "the model runs on the GPU")
    if f.device.blas.startswith("openblas"):
        return Check("blas", f.device.blas, Verdict.OK)
    return Check("blas", f.device.blas or "reference", Verdict.WARN,
                 "MLX's reference BLAS: float32 matmuls ~40x slower; install libopenblas0-pthread (setup.sh does)")


def machine_checks(f: Facts, kv_budget: int | None = None) -> list[Check]:
    return [*version_checks(f), device_check(f), memory_check(f, kv_budget), wired_check(f), blas_check(f)]


def run_checks(on_gpu: bool, quick: bool, model: str | None, cache_dir: Path) -> tuple[list[Check], int | None]:
    """The engine checks (and the KV budget its run took); a run that raises is a FAIL row, not a traceback."""
    from mlxbatch.bench.doctor_runs import (
        FIRST_TOKENS,
        LOGPROB_TOLERANCE,
        compare_with_mlx_lm,
        forced_oom,
        open_bench,
        pick_size,
    )

    size = pick_size(on_gpu, quick, model)
    try:
        b = open_bench(size, cache_dir)
        cmp = compare_with_mlx_lm(b, size)
        oom = forced_oom(b)
    except Exception as exc:  # the table is the point: it says what broke, with the rest of the checks
        return [Check("engine run", f"{type(exc).__name__}: {exc}"[:300], Verdict.FAIL,
                      "send this table and the output of mlxbatch -v doctor")], None
    ratio = cmp.engine_tps / cmp.mlx_lm_tps
    # a first token that differs is a near-tie at most, and rare; many are a wrong path. Later tokens part ways more
    # often in bfloat16 (a row differs from its first near-tie on), so whole rows are shown, not judged
    verdict = Verdict.OK if ratio >= 0.8 and cmp.same_first >= 0.75 * cmp.rows else Verdict.WARN  # H100: 92%
    if cmp.same_first < 0.5 * cmp.rows:
        verdict = Verdict.FAIL
    speed = Check("engine vs mlx-lm", f"{cmp.engine_tps:,.0f} vs {cmp.mlx_lm_tps:,.0f} tok/s ({ratio:.2f}x); the "
                  f"same tokens: first {FIRST_TOKENS} {cmp.same_first}/{cmp.rows} rows, all {cmp.max_tokens} "
                  f"{cmp.same_rows}/{cmp.rows}", verdict,
                  f"{cmp.model} ({cmp.dtype}), {cmp.rows} rows, {cmp.prompt_tokens} prompt tokens, {cmp.max_tokens} "
                  f"new each (greedy), {cmp.concurrency} at a time; {cmp.engine_s:.1f} s vs {cmp.mlx_lm_s:.1f} s",
                  {**asdict(cmp), "engine_tps": cmp.engine_tps, "mlx_lm_tps": cmp.mlx_lm_tps})
    if oom.problem:
        forced = Check("forced out-of-memory", "not run", Verdict.WARN, oom.problem, asdict(oom))
    else:
        ok = all(n == oom.rows for n in oom.equal_rows) and all(p >= 1 for p in oom.preemptions)
        forced = Check("forced out-of-memory",
                       f"outputs equal to the unforced run: {', '.join(f'{n}/{oom.rows}' for n in oom.equal_rows)} "
                       f"rows", Verdict.OK if ok else Verdict.FAIL,
                       f"{'; '.join(oom.failures)} failed for lack of memory (one run each; late: the error "
                       f"at the next device call, as Metal reports it; batch shrunk "
                       f"{', '.join(map(str, oom.preemptions))} time(s)); "
                       + ("batch-invariant rows, 4 at a time" if oom.batch_invariant else
                          f"rows 4 at a time, not batch-invariant on this device (the same tokens, logprobs within "
                          f"{LOGPROB_TOLERANCE:g}): {oom.not_invariant}"),
                       asdict(oom))
    return [speed, forced], cmp.kv_budget_bytes


def doctor(quick: bool = False, run: bool = True, model: str | None = None,
           cache_dir: Path = Path("~/.cache/mlxbatch/bench"),
           facts: Callable[[], Facts] = gather_facts) -> list[Check]:
    f = facts()
    runs, budget = run_checks(f.device.kind != "cpu", quick, model, cache_dir.expanduser()) if run else ([], None)
    return machine_checks(f, budget) + runs


def render(checks: list[Check]) -> str:
    """A Markdown table (it pastes into a GitHub issue as it is)."""
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    lines = ["| check | result | verdict | detail |", "|---|---|---|---|"]
    lines += [f"| {c.name} | {esc(c.result)} | {c.verdict.value} | {esc(c.detail)} |" for c in checks]
    return "\n".join(lines)


def as_json(checks: list[Check]) -> dict[str, Any]:
    return {"checks": [{**asdict(c), "verdict": c.verdict.value} for c in checks],
            "failed": [c.name for c in checks if c.verdict is Verdict.FAIL]}
