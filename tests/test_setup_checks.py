"""scripts/setup.sh's pre-flight checks (scripts/check_platform.py), with the Mac's uname / sw_vers / sysctl and
the interpreters found injected: the rules in-process, then setup.sh itself with fake commands on its PATH."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_platform", ROOT / "scripts" / "check_platform.py")
cp = importlib.util.module_from_spec(_spec)
sys.modules["check_platform"] = cp  # dataclasses look their module up
_spec.loader.exec_module(cp)

MAC = cp.Host("Darwin", "arm64", True, (14, 5))
LINUX = cp.Host("Linux", "x86_64")


def py(path: str, version: str, machine: str = "arm64"):
    return cp.Interpreter(path, tuple(int(x) for x in version.split(".")), machine)


def problems(host, found, forced=None) -> str:
    choice = cp.choose(host, found, forced)
    assert choice.python is None
    return "\n".join(choice.problems)


def test_the_newest_usable_python_is_chosen():
    found = [py("/usr/bin/python3", "3.9.6"), py("/opt/homebrew/bin/python3.12", "3.12.4"),
             py("/opt/homebrew/bin/python3.11", "3.11.9"), py("/usr/local/bin/python3.13", "3.13.1", "x86_64")]
    # the x86_64 3.13 (an Intel Homebrew's) would run under Rosetta and find no MLX wheel: the arm64 3.12 wins
    assert cp.choose(MAC, found).python.path == "/opt/homebrew/bin/python3.12"
    assert cp.choose(LINUX, [py("/usr/bin/python3", "3.11.2", "x86_64"), py("/x/python3.13", "3.13.0", "x86_64")]) \
        .python.path == "/x/python3.13"


def test_no_python_311_says_what_to_install():
    text = problems(MAC, [py("/usr/bin/python3", "3.9.6")])
    assert "/usr/bin/python3 (Python 3.9.6, arm64) is too old" in text and "3.11 or newer" in text
    assert "brew install python@3.12" in text and "python.org" in text
    text = problems(LINUX, [])
    assert "no python3 at all" in text and "apt-get install python3.12 python3.12-venv" in text


def test_a_forced_python_is_checked_too():
    assert "PYTHON=/x/python does not run" in problems(LINUX, [], forced="/x/python")
    assert "is too old" in problems(LINUX, [py("/x/python3.10", "3.10.13", "x86_64")], forced="/x/python3.10")
    ok = py("/x/python3.11", "3.11.7", "x86_64")
    assert cp.choose(LINUX, [ok], forced="/x/python3.11").python == ok


@pytest.mark.parametrize("host,words", [
    (cp.Host("Darwin", "x86_64", False, (13, 6)), "Intel processor"),
    (cp.Host("Darwin", "x86_64", True, (14, 5)), "runs under Rosetta 2 (uname -m says x86_64"),
    (cp.Host("Darwin", "arm64", True, (13, 6, 1)), "macOS 13.6.1 is too old: MLX's wheels need macOS 14"),
    (cp.Host("Darwin", "arm64", True, None), "could not read the macOS version"),
    (cp.Host("Windows_NT", "AMD64"), "macOS (Apple silicon) and Linux only"),
])
def test_machines_mlx_cannot_run_on_are_named(host, words):
    assert words in problems(host, [py("/opt/homebrew/bin/python3.12", "3.12.4")])


def test_macos_14_is_accepted_with_what_it_lacks_said(tmp_path):
    """MLX wires memory through Metal residency sets, which macOS 14 does not have: setup goes on and says so."""
    (note,) = cp.host_notes(cp.Host("Darwin", "arm64", True, (14, 6, 1)))
    assert "macOS 14.6.1" in note and "wired" in note and "macOS 15" in note and "docs/mac.md" in note
    assert cp.host_notes(cp.Host("Darwin", "arm64", True, (15, 0))) == [] == cp.host_notes(LINUX)
    on_path = fake_commands(tmp_path / "bin", {"python3.12": "3.12.4 arm64"})
    probe = cp.Probe(mac_run(macos="14.6"), path_env=str(on_path), extra_dirs=[])
    out, err = _Capture(), _Capture()
    assert cp.main([], probe, out, err) == 0 and out.text.strip()  # an interpreter is chosen: setup goes on
    assert err.text.startswith("mlxbatch setup: note: macOS 14.6 ")


def test_an_x86_64_python_on_apple_silicon_is_named_with_the_fix():
    text = problems(MAC, [py("/usr/local/bin/python3.12", "3.12.4", "x86_64")])
    assert "Intel (x86_64) build, which runs under Rosetta 2" in text and "/opt/homebrew" in text


def fake_commands(folder: Path, outputs: dict[str, str]) -> Path:
    """Executables that print a fixed text (``None``: fail like a pyenv shim of an unselected version)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in outputs.items():
        if text is None:
            body = "#!/bin/sh\necho \"pyenv: $0: command not found\" >&2; exit 127"
        else:
            body = text if text.startswith("#!") else f"#!/bin/sh\nprintf '%s\\n' '{text}'"
        (folder / name).write_text(body + "\n")
        (folder / name).chmod(0o755)
    return folder


