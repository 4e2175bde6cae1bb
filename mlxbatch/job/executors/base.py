"""The executor boundary: where a job's rows run, as the run loop sees it.

Owns the contract between the job loop and whatever runs rows: ``take(feed)`` pulls rows from the feed as capacity
allows and submits them (it returns the feed's error rows for the loop to record), ``poll()`` returns finished
rows, ``busy`` says whether any row taken is still unreturned, ``in_flight`` counts the rows engines hold (the
progress bar shows it), ``abort()`` drops what is in flight, ``stats()`` is the engine report. Also the named types
that cross it (``RowDone``, ``Finished``, ``ModelInfo``) and what every implementation builds an engine from.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from mlxbatch.config import EngineConfig
from mlxbatch.engine import LoadedModel, ModelSpec, PromptEncoder, resolve_path
from mlxbatch.errors import MlxbatchError
from mlxbatch.job.rows.feed import Failed, Resumed, RowFeed
from mlxbatch.job.rows.prepare import PreparedRow
from mlxbatch.job.spec import EngineSection, JobSpec, ModelSection
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
    takes images, its context length (row preparation refuses prompts far beyond it), the engine's reuse step
    (the feed plans with it: ``EngineCore.reuse_step``) and its batch in words (set, or sized by its device: the
    run shows it)."""

    identity: str
    dtype: str
    tokenizer: Any
    takes_images: bool
    context_length: int
    reuse_step: int = 1
    batch: str = ""  # ``EngineCore.batch_size.describe()``

    @classmethod
    def of(cls, loaded: LoadedModel) -> ModelInfo:
        return cls(loaded.identity, loaded.dtype, loaded.tokenizer, loaded.vlm is not None, loaded.context_length)


class Executor(Protocol):
    model: ModelInfo
    engine_process: bool  # its engine runs in a child process of the run (``job.executors.process``)

    def warm_up(self) -> None: ...
    def take(self, feed: RowFeed) -> list[Failed | Resumed]: ...
    def poll(self) -> list[Finished]: ...
    @property
    def busy(self) -> bool: ...
    @property
    def in_flight(self) -> int: ...
    def abort(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    def rows_done(self) -> None: ...  # no row will come any more: the run writes its results next
    def shutdown(self) -> None: ...


def model_spec(m: ModelSection) -> ModelSpec:
    return ModelSpec(m.path, m.dtype, m.adapter, m.trust_remote_code)


def engine_config(e: EngineSection, seed: int, row_tokens: int | None = None) -> EngineConfig:
    """The engine's config for a job; ``row_tokens`` the hint of a row's length (``row_tokens_hint``)."""
    return EngineConfig(max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                        prefill_chunk_size=e.prefill_chunk_size, kv_memory_fraction=e.kv_memory_fraction,
                        prefix_cache=e.prefix_cache, batch_invariant=e.batch_invariant, seed=seed,
                        expected_row_tokens=row_tokens, overlap_steps=e.overlap_steps)


def row_tokens_hint(spec: JobSpec) -> int | None:
    """What the engine's default batch size takes a row to hold: the job's ``max_tokens`` (every row reserves its
    prompt on top, unknown before rows are read: a lower bound, so the default errs towards more rows, and admission
    still charges each row its own length). None (unknown) for scoring, whose rows generate nothing, and where rows
    set their own ``max_tokens`` (``sampling.overrides``)."""
    if spec.task.kind != "generate" or "max_tokens" in spec.sampling.overrides:
        return None
    return spec.sampling.params.max_tokens


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A digest of how ``tokenizer`` encodes a text and a chat prompt: the driver and every engine must agree."""
    probe = PromptEncoder(tokenizer).encode_many(["mlxbatch probe: Ünïcödé 123 <b>", [{"role": "user", "content": "x"}]])
    return hashlib.sha256(json.dumps([len(getattr(tokenizer, "_tokenizer", tokenizer)), probe]).encode()).hexdigest()[:16]


def driver_tokenizer(spec: JobSpec) -> Any:
    """The model's tokenizer without its weights: the driver tokenizes and plans, the actors run the model."""
    from mlx_lm.utils import load_tokenizer

    m = spec.model
    source = resolve_path(m.path)  # a folder, or a hub id (mlx-lm then fetches the tokenizer files only)
    return load_tokenizer(Path(source) if Path(source).exists() else source,
                          {"trust_remote_code": m.trust_remote_code})  # always explicit: transformers never asks
