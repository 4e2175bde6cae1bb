"""The single-machine executor: one engine in this process.

``RowEngine`` turns ``RowTask``s into ``RowDone``s on one ``EngineCore``; the local executor and each Ray actor
(``job.executors.ray.actor``) own one. ``LocalExecutor`` keeps at most ``4 x max_num_seqs`` rows in flight.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from mlxbatch.config import EngineConfig
from mlxbatch.engine import REGISTRY, EngineCore, LoadedModel, RequestGroup
from mlxbatch.errors import InvalidRequestError
from mlxbatch.job.executors.base import Finished, ModelInfo, RowDone, engine_config, model_spec, row_tokens_hint
from mlxbatch.job.executors.ray.progress import clear_progress
from mlxbatch.job.rows.feed import Failed, Resumed, RowFeed, Submit
from mlxbatch.job.rows.media import ImageError
from mlxbatch.job.rows.tasks import RowTask, submit
from mlxbatch.job.spec import JobSpec


def max_inflight(max_num_seqs: int) -> int:
    """The most rows the local executor keeps in an engine: 4 x its ``max_num_seqs`` (set or sized), so admission has
    a queue to choose from (the scheduler looks that far ahead)."""
    return 4 * max_num_seqs


def take_room(in_flight: int, most: int) -> int:
    """Rows the local executor takes from the feed now: as many as finished since it last took, up to ``most`` in
    flight, so rows reach the engine about a step's worth at a time. Taken in bursts (none until half of ``most`` had
    finished, then that half: 2,048 rows at an H100's defaults), the engine's thread spent tens of milliseconds
    submitting rows between two steps while a GPU's launch thread, done encoding the step before, had nothing to
    encode (docs/benchmarks.md). The feed gives rows in plan order whatever their number. ``mlxbatch plan`` paces its
    dry run by the same rule."""
    return max(0, most - in_flight)


class InFlight:
    """The rows a single-machine executor's one engine holds (in this process or its own), by result key: the one
    owner of that book. ``take`` gives the engine what room there is, ``finished`` matches what the engine returns."""

    def __init__(self, most: int) -> None:
        self.most = most  # ``max_inflight``
        self.held: dict[str, Submit] = {}

    def __len__(self) -> int:
        return len(self.held)

    def take(self, feed: RowFeed) -> tuple[list[RowTask], list[Failed | Resumed]]:
        """The rows the engine gets now (``take_room``), each recorded here, and the feed's other items (error rows,
        resumed ones). The feed is waited for only when no row is in flight (an engine with rows keeps stepping while
        the next window is prepared)."""
        room = take_room(len(self.held), self.most)
        if not room:
            return [], []
        tasks: list[RowTask] = []
        other: list[Failed | Resumed] = []
        for item in feed.take(room, wait=not self.held):
            if not isinstance(item, Submit):
                other.append(item)
                continue
            self.held[item.prep.key] = item
            tasks.append(RowTask.of(item.prep, item.token_ids, item.cache_tokens, item.block_hashes))
        return tasks, other

    def finished(self, done: Iterable[RowDone]) -> list[Finished]:
        """The engine's finished rows as the run records them (a row no longer held, aborted, is dropped)."""
        out = []
        for d in done:
            row = self.held.pop(d.key, None)
            if row is not None:
                out.append(Finished(row.prep, d.output, row.index, d.error, d.error_kind))
        return out


@dataclass(frozen=True)
class Prepared:
    """A row task made ready off the step loop (``RowEngine.prepare``): its request, or the error refusing it;
    neither for a row that ``submit`` prepares itself."""

    task: RowTask
    group: RequestGroup | None = None  # the engine's request (``EngineCore.prepare_request``)
    refused: RowDone | None = None


def _refusal(task: RowTask, exc: InvalidRequestError | ImageError) -> RowDone:
    """The error row of a task the engine refused (kind ``request``, ``constraint`` or ``image``)."""
    if isinstance(exc, ImageError):
        kind = "image"
    else:
        kind = "constraint" if exc.field == "constraint" else "request"
    return RowDone(task.key, None, f"{task.row_id}: {exc}", kind)


