"""The job's row feed: input rows -> engine submissions, in the plan's order, prepared beside the engine.

Owns reading ahead. Rows are read in windows of ``window`` input rows, after a ramp of smaller ones with ``ramp``
(``spec.sections.window_sizes``: the engine starts sooner) (``WindowReader``, the only reader of the input in a
run). Each row is prepared; rows finished by an earlier run are skipped, rows that cannot run come back as
errors, and the prompts of the rest are tokenized in batches (``engine.inputs``, exactly as the engine would). Each
window's runnable rows are planned (``engine.planner``): rows sharing a prefix reach the engine back to back in trie
order, each with the plan's retention (how much of its prompt later rows reuse), and rows sharing nothing come after
them, longest first. Every row read is recorded once in the run's ``ExpectedSpool`` (its id, key and kept
columns): the final Parquet is written from it, without reading the input again.

``RowFeed`` hands the windows out. With ``background`` (the run's default) a thread reads, prepares, tokenizes and
plans the next window while the engine runs the current one (tokenizers release the GIL; so does MLX while the
device works), at most ``ahead`` windows ahead; a failure there (an unreadable input) is raised where the rows are
taken. Windows are cut by input position, counting every row. A resumed run plans a window's rows done by an earlier
run with the others and then skips them (``plan(skip=)``): the trie order puts larger subtrees first, so it depends
on every row, and the rows left follow the first run's plan. Every item carries its row's input position
(``index``, 0-based, every row counted); rows done by an earlier run come back as ``Resumed`` items saying whether
their result is an error, so the runner can judge the error rate on rows in input order, across runs.
"""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence, Set
from dataclasses import dataclass, field

from mlxbatch.io import InputRow
from mlxbatch.io.expected import ExpectedSpool
from mlxbatch.job.rows.prepare import PreparedRow, RowPreparer
from mlxbatch.job.rows.workers import preparation  # the window's per-row work and its plan run there
from mlxbatch.job.spec.sections import window_sizes


@dataclass(frozen=True)
class Submit:
    prep: PreparedRow
    token_ids: list[int] | None  # None for a row with images: it is encoded when submitted
    cache_tokens: int | None  # the plan's retention (None when planning is off)
    index: int = -1  # the row's input position
    block_hashes: list[int] | None = None  # the prompt's ``engine.prompt_block_hashes`` (a text row's), made here


@dataclass(frozen=True)
class Failed:
    prep: PreparedRow
    error: str
    kind: str
    index: int = -1


@dataclass(frozen=True)
class Resumed:
    """A row whose current key an earlier run already checkpointed."""

    index: int
    error: bool  # its checkpointed result is an error row


@dataclass
class PlanStats:
    """The plan of this run's rows, summed over windows (``mlxbatch plan`` reports the same figures by the same
    names)."""

    window: int
    enabled: bool
    windows: int = 0  # windows with rows to run
    rows: int = 0
    prompt_tokens: int = 0
    # each window's trie node count, summed: the least prefill if nothing were reused from one window to the next.
    # The whole job's floor when it is one window; a windowed run can compute less (the prefix cache outlives a
    # window), and no whole-job trie is built (memory holds one window)
    distinct_tokens: int = 0

    def as_dict(self) -> dict[str, object]:
        return {"enabled": self.enabled, "window": self.window, "windows": self.windows,
                "windowed": self.windows > 1, "rows": self.rows, "prompt_tokens": self.prompt_tokens,
                "distinct_tokens": self.distinct_tokens,
                "window_floor_saving": window_floor_saving(self.distinct_tokens, self.prompt_tokens)}


def window_floor_saving(distinct_tokens: int, prompt_tokens: int) -> float:
    """``1 - distinct / prompt``: the prefill saving at the windows' trie floors (not the run's or the plan's
    predicted saving: the prefix cache can carry prefixes across windows)."""
    return round(1 - distinct_tokens / prompt_tokens, 4) if prompt_tokens else 0.0


@dataclass
class Window:
    """One window of input rows, prepared and planned: its items in plan order and what it adds to the feed's
    counts."""

    items: list[Submit | Failed | Resumed] = field(default_factory=list)
    skipped: int = 0  # rows done by an earlier run
    planned_rows: int = 0
    prompt_tokens: int = 0
    distinct_tokens: int = 0
    last: bool = False  # the input ends with this window


