"""A pytest plugin (registered by ``tests/conftest.py``): one Ctrl-C stops the whole suite.

A job run installs its own SIGINT handler while it runs (a first Ctrl-C checkpoints what finished and raises
``JobInterrupted``), so a Ctrl-C during such a test would fail only that test and the suite would go on. Python writes
every signal that reaches one of its handlers to the wakeup fd set here, whichever handler is installed; after each
test, a SIGINT found there stops the session as pytest's own Ctrl-C does (exit status 2). So a test must not send SIGINT
to the pytest process itself: send it to a child process.
"""

from __future__ import annotations

import signal
import socket
import threading

import pytest

_sockets: tuple[socket.socket, socket.socket] | None = None  # (read, write); None where no wakeup fd is set


def pytest_configure(config: pytest.Config) -> None:
    global _sockets
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set the wakeup fd (and only it runs signal handlers)
    _sockets = socket.socketpair()
    for s in _sockets:
        s.setblocking(False)
    signal.set_wakeup_fd(_sockets[1].fileno(), warn_on_full_buffer=False)


def pytest_unconfigure(config: pytest.Config) -> None:
    global _sockets
    if _sockets is not None:
        signal.set_wakeup_fd(-1)
        for s in _sockets:
            s.close()
        _sockets = None


def _sigint_arrived() -> bool:
    """Whether a SIGINT reached this process since the last call (drains the signals recorded so far)."""
    seen = b""
    while _sockets is not None:
        try:
            chunk = _sockets[0].recv(4096)
        except BlockingIOError:
            break
        if not chunk:
            break
        seen += chunk
    return signal.SIGINT in seen


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    result = yield
    if _sigint_arrived():
        item.session.shouldstop = f"Ctrl-C (SIGINT) during {item.nodeid}"
    return result
