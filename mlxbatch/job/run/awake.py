"""Keeping a Mac awake while a job runs.

Owns the sleep assertion of a run. macOS idle sleep freezes an overnight job until someone wakes the machine, so
while a job runs ``caffeinate -i -w <pid>`` holds an assertion against idle sleep. ``-w`` ties it to this process:
it ends when the run ends, even after ``kill -9``, and it is also stopped as soon as the run returns. Elsewhere
nothing is started. It does not stop a laptop from sleeping when its lid is closed (unless it runs on power with an
external display), and the display may still turn off: the system stays awake, not the screen.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


def _platform() -> str:
    return sys.platform


def keep_awake_command(platform: str, pid: int, which: Callable[[str], str | None] = shutil.which) -> list[str] | None:
    """The command that keeps this machine awake while process ``pid`` lives (None: nothing to do here)."""
    if platform != "darwin":
        return None
    exe = which("caffeinate")
    if exe is None:
        log.warning("caffeinate not found: macOS may sleep while this job runs (System Settings > Energy)")
        return None
    return [exe, "-i", "-w", str(pid)]


@contextmanager
def keep_awake(platform: str | None = None) -> Iterator[subprocess.Popen[bytes] | None]:
    """Hold a sleep assertion (macOS) for the duration of the block; yields the process holding it, or None."""
    cmd = keep_awake_command(platform or _platform(), os.getpid())
    proc = None
    if cmd is not None:
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            log.info("keeping the Mac awake while the job runs (%s)", " ".join(cmd))
        except OSError as exc:
            log.warning("could not start %s (%s): macOS may sleep while this job runs", cmd[0], exc)
    try:
        yield proc
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
