"""Process memory figures (current RSS, peak RSS, /proc/self/status fields) that work on Linux and macOS.

Linux: ``/proc/self/statm`` (current RSS) and ``/proc/self/status`` (``VmHWM`` peak, ``RssAnon``...). Where
``/proc`` is missing or unreadable (macOS): ``getrusage``'s ``ru_maxrss``, the process's lifetime high-water
mark, which is in bytes on macOS and in KiB on Linux and the BSDs. The platform and the ``/proc`` files are
module attributes read at call time (``PLATFORM``, ``STATM``, ``STATUS``) or arguments, so tests inject them.
Pure stdlib, no mlx: the streaming child imports it.
"""

from __future__ import annotations

import os
import resource
import sys

PLATFORM = sys.platform
STATM = "/proc/self/statm"
STATUS = "/proc/self/status"


def ru_maxrss_bytes(platform: str | None = None, raw: int | None = None) -> int:
    """``getrusage(RUSAGE_SELF).ru_maxrss`` (or ``raw``) in bytes: macOS reports bytes, Linux and BSD KiB."""
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss if raw is None else raw
    return int(value) if (platform or PLATFORM) == "darwin" else int(value) * 1024


def status_kb(field: str, path: str | None = None) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmHWM``, ``VmRSS``, ``RssAnon``...), None where unavailable."""
    try:
        with open(path or STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def current_rss(platform: str | None = None, statm: str | None = None) -> int:
    """Resident set size now, in bytes; without /proc the lifetime peak (``ru_maxrss``) stands in for it."""
    try:
        with open(statm or STATM) as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return ru_maxrss_bytes(platform)


def peak_rss(platform: str | None = None, status: str | None = None) -> int:
    """Peak resident set size of this process image, in bytes: ``VmHWM``, else ``ru_maxrss``.

    ``VmHWM`` first because on Linux ``ru_maxrss`` keeps the parent's RSS across fork + exec (a child started
    from a process holding a model reports at least the parent's size).
    """
    hwm = status_kb("VmHWM", status)
    return hwm * 1024 if hwm else ru_maxrss_bytes(platform)