class WindowReader:
    """Reads the input a window at a time: the one reader of a run's rows (and the one writer of its spool)."""

    def __init__(self, rows: Iterator[InputRow], preparer: RowPreparer, tokenizer: object, done: Set[str],
                 window: int, planned: bool = True, done_errors: Set[str] = frozenset(),
                 min_step_tokens: int = 1, spool: ExpectedSpool | None = None, keep_urls: bool = False,
                 workers: int = 0, spawned: Sequence[subprocess.Popen[bytes]] = (), ramp: bool = False) -> None:
        self._rows = rows
        self._preparation = preparation(preparer, tokenizer, workers, spawned)  # stopped by ``close``
        self._done = done
        self._done_errors = done_errors  # keys in ``done`` whose result is an error row
        self.window = window
        self._sizes = window_sizes(window, ramp)  # each window's rows (``ramp``: smaller ones first)
        self.planned = planned
        self.min_step_tokens = min_step_tokens  # the engine's reuse step (``plan(min_step_tokens=)``)
        self._spool = spool
        self._keep_urls = keep_urls  # OpenAI Batch input: each row's endpoint goes to the spool
        self._read = 0  # rows read so far: the next row's input position

    def next_window(self, stop: threading.Event | None = None) -> Window:
        w = Window()
        read: list[InputRow] = []
        for _ in range(next(self._sizes)):
            if stop is not None and stop.is_set():
                return w
            row = next(self._rows, None)
            if row is None:
                w.last = True
                break
            read.append(row)
        runnable: list[tuple[int, PreparedRow, list[int] | str, list[int] | None]] = []  # with the ids' block hashes
        imaged: list[tuple[int, PreparedRow]] = []  # decoded only when submitted (pictures are big): not planned
        done: list[list[int] | str | None] = []  # token ids of text rows done by an earlier run: planned, not run
        for row, encoded in zip(read, self._preparation.run(read)):
            prep, ids = encoded.prep, encoded.ids
            index, self._read = self._read, self._read + 1
            if self._spool is not None:
                self._spool.add(prep.row_id, prep.key, prep.inputs,
                                row.fields.get("url") if self._keep_urls else None)
            if prep.key in self._done:
                w.skipped += 1
                w.items.append(Resumed(index, prep.key in self._done_errors))
                if prep.error is None and prep.prompt is not None and not prep.images:
                    done.append(ids)
            elif prep.error is not None or prep.prompt is None:
                w.items.append(Failed(prep, prep.error or "no prompt", prep.error_kind or "input", index))
            elif prep.images:
                imaged.append((index, prep))
            else:
                runnable.append((index, prep, ids, encoded.hashes))  # type: ignore[arg-type]  # a text row: encoded
        if w.last and self._spool is not None:
            self._spool.close()
        rows: list[tuple[PreparedRow, list[int], int, list[int] | None]] = []
        for index, prep, ids, hashes in runnable:
            if isinstance(ids, str):
                w.items.append(Failed(prep, f"{prep.row_id}: {ids}", "request", index))
            elif not ids:
                w.items.append(Failed(prep, f"{prep.row_id}: the prompt is empty (it renders to no tokens)",
                                      "request", index))
            else:
                rows.append((prep, ids, index, hashes))
        if rows:
            self._plan(w, rows, done)
        w.items.extend(Submit(prep, None, None, index) for index, prep in imaged)
        return w

    def cancel(self) -> None:
        self._preparation.cancel()

    def close(self) -> None:
        self._preparation.close()

    def _plan(self, w: Window, rows: list[tuple[PreparedRow, list[int], int, list[int] | None]],
              done: list[list[int] | str | None]) -> None:
        # the first run planned these rows with the ones done since: the order of a trie's rows depends on every
        # row (larger subtrees first), so the done rows are planned too, then skipped
        done_ids = [ids for ids in done if ids and not isinstance(ids, str)]
        p = self._preparation.plan([r[1] for r in rows] + done_ids, len(rows), self.min_step_tokens)
        w.planned_rows, w.prompt_tokens, w.distinct_tokens = len(rows), p.total_tokens, p.distinct_tokens
        if self.planned:
            w.items.extend(Submit(rows[i][0], rows[i][1], cache_tokens, rows[i][2], rows[i][3])
                           for i, cache_tokens in p.order)
        else:  # planning off: longest first, every full block offered to the cache (LRU)
            w.items.extend(Submit(prep, ids, None, index, hashes)
                           for prep, ids, index, hashes in sorted(rows, key=lambda r: -len(r[1])))