class RowEngine:
    """One engine running row tasks: refused rows come back as errors (kind ``request``, ``constraint`` or
    ``image``) on the next ``step``, never as exceptions."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, warm_up_later: bool = False) -> None:
        """``warm_up_later``: the engine's warm-up (``config.warm_up``) waits for ``warm_up``."""
        self._warm_up_due = warm_up_later and config.warm_up
        self.core = EngineCore(loaded, dataclasses.replace(config, warm_up=False) if self._warm_up_due else config)
        self._refused: list[RowDone] = []
        self.busy_s = 0.0  # time spent stepping

    def warm_up(self) -> None:
        """The warm-up put off at construction, if any (once)."""
        if self._warm_up_due:
            self._warm_up_due = False
            self.core.warm_up()

    def prepare(self, task: RowTask) -> Prepared:
        """A text row's request made ready for ``submit`` (its checks, its sequences) where a thread beside the one
        that steps can do it: the engine's process does so on its input thread, while its stepping thread waits for
        the device. Rows with images, candidates or an output constraint are prepared by ``submit`` itself."""
        if task.token_ids is None or task.images or task.candidates is not None or task.params.constraint is not None:
            return Prepared(task)
        try:
            return Prepared(task, self.core.prepare_request(task.token_ids, task.params, task.key, task.cache_tokens,
                                                            task.block_hashes))
        except InvalidRequestError as exc:
            return Prepared(task, refused=_refusal(task, exc))

    def submit(self, task: RowTask | Prepared) -> None:
        """Queue a row (a task, or one ``prepare`` made ready); a row the engine refuses comes back as an error on the
        next ``step``."""
        row = task.task if isinstance(task, Prepared) else task
        try:
            if not isinstance(task, Prepared) or (task.group is None and task.refused is None):
                submit(self.core, row)  # (a task as it came: no wrapper made on the step loop)
            elif task.refused is not None:
                self._refused.append(task.refused)
            else:
                self.core.queue_request(task.group)
        except (InvalidRequestError, ImageError) as exc:
            self._refused.append(_refusal(row, exc))

    @property
    def has_work(self) -> bool:
        return bool(self._refused) or self.core.has_unfinished

    def step(self) -> list[RowDone]:
        done, self._refused = self._refused, []
        if self.core.has_unfinished:
            t0 = time.perf_counter()
            done += [RowDone(d.request_id, d.output) for d in self.core.step() if d.output is not None]
            self.busy_s += time.perf_counter() - t0
        return done

    def abort(self, key: str) -> None:
        self.core.abort(key)

    def stats(self) -> dict[str, Any]:
        """The core's, its profile with ``stepping_s``: the wall of this engine's steps as the caller sees them, the
        profiled steps' plus what the profile leaves out (finished rows' outputs, steps with nothing to launch)."""
        stats = self.core.stats()
        stats["profile"] = {**stats["profile"], "stepping_s": round(self.busy_s, 4)}
        return stats

    def shutdown(self) -> None:
        self.core.shutdown()


class LocalExecutor:
    """The single-machine path: one engine in this process."""

    engine_process = False

    def __init__(self, spec: JobSpec, loaded: LoadedModel) -> None:
        # warmed up by the run once its feed has started (``warm_up``): the first window is prepared meanwhile
        self.engine = RowEngine(loaded, engine_config(spec.engine, spec.seed, row_tokens_hint(spec)), warm_up_later=True)
        core = self.engine.core
        self.model = dataclasses.replace(ModelInfo.of(loaded), reuse_step=core.reuse_step,
                                         batch=core.batch_size.describe())
        self.rows = InFlight(max_inflight(core.config.max_num_seqs))  # (the one book of what the engine holds)

    def warm_up(self) -> None:
        """The engine's warm-up (GPU kernels compiled, first evaluations): the run calls it once its feed has started
        preparing the first window, which a fast start would otherwise wait for with the engine idle."""
        self.engine.warm_up()

    def take(self, feed: RowFeed) -> list[Failed | Resumed]:
        self.engine.warm_up()  # (done already when the run called ``warm_up``)
        tasks, other = self.rows.take(feed)
        for task in tasks:
            self.engine.submit(task)
        return other

    @property
    def busy(self) -> bool:
        return bool(self.rows)

    @property
    def in_flight(self) -> int:
        return len(self.rows)

    def poll(self) -> list[Finished]:
        return self.rows.finished(self.engine.step()) if self.rows else []

    def abort(self) -> None:
        for key in list(self.rows.held):
            self.engine.abort(key)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def rows_done(self) -> None:
        """Nothing to do: the engine is this process's (released by ``shutdown``)."""

    def shutdown(self) -> None:
        self.engine.shutdown()


@contextmanager
def open_local_executor(spec: JobSpec) -> Iterator[LocalExecutor]:
    """A ``LocalExecutor`` on the job's model (shared through the registry), released when the block ends."""
    clear_progress(spec.output)  # a distributed run's leftover: this run owns the folder now
    ms, user = model_spec(spec.model), f"job:{spec.output}"
    loaded = REGISTRY.acquire(ms, user)
    try:
        executor = LocalExecutor(spec, loaded)
        try:
            yield executor
        finally:
            executor.shutdown()
    finally:
        REGISTRY.release(ms, user)
