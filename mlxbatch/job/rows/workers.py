"""Row preparation of a window: input rows -> prepared rows with their token ids, here or in worker processes.

Owns where a window's per-row work runs. Rendering, the sampling parameters, the key, the chat template and
tokenizing are a function of the row alone (``RowPreparer.prepare_admitted`` and ``engine.PromptEncoder``); all but
the tokenizer hold the GIL, which the engine's step loop needs in the same process. ``LocalPreparation`` runs them in
the calling thread; ``PooledPreparation`` in child processes (new interpreters, never forks of a process running MLX
or threads), each with an equal preparer and the run's own tokenizer (pickled: the same template and settings),
chunks of a window in parallel, results in input order. Both admit rows in the calling thread first
(``RowPreparer.admit``: the duplicate ids, the one step that depends on earlier rows), so the output is the same:
the same keys, prompts and token ids.

A run starts its workers (``spawn``) before it loads its model, so their imports overlap the load and its first window
does not wait for them. A worker runs in a session of its own and ignores SIGINT and SIGTERM (a Ctrl-C reaches the run,
which decides what stops, then stops its workers), and exits when its input pipe ends: closed by the run, or by the
kernel when the run is gone (a run killed by SIGKILL leaves no worker behind once it finishes its chunk).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlxbatch.engine import Backend, PromptEncoder, plan, prompt_block_hashes, submission_order
from mlxbatch.errors import MlxbatchError
from mlxbatch.io import InputRow
from mlxbatch.io.frames import frame, read_frame
from mlxbatch.job.rows.prepare import PreparedRow, RowPreparer

WORKERS_ENV = "MLXBATCH_FEED_WORKERS"  # worker processes of the feed: a number (unset or 0: none)
CHUNK_ROWS = 512  # rows one worker call prepares: small enough to spread a window and to stop within a second
DEFAULT_WORKERS = 2  # on a GPU: 2 and 4 fed an H100's job equally (docs/benchmarks.md)
MIN_CORES = 8  # the engine's threads, MLX's and the workers' each have a core
# a job of fewer rows prepares them on the feed's thread: at ~130 us a row that costs less than two workers take to
# start (new interpreters importing MLX and the tokenizer: ~1 s on a 2-core CPU, ~3.8 s on an H100's host), which a
# run whose model is loaded already (``job.api``, a notebook's second job) cannot hide behind the load
MIN_ROWS = 20_000
CLOSE_WAIT_S = 5.0  # a worker closed at the end of input finishes its chunk (there is none) and exits


@dataclass(frozen=True)
class Encoded:
    prep: PreparedRow
    # token ids of a text row that can run (or that an earlier run finished: the plan needs it), the reason it
    # cannot be tokenized, or None (an error row, or a row with images: encoded when submitted)
    ids: list[int] | str | None
    # the token ids' ``engine.prompt_block_hashes``: the prefix index's keys, hashed here, off the engine's step loop
    hashes: list[int] | None = None


class FeedWorkerError(MlxbatchError):
    """A feed worker process died (killed, or out of memory): the run stops; what finished is checkpointed."""


def feed_workers(rows: int | None = None) -> int:
    """Worker processes of a run's feed: ``MLXBATCH_FEED_WORKERS``, else sized by this machine and the job's ``rows``
    (None: not known) (``default_workers``)."""
    given = os.environ.get(WORKERS_ENV, "").strip()
    if not given:
        return default_workers(Backend.detect().gpu, os.cpu_count() or 1, rows)
    if not given.isdigit():
        raise MlxbatchError(f"{WORKERS_ENV}={given!r}: expected a number of worker processes (0: none)")
    return int(given)


def default_workers(gpu: bool, cores: int, rows: int | None = None) -> int:
    """``DEFAULT_WORKERS`` where the engine runs on a GPU, the machine has ``MIN_CORES`` cores or more and the job
    has ``MIN_ROWS`` rows or more (or an unknown count), else none. On a GPU the engine's step loop is bound by the
    host and needs the GIL the feed's thread would hold (~130 us a row: rendering, the chat template, keys,
    planning); on an H100 host a job ran 22% faster with the feed in workers, its steps 18% (docs/benchmarks.md). A
    4096-row job run with its model loaded already took twice its engine's time on an H100, most of it waiting for
    the workers to start (docs/benchmarks.md). On the CPU the device's work is the CPU's own: workers would take its
    cores."""
    return DEFAULT_WORKERS if gpu and cores >= MIN_CORES and (rows is None or rows >= MIN_ROWS) else 0


def encode_prepared(preps: list[PreparedRow], encoder: PromptEncoder) -> list[Encoded]:
    """Token ids of the rows that have a text prompt (no error, no images), in one batch."""
    texts = [i for i, p in enumerate(preps) if p.error is None and p.prompt is not None and not p.images]
    ids: list[list[int] | str | None] = [None] * len(preps)
    for i, seq in zip(texts, encoder.encode_many([preps[i].prompt for i in texts])):  # type: ignore[misc]
        ids[i] = seq
    return [Encoded(p, s, prompt_block_hashes(s) if isinstance(s, list) else None) for p, s in zip(preps, ids)]


@dataclass(frozen=True)
class WindowPlan:
    order: list[tuple[int, int]]  # (row, cache_tokens) in submission order
    total_tokens: int
    distinct_tokens: int


def plan_window(seqs: list[list[int]], runs: int, min_step_tokens: int) -> WindowPlan:
    """The plan of a window's text rows: the first ``runs`` of ``seqs`` run, the rest were done by an earlier run
    (planned with them, then skipped: the trie order of a row depends on every row)."""
    p = plan(seqs, skip=range(runs, len(seqs)), min_step_tokens=min_step_tokens)
    return WindowPlan([(s.index, s.cache_tokens) for s in submission_order(p)], p.total_tokens, p.distinct_tokens)


class LocalPreparation:
    """Prepares and tokenizes in the calling thread."""

    def __init__(self, preparer: RowPreparer, tokenizer: Any) -> None:
        self._preparer = preparer
        self._encoder = PromptEncoder(tokenizer)

    def run(self, rows: list[InputRow]) -> list[Encoded]:
        return encode_prepared([self._preparer.prepare(r) for r in rows], self._encoder)

    def run_admitted(self, rows: Sequence[InputRow | PreparedRow]) -> list[Encoded]:
        p = self._preparer
        return encode_prepared([r if isinstance(r, PreparedRow) else p.prepare_admitted(r) for r in rows],
                               self._encoder)

    def plan(self, seqs: list[list[int]], runs: int, min_step_tokens: int) -> WindowPlan:
        return plan_window(seqs, runs, min_step_tokens)

    def cancel(self) -> None:
        pass

    def close(self) -> None:
        pass


class PooledPreparation:
    """Prepares and tokenizes in ``workers`` child processes, started on first use and stopped by ``close``.

    A worker is ``python -c 'serve()'``: nothing of the parent's ``__main__`` runs again (a user's script without a
    ``__main__`` guard is fine). Chunks go round-robin from a sender thread while the caller reads the results in
    input order (reads never wait on writes: no pipe can fill both ways). Frames on the pipes are a length and a
    pickle."""

    def __init__(self, preparer: RowPreparer, tokenizer: Any, workers: int, chunk: int | None = None,
                 spawned: Sequence[subprocess.Popen[bytes]] = ()) -> None:
        self._preparer = preparer
        self._setup = frame((preparer.args, tokenizer))
        self._workers = workers
        self._chunk = chunk or CHUNK_ROWS
        self._procs: list[subprocess.Popen[bytes]] = list(spawned)  # ``spawn``'s, adopted: they get their setup
        self._sent = 0  # workers that were sent their setup frame (the first ones)
        self._closed = False
        self._lock = threading.Lock()  # the feed thread starts the workers; the run's thread stops them

    def run(self, rows: list[InputRow]) -> list[Encoded]:
        p = self._preparer
        admitted = [p.admit(r) for r in rows]
        todo = [a for a in admitted if not isinstance(a, PreparedRow)]
        chunks = [todo[k:k + self._chunk] for k in range(0, len(todo), self._chunk)]
        procs = self._started() if chunks else []
        sender = threading.Thread(target=_send_all, args=(procs, chunks), name="mlxbatch-feed-send", daemon=True)
        sender.start()
        done: list[Encoded] = []
        for k in range(len(chunks)):
            done.extend(_receive(procs[k % len(procs)]))  # a worker gone: raised here (its pipe ends)
        sender.join()
        it = iter(done)
        return [Encoded(a, None) if isinstance(a, PreparedRow) else next(it) for a in admitted]

    def plan(self, seqs: list[list[int]], runs: int, min_step_tokens: int) -> WindowPlan:
        w = self._started()[0]
        _write_frame(w, frame(("plan", (seqs, runs, min_step_tokens))))
        return _receive(w)  # type: ignore[return-value]

    def _started(self) -> list[subprocess.Popen[bytes]]:
        with self._lock:
            if self._closed:
                raise MlxbatchError("the feed's workers are stopped")
            self._procs += spawn(self._workers - len(self._procs))
            fresh, self._sent = self._procs[self._sent :], len(self._procs)
            procs = list(self._procs)
        for proc in fresh:  # outside the lock: a write waits for the worker's imports, and ``cancel`` must not
            _write_frame(proc, self._setup)
        return procs

    def cancel(self) -> None:
        """Stop the workers now (the run is stopping: nothing they prepare is needed)."""
        with self._lock:
            self._closed = True
            for proc in self._procs:
                proc.kill()

    def close(self) -> None:
        """Stop the workers (end of input: they exit on their input's end) and wait for them to exit."""
        with self._lock:
            self._closed = True
            procs = list(self._procs)
        stop(procs)


def spawn(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` worker processes, started now and waiting for their setup: a run starts them before it loads its model,
    so their imports are done by the time its first window is prepared (``PooledPreparation(spawned=)`` adopts them;
    ``stop`` ends those never adopted)."""
    # a session of their own: a Ctrl-C at the terminal reaches the run, not a worker still importing (the run
    # decides what stops, then ends its workers' input)
    return [subprocess.Popen([sys.executable, "-c", _SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             start_new_session=True) for _ in range(n)]


def stop(procs: Sequence[subprocess.Popen[bytes]], at_once: bool = False) -> None:
    """End workers: their input closed (they exit when it ends, after the chunk in hand), then waited for;
    ``at_once``: killed (workers given no work: nothing to finish)."""
    for proc in procs:
        if at_once:
            proc.kill()
        with contextlib.suppress(OSError):
            proc.stdin.close()  # type: ignore[union-attr]
    for proc in procs:
        try:
            proc.wait(timeout=CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            proc.stdout.close()  # type: ignore[union-attr]


def preparation(preparer: RowPreparer, tokenizer: Any, workers: int,
                spawned: Sequence[subprocess.Popen[bytes]] = ()) -> LocalPreparation | PooledPreparation:
    """Where a window's rows are prepared: ``workers`` processes (``spawned``: started earlier by ``spawn``), or here."""
    if workers > 0:
        return PooledPreparation(preparer, tokenizer, workers, spawned=spawned)
    stop(spawned)
    return LocalPreparation(preparer, tokenizer)


# transformers runs without torch (``mlxbatch._torch``): a worker renders and tokenizes, and never needs it, but
# transformers imports torch wherever it is installed: on an H100 host that made a worker's start 15-21 s, which the
# run's first window waited for, and costs each worker hundreds of MB.
_SERVE = "from mlxbatch._torch import without_torch; without_torch(); from mlxbatch.job.rows.workers import serve; serve()"


def _write_frame(proc: subprocess.Popen[bytes], data: bytes) -> None:
    try:
        proc.stdin.write(data)  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
    except (BrokenPipeError, ValueError):  # ValueError: closed by ``cancel`` / ``close`` in the meantime
        raise FeedWorkerError(f"the feed worker process {proc.pid} is gone (exit code {proc.poll()}); rerun the "
                              f"job to resume, or set {WORKERS_ENV}=0 to prepare rows in the run's process") from None


def _send_all(procs: list[subprocess.Popen[bytes]], chunks: list[list[InputRow]]) -> None:
    for k, rows in enumerate(chunks):
        try:
            _write_frame(procs[k % len(procs)], frame(("prepare", rows)))
        except FeedWorkerError:  # the reader sees the worker's end on its output and raises there
            return


def _receive(proc: subprocess.Popen[bytes]) -> Any:
    data = read_frame(proc.stdout)  # type: ignore[arg-type]
    if data is None:
        raise FeedWorkerError(f"the feed worker process {proc.pid} died (exit code {proc.wait()}); rerun the job "
                              f"to resume, or set {WORKERS_ENV}=0 to prepare rows in the run's process")
    status, value = pickle.loads(data)
    if status != "ok":
        raise MlxbatchError(f"the feed worker process {proc.pid} failed: {value}")
    return value


# -- in a worker process ------------------------------------------------------------------------------------------
def serve() -> None:
    """A worker's life: the setup frame, then chunk after chunk until its input ends (the run closed it, or the
    run is gone: killed too)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the run decides, then stops us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print goes to stderr, never into the frames
    inp = sys.stdin.buffer
    setup = read_frame(inp)
    if setup is None:
        return
    args, tokenizer = pickle.loads(setup)
    worker = LocalPreparation(RowPreparer(*args), tokenizer)
    while (data := read_frame(inp)) is not None:
        try:
            what, arg = pickle.loads(data)
            reply: tuple[str, Any] = ("ok", worker.run_admitted(arg) if what == "prepare" else worker.plan(*arg))
        except Exception:  # noqa: BLE001 - the run raises it, as it would raise it from its own thread
            reply = ("error", traceback.format_exc())
        try:
            out.write(frame(reply))
            out.flush()
        except OSError:  # the run is gone
            return
