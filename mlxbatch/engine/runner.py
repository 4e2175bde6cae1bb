"""Executes one scheduled step on the model: SchedulerOutput -> forward passes -> sampled tokens.

Owns the KV of every admitted sequence: per-sequence mlx-lm caches while a sequence prefills, then its row
in the decode ``SlotBatch``. The scheduler never sees this layout; it only gets a cost function
(``kv_cost``) to admit by memory. Prefill chunks run one sequence at a time; all decoding sequences run as
one batched forward; the rows whose next token is due are sampled together.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxbatch.engine.kv_slots import SlotBatch
from mlxbatch.engine.request import Request
from mlxbatch.engine.sampling import SampledToken, SampleRow, sample
from mlxbatch.engine.scheduler import SchedulerOutput
from mlxbatch.errors import OutOfMemoryError

log = logging.getLogger(__name__)

_OOM_MARKERS = ("out of memory", "outofmemory", "bad_alloc", "malloc", "failed to allocate")


@dataclass
class StepProfile:
    """Where step time goes, summed over the engine's life (seconds)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    sampling_s: float = 0.0
    total_s: float = 0.0
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    batch_sizes: list[int] = field(default_factory=list, repr=False)

    @property
    def host_s(self) -> float:
        """Scheduling, bookkeeping, detokenization: step time not spent in the model or sampler."""
        return max(0.0, self.total_s - self.prefill_s - self.decode_s - self.sampling_s)

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps, "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
            "sampling_s": round(self.sampling_s, 4), "host_s": round(self.host_s, 4),
            "total_s": round(self.total_s, 4), "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
        }


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _OOM_MARKERS)


class ModelRunner:
    def __init__(self, model: object, num_layers: int, bytes_per_token: int) -> None:
        self.model = model
        self.bytes_per_token = bytes_per_token
        self.batch = SlotBatch(num_layers)
        self._prefill: dict[str, list[KVCache]] = {}
        self.profile = StepProfile()

    def kv_cost(self, reserved_lengths: list[int]) -> int:
        return SlotBatch.cost_positions(reserved_lengths) * self.bytes_per_token

    @property
    def kv_bytes(self) -> int:
        held = sum(c.keys.nbytes + c.values.nbytes for cs in self._prefill.values() for c in cs if c.keys is not None)
        return held + self.batch.nbytes

    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """Run the step; returns the next token of every sequence whose next token became due."""
        try:
            return self._execute(out)
        except Exception as exc:
            if is_out_of_memory(exc):
                raise OutOfMemoryError(str(exc)) from exc
            raise

    def _execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        prof = self.profile
        due: list[Request] = []
        logits: list[mx.array] = []
        if out.decodes:
            t0 = time.perf_counter()
            ids = [r.request_id for r in out.decodes]
            if ids != self.batch.ids:  # keep row order == decode order
                order = {rid: i for i, rid in enumerate(self.batch.ids)}
                decodes = sorted(out.decodes, key=lambda r: order[r.request_id])
            else:
                decodes = list(out.decodes)
            self.batch.prepare([r.request_id for r in decodes])
            inputs = mx.array([[r.last_token] for r in decodes], dtype=mx.int32)
            step_logits = self.model(inputs, cache=self.batch.layers)[:, -1, :]
            mx.eval(step_logits)
            prof.decode_s += time.perf_counter() - t0
            prof.decode_tokens += len(decodes)
            prof.batch_sizes.append(len(decodes))
            due += decodes
            logits.append(step_logits)
        for chunk in out.prefills:
            t0 = time.perf_counter()
            r = chunk.request
            cache = self._prefill.get(r.request_id)
            if cache is None:
                cache = self._prefill[r.request_id] = make_prompt_cache(self.model)
            assert cache[0].offset == chunk.start, "prefill KV out of step with the scheduler"
            tokens = mx.array([r.tokens(chunk.start, chunk.end)], dtype=mx.int32)
            chunk_logits = self.model(tokens, cache=cache)
            if chunk.last:
                last = chunk_logits[:, -1, :]
                mx.eval(last)
                self.batch.add(r.request_id, [c.state[:2] for c in cache], chunk.end)
                del self._prefill[r.request_id]
                due.append(r)
                logits.append(last)
            else:
                mx.eval([c.state for c in cache])
            prof.prefill_s += time.perf_counter() - t0
            prof.prefill_tokens += chunk.end - chunk.start
        if not due:
            return {}
        t0 = time.perf_counter()
        n_decoded = len(out.decodes)
        rows = [
            SampleRow(r.params, r.seed, len(r.output_token_ids), r.prompt_token_ids, r.output_token_ids,
                      r.banned_ids)
            for r in due
        ]
        tokens_out = sample(mx.concatenate(logits, axis=0), rows)
        self.batch.advance(n_decoded)  # commit only once the whole step succeeded
        prof.sampling_s += time.perf_counter() - t0
        return {r.request_id: t for r, t in zip(due, tokens_out)}

    def free(self, request_ids: list[str]) -> None:
        """Drop the KV of sequences that finished, were aborted or were preempted."""
        for rid in request_ids:
            self._prefill.pop(rid, None)
            if rid in self.batch.ids:
                self.batch.remove(rid)
        if request_ids:
            self.batch.shrink()
