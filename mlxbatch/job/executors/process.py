"""The single-machine executor with the engine in a process of its own.

A job's run loop shares its process with the engine's step loop, and so its GIL: reading, rendering and planning
rows (the feed's thread), writing shards (the checkpoint's thread) and building result records took the GIL from the
engine's thread between its waits for the device, and the steps waited (docs/benchmarks.md: on an H100 the 100k-row
job's run thread spent ~6 s of its 30 s waiting for the GIL in pure-Python work, the wall 1.5x the engine's steps).
Here the engine runs in a child process (a new interpreter, like the feed's workers): one thread steps it, and the
run sends it rows (``RowTask``) and gets finished ones back (``RowDone``) in frames over its pipes, the protocol of
the Ray executor's actors, which run the same ``RowEngine``. The run loads only the tokenizer; the child, started
with its setup (``placement.spawn_engine``; by the command line before it checks the job: ``early_engine``), loads
the model, reports what the run needs of it (``EngineInfo``), warms up while the feed prepares the first window, then
steps while it holds rows. Rows reach it in the order they are taken (plan order), at most ``4 x max_num_seqs`` in
flight, as in the engine of the run's own process.

The child runs in a session of its own and ignores SIGINT and SIGTERM: the run decides what stops (it aborts what is
in flight and closes the pipe). The child exits when its input ends: closed by the run, or by the kernel when the run
is gone (killed too). A child that fails sends its error, which the run raises as the executor's failure.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from mlxbatch.errors import MlxbatchError, ModelLoadError
from mlxbatch.io.frames import FrameWriter, read_frame
from mlxbatch.job.executors.base import (
    ExecutorError,
    Finished,
    ModelInfo,
    driver_tokenizer,
    engine_config,
    model_spec,
    row_tokens_hint,
)
from mlxbatch.job.executors.interpreter import generating
from mlxbatch.job.executors.local import InFlight, RowEngine, max_inflight
from mlxbatch.job.executors.placement import spawn_engine
from mlxbatch.job.executors.ray.progress import clear_progress
from mlxbatch.job.rows.feed import Failed, Resumed, RowFeed
from mlxbatch.job.spec import JobSpec

STATS_EVERY_S = 0.5  # the child sends its engine's counters this often while it steps (the progress line reads them)
WAIT_S = 0.1  # ``poll`` waits this long for finished rows before it returns none (the loop then takes rows again)
CLOSE_WAIT_S = 10.0  # a child told to stop finishes its step and exits
STATS_WAIT_S = 60.0  # the run's end waits this long for the engine's last counters (else reports the latest)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineInfo:
    """What the run needs of the child's model and engine (``ModelInfo`` less the tokenizer, which the run loads)."""

    identity: str
    dtype: str
    takes_images: bool
    context_length: int
    reuse_step: int
    max_num_seqs: int
    batch: str