def mac_run(uname_m="arm64", arm64="1", macos="14.6.1"):
    """A Probe runner answering like a Mac for uname / sysctl / sw_vers and running everything else for real."""
    canned = {("uname", "-s"): "Darwin\n", ("uname", "-m"): uname_m + "\n",
              ("sysctl", "-n", "hw.optional.arm64"): arm64 + "\n", ("sw_vers", "-productVersion"): macos + "\n"}
    return lambda argv: canned[tuple(argv)] if tuple(argv) in canned else cp._run(argv)


def test_probe_reads_the_host_and_finds_interpreters_on_path_and_in_homebrew(tmp_path):
    on_path = fake_commands(tmp_path / "bin", {"python3.13": None, "python3.12": "3.12.4 arm64",
                                               "python3": "3.9.6 arm64"})
    brew = fake_commands(tmp_path / "homebrew", {"python3.11": "3.11.9 arm64", "python3.13": "3.13.1 arm64"})
    probe = cp.Probe(mac_run(), path_env=str(on_path), extra_dirs=[str(brew)])
    assert probe.host() == cp.Host("Darwin", "arm64", True, (14, 6, 1))
    assert cp.Probe(mac_run(uname_m="x86_64"), path_env="").host().arm64_hardware  # Rosetta: still Apple silicon
    assert not cp.Probe(mac_run(uname_m="x86_64", arm64="0"), path_env="").host().arm64_hardware  # Intel Mac
    assert probe.candidates() == [str(on_path / "python3.13"), str(brew / "python3.13"), str(on_path / "python3.12"),
                                  str(brew / "python3.11"), str(on_path / "python3")]
    assert probe.interpreter(str(on_path / "python3.13")) is None  # the shim that does not run is skipped
    out, err = _Capture(), _Capture()
    assert cp.main([], probe, out, err) == 0 and out.text.strip() == str(brew / "python3.13")
    # only the 3.9 of the Command Line Tools: exit 1 and what to install, nothing on stdout
    probe = cp.Probe(mac_run(), path_env=str(fake_commands(tmp_path / "clt", {"python3": "3.9.6 arm64"})),
                     extra_dirs=[])
    out, err = _Capture(), _Capture()
    assert cp.main([], probe, out, err) == 1 and out.text == ""
    assert "(Python 3.9.6, arm64) is too old" in err.text and "brew install python@3.12" in err.text


def test_an_old_or_broken_venv_is_rebuilt_and_a_good_one_kept(tmp_path):
    probe = cp.Probe(mac_run(), path_env="")
    assert cp.venv_problem(probe, MAC, str(tmp_path / "none")) is None  # nothing there: setup creates it
    for version, machine, keep in (("3.9.6", "arm64", False), ("3.12.4", "arm64", True), ("3.12.4", "x86_64", False)):
        venv = tmp_path / f"v-{version}-{machine}"
        fake_commands(venv / "bin", {"python": f"{version} {machine}"})
        why = cp.venv_problem(probe, MAC, str(venv))
        assert (why is None) == keep, why
        err = _Capture()
        assert cp.main(["--venv", str(venv)], probe, _Capture(), err) == (0 if keep else 1)
        assert keep or ("rebuilding" in err.text and str(venv) in err.text)
    (tmp_path / "broken").mkdir()
    assert "does not run" in cp.venv_problem(probe, MAC, str(tmp_path / "broken"))


class _Capture:
    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass


