"""The Ray executor: one job's rows over engine actors on a Ray cluster, with this process as the only writer.

Owns the driver side of a distributed run. Each window of the plan is cut into prefix-local units
(``job.executors.ray.partition``) and queued largest first; an actor with room takes the next unit and its rows go to it in plan
order, at most ``4 x max_num_seqs`` in flight per actor (``ray_actor.EngineActor.advance``). Two calls are out per
actor: Ray runs an actor's calls in order, so the second starts the moment the first returns and the engine keeps
stepping while its finished rows travel here and the next rows travel back (one call at a time left a GPU idle for
every round trip). Finished rows come back here and the run loop checkpoints them, so shards,
keys and final outputs are a single-machine run's. An idle actor with nothing queued takes the tail of the busiest
actor's unsent rows (cut at a weak link), so a window ends together. The books of each actor and these rules of who
gets which rows are ``job.executors.ray.slots``'s; this module starts the actors, talks to them and handles their failures.

Failures: an actor that dies (or whose call fails) loses only the rows it held unreturned; they go to the front of
the queue for the others, and a replacement actor starts while ``max_restarts`` allows. An actor is seen placed on a
node (``placed()``) apart from loading its model (``info()``): one still waiting for room on the cluster (a node
stopped) is logged, and one not ready within ``start_timeout_s`` is given up. A result for a row that was
given to another actor is dropped, so no row is recorded twice. The driver's own death leaves the checkpoint: the
next run, with or without Ray, resumes it. ``progress.json`` (``job.executors.ray.progress``) shows each actor while the
run goes.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError

from mlxbatch._torch import without_torch
from mlxbatch.engine import common_prefix_len
from mlxbatch.job.check.model_ref import tokenizers_only
from mlxbatch.job.executors.base import (
    ExecutorError,
    Finished,
    ModelInfo,
    driver_tokenizer,
    row_tokens_hint,
    tokenizer_fingerprint,
)
from mlxbatch.job.executors.engine_stats import merge_engine_stats
from mlxbatch.job.executors.ray.actor import ActorInfo, Advance, EngineActor, Placed
from mlxbatch.job.executors.ray.cluster import ActorPlan, actor_plan, connected, kill
from mlxbatch.job.executors.ray.progress import clear_progress, write_progress
from mlxbatch.job.executors.ray.slots import Slot, next_rows, units_of
from mlxbatch.job.rows.feed import Failed, Resumed, RowFeed, Submit
from mlxbatch.job.rows.tasks import RowTask
from mlxbatch.job.spec import JobSpec

log = logging.getLogger(__name__)

ADVANCE_BUDGET_S = 0.5  # an actor reports back at least this often
PIPELINE = 2  # advance() calls out per actor: the next one waits at the actor, not at this driver
ROOM_WAIT_LOG_S = 30.0  # an actor without room on the cluster this long (at most a third of start_timeout_s): logged
PROGRESS_EVERY_S = 1.0
POLL_WAIT_S = 0.05


class RayExecutor:
    engine_process = False  # (its engines run in Ray's actors)

    def __init__(self, spec: JobSpec, tokenizer: Any, address: str | None, plan: ActorPlan,
                 placement: dict[str, Any] | None = None) -> None:
        self.spec, self.tokenizer, self.address = spec, tokenizer, address
        x = spec.executor
        self.plan = plan  # cluster.plan_actors: executor.actors, one per GPU, one per Mac, or what resources fit
        self.n_actors = plan.count
        self._placement = placement or {}
        self.restarts_left = self.n_actors if x.max_restarts is None else x.max_restarts
        self.limit = 4 * (spec.engine.max_num_seqs or 1)  # unset: the first actor ready says its engine's (``_ready``)
        self.slots: list[Slot] = []
        self.queue: deque[list[Submit]] = deque()  # units not taken by an actor yet (plan order inside each)
        self.feed_done = False
        self.started_at = time.time()
        self._cpu0 = time.process_time()  # the driver's CPU (its feed thread's reading and tokenizing included)
        self._last_progress = 0.0
        self._fingerprint = tokenizer_fingerprint(tokenizer)
        self.model: ModelInfo | None = None
        for _ in range(self.n_actors):
            self._start()

    # -- actors -----------------------------------------------------------------------------------
    def _start(self, replacing: str | None = None) -> None:
        x, name = self.spec.executor, f"actor-{len(self.slots)}"
        options = {**self.plan.options(x), "max_restarts": 0, "max_task_retries": 0}
        options.update(self._placement)  # on Macs: the actor takes a free bundle of one-per-Mac placement group
        handle = ray.remote(EngineActor).options(**options).remote(name, self.spec.model, self.spec.engine,
                                                                     self.spec.seed, row_tokens_hint(self.spec))
        slot = Slot(name, handle, replacing=replacing)
        slot.calls.append(handle.placed.remote())  # answers once the cluster has room; then info() loads the model
        self.slots.append(slot)

    def _needs(self) -> str:
        o = self.plan.options(self.spec.executor)
        wanted = {"CPU": o["num_cpus"], "GPU": o["num_gpus"], **o.get("resources", {})}
        return ", ".join(f"{k}={v:g}" for k, v in wanted.items() if v > 0)

    def _check_starting(self) -> None:
        """Actors not ready yet: a wait for room on the cluster is logged once; past ``start_timeout_s`` (no room,
        or the model still not loaded) the actor is given up."""
        timeout = self.spec.executor.start_timeout_s
        for slot in self.slots:
            if slot.state != "starting":
                continue
            waited = time.monotonic() - slot.started
            if waited > timeout:
                why = (f"got no room on the cluster within {timeout:.0f} s (it needs {self._needs()})"
                       if slot.placed is None else f"did not load the model within {timeout:.0f} s")
                self._lost(slot, why, replace=False)
            elif slot.placed is None and not slot.waiting_logged and waited > min(ROOM_WAIT_LOG_S, timeout / 3):
                slot.waiting_logged = True
                who = f"{slot.name} (replacing {slot.replacing})" if slot.replacing else slot.name
                log.warning("%s is still waiting for room on the cluster after %.0f s (it needs %s): a node may have "
                            "stopped, or other work holds its resources; the other actors go on, and it is given up "
                            "after start_timeout_s=%.0f s", who, waited, self._needs(), timeout)

    def warm_up(self) -> None:
        """Nothing: each actor warmed its engine up when it started (``await_ready``)."""

    def await_ready(self) -> None:
        """Wait until every actor loaded the model; those that did not within ``start_timeout_s`` are given up."""
        while any(s.state == "starting" for s in self.slots):
            self.poll(wait_s=1.0)

    def _ready(self, slot: Slot, info: ActorInfo) -> None:
        slot.info = info
        problem = None
        if info.tokenizer != self._fingerprint:
            problem = "its tokenizer encodes differently from the driver's (another model folder on that node?)"
        elif self.model is not None and info.identity != self.model.identity:
            problem = f"its model identity {info.identity} differs from {self.model.identity} (another model?)"
        if problem:
            self._lost(slot, f"refused on {info.host}: {problem}", replace=False)
            return
        if self.model is None:
            # the first actor ready decides the plan's reuse step too (a block where its engine packs prefill passes;
            # an actor of another kind still runs that plan, reusing a little more or less than it could)
            self.model = ModelInfo(info.identity, info.dtype, self.tokenizer, info.takes_images, info.context_length,
                                   info.reuse_step, f"{slot.name}: {info.batch}")
            self.limit = 4 * info.max_num_seqs  # its engine's max_num_seqs: as set, or sized by its device
        slot.state = "ready"
        log.info("%s ready on %s (pid %d, %s, BLAS %s)", slot.name, info.host, info.pid, info.device, info.blas)

    def _lost(self, slot: Slot, why: str, replace: bool = True) -> None:
        """An actor is gone: the rows it held unreturned go back to the front of the queue for the others."""
        slot.state, slot.error = "dead", why
        slot.calls.clear()
        rows = list(slot.in_flight.values()) + (slot.units.popleft() if slot.units else [])
        for unit in reversed(slot.units):
            self.queue.appendleft(unit)
        if rows:
            self.queue.appendleft(rows)
        requeued = len(rows) + sum(len(u) for u in slot.units)
        slot.in_flight.clear()
        slot.units.clear()
        kill(slot.handle)
        log.warning("engine actor %s lost (%s); its %d unfinished rows go to the other actors", slot.name, why,
                    requeued)
        if replace and self.restarts_left > 0:
            self.restarts_left -= 1
            self._start(replacing=slot.name)
        if all(s.state == "dead" for s in self.slots):
            raise ExecutorError(f"every engine actor is gone (last: {slot.name}: {why}); finished rows are "
                                f"checkpointed in {self.spec.output}: run the job again to resume")

    # -- rows in ----------------------------------------------------------------------------------
    def take(self, feed: RowFeed) -> list[Failed | Resumed]:
        other: list[Failed | Resumed] = []
        low_water = self.limit * sum(s.state != "dead" for s in self.slots)
        while not feed.finished and sum(len(u) for u in self.queue) < low_water:
            # wait for the next window (the feed's thread prepares it) only when no actor has rows to work on
            items = feed.take_window(wait=not self.busy)
            if not items:
                break
            rows: list[Submit] = []
            for item in items:
                if isinstance(item, Submit):
                    rows.append(item)
                else:
                    other.append(item)
            self.queue.extend(units_of(rows, self.spec.executor.partition, self.n_actors))
        self.feed_done = feed.finished
        self._dispatch()
        return other

    def _send(self, slot: Slot) -> None:
        """Keep ``PIPELINE`` advance calls out while the actor has rows to get or rows to finish."""
        while len(slot.calls) < PIPELINE:
            tasks = []
            for r in next_rows(slot, self.limit - len(slot.in_flight), self.queue, self.slots, self.feed_done,
                               self.limit):
                slot.in_flight[r.prep.key] = r
                ids = r.token_ids or []
                slot.floor_tokens += len(ids) - common_prefix_len(slot.last_ids, ids)
                slot.last_ids = ids
                tasks.append(RowTask.of(r.prep, r.token_ids, r.cache_tokens, r.block_hashes))
            if not tasks and not slot.in_flight:
                return
            slot.calls.append(slot.handle.advance.remote(tasks, ADVANCE_BUDGET_S, max(1, self.limit // 4)))

    def _dispatch(self) -> None:
        for slot in self.slots:
            if slot.state == "ready" and len(slot.calls) < PIPELINE:
                self._send(slot)

    # -- rows out ---------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.queue) or any(s.in_flight or s.units for s in self.slots)

    @property
    def in_flight(self) -> int:
        return sum(len(s.in_flight) for s in self.slots)

    def poll(self, wait_s: float = POLL_WAIT_S) -> list[Finished]:
        pending = [ref for s in self.slots for ref in s.calls]
        finished: list[Finished] = []
        if not pending:
            time.sleep(wait_s)  # nothing out: rows wait for an actor to free up or start
        else:
            ready, rest = ray.wait(pending, num_returns=1, timeout=wait_s)
            if ready and rest:
                ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
            done = set(ready)
            for slot in self.slots:
                while slot.calls and slot.calls[0] in done:  # an actor's calls finish in the order it runs them
                    finished += self._answer(slot, slot.calls.popleft())
        self._check_starting()
        self._dispatch()
        if time.monotonic() - self._last_progress >= PROGRESS_EVERY_S:
            self.write_progress("running")
        return finished

    def _answer(self, slot: Slot, ref: Any) -> list[Finished]:
        """One call of ``slot``'s actor has returned: its result, or its actor lost."""
        try:
            result = ray.get(ref)
        except RayError as exc:
            if slot.state != "dead":
                self._lost(slot, _failure(exc))
            return []
        if isinstance(result, Placed):
            slot.placed = result
            slot.calls.append(slot.handle.info.remote())  # the model loads now
        elif isinstance(result, ActorInfo):
            self._ready(slot, result)
        elif slot.state != "dead":
            finished = self._returned(slot, result)
            self._send(slot)  # the next rows go out before this process writes anything
            return finished
        return []

    def _returned(self, slot: Slot, adv: Advance) -> list[Finished]:
        out = []
        for d in adv.done:
            row = slot.in_flight.pop(d.key, None)
            if row is None:  # given to another actor meanwhile: that one's result counts
                continue
            slot.rows += 1
            slot.errors += d.error is not None
            if d.output is not None:
                slot.prompt_tokens += d.output.prompt_tokens
                slot.generated_tokens += d.output.generated_tokens
            out.append(Finished(row.prep, d.output, row.index, d.error, d.error_kind, slot.name))
        slot.engine, slot.busy_s, slot.idle_s = adv.stats, adv.busy_s, adv.idle_s
        return out

    def abort(self) -> None:
        for slot in self.slots:
            if slot.state != "dead":
                kill(slot.handle)
                slot.state = "dead"
                slot.calls.clear()

    # -- reporting --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        stats = merge_engine_stats([s.engine for s in self.slots if s.engine])
        actors = [s.summary() for s in self.slots]
        stats["executor"] = {"kind": "ray", "address": self.address, "partition": self.spec.executor.partition,
                             "actors": actors, "floor_tokens": sum(a["floor_tokens"] for a in actors),
                             "prefill_tokens": sum(a["prefill_tokens"] for a in actors),
                             "driver_cpu_s": round(time.process_time() - self._cpu0, 3)}
        return stats

    def write_progress(self, state: str) -> None:
        self._last_progress = time.monotonic()
        actors = [{**s.summary(), "in_flight": len(s.in_flight), "queued": s.queued} for s in self.slots]
        write_progress(self.spec.output, {
            "executor": "ray", "state": state, "address": self.address, "started_at": self.started_at,
            "driver": {"host": socket.gethostname(), "pid": os.getpid()},
            "rows_done": sum(s.rows for s in self.slots), "rows_queued": sum(len(u) for u in self.queue),
            "actors": actors})

    def rows_done(self) -> None:
        """Nothing to do: the actors are released by ``shutdown``."""

    def shutdown(self) -> None:
        for slot in self.slots:
            if slot.state == "starting" and slot.placed is None:
                log.warning("%s never got room on the cluster (it needs %s); the run ended without it", slot.name,
                            self._needs())
        self.abort()


def _failure(exc: RayError) -> str:
    """Why an actor's call failed, in a line: the actor's own exception (e.g. its model did not load), or Ray's."""
    cause = exc.cause if isinstance(exc, RayTaskError) else None
    err: BaseException = cause if isinstance(cause, BaseException) else exc
    first = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


@contextmanager
def open_ray_executor(spec: JobSpec) -> Iterator[RayExecutor]:
    x = spec.executor
    clear_progress(spec.output)
    tokenizer = driver_tokenizer(spec)
    # a text model's actors run transformers without torch, as the run does (``mlxbatch._torch``)
    setup = f"{without_torch.__module__}.{without_torch.__name__}" if tokenizers_only(spec.model) else None
    with connected(x.address, x.actors, x.num_cpus, setup) as address, actor_plan(x) as (plan, placement):
        executor = RayExecutor(spec, tokenizer, address, plan, placement)
        ok = False
        try:
            executor.await_ready()
            yield executor
            ok = True
        finally:
            executor.shutdown()
            if ok:
                clear_progress(spec.output)
            else:
                executor.write_progress("stopped")
