"""A dry run of the engine's scheduling on token ids: the real scheduler and prefix index, no model, no device.

What ``mlxbatch plan`` predicts a run's prefill with. ``DryRun`` builds its scheduler as the engine core does
(``sched.setup.build_scheduler``, from the config and the memory plan of ``engine.model.memory``: the model's KV bytes
per token and weights from its config.json, this device's memory) and makes its requests' sequences as the intake does
(``intake.sample_sequences`` / ``score_sequences``: ``n`` samples fork sample 0, score candidates are one sequence
each or one for all). Each ``step`` schedules once, then a stand-in for the runner "computes" the step's prefill
chunks (counted) and draws one token for every row whose next token is due (decodes, prompts that end, forks), so
every row generates exactly its ``max_tokens`` (no EOS: the dry run cannot know where a row stops; pass an expected
length as ``max_tokens`` where it is known better), and score sequences finish with their prefill. The prefix
index's books (matches, stores, evictions, waits, twins) are the engine's own, acting on the same retention.
Not modelled: out-of-memory steps, batch-invariant mode's slices (it needs the model's shapes), images' pixels
(a row with images is keyed by its media hashes, as the engine keys it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlxbatch.config import EngineConfig
from mlxbatch.engine.backend import Backend
from mlxbatch.engine.decoding.detok import TextTracker
from mlxbatch.engine.intake import continuation_ids, sample_sequences, score_sequences
from mlxbatch.engine.kv.slots import SlotBatch
from mlxbatch.engine.model.memory import kv_budget, plan_memory
from mlxbatch.engine.model.worker import DeviceInfo, device_info
from mlxbatch.engine.paths import cuda_text_path
from mlxbatch.engine.request import Request
from mlxbatch.engine.sched.blocks import BLOCK_SIZE
from mlxbatch.engine.sched.setup import build_scheduler
from mlxbatch.types import SamplingParams, TokenLogprob

_DRAWN = 0  # the token every dry-run row draws (its value is never read: no EOS, no stop strings)


@dataclass(frozen=True)
class DryModel:
    """What the dry run knows of a model without loading it (its config.json): KV bytes per token in the dtype it will
    run in, its context, what its weights will take of the device's memory, and whether it takes images."""

    kv_bytes_per_token: int
    context_length: int
    weights_bytes: int = 0
    takes_images: bool = False


@dataclass
class DryCounts:
    """What a dry run did, by the engine's measures."""

    prefill_tokens: int = 0  # prompt tokens computed (the runner's ``profile.prefill_tokens``)
    reused_tokens: int = 0  # from the prefix cache or a running row, twins' forks included (``tokens_reused``)
    forked_tokens: int = 0  # prompt tokens forked: samples 1..n-1 from sample 0, twins (in ``reused_tokens`` too)
    decode_tokens: int = 0
    steps: int = 0


