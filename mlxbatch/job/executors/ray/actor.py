"""One engine actor of a distributed run: an mlxbatch engine owning one device, inside a Ray worker process.

Owns the remote side of the Ray executor's protocol. ``placed()`` answers as soon as the actor's process runs on a
node (so the driver can tell an actor the cluster has no room for from one loading its model); the model loads once,
on the first ``info()`` (``import mlxbatch``, which every import of this module runs first, preloads OpenBLAS before
MLX). ``advance(tasks)`` queues the rows it
is sent and steps the engine until a share of what it holds has finished (or a time budget passes), then returns the
finished rows and the engine's counters; the driver sends the next rows with its next call, so an actor holds at
most the driver's in-flight bound and rows arrive in the order the driver sends them (plan order). Nothing here
imports Ray: the driver (``job.executors.ray.executor``) makes the class remote, and the class works in-process too.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from mlxbatch.job.executors.base import RowDone, engine_config, model_spec, tokenizer_fingerprint
from mlxbatch.job.executors.local import RowEngine
from mlxbatch.job.rows.tasks import RowTask
from mlxbatch.job.spec import EngineSection, ModelSection

MIN_ADVANCE_S = 0.05  # an advance call returns early (enough finished) only after this long


@dataclass(frozen=True)
class ActorInfo:
    name: str
    host: str
    pid: int
    device: str
    blas: str | None
    identity: str  # the model identity: part of every result key, so every actor must agree
    dtype: str
    tokenizer: str  # tokenizer_fingerprint: the driver tokenizes, so it must agree too
    takes_images: bool
    context_length: int
    reuse_step: int = 1  # its engine's (``EngineCore.reuse_step``: a block on CUDA): the driver's feed plans with it
    max_num_seqs: int = 1  # its engine's, set or sized by its device: the driver's in-flight bound goes by it
    batch: str = ""  # its engine's batch in words (``EngineCore.batch_size.describe()``)
    gpus: str | None = None  # CUDA_VISIBLE_DEVICES as Ray set it for this actor (None: unset, every GPU visible)
    device_memory: int = 0  # bytes its device has (a GPU's own memory; on a CPU or a Mac, the host's)


@dataclass(frozen=True)
class Placed:
    """An actor's process is running on a node (its model is not loaded yet)."""

    host: str
    pid: int


@dataclass(frozen=True)
class Advance:
    done: list[RowDone]
    stats: dict[str, Any]  # the engine's counters (EngineCore.stats)
    busy_s: float  # time this engine spent stepping, in all
    idle_s: float = 0.0  # time it held unfinished rows between two calls (waiting for the driver), in all


class EngineActor:
    def __init__(self, name: str, model: ModelSection, engine: EngineSection, seed: int,
                 row_tokens: int | None = None) -> None:
        self.name = name
        self._setup = (model, engine, seed, row_tokens)
        self.loaded: Any = None
        self.engine: Any = None  # RowEngine, once info() loaded the model
        self.idle_s = 0.0
        self._idle_since: float | None = None  # when the last call returned with rows unfinished

    def placed(self) -> Placed:
        return Placed(socket.gethostname(), os.getpid())

    def info(self) -> ActorInfo:
        """What this actor runs; loads the model on the first call."""
        if self.engine is None:
            from mlxbatch.engine import load_model

            model, engine, seed, row_tokens = self._setup
            self.loaded = load_model(model_spec(model))
            self.engine = RowEngine(self.loaded, engine_config(engine, seed, row_tokens))
        dev = self.engine.core.worker.device
        m = self.loaded
        return ActorInfo(self.name, socket.gethostname(), os.getpid(), dev.kind, dev.blas, m.identity, m.dtype,
                         tokenizer_fingerprint(m.tokenizer), m.vlm is not None, m.context_length,
                         self.engine.core.reuse_step, self.engine.core.config.max_num_seqs,
                         self.engine.core.batch_size.describe(), os.environ.get("CUDA_VISIBLE_DEVICES"),
                         dev.total_memory)

    def advance(self, tasks: list[RowTask], budget_s: float, return_after: int) -> Advance:
        """Queue ``tasks``, then step until ``return_after`` rows have finished (after at least MIN_ADVANCE_S),
        ``budget_s`` has passed, or nothing is left."""
        t0 = time.perf_counter()
        if self._idle_since is not None:
            self.idle_s += t0 - self._idle_since
        for task in tasks:
            self.engine.submit(task)
        done: list[RowDone] = []
        while self.engine.has_work:
            done += self.engine.step()
            elapsed = time.perf_counter() - t0
            if elapsed >= budget_s or (len(done) >= return_after and elapsed >= MIN_ADVANCE_S):
                break
        self._idle_since = time.perf_counter() if self.engine.has_work else None
        return Advance(done, self.engine.stats(), self.engine.busy_s, self.idle_s)
