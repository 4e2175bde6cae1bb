"""Pre-flight checks of ``scripts/setup.sh``: which Python builds ``.venv``, and can this machine run MLX at all.

Owns the rules, so that setup says exactly what is wrong instead of letting pip fail with "No matching
distribution found":
- Python: every mlx-lm 0.32.x needs Python >= 3.11. The newest ``python3.13`` / ``python3.12`` / ``python3.11`` found
  on PATH, in Homebrew's ``/opt/homebrew/bin`` or in ``/usr/local/bin`` is used (then ``python3`` if it is new
  enough; ``$PYTHON`` overrides the search). Commands that do not run (a pyenv shim of a version that is not
  selected, the macOS ``python3`` stub without the Command Line Tools) are skipped.
- macOS: MLX ships wheels for Apple silicon (arm64) and macOS >= 14 only. An Intel Mac, a terminal running under
  Rosetta 2 and an x86_64 Python on an Apple silicon Mac are each named as such, with the fix.
- ``.venv``: one whose Python is older than 3.11 (or, on a Mac, not arm64, or no longer runs) is rebuilt.
- Notes that do not stop setup: macOS 14 runs MLX but cannot wire memory (``WIRED_MACOS``), and setup says so.

Usage (by setup.sh; it runs under any python3 >= 3.7, even the Command Line Tools' 3.9):
    python3 scripts/check_platform.py              # prints the chosen interpreter; exit 1 with the reason
    python3 scripts/check_platform.py --venv .venv # exit 0: keep it; exit 1: rebuild it (the reason on stderr)
Everything the checks read (uname, sw_vers, sysctl, the interpreters) comes through ``Probe`` so tests inject it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

MIN_PYTHON = (3, 11)
MIN_MACOS = (14, 0)
# MLX wires the model's weights and KV (mx.set_wired_limit) through Metal residency sets, a macOS 15 API: before it
# the call does nothing. The same rule is mlxbatch.bench.doctor.WIRED_MACOS (this script runs before mlxbatch is
# installed; tests/test_setup_checks.py checks the two agree).
WIRED_MACOS = (15, 0)
PREFERRED = ("python3.13", "python3.12", "python3.11")
EXTRA_DIRS = ("/opt/homebrew/bin", "/usr/local/bin")  # Homebrew on Apple silicon, Homebrew on Intel / python.org
# printed by a candidate interpreter: "3.12.4 arm64"
PROBE_CODE = "import platform, sys; print('%d.%d.%d' % sys.version_info[:3], platform.machine())"


@dataclass(frozen=True)
class Interpreter:
    path: str
    version: tuple[int, ...]  # (major, minor, micro)
    machine: str  # platform.machine() of that interpreter: "arm64", "x86_64", "aarch64"

    @property
    def label(self) -> str:
        return f"{self.path} (Python {'.'.join(map(str, self.version))}, {self.machine})"


@dataclass(frozen=True)
class Host:
    system: str  # uname -s: "Darwin", "Linux"
    machine: str  # uname -m as this shell sees it ("x86_64" in a terminal running under Rosetta)
    arm64_hardware: bool = False  # sysctl hw.optional.arm64 (Apple silicon, even under Rosetta)
    macos: tuple[int, ...] | None = None  # sw_vers -productVersion, e.g. (14, 5)

    @property
    def is_mac(self) -> bool:
        return self.system == "Darwin"


@dataclass
class Probe:
    """How the checks see the machine: commands run through ``run`` (argv -> stdout, or None if it failed)."""

    run: Callable[[Sequence[str]], str | None]
    path_env: str = field(default_factory=lambda: os.environ.get("PATH", ""))
    extra_dirs: Sequence[str] = EXTRA_DIRS

    def host(self) -> Host:
        system = (self.run(["uname", "-s"]) or "").strip() or "unknown"
        machine = (self.run(["uname", "-m"]) or "").strip() or "unknown"
        if system != "Darwin":
            return Host(system, machine)
        arm64 = (self.run(["sysctl", "-n", "hw.optional.arm64"]) or "").strip() == "1"
        return Host(system, machine, arm64 or machine == "arm64",
                    _version((self.run(["sw_vers", "-productVersion"]) or "").strip()))

    def interpreter(self, command: str) -> Interpreter | None:
        out = self.run([command, "-c", PROBE_CODE])
        parts = (out or "").split()
        if len(parts) != 2 or _version(parts[0]) is None:
            return None
        return Interpreter(command, _version(parts[0]), parts[1])

    def candidates(self) -> list[str]:
        """Commands worth probing, best first: the preferred names on PATH, then in the extra folders, then python3."""
        seen: set[str] = set()
        out: list[str] = []
        for name in (*PREFERRED, "python3"):
            found = [shutil.which(name, path=self.path_env)] + [os.path.join(d, name) for d in self.extra_dirs]
            for p in found:
                if p and os.path.isfile(p) and os.access(p, os.X_OK) and os.path.realpath(p) not in seen:
                    seen.add(os.path.realpath(p))
                    out.append(p)
        return out


def _version(text: str) -> tuple[int, ...] | None:
    try:
        parts = tuple(int(x) for x in text.split(".") if x != "")
    except ValueError:
        return None
    return parts or None


def _run(argv: Sequence[str]) -> str | None:
    try:
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def install_hint(host: Host) -> str:
    if host.is_mac:
        return ("install one with Homebrew (https://brew.sh): `brew install python@3.12`, or the macOS installer "
                "from https://www.python.org/downloads/ ; then run `bash scripts/setup.sh` again "
                "(or `PYTHON=/opt/homebrew/bin/python3.12 bash scripts/setup.sh`)")
    return ("install one: `sudo apt-get install python3.12 python3.12-venv` (Debian/Ubuntu; python3.11 on older "
            "releases), `sudo dnf install python3.12` (Fedora), or pyenv; then run `bash scripts/setup.sh` again "
            "(or `PYTHON=/path/to/python3.12 bash scripts/setup.sh`)")


def host_problems(host: Host) -> list[str]:
    """What stops MLX on this machine itself, whatever the Python (empty when nothing does)."""
    if host.is_mac:
        if not host.arm64_hardware:
            return [f"this Mac has an Intel processor (uname -m: {host.machine}); MLX runs only on Apple silicon "
                    "(M1 or newer), so mlxbatch cannot run here. On Linux it runs on the CPU or an NVIDIA GPU."]
        problems: list[str] = []
        if host.machine != "arm64":
            problems.append(f"this shell runs under Rosetta 2 (uname -m says {host.machine} on an Apple silicon "
                            "Mac), so pip would look for Intel wheels, which MLX does not publish. Run setup from "
                            "a native terminal (Terminal > Get Info: untick 'Open using Rosetta'), or as "
                            "`arch -arm64 bash scripts/setup.sh`.")
        if host.macos is None:
            problems.append("could not read the macOS version (sw_vers -productVersion); MLX needs macOS 14 or newer")
        elif tuple(host.macos[:2]) < MIN_MACOS:
            problems.append(f"macOS {'.'.join(map(str, host.macos))} is too old: MLX's wheels need macOS 14 "
                            "(Sonoma) or newer. Update macOS (System Settings > General > Software Update).")
        return problems
    if host.system != "Linux":
        return [f"{host.system}: mlxbatch runs on macOS (Apple silicon) and Linux only"]
    return []


def host_notes(host: Host) -> list[str]:
    """What this machine runs without (it does not stop setup): macOS 14 has no wired memory for MLX."""
    if host.is_mac and host.macos is not None and MIN_MACOS <= tuple(host.macos[:2]) < WIRED_MACOS:
        return [f"macOS {'.'.join(map(str, host.macos))} runs mlxbatch, but MLX can wire memory only on macOS 15 or "
                "newer: here the model's weights and KV are not wired, so under memory pressure macOS may compress "
                "or swap them out between steps (slower steps, never wrong outputs). Leave memory free (close other "
                "apps; engine.kv_memory_fraction lower) or update to macOS 15. See docs/mac.md."]
    return []


def python_problem(py: Interpreter, host: Host) -> str | None:
    """Why ``py`` cannot build mlxbatch's environment on ``host`` (None when it can)."""
    if tuple(py.version[:2]) < MIN_PYTHON:
        return (f"{py.label} is too old: mlx-lm 0.32 needs Python {'.'.join(map(str, MIN_PYTHON))} or newer")
    if host.is_mac and host.arm64_hardware and py.machine != "arm64":
        return (f"{py.label} is an Intel (x86_64) build, which runs under Rosetta 2 on this Apple silicon Mac; "
                "MLX needs an arm64 Python. An Intel Homebrew in /usr/local installs Intel Pythons: use Homebrew "
                "in /opt/homebrew (`/opt/homebrew/bin/brew install python@3.12`) or python.org's universal2 "
                "installer, then `PYTHON=/opt/homebrew/bin/python3.12 bash scripts/setup.sh`.")
    return None


