"""The job's row feed: input rows -> engine submissions, in the plan's order.

Owns reading ahead. Rows are read in windows of ``window`` input rows. Each row is prepared; rows finished by an
earlier run are skipped, rows that cannot run come back as errors, and the prompts of the rest are tokenized in
batches (``engine.inputs``, exactly as the engine would). Each window's runnable rows are planned
(``engine.planner``): rows sharing a prefix reach the engine back to back in trie order, each with the plan's
retention (how much of its prompt later rows reuse), and rows sharing nothing come after them, longest first.

Windows are cut by input position, counting every row. A resumed run plans a window's rows done by an earlier run
with the others and then skips them (``plan(skip=)``): the trie order puts larger subtrees first, so it depends on
every row, and the rows left follow the first run's plan. Memory holds one window. Every item carries its row's input position (``index``, 0-based, every row
counted); rows done by an earlier run come back as ``Resumed`` items saying whether their result is an error, so
the runner can judge the error rate on rows in input order, across runs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Set
from dataclasses import dataclass

from mlxbatch.engine import PromptEncoder, plan, submission_order
from mlxbatch.io import InputRow
from mlxbatch.job.rows.prepare import PreparedRow, RowPreparer


@dataclass(frozen=True)
class Submit:
    prep: PreparedRow
    token_ids: list[int] | None  # None for a row with images: it is encoded when submitted
    cache_tokens: int | None  # the plan's retention (None when planning is off)
    index: int = -1  # the row's input position


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


class RowFeed:
    def __init__(self, rows: Iterator[InputRow], preparer: RowPreparer, tokenizer: object, done: Set[str],
                 window: int, planned: bool = True, done_errors: Set[str] = frozenset(),
                 min_step_tokens: int = 1) -> None:
        self._rows = rows
        self._preparer = preparer
        self._encoder = PromptEncoder(tokenizer)
        self._done = done
        self._done_errors = done_errors  # keys in ``done`` whose result is an error row
        self.window = window
        self.planned = planned
        self.min_step_tokens = min_step_tokens  # the engine's reuse step (``plan(min_step_tokens=)``)
        self._read = 0  # rows read so far: the next row's input position
        self._queue: deque[Submit | Failed | Resumed] = deque()
        self.exhausted = False  # the input is read to the end (the queue may still hold rows)
        self.skipped = 0  # rows done by an earlier run
        self.stats = PlanStats(window, planned)

    @property
    def finished(self) -> bool:
        return self.exhausted and not self._queue

    def take(self, max_submits: int) -> list[Submit | Failed | Resumed]:
        """The next items in plan order, with at most ``max_submits`` rows to submit (errors come along)."""
        out: list[Submit | Failed | Resumed] = []
        n = 0
        while n < max_submits:
            if not self._queue:
                if self.exhausted:
                    break
                self._read_window()
                continue
            item = self._queue.popleft()
            out.append(item)
            n += isinstance(item, Submit)
        return out

    def take_window(self) -> list[Submit | Failed | Resumed]:
        """The rest of the current window in plan order, or the next whole window when none is left: the rows one
        partitioning covers (engines sharing a job split a window, never a prefix group across two windows)."""
        if not self._queue and not self.exhausted:
            self._read_window()
        out = list(self._queue)
        self._queue.clear()
        return out

    def _read_window(self) -> None:
        runnable: list[tuple[int, PreparedRow]] = []
        imaged: list[tuple[int, PreparedRow]] = []  # decoded only when submitted (pictures are big): not planned
        done: list[PreparedRow] = []  # text rows done by an earlier run: planned with the rest, not submitted
        for _ in range(self.window):
            row = next(self._rows, None)
            if row is None:
                self.exhausted = True
                break
            index, self._read = self._read, self._read + 1
            prep = self._preparer.prepare(row)
            if prep.key in self._done:
                self.skipped += 1
                self._queue.append(Resumed(index, prep.key in self._done_errors))
                if prep.error is None and prep.prompt is not None and not prep.images:
                    done.append(prep)
            elif prep.error is not None or prep.prompt is None:
                self._queue.append(Failed(prep, prep.error or "no prompt", prep.error_kind or "input", index))
            elif prep.images:
                imaged.append((index, prep))
            else:
                runnable.append((index, prep))
        encoded = self._encoder.encode_many([p.prompt for _, p in runnable])  # type: ignore[misc]
        rows: list[tuple[PreparedRow, list[int], int]] = []
        for (index, prep), ids in zip(runnable, encoded):
            if isinstance(ids, str):
                self._queue.append(Failed(prep, f"{prep.row_id}: {ids}", "request", index))
            elif not ids:
                self._queue.append(Failed(prep, f"{prep.row_id}: the prompt is empty (it renders to no tokens)",
                                          "request", index))
            else:
                rows.append((prep, ids, index))
        if not rows:
            self._queue.extend(Submit(prep, None, None, index) for index, prep in imaged)
            return
        # the first run planned these rows with the ones done since: the order of a trie's rows depends on every
        # row (larger subtrees first), so the done rows are planned too, then skipped
        done_ids = [ids for ids in self._encoder.encode_many([d.prompt for d in done])  # type: ignore[misc]
                    if ids and not isinstance(ids, str)] if done else []
        seqs = [ids for _, ids, _ in rows]
        p = plan(seqs + done_ids, skip=range(len(seqs), len(seqs) + len(done_ids)),
                 min_step_tokens=self.min_step_tokens)
        st = self.stats
        st.windows += 1
        st.rows += len(rows)
        st.prompt_tokens += p.total_tokens
        st.distinct_tokens += p.distinct_tokens
        if self.planned:
            self._queue.extend(Submit(rows[s.index][0], rows[s.index][1], s.cache_tokens, rows[s.index][2])
                               for s in submission_order(p))
        else:  # planning off: longest first, every full block offered to the cache (LRU)
            self._queue.extend(Submit(prep, ids, None, index)
                               for prep, ids, index in sorted(rows, key=lambda r: -len(r[1])))
        self._queue.extend(Submit(prep, None, None, index) for index, prep in imaged)