class _ReaderFailed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class RowFeed:
    """The windows of a ``WindowReader`` as a stream of items in plan order; see the module docstring."""

    def __init__(self, rows: Iterator[InputRow], preparer: RowPreparer, tokenizer: object, done: Set[str],
                 window: int, planned: bool = True, done_errors: Set[str] = frozenset(),
                 min_step_tokens: int = 1, spool: ExpectedSpool | None = None, keep_urls: bool = False,
                 background: bool = False, ahead: int = 1, workers: int = 0,
                 spawned: Sequence[subprocess.Popen[bytes]] = (), ramp: bool = False) -> None:
        self._reader = WindowReader(rows, preparer, tokenizer, done, window, planned, done_errors, min_step_tokens,
                                    spool, keep_urls, workers, spawned, ramp)
        self.window = window
        self.planned = planned
        self._queue: deque[Submit | Failed | Resumed] = deque()
        self.exhausted = False  # the input is read to the end (the queue may still hold rows)
        self.skipped = 0  # rows done by an earlier run
        self.stats = PlanStats(window, planned)
        self._background = background
        self._ready: queue.Queue[Window | _ReaderFailed] = queue.Queue(maxsize=max(1, ahead))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # CPU seconds of the thread that prepared the windows (the read-ahead thread's, read once it has stopped): in
        # the run's process, time mostly holding the GIL the engine's thread also needs (worker processes not counted)
        self.cpu_s = 0.0

    @property
    def finished(self) -> bool:
        return self.exhausted and not self._queue

    def take(self, max_submits: int, wait: bool = True) -> list[Submit | Failed | Resumed]:
        """The next items in plan order, with at most ``max_submits`` rows to submit (errors come along).
        ``wait``: for the next window when none is in hand yet (else what is ready now: an engine with rows to run
        keeps stepping while the next window is still in preparation)."""
        out: list[Submit | Failed | Resumed] = []
        n = 0
        while n < max_submits:
            if not self._queue:
                if self.exhausted or not self._next_window(wait and not out):
                    break
                continue
            item = self._queue.popleft()
            out.append(item)
            n += isinstance(item, Submit)
        return out

    def take_window(self, wait: bool = True) -> list[Submit | Failed | Resumed]:
        """The rest of the current window in plan order, or the next whole window when none is left: the rows one
        partitioning covers (engines sharing a job split a window, never a prefix group across two windows).
        ``wait`` False: nothing when the next window is still in preparation."""
        if not self._queue and not self.exhausted:
            self._next_window(wait)
        out = list(self._queue)
        self._queue.clear()
        return out

    def close(self) -> None:
        """Stop reading ahead (the run is over or stopping) and the worker processes, if any."""
        self._stop.set()
        self._reader.cancel()  # a reader waiting on workers gets its window's chunks not started cancelled
        if self._thread is not None:
            while self._thread.is_alive():  # unblock a reader waiting to hand over a window
                try:
                    self._ready.get_nowait()
                except queue.Empty:
                    self._thread.join(0.05)
        self._reader.close()

    def start(self) -> None:
        """With ``background``: start reading ahead now (else on the first ``take``)."""
        if self._background and self._thread is None:
            self._thread = threading.Thread(target=self._read_ahead, name="mlxbatch-feed", daemon=True)
            self._thread.start()

    def _next_window(self, block: bool) -> bool:
        """Move the next window's items into the queue; False when none is ready and ``block`` is off."""
        if not self._background:
            c0 = time.thread_time()
            w: Window | _ReaderFailed = self._reader.next_window()
            self.cpu_s += time.thread_time() - c0
        else:
            self.start()
            try:
                w = self._ready.get(block=block)
            except queue.Empty:
                return False
        if isinstance(w, _ReaderFailed):
            self.exhausted = True
            raise w.exc
        self.exhausted = w.last
        self.skipped += w.skipped
        if w.planned_rows:
            st = self.stats
            st.windows += 1
            st.rows += w.planned_rows
            st.prompt_tokens += w.prompt_tokens
            st.distinct_tokens += w.distinct_tokens
        self._queue.extend(w.items)
        return True

    def _read_ahead(self) -> None:
        """The reader thread: windows in input order until the input ends, a failure, or ``close``."""
        try:
            while not self._stop.is_set():
                c0 = time.thread_time()
                w: Window | _ReaderFailed = self._reader.next_window(self._stop)
                self.cpu_s += time.thread_time() - c0
                self._hand_over(w)
                if w.last:
                    return
        except BaseException as exc:  # raised in the consumer's thread, where the rows are taken
            self._hand_over(_ReaderFailed(exc))

    def _hand_over(self, w: Window | _ReaderFailed) -> None:
        while not self._stop.is_set():
            try:
                self._ready.put(w, timeout=0.1)
                return
            except queue.Full:
                continue