@dataclass(frozen=True)
class Choice:
    python: Interpreter | None
    problems: list[str]  # why setup cannot go on (empty when ``python`` is set)


def choose(host: Host, found: Sequence[Interpreter], forced: str | None = None) -> Choice:
    """The interpreter to build ``.venv`` with: ``forced`` (``$PYTHON``) if usable, else the newest usable one."""
    problems = host_problems(host)
    if problems:
        return Choice(None, problems)
    if forced is not None:
        py = next((p for p in found if p.path == forced), None)
        if py is None:
            return Choice(None, [f"PYTHON={forced} does not run (or is not a Python)"])
        why = python_problem(py, host)
        return Choice(None, [why]) if why else Choice(py, [])
    usable = [p for p in found if python_problem(p, host) is None]
    if usable:
        return Choice(max(usable, key=lambda p: tuple(p.version)), [])  # max keeps the first of equals
    seen = "; ".join(python_problem(p, host) or p.label for p in found) or "no python3 at all"
    return Choice(None, [f"no usable Python {'.'.join(map(str, MIN_PYTHON))}+ found (looked for "
                         f"{', '.join(PREFERRED)} and python3 on PATH and in {', '.join(EXTRA_DIRS)}; found: "
                         f"{seen}). {install_hint(host)[0].upper()}{install_hint(host)[1:]}."])


