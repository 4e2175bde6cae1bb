"""The launch thread: a step's evaluation handed to MLX off the engine's thread.

``mx.async_eval`` orders a step's graph and encodes its kernels on the thread that calls it, without the GIL. On a
GPU that is most of a step's host time (an H100 with the 0.5B shape: ~8 ms of a ~18 ms step, docs/benchmarks.md), and
on the engine's thread it runs between the step's Python, never beside it. Here a thread of its own waits for the
step before to complete (the device queue's rule: ``outputs.Traffic``) and then launches the step, while the engine's
thread reads the step before's tokens, keeps the books and schedules the next one: only building the graph stays on
the engine's thread. A step's Python and its encoding then take the longer of the two, not their sum.

MLX evaluates a graph on another thread than the one that built it only on a stream any thread may use
(``mx.new_thread_unsafe_stream``): the engine builds its graphs on ``stream`` (``EngineCore``), and one thread at a
time works on it: this thread between ``submit`` and ``join``, the engine's thread otherwise, except that it may read
the results of the step this thread has seen complete (``wait_settled``). ``Traffic`` is the only caller.

Reading an array changes it in MLX: the first read of a launched array waits for its event and drops it, and so does
an evaluation that takes the array in (the next step's decode pass takes the step before's draw). Two threads doing
that to one array at once free its event twice (a segmentation fault on an H100, 1 run in 3 of a 20k-row job). So the
thread that sees a launch complete also completes the arrays the engine's thread will read from it (``complete``:
before ``wait_settled`` lets that thread read them), and the engine's thread does the same after its own waits.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx


@dataclass(frozen=True)
class LaunchResult:
    """What a submission came to on the launch thread: whether the launch before it was seen complete, the seconds it
    waited for that and spent inside ``mx.async_eval``, and what failed (raised on the engine's thread by ``Traffic``)."""

    settled: bool
    waited_s: float
    encoded_s: float
    error: BaseException | None


class _State:
    """The submission in flight, shared by the two threads: written by the engine's thread before the job is queued,
    by the launch thread until ``done`` is set."""

    def __init__(self) -> None:
        self.settled = threading.Event()  # the wait for the launch before is over (succeeded or not)
        self.done = threading.Event()  # the submission is launched (or failed)
        self.result = LaunchResult(True, 0.0, 0.0, None)


class Launcher:
    """One thread launching an engine's steps on ``stream``, each inside ``bound()`` (the step's memory bound)."""

    def __init__(self, gpu: bool, bound: Callable[[], AbstractContextManager[Any]]) -> None:
        self.stream = mx.new_thread_unsafe_stream(mx.gpu if gpu else mx.cpu)
        self._jobs: queue.SimpleQueue[tuple[Sequence[Any], Sequence[Any] | None] | None] = queue.SimpleQueue()
        self._state = _State()
        self.pending = False  # a submission not joined yet
        self._thread = threading.Thread(target=_run, args=(self._jobs, self._state, self.stream, bound),
                                        name="mlxbatch-launch", daemon=True)
        self._thread.start()
        # an engine dropped without ``close`` (a notebook's) stops its thread too
        self._finalizer = weakref.finalize(self, self._jobs.put, None)

    def on_stream(self) -> AbstractContextManager[Any]:
        """The engine's arrays are made inside this (MLX's default stream of the calling thread: ``stream``)."""
        return mx.stream(self.stream)

    def submit(self, arrays: Sequence[Any], settle: Sequence[Any] | None) -> None:
        """Launch ``arrays`` (the step's outputs) on the thread; returns at once. ``settle``: None when nothing is in
        flight, else the thread first waits for what is and then completes these arrays of it (those the engine's
        thread will read: ``complete``). The last submission must be joined first."""
        assert not self.pending, "a submission is still in flight: join it first"
        self._state.settled.clear()
        self._state.done.clear()
        self.pending = True
        self._jobs.put((arrays, settle))

    def wait_settled(self) -> bool:
        """Wait until the thread's wait for the launch before the submitted one is over; whether it succeeded (a
        failure comes with ``join``)."""
        self._state.settled.wait()
        if self._state.done.is_set():
            return self._state.result.settled
        return True  # (the result is written when the submission ends; until then the wait has succeeded)

    def join(self) -> LaunchResult:
        """Wait for the submission to be launched (or to fail) and return what it came to."""
        self._state.done.wait()
        self.pending = False
        return self._state.result

    def close(self) -> None:
        """Wait for the submission in flight (nothing will read it) and stop the thread."""
        self.join()
        self._finalizer()
        self._thread.join()


def complete(arrays: Sequence[Any]) -> None:
    """Mark launched arrays whose launch was seen complete as readable (MLX's ``array.wait``: their events dropped)
    on this thread, so that no evaluation on another thread does it while the engine's thread reads them."""
    if arrays:
        mx.eval(*arrays)  # (every array here was launched: ``eval`` only waits for each, it computes nothing)


def _run(jobs: queue.SimpleQueue[tuple[Sequence[Any], Sequence[Any] | None] | None], st: _State, stream: Any,
         bound: Callable[[], AbstractContextManager[Any]]) -> None:
    while (job := jobs.get()) is not None:
        arrays, settle = job
        settled, waited, encoded, error = settle is None, 0.0, 0.0, None
        try:
            if settle is not None:
                t0 = time.perf_counter()
                mx.synchronize(stream)
                complete(settle)
                waited, settled = time.perf_counter() - t0, True
            st.settled.set()
            t0 = time.perf_counter()
            with bound():
                mx.async_eval(*arrays)
            encoded = time.perf_counter() - t0
        except BaseException as exc:  # raised on the engine's thread by ``Traffic``
            error = exc
        st.result = LaunchResult(settled, waited, encoded, error)
        st.settled.set()
        st.done.set()