class ProcessExecutor:
    """The single-machine path with the engine in a child process (``serve``)."""

    engine_process = True

    def __init__(self, spec: JobSpec, early: subprocess.Popen[bytes] | None = None) -> None:
        # ``early``: the child started already (``placement.early_engine``: its imports overlapped the run's)
        adopted = early is not None and early.poll() is None
        self._proc = early if adopted else spawn_engine(spec)  # type: ignore[assignment]
        log.debug("engine process %d: %s", self._proc.pid, "started before the job's checks" if adopted else "started")
        self._inbox: queue.Queue[bytes | None] = queue.Queue()  # frames from the child; None: its output ended
        threading.Thread(target=self._read, name="mlxbatch-engine-reader", daemon=True).start()
        self._writer = FrameWriter(self._proc.stdin, "mlxbatch-engine-writer")  # type: ignore[arg-type]
        self._stats: dict[str, Any] = {}
        try:
            try:  # the tokenizer here while the child loads the model (its setup sent when it was started)
                tokenizer, failed = driver_tokenizer(spec), None
            except Exception as exc:  # noqa: BLE001 - the child's error about the model comes first
                tokenizer, failed = None, exc
            info: EngineInfo = self._expect("info")
            if failed is not None:
                raise ModelLoadError(f"model={spec.model.path!r}: its tokenizer could not be loaded: "
                                     f"{type(failed).__name__}: {failed}") from failed
        except BaseException:  # the model did not load (its error raised here): no child left behind
            self._proc.kill()
            self._proc.wait()
            raise
        self.model = ModelInfo(info.identity, info.dtype, tokenizer, info.takes_images, info.context_length,
                               info.reuse_step, info.batch)
        self.rows = InFlight(max_inflight(info.max_num_seqs))
        self._ready = False

    # -- the executor's contract ---------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Wait for the child's warm-up (it began once the model loaded: the feed's first window is prepared
        meanwhile)."""
        if not self._ready:
            self._stats = self._expect("ready")
            self._ready = True

    def take(self, feed: RowFeed) -> list[Failed | Resumed]:
        self.warm_up()
        tasks, other = self.rows.take(feed)
        if tasks:
            self._send(("tasks", tasks))
        return other

    @property
    def busy(self) -> bool:
        return bool(self.rows)

    @property
    def in_flight(self) -> int:
        return len(self.rows)

    def poll(self) -> list[Finished]:
        """Rows the child finished since the last call (waiting up to ``WAIT_S`` for the first)."""
        out: list[Finished] = []
        block = True
        while self.rows:
            try:
                data = self._inbox.get(timeout=WAIT_S) if block else self._inbox.get_nowait()
            except queue.Empty:
                break
            block = False
            kind, value = self._message(data)
            if kind == "stats":
                self._stats = value
                continue
            if kind != "done":
                raise ExecutorError(f"the engine process sent {kind!r} while rows ran")
            out += self.rows.finished(value)
        return out

    def abort(self) -> None:
        """Drop what is in flight (the run stops)."""
        if self.rows and self._proc.poll() is None:
            self._send(("abort", list(self.rows.held)))
        self.rows.held.clear()

    def stats(self) -> dict[str, Any]:
        """The engine's counters: asked of the child when no row is in flight (the run's end), else its latest."""
        if not self.rows and self._proc.poll() is None:
            try:
                self._send(("stats",))
                self._stats = self._expect("stats", STATS_WAIT_S)
            except ExecutorError:
                pass  # a child gone: its last counters
        return self._stats

    def rows_done(self) -> None:
        """No row will come any more: the child's input is closed now, so it exits (its teardown took 0.2-0.4 s on an
        H100's host and on a CPU) while the run writes its results; ``shutdown`` then waits for it."""
        self._close_input()

    def shutdown(self) -> None:
        """Close the child's input (it exits after its step) and wait for it; kill it if it does not."""
        t0 = time.monotonic()
        self._close_input()
        try:
            self._proc.wait(timeout=CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        log.debug("the engine process %d exited in %.2f s (code %s)", self._proc.pid, time.monotonic() - t0,
                  self._proc.returncode)

    def _close_input(self) -> None:
        """What was sent is written, then the child's input ends (again: nothing changes)."""
        if not self._writer.close(CLOSE_WAIT_S):  # the child reads nothing (a write waits on its full pipe): stuck
            self._proc.kill()  # (the write fails then, and the pipe can be closed)
        try:
            self._proc.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass

    # -- frames ---------------------------------------------------------------------------------------------------
    def _send(self, message: Any) -> None:
        try:
            self._writer.send(message)  # (written by its thread: a full pipe does not hold up the run's loop)
        except OSError:
            raise ExecutorError(self._gone()) from None

    def _read(self) -> None:
        """The reader thread: the child's frames as they come (bytes: unpickled on the run's thread)."""
        while (data := read_frame(self._proc.stdout)) is not None:  # type: ignore[arg-type]
            self._inbox.put(data)
        self._inbox.put(None)

    def _message(self, data: bytes | None) -> tuple[str, Any]:
        if data is None:
            self._inbox.put(None)  # (for whoever reads next)
            raise ExecutorError(self._gone())
        kind, value = pickle.loads(data)
        if kind == "error":
            raise value if isinstance(value, MlxbatchError) else ExecutorError(f"the engine process failed: {value}")
        return kind, value

    def _expect(self, want: str, timeout: float | None = None) -> Any:
        """The child's next message of kind ``want`` (the counters it sends meanwhile are kept); ExecutorError past
        ``timeout`` seconds (None: as long as it takes, e.g. a model's load)."""
        while True:
            try:
                data = self._inbox.get(timeout=timeout)
            except queue.Empty:
                raise ExecutorError(f"the engine process did not answer within {timeout:.0f} s") from None
            kind, value = self._message(data)
            if kind == want:
                return value
            if kind == "stats":
                self._stats = value
            elif kind != "done":  # (rows given up by ``abort``)
                raise ExecutorError(f"the engine process sent {kind!r}, expected {want!r}")

    def _gone(self) -> str:
        try:
            code = self._proc.wait(timeout=CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            code = None
        return (f"the engine process {self._proc.pid} is gone (exit code {code}); rows that finished are "
                f"checkpointed: run the job again to resume")


# -- in the child -----------------------------------------------------------------------------------------------
def serve() -> None:
    """The child's life: load the model, report it, warm up, then step while it holds rows, taking rows between
    steps, until its input ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the process group: the run decides
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print goes to stderr, never into the frames
    inbox: queue.Queue[Any] = queue.Queue()
    engines: list[RowEngine] = []  # the engine, once made (rows come only after it reported itself ready)

    def read() -> None:  # messages as they come, unpickled here and their rows' requests made (``prepare``: their
        # checks and sequences); the stepping thread takes them between steps. This thread's work, ~15 us a row, runs
        # while that one waits for the device (an H100's stepping thread spent 2.2 s of a 100k-row job submitting rows)
        try:
            while (data := read_frame(sys.stdin.buffer)) is not None:
                message = pickle.loads(data)
                if message[0] == "tasks" and engines:
                    message = ("tasks", [engines[0].prepare(task) for task in message[1]])
                inbox.put(message)
        except BaseException as exc:  # noqa: BLE001 - the stepping thread raises it
            inbox.put(exc)
        inbox.put(None)

    threading.Thread(target=read, name="mlxbatch-engine-input", daemon=True).start()
    writer = FrameWriter(out, "mlxbatch-engine-output")  # (finished rows are pickled by its thread, not the stepping one)
    try:
        _serve(inbox, writer, engines)
    except BrokenPipeError:  # the run is gone
        return
    except BaseException as exc:  # noqa: BLE001 - the run raises it
        try:
            writer.send(("error", exc if isinstance(exc, MlxbatchError) and _picklable(exc) else traceback.format_exc()))
        except OSError:
            pass
    finally:
        writer.close()  # what was sent is written before the child exits (at once when the run is gone)


def _serve(inbox: queue.Queue[Any], writer: FrameWriter, engines: list[RowEngine]) -> None:
    from mlxbatch.engine import load_model

    setup = _take(inbox, block=True)
    if setup is None:
        return
    _, spec, (level, fmt) = setup  # (``placement.spawn_engine``)
    if fmt is not None:  # the engine's log lines as the run's (its warnings, the batch it sized)
        logging.basicConfig(level=logging.WARNING, format=fmt, stream=sys.stderr)
    logging.getLogger("mlxbatch").setLevel(level)
    loaded = load_model(model_spec(spec.model))
    engine = RowEngine(loaded, engine_config(spec.engine, spec.seed, row_tokens_hint(spec)), warm_up_later=True)
    engines.append(engine)  # (the input thread prepares rows with it from now on)
    core = engine.core
    writer.send(("info", EngineInfo(loaded.identity, loaded.dtype, loaded.vlm is not None, loaded.context_length,
                             core.reuse_step, core.config.max_num_seqs, core.batch_size.describe())))
    engine.warm_up()
    writer.send(("ready", engine.stats()))
    with generating():  # the run's interpreter settings: a short switch interval, a quiet collector
        _step_loop(inbox, writer, engine)


def _take(inbox: queue.Queue[Any], block: bool) -> Any:
    """The next message from the run (None: its input ended); raises what stopped the input thread, and
    ``queue.Empty`` when ``block`` is off and nothing came."""
    message = inbox.get() if block else inbox.get_nowait()
    if isinstance(message, BaseException):
        raise message
    return message


def _step_loop(inbox: queue.Queue[Any], writer: FrameWriter, engine: RowEngine) -> None:
    cpu0 = time.thread_time()

    def stats() -> dict[str, Any]:  # the engine's counters and the CPU time of the thread that steps it
        return {**engine.stats(), "engine_thread_cpu_s": round(time.thread_time() - cpu0, 3)}

    last_stats = time.monotonic()
    while True:
        # every frame that came meanwhile; with nothing to step, wait for the next
        while True:
            try:
                message = _take(inbox, block=not engine.has_work)
            except queue.Empty:
                break
            if message is None:
                return  # the run closed the input (or is gone)
            kind, *args = message
            if kind == "tasks":
                for task in args[0]:
                    engine.submit(task)
            elif kind == "abort":  # (the run stops: what the aborted rows' steps give is not asked for)
                for key in args[0]:
                    engine.abort(key)
            elif kind == "stats":
                writer.send(("stats", stats()))
        if engine.has_work:
            done = engine.step()
            if done:  # (finished rows change no more: the writer's thread pickles them)
                writer.send_later(("done", done))
            if time.monotonic() - last_stats >= STATS_EVERY_S:
                writer.send(("stats", stats()))
                last_stats = time.monotonic()


def _picklable(exc: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(exc))
        return True
    except Exception:  # noqa: BLE001
        return False


@contextmanager
def open_process_executor(spec: JobSpec, early: subprocess.Popen[bytes] | None = None) -> Iterator[ProcessExecutor]:
    """A ``ProcessExecutor`` on the job's model (its tokenizer loaded here, the model in the child, ``early`` if
    started already), stopped when the block ends."""
    clear_progress(spec.output)  # a distributed run's leftover: this run owns the folder now
    executor = ProcessExecutor(spec, early)
    try:
        yield executor
    finally:
        executor.shutdown()