def venv_problem(probe: Probe, host: Host, venv: str) -> str | None:
    """Why an existing ``venv`` must be rebuilt (None: keep it, or there is none to keep)."""
    exe = os.path.join(venv, "bin", "python")
    if not os.path.lexists(exe) and not os.path.exists(venv):
        return None
    py = probe.interpreter(exe)
    if py is None:
        return f"{venv}: its Python ({exe}) does not run (moved or uninstalled)"
    why = python_problem(py, host)
    return f"{venv}: {why}" if why else None


def main(argv: Sequence[str], probe: Probe | None = None, out=sys.stdout, err=sys.stderr) -> int:
    probe = probe or Probe(_run)
    host = probe.host()
    if len(argv) == 2 and argv[0] == "--venv":
        why = venv_problem(probe, host, argv[1])
        if why:
            print(f"mlxbatch setup: rebuilding {why}", file=err)
        return 1 if why else 0
    forced = os.environ.get("PYTHON") or None
    if forced is not None:
        forced = shutil.which(forced, path=probe.path_env) or forced
        py = probe.interpreter(forced)
        found = [py] if py else []
    else:
        found = [py for py in map(probe.interpreter, probe.candidates()) if py is not None]
    choice = choose(host, found, forced)
    for note in host_notes(host) if choice.python is not None else []:
        print(f"mlxbatch setup: note: {note}", file=err)
    for problem in choice.problems:
        print(f"mlxbatch setup: {problem}", file=err)
    if choice.python is None:
        return 1
    print(choice.python.path, file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