def run_setup(tmp_path: Path, fakes: dict[str, str], python3: bool = True) -> subprocess.CompletedProcess:
    """scripts/setup.sh, copied into an empty project, with only ``fakes`` and a few real tools on its PATH."""
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    for name in ("setup.sh", "check_platform.py"):
        shutil.copy(ROOT / "scripts" / name, project / "scripts" / name)
    bin_dir = fake_commands(tmp_path / "fakebin", fakes)
    for tool in ("dirname", "rm"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    if python3:  # this Python runs the checks (and is a candidate itself)
        os.symlink(sys.executable, bin_dir / "python3")
    else:  # a python3 that runs the checks but is not a candidate: the probe's output says 3.9
        (bin_dir / "python3").write_text(f"#!/bin/sh\ncase \"$2\" in *platform.machine*) echo 3.9.6 x86_64; exit 0;; "
                                         f"esac\nexec {sys.executable} \"$@\"\n")
        (bin_dir / "python3").chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    r = subprocess.run(["/bin/bash", str(project / "scripts" / "setup.sh")], env=env, capture_output=True, text=True,
                       timeout=120)
    assert not (project / ".venv").exists()  # it stopped before creating anything
    return r


@pytest.mark.parametrize("uname_m,arm64,macos,words", [
    ("x86_64", "0", "14.5", "this Mac has an Intel processor"),
    ("x86_64", "1", "14.5", "this shell runs under Rosetta 2"),
    ("arm64", "1", "13.6", "macOS 13.6 is too old"),
])
def test_setup_sh_stops_with_the_reason_on_a_mac_mlx_cannot_run_on(tmp_path, uname_m, arm64, macos, words):
    uname = f'#!/bin/sh\ncase "$1" in -m) echo {uname_m};; *) echo Darwin;; esac'
    r = run_setup(tmp_path, {"uname": uname, "sysctl": arm64, "sw_vers": macos})
    assert r.returncode == 1 and f"mlxbatch setup: {words}" in r.stderr, r.stdout + r.stderr
    assert r.stdout == "" and all(line.startswith("mlxbatch setup: ") for line in r.stderr.splitlines())


def test_setup_sh_without_python_311_names_what_to_install(tmp_path):
    if any(os.path.exists(os.path.join(d, n)) for d in cp.EXTRA_DIRS for n in (*cp.PREFERRED, "python3")):
        pytest.skip("a Python in /opt/homebrew/bin or /usr/local/bin would be found (covered in-process above)")
    old = "#!/bin/sh\nprintf '3.10.13 x86_64\\n'"  # a python3.11 that is really a 3.10 (as far as the probe sees)
    r = run_setup(tmp_path, {"uname": "#!/bin/sh\necho Linux", "python3.11": old}, python3=False)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no usable Python 3.11+ found" in r.stderr and "(Python 3.10.13, x86_64) is too old" in r.stderr
    assert "apt-get install python3.12" in r.stderr


def fake_python(path: Path, log: Path) -> Path:
    """A Python 3.12 (arm64) as setup sees it: answers the probe, makes a venv whose python logs its arguments."""
    venv_python = f'#!/bin/sh\necho "$*" >> {log}\n'
    path.write_text("#!/bin/sh\n"
                    'case "$2" in *platform.machine*) echo 3.12.4 arm64; exit 0;; esac\n'
                    'if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"; '
                    f"printf '%s' '{venv_python}' > \"$3/bin/python\"; chmod +x \"$3/bin/python\"; exit 0; fi\n"
                    "exit 1\n")
    path.chmod(0o755)
    return path


def setup_install(tmp_path: Path, extras: str | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    """scripts/setup.sh on a Mac (macOS 15.1, arm64) up to its pip install, which a fake venv Python records."""
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    for name in ("setup.sh", "check_platform.py"):
        shutil.copy(ROOT / "scripts" / name, project / "scripts" / name)
    uname = '#!/bin/sh\ncase "$1" in -m) echo arm64;; *) echo Darwin;; esac'
    bin_dir = fake_commands(tmp_path / "fakebin", {"uname": uname, "sysctl": "1", "sw_vers": "15.1"})
    for tool in ("dirname", "rm", "mkdir", "chmod", "sh"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    os.symlink(sys.executable, bin_dir / "python3")
    log = tmp_path / "pip.log"
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "PYTHON": str(fake_python(bin_dir / "python3.12", log))}
    if extras is not None:
        env["MLXBATCH_EXTRAS"] = extras
    r = subprocess.run(["/bin/bash", str(project / "scripts" / "setup.sh")], env=env, capture_output=True, text=True,
                       timeout=120)
    return r, log.read_text().splitlines() if log.exists() else []


def test_setup_sh_on_a_mac_installs_what_the_first_job_needs_and_names_the_extras(tmp_path):
    r, pip = setup_install(tmp_path / "plain")
    assert r.returncode == 0, r.stdout + r.stderr
    assert pip[-1] == "-m pip install -q -e .[dev]"  # no mlx-vlm (mlx-audio, opencv, transformers 5) and no Ray
    assert "MLXBATCH_EXTRAS=vlm,ray" in r.stdout  # how to add them
    r, pip = setup_install(tmp_path / "all", "vlm,ray")
    assert r.returncode == 0 and pip[-1] == "-m pip install -q -e .[dev,vlm,ray]", r.stdout + r.stderr
    r, pip = setup_install(tmp_path / "typo", "vml")
    assert r.returncode == 1 and "MLXBATCH_EXTRAS: unknown extra 'vml'" in r.stderr and pip == []