class DryRun:
    """The engine's scheduling of submitted token ids, stepped like ``EngineCore``; see the module docstring.
    ``device``: this machine's (None: measured now); ``packed_prefill``: the layout's (None: as the engine decides
    it for a model on this device, packed on CUDA's text path)."""

    def __init__(self, model: DryModel, config: EngineConfig, tokenizer: Any = None, device: DeviceInfo | None = None,
                 packed_prefill: bool | None = None) -> None:
        dev = device or device_info()
        bpt = model.kv_bytes_per_token
        free = dev.available_memory - model.weights_bytes if dev.available_memory > 0 else 0

        def auto_budget(fraction: float | None) -> int:  # as the worker finds it once the weights are loaded
            return kv_budget(max(1, free), fraction, dev.kind, dev.host_memory, bpt)

        self.memory = plan_memory(config, dev.kind, dev.host_memory, auto_budget, bpt * BLOCK_SIZE,
                                  model.takes_images, free)
        if packed_prefill is None:
            packed_prefill = cuda_text_path(Backend.detect(), model.takes_images, config.batch_invariant)

        def kv_cost(reserved: list[int]) -> int:  # the slot layout's charge (the runner's ``kv_cost``)
            return SlotBatch.cost_positions(reserved) * bpt

        def kv_cost_rows(rows: int, longest: int) -> int:  # the same by rows (the runner's ``kv_cost_rows``)
            return SlotBatch.rows_cost_positions(rows, longest) * bpt

        built = build_scheduler(config, dev.sizing_facts, self.memory.slot_budget, self.memory.prefix_blocks, bpt,
                                kv_cost, packed_prefill, rows_cost=kv_cost_rows)
        self.scheduler, self.batch_size, self.config, self.reuse_step = \
            built.scheduler, built.batch_size, built.config, built.reuse_step
        self.model = model
        self._tokenizer = tokenizer
        self._groups: dict[str, list[Request]] = {}  # request id -> its sequences
        self._counts = DryCounts()

    @property
    def counts(self) -> DryCounts:
        """What the dry run did so far."""
        if self.scheduler.prefix is not None:
            self._counts.reused_tokens = self.scheduler.prefix.stats()["tokens_reused"]
        return self._counts

    # -- submission (already validated token ids) ------------------------------------------------------
    def add_request(self, token_ids: Sequence[int], params: SamplingParams, request_id: str,
                    cache_tokens: int | None = None, media: Sequence[tuple[int, str]] = ()) -> None:
        """Queue one request as ``EngineCore.add_request`` would (``media``: a row with images' (position, content
        hash) pairs: its blocks are keyed by them and its samples prefill on their own)."""
        mm = _Media(tuple(media)) if media else None
        if _DRAWN in params.stop_token_ids:  # the token every row draws must not stop it
            params = dataclasses.replace(params, stop_token_ids=tuple(t for t in params.stop_token_ids if t != _DRAWN))
        self._queue(request_id, sample_sequences(request_id, list(token_ids), params, 0, frozenset(),
                                                 self.model.context_length, cache_tokens, mm, _no_text))

    def add_score_request(self, context_ids: Sequence[int], continuations: Sequence[str | Sequence[int]],
                          request_id: str, cache_tokens: int | None = None) -> None:
        """Queue the scoring of each continuation after the context, as ``EngineCore.add_score_request`` would
        (continuations as text need the tokenizer the dry run was given)."""
        cands = [continuation_ids(self._tokenizer, c) for c in continuations]
        self._queue(request_id, score_sequences(request_id, list(context_ids), cands, frozenset(),
                                                self.model.context_length, cache_tokens, _no_text))

    def _queue(self, group_id: str, seqs: list[Request]) -> None:
        self._groups[group_id] = seqs
        for s in seqs:
            self.scheduler.add(s)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._groups)

    # -- the step loop ---------------------------------------------------------------------------------
    def step(self) -> list[str]:
        """One engine step (schedule, the runner's stand-in, finish); returns the requests finished in it."""
        out = self.scheduler.schedule()
        if out.empty:
            self.scheduler.reap()
            if self._groups and not self.scheduler.has_work:  # (never: every queued sequence runs to its end)
                raise RuntimeError(f"dry run: {len(self._groups)} requests left unfinished with nothing to schedule")
            return []
        c = self._counts
        c.steps += 1
        c.prefill_tokens += sum(ch.end - ch.start for ch in out.prefills)
        ended: list[Request] = []  # the sequences that finish in this step, in order
        due = list(out.decodes)
        for ch in out.prefills:
            r = ch.request
            if not ch.last:
                continue
            if r.score_from is not None:  # every continuation token scored by its prefill: done
                n = len(r.score_targets())
                r.add_scores([TokenLogprob(_DRAWN, 0.0)] * n, [True] * n)
                r.finish_scored()
                ended.append(r)
            else:
                due.append(r)
        for _, child in out.forks:
            due.append(child)
            c.forked_tokens += child.num_prompt_tokens
        c.decode_tokens += len(out.decodes)
        for r in due:
            if r.status.finished:
                continue
            if r.append(_DRAWN, None) is not None:  # it drew its last token (its max_tokens, or the context)
                ended.append(r)
        self.scheduler.finish_step(out)
        return self._finished(ended)

    def _finished(self, ended: list[Request]) -> list[str]:
        """The requests whose last sequence is among ``ended`` (finished this step)."""
        done = []
        for r in ended:
            group = self._groups.get(r.group_id)
            if group is not None and all(s.status.finished for s in group):
                del self._groups[r.group_id]
                done.append(r.group_id)
        return done

    def run_until_done(self) -> DryCounts:
        while self.has_unfinished:
            self.step()
        return self.counts


@dataclass(frozen=True)
class _Media:
    """A row's images as the scheduler sees them: (token position, content hash) pairs."""

    media: tuple[tuple[int, str], ...]


class _NoText(TextTracker):
    """The text of a dry run's rows: nobody reads it, so nothing is kept (one instance serves every row)."""

    def __init__(self) -> None:
        super().__init__(None, (), False, False)

    def add(self, token_id: int) -> None:
        return None


_NO_TEXT = _NoText()


def _no_text() -> TextTracker:
    return _NO_TEXT
