"""Executors: where a job's rows run. The boundary the run loop uses, and the single-machine implementation.

Owns the contract between the job loop and whatever runs rows: ``take(feed)`` pulls rows from the feed as capacity
allows and submits them (it returns the feed's error rows for the loop to record), ``poll()`` returns finished
rows, ``busy`` says whether any row taken is still unreturned, ``in_flight`` counts the rows engines hold (the
progress bar shows it), ``abort()`` drops what is in flight, ``stats()`` is the engine report. ``LocalExecutor``
runs one ``EngineCore`` in this process (the single-machine path, exactly as before: at most ``4 x max_num_seqs``
rows in flight). ``RowEngine`` turns ``RowTask``s into ``RowDone``s on one engine; the local executor and each Ray
actor (``job.ray_actor``) own one. ``open_executor`` picks the implementation; Ray is imported only when the job
asks for it (``job.ray_exec``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from mlxbatch.config import EngineConfig
from mlxbatch.engine import REGISTRY, EngineCore, LoadedModel, ModelSpec, PromptEncoder
from mlxbatch.errors import InvalidRequestError, MlxbatchError
from mlxbatch.job.actor_progress import clear_progress
from mlxbatch.job.feed import Failed, Resumed, RowFeed, Submit
from mlxbatch.job.media import ImageError
from mlxbatch.job.prepare import PreparedRow
from mlxbatch.job.spec import EngineSection, JobSpec, ModelSection
from mlxbatch.job.tasks import RowTask, submit
from mlxbatch.types import RequestOutput


class ExecutorError(MlxbatchError):
    """Rows cannot run any more (e.g. every engine actor died); finished rows are checkpointed."""


@dataclass(frozen=True)
class RowDone:
    """One row back from an engine: its output, or why the engine refused it."""

    key: str
    output: RequestOutput | None
    error: str | None = None
    error_kind: str | None = None


@dataclass(frozen=True)
class Finished:
    """A finished row as the run loop records it; ``worker`` names the engine actor that ran it (Ray only)."""

    prep: PreparedRow
    output: RequestOutput | None
    index: int  # the row's input position (the error rate is judged in input order)
    error: str | None = None
    error_kind: str | None = None
    worker: str | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What the run loop needs of the model: the identity for result keys, the dtype, the tokenizer, whether it
    takes images, its context length (row preparation refuses prompts far beyond it) and the engine's reuse step
    (the feed plans with it: ``EngineCore.reuse_step``)."""

    identity: str
    dtype: str
    tokenizer: Any
    takes_images: bool
    context_length: int
    reuse_step: int = 1

    @classmethod
    def of(cls, loaded: LoadedModel) -> ModelInfo:
        return cls(loaded.identity, loaded.dtype, loaded.tokenizer, loaded.vlm is not None, loaded.context_length)


class Executor(Protocol):
    model: ModelInfo

    def take(self, feed: RowFeed) -> list[Failed | Resumed]: ...
    def poll(self) -> list[Finished]: ...
    @property
    def busy(self) -> bool: ...
    @property
    def in_flight(self) -> int: ...
    def abort(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    def shutdown(self) -> None: ...


def model_spec(m: ModelSection) -> ModelSpec:
    return ModelSpec(m.path, m.dtype, m.adapter, m.trust_remote_code)


def engine_config(e: EngineSection, seed: int) -> EngineConfig:
    return EngineConfig(max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                        prefill_chunk_size=e.prefill_chunk_size, kv_memory_fraction=e.kv_memory_fraction,
                        prefix_cache=e.prefix_cache, batch_invariant=e.batch_invariant, seed=seed)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A digest of how ``tokenizer`` encodes a text and a chat prompt: the driver and every engine must agree."""
    probe = PromptEncoder(tokenizer).encode_many(["mlxbatch probe: Ünïcödé 123 <b>", [{"role": "user", "content": "x"}]])
    return hashlib.sha256(json.dumps([len(getattr(tokenizer, "_tokenizer", tokenizer)), probe]).encode()).hexdigest()[:16]


class RowEngine:
    """One engine running row tasks: refused rows come back as errors (kind ``request``, ``constraint`` or
    ``image``) on the next ``step``, never as exceptions."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.core = EngineCore(loaded, config)
        self._refused: list[RowDone] = []
        self.busy_s = 0.0  # time spent stepping

    def submit(self, task: RowTask) -> None:
        try:
            submit(self.core, task)
        except InvalidRequestError as exc:
            kind = "constraint" if exc.field == "constraint" else "request"
            self._refused.append(RowDone(task.key, None, f"{task.row_id}: {exc}", kind))
        except ImageError as exc:
            self._refused.append(RowDone(task.key, None, f"{task.row_id}: {exc}", "image"))

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
        return self.core.stats()

    def shutdown(self) -> None:
        self.core.shutdown()


class LocalExecutor:
    """The single-machine path: one engine in this process."""

    def __init__(self, spec: JobSpec, loaded: LoadedModel) -> None:
        self.engine = RowEngine(loaded, engine_config(spec.engine, spec.seed))
        self.model = dataclasses.replace(ModelInfo.of(loaded), reuse_step=self.engine.core.reuse_step)
        self.max_inflight = 4 * spec.engine.max_num_seqs
        self._pending: dict[str, Submit] = {}

    def take(self, feed: RowFeed) -> list[Failed | Resumed]:
        if len(self._pending) > self.max_inflight // 2:
            return []
        other: list[Failed | Resumed] = []
        for item in feed.take(self.max_inflight - len(self._pending)):
            if not isinstance(item, Submit):
                other.append(item)
                continue
            self._pending[item.prep.key] = item
            self.engine.submit(RowTask.of(item.prep, item.token_ids, item.cache_tokens))
        return other

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def poll(self) -> list[Finished]:
        if not self._pending:
            return []
        out = []
        for d in self.engine.step():
            row = self._pending.pop(d.key, None)
            if row is not None:
                out.append(Finished(row.prep, d.output, row.index, d.error, d.error_kind))
        return out

    def abort(self) -> None:
        for key in list(self._pending):
            self.engine.abort(key)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()


@contextmanager
def open_executor(spec: JobSpec) -> Iterator[Executor]:
    """The executor the job asks for (``spec.executor.kind``), released when the block ends. The Ray executor
    is imported only here, only for ``kind: ray``: the single-machine path never imports Ray."""
    if spec.executor.kind == "ray":
        try:
            from mlxbatch.job.ray_exec import open_ray_executor
        except ImportError as exc:
            raise ExecutorError(f"executor.kind ray needs Ray: pip install 'mlxbatch[ray]' ({exc})") from exc

        with open_ray_executor(spec) as executor:
            yield executor
        return
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
