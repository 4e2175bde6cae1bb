"""Stopping a run: SIGINT/SIGTERM, a second signal, and a stop asked for from another thread.

Owns a run's stop flag and its signal handlers. The first SIGINT/SIGTERM only sets the flag: the run loop
(``job.run.runner``) sees it, aborts what is in flight, checkpoints what finished and raises ``JobInterrupted``. A second
signal leaves at once (``os._exit``) when ``exit_on_second`` is set (the command line: shards are atomic, nothing is
corrupted); otherwise (notebooks, ``run_job``) it raises ``KeyboardInterrupt`` in the loop, which stops without
waiting and keeps the process. Handlers are installed only on the main thread, and the previous ones are put back
after the run; on other threads ``request`` is the way to stop.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)


EXIT_INTERRUPTED = 130  # the command line's exit code of an interrupted run, however it was stopped (README)


def signal_name(signum: int) -> str:
    """How a user knows the signal: Ctrl-C for SIGINT, else its name (SIGTERM, ...)."""
    if signum == signal.SIGINT:
        return "Ctrl-C"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignals:
    """The stop flag of one run (``signum``: the signal that asked, None while running) and its handlers."""

    def __init__(self, exit_on_second: bool) -> None:
        self.exit_on_second = exit_on_second
        self.signum: int | None = None
        self._requested = False

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is not None:
            if self.exit_on_second:
                os._exit(EXIT_INTERRUPTED)  # second signal: leave now; shards are atomic, nothing is corrupted
            raise KeyboardInterrupt  # in a notebook: stop now, keep the kernel (finished rows are flushed)
        self.signum = signum
        name = signal_name(signum)
        log.warning("%s: finishing the current shard, then stopping (%s again to %s at once)", name, name,
                    "exit" if self.exit_on_second else "stop")

    def request(self) -> None:
        """Stop as a first Ctrl-C would."""
        self.signum, self._requested = signal.SIGINT, True

    @property
    def reason(self) -> str:
        """Why the run stopped, in the user's words: "interrupted (Ctrl-C)", "stopped (SIGTERM)", ..."""
        if self._requested:
            return "stopped (asked to stop)"
        if self.signum == signal.SIGINT:
            return "interrupted (Ctrl-C)"
        return f"stopped ({signal_name(self.signum or 0)})"

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The handlers for SIGINT and SIGTERM while the block runs (main thread only), the previous ones after."""
        old: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
            old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
