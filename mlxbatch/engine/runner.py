"""Executes one scheduled step on the model: ``SchedulerOutput`` -> forward passes -> ``RunnerOutput``.

Owns the KV of every admitted sequence (a ``KVLayout``: fixed slots), the prefix cache's block tensors, the
structured-output matchers of constrained sequences, and the step profile. The scheduler never sees the layout: it
gets a cost function (``kv_cost``) to admit by memory, and it decides every reuse; the runner copies what the
``SchedulerOutput`` lists (new rows' prefixes, finished prompts' blocks). All decoding sequences run as one batched
forward; prefill chunks run batched too, in groups of similar length so right-padding stays small; the rows whose
next token is due are sampled together. KV positions are committed only when the whole step succeeded, so a failed
(out-of-memory) step leaves nothing half-counted. With ``batch_invariant`` the forwards run in fixed shapes instead
(``engine.invariant``: slices, key widths and row tiles fixed by each row alone); sampling and commit are shared
(``engine.commit``: the runner's ``StepCommit``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from mlxbatch.engine import invariant
from mlxbatch.engine.backend import Backend
from mlxbatch.engine.commit import StepCommit
from mlxbatch.engine.decoding.structured import Matcher, SequenceGrammars
from mlxbatch.engine.invariant import FixedForwards, InvariantSlots
from mlxbatch.engine.kv import KVLayout, LayoutOptions, reuse
from mlxbatch.engine.kv.prefix_store import PrefixStore
from mlxbatch.engine.kv.slots import SlotBatch
from mlxbatch.engine.model.own_body import OwnBody
from mlxbatch.engine.model.split import split_model
from mlxbatch.engine.model.worker import KVGeometry
from mlxbatch.engine.outputs import Launched, RunnerOutput, RunnerStats, ScoredTokens, StepProfile
from mlxbatch.engine.paths import layout_for
from mlxbatch.engine.request import Request
from mlxbatch.engine.sched.step import PrefillChunk, SchedulerOutput
from mlxbatch.engine.scoring import score_chunk, score_positions
from mlxbatch.engine.vision.rows import RowInput, VisionLanguageRows
from mlxbatch.errors import InvalidRequestError, OutOfMemoryError

# Prefill passes apart (the CPU, Metal) pad their rows to the pass's longest, and padding costs what real tokens cost
# (the matmuls, attention over it), while a new pass costs a launch of every layer and a read of the weights: a pass
# pads at most this share of its real tokens (at 0.25 label's and chat's steps computed 18% padding; at 0.10, 7-8%,
# for 1.3-1.8x the passes: 7-9% less time with a Mac's decisions on a CPU, the CPU's own job unchanged:
# docs/benchmarks.md)
PASS_WASTE = 0.10
# where one packed pass (CUDA: no padding) takes every group, the groups only order its rows (similar lengths together)
PACKED_ORDER_WASTE = 0.25

log = logging.getLogger(__name__)

_OOM_MARKERS = ("out of memory", "outofmemory", "bad_alloc", "malloc", "failed to allocate")


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _OOM_MARKERS)


class ModelRunner:
    def __init__(self, model: Any, geometry: KVGeometry, backend: Backend, prefix_blocks: int = 0,
                 block_size: int = 16, vlm: Any = None, vision_cache_bytes: int = 1 << 30,
                 batch_invariant: bool = False, layout: LayoutOptions | None = None) -> None:
        self.model = model
        self._split = split_model(model)
        # vision-language models: rows are fed embeddings and multimodal positions instead of token ids
        self._mm = VisionLanguageRows(vlm, vision_cache_bytes) if vlm is not None else None
        self.geometry = geometry
        dtype = getattr(mx, geometry.dtype)
        self.profile = StepProfile()
        self.traffic = self.profile.traffic  # the layout and the prefix store count their copies and syncs here
        self._fixed: FixedForwards | None = None  # batch-invariant mode: fixed-shape forwards
        if layout is None:
            layout = layout_for(backend, self._split, geometry, vlm is not None, batch_invariant)
        self.layout = layout
        slots = (InvariantSlots if batch_invariant else SlotBatch)(geometry.num_layers, self.traffic, layout)
        slots.allocate(geometry.kv_heads, geometry.head_dim, dtype)
        if batch_invariant:
            if vlm is not None:
                raise InvalidRequestError("batch_invariant", True, "is not supported for vision-language models yet")
            assert isinstance(slots, InvariantSlots)
            body, head = (self._split.body, self._split.head) if self._split else (model, None)
            device = "gpu" if backend.gpu else "cpu"
            self._fixed = invariant.start(slots, model, body, head, geometry.dtype, device, self.profile)
        # prefill chunks and reused prefixes start at multiples of this (0: anywhere), for the scheduler
        self.invariant_slice = self._fixed.shapes.slice_tokens if self._fixed is not None else 0
        if layout.fuse:
            assert self._split is not None and isinstance(self._split.body, OwnBody)
            self._split.body.fuse()
        self.batch: KVLayout = slots
        self._store = (PrefixStore(geometry.num_layers, geometry.kv_heads, geometry.head_dim, dtype,
                                   geometry.bytes_per_token, prefix_blocks, block_size, self.traffic)
                       if prefix_blocks > 0 else None)
        self._grammars = SequenceGrammars(backend.metal)  # structured outputs: constrained sequences' matchers
        # the draw and the commit of each step, the last launched step and the row moves it leaves
        self._steps = StepCommit(slots, self._store, self._grammars, self.profile)

    def kv_cost(self, reserved_lengths: list[int]) -> int:
        """The layout's KV bytes for sequences of these reserved lengths (the scheduler's ``KVCost``)."""
        return self.kv_cost_rows(len(reserved_lengths), max(reserved_lengths)) if reserved_lengths else 0

    def kv_cost_rows(self, rows: int, longest: int) -> int:
        """The same from the number of sequences and the longest reserved length (the scheduler's ``RowsCost``)."""
        if self._fixed is not None:
            return self._fixed.shapes.rows_cost_positions(rows, longest) * self.geometry.bytes_per_token
        return SlotBatch.rows_cost_positions(rows, longest) * self.geometry.bytes_per_token

    def set_constraint(self, request_id: str, matcher: Matcher | None) -> None:
        """Constrain a sequence's tokens by ``matcher`` (None: drop its matcher)."""
        self._grammars.set(request_id, matcher)

    @property
    def num_constrained(self) -> int:
        return len(self._grammars)

    def end_step(self, seconds: float) -> None:
        """The core's whole step (scheduling and bookkeeping included) took ``seconds``."""
        self.profile.steps += 1
        self.profile.total_s += seconds

    def stats(self) -> RunnerStats:
        policy = self.layout.attention.prefill  # CUDA: prefill passes run unfused (new shapes)
        unfused = {"prefill_unfused_passes": policy.unfused_passes} if policy is not None else {}
        if self.layout.attention.packed is not None:  # CUDA: packed passes' attention, one kernel
            unfused["prefill_attention_kernel"] = 1
        compiled = self.batch.compiled_decode  # CUDA: decode passes from compiled graphs
        if compiled is not None:
            unfused.update(decode_compiled_passes=compiled.passes, decode_traces=compiled.traces)
        compiled = self.batch.compiled_prefill  # CUDA: packed prefill passes too
        if compiled is not None:
            unfused.update(prefill_compiled_passes=compiled.passes, prefill_traces=compiled.traces)
        return RunnerStats({**self.profile.as_dict(), **unfused}, self.batch.nbytes,
                           self._store.nbytes if self._store is not None else 0,
                           self._mm.stats() if self._mm is not None else None)

    def launch(self, out: SchedulerOutput) -> Launched:
        """Enqueue the step: copy-ins, forwards, the draw and the commit of its books. Returns without waiting for
        the device: ``collect`` reads the drawn tokens, and the next step may be launched first (its decode pass
        is fed this step's draw on the device). Raises ``OutOfMemoryError`` where an allocation failed, this step's
        or one still in flight (Metal reports a failure at the next synchronisation or op: ``recover``)."""
        with _out_of_memory():
            return self._launch(out)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run the step and read its results (``launch`` then ``collect``)."""
        return self.collect(self.launch(out))

    def collect(self, step: Launched) -> RunnerOutput:
        """A launched step's drawn tokens, read back (waiting for the device if the step is still running); raises
        ``OutOfMemoryError`` as ``launch`` does (the tokens are then not to be trusted: ``recover``)."""
        if step.drawn is None:
            return RunnerOutput(scored=step.scored)
        with _out_of_memory():
            self.traffic.wait_for(step.launch)  # (its time goes to the launch's kind)
            tokens_out = self.traffic.read(step.drawn)
        self._steps.collected(step)  # the host knows the step's tokens: the next decode pass is fed from them
        done: frozenset[str] = frozenset()
        if len(self._grammars):  # constrained sequences (none: no per-row work here)
            t1 = time.perf_counter()
            self._grammars.advance(list(step.due), [t.token_id for t in tokens_out])  # the step can no longer fail
            self.profile.grammar_advance_s += time.perf_counter() - t1
            done = frozenset(rid for rid in step.due if self._grammars.done(rid))
        return RunnerOutput(dict(zip(step.due, tokens_out)), step.scored, done)

    @property
    def overlappable(self) -> bool:
        """Whether a step may be launched before the last one's tokens are read: not with structured outputs (masks
        follow each sequence's tokens), vision rows (fed embeddings of host tokens) or fixed-shape forwards."""
        return not len(self._grammars) and self._mm is None and self._fixed is None

    def _launch(self, out: SchedulerOutput) -> Launched:
        self.traffic.join()  # (no graph is built while the launch thread encodes one)
        self._steps.settle_rows()
        if self._fixed is not None:
            return self._launch_fixed(out)
        prof, batch, traffic = self.profile, self.batch, self.traffic
        scored: dict[str, ScoredTokens] = {}
        due: list[Request] = []
        logits: list[mx.array] = []
        if out.prefills:
            t0, w0 = time.perf_counter(), traffic.wait_s
            # the passes: each group its own, or every group in one packed pass (``kv.packed``: no score rows)
            packed = self.layout.packed_prefill and self._mm is None \
                and all(c.request.score_from is None for c in out.prefills)
            groups = _pad_groups(out.prefills, [a.request.request_id for a in out.admissions],
                                 PACKED_ORDER_WASTE if packed else PASS_WASTE)
            # new rows join in pass order, then get the KV they reuse; arranged once, before any forward: rows move
            # by committed length, and this step's writes are not committed yet
            reuse.admit(batch, self._store, out.admissions, [c.request.request_id for g in groups for c in g])
            start = batch.n_decode
            if packed and out.decodes and self.layout.attention.packed is not None:
                due, step_logits = self._one_pass(out, [c for g in groups for c in g])
                prof.prefill_build_s += time.perf_counter() - t0 - (traffic.wait_s - w0)
                return self._steps.draw_commit(out, due, [step_logits], scored)
            passes = [([c for g in groups for c in g], [len(g) for g in groups])] if packed else \
                [(g, None) for g in groups]
            for group, sizes in passes:
                for i, c in enumerate(group):
                    rid = c.request.request_id
                    assert batch.ids[start + i] == rid and batch.committed(rid) == c.start
                last = [i for i, c in enumerate(group) if c.last and c.request.score_from is None]
                tokens = [c.request.tokens(c.start, c.end) for c in group]
                seqs = [RowInput(c.request, c.start, c.end - c.start) for c in group]
                if sizes is not None:
                    chunk_logits = self._forward_packed(start, tokens, sizes, last)
                elif any(c.request.score_from is not None for c in group):
                    chunk_logits = self._score(start, group, tokens, last, seqs, scored)
                elif self.layout.prune_last and self._mm is None and len(last) == len(group) \
                        and all(len(t) > 1 for t in tokens):
                    chunk_logits = self._prefill_pruned(start, group, tokens)
                else:
                    chunk_logits = self._forward(start, tokens, rows=last, seqs=seqs)
                start += len(group)
                if last:
                    logits.append(chunk_logits)
                    due += [group[i].request for i in last]
                    traffic.launch("prefill", chunk_logits)  # the host builds the next pass meanwhile
                else:  # no logits needed: evaluating only the KV lets MLX skip the LM head
                    traffic.launch("prefill", *batch.kv_arrays())
                prof.prefill_tokens += sum(c.end - c.start for c in group)
            prof.prefill_build_s += time.perf_counter() - t0 - (traffic.wait_s - w0)
        if out.decodes:  # after the prefill passes: the device runs this (the step's largest pass, at 256 rows)
            t0, w0 = time.perf_counter(), traffic.wait_s  # while the host reads the last step and schedules the next
            assert len(out.decodes) == batch.n_decode, "every decoding sequence runs every step"
            by_id = {r.request_id: r for r in out.decodes}
            rows = [by_id[rid] for rid in batch.ids[: batch.n_decode]]
            seqs = [RowInput(r, r.num_tokens - 1, 1) for r in rows] if self._mm is not None else None
            logits.insert(0, self._forward(0, self._steps.decode_tokens(rows), seqs=seqs))
            due = rows + due
            prof.decode_build_s += time.perf_counter() - t0 - (traffic.wait_s - w0)
            prof.decode_tokens += len(rows)
        return self._steps.draw_commit(out, due, logits, scored)

    def _one_pass(self, out: SchedulerOutput, group: list[PrefillChunk]) -> tuple[list[Request], mx.array]:
        """The step's decode rows and prefill chunks as one packed pass (CUDA, through the packed attention kernel:
        a decode row is a row of one token): one graph, one launch and one wait a step instead of two, whose
        encoding and building are most of a step (docs/benchmarks.md). Returns the rows due (the decode rows, then
        the rows whose prompt ends) and their logits."""
        prof, batch = self.profile, self.batch
        n = batch.n_decode
        assert len(out.decodes) == n, "every decoding sequence runs every step"
        by_id = {r.request_id: r for r in out.decodes}
        rows = [by_id[rid] for rid in batch.ids[:n]]
        for i, c in enumerate(group):
            assert batch.ids[n + i] == c.request.request_id and batch.committed(c.request.request_id) == c.start
        fed = self._steps.decode_tokens(rows)  # the last step's draw, on the device, or the host's tokens
        lead = fed if isinstance(fed, mx.array) else None
        tokens = ([[0]] * n if lead is not None else list(fed)) + [c.request.tokens(c.start, c.end) for c in group]
        last = [i for i, c in enumerate(group) if c.last]
        fn, head = self._body_head(None)
        hidden = batch.forward_packed(fn, 0, tokens, [len(tokens)], list(range(n)) + [n + i for i in last], lead)
        prof.prefill_tokens += sum(c.end - c.start for c in group)
        prof.decode_tokens += n
        prof.one_pass_steps += 1
        return rows + [group[i].request for i in last], head(hidden) if head is not None else hidden

    def _launch_fixed(self, out: SchedulerOutput) -> Launched:
        """The step in batch-invariant mode: fixed-shape forwards, then the shared draw and commit."""
        fx = self._fixed
        assert fx is not None and len(out.decodes) == self.batch.n_decode, "every decoding sequence runs every step"
        step = fx.run(out.decodes, out.prefills,
                      lambda order: reuse.admit(self.batch, self._store, out.admissions, order))
        scored: dict[str, ScoredTokens] = {}
        if step.score_hidden:
            lg = fx.logits(step.score_hidden).astype(mx.float32)
            scored = score_positions(lg, step.score_targets, step.score_owners, self.traffic)
        return self._steps.draw_commit(out, step.due, [fx.logits(step.hidden)] if step.due else [], scored)

    def _score(self, start: int, group: list[PrefillChunk], tokens: list[list[int]], last: list[int],
               seqs: list[RowInput], scored: dict[str, ScoredTokens]) -> mx.array:
        """A prefill forward that also scores tokens (``scoring.score_chunk``)."""
        fn, head = self._body_head(seqs)
        out = self.batch.forward(fn, start, tokens, full=True)  # [rows, T, dim]
        return score_chunk(out, head, group, tokens, last, scored, self.traffic)

    def _prefill_pruned(self, start: int, group: list[PrefillChunk], tokens: list[list[int]]) -> mx.array:
        """Rows whose prompt ends in this chunk: every token but the last is run for its KV only, which lets MLX
        skip the last layer's attention output and MLP for them (as mlx-lm's prefill does: half the work of a
        2-layer model, 1/L of an L-layer one); the last tokens then run as one ``T = 1`` forward for the logits."""
        fn, _ = self._body_head(None)
        self.batch.forward(fn, start, [t[:-1] for t in tokens], full=True)
        self.traffic.launch("prefill", *self.batch.kv_arrays())
        return self._forward(start, [[t[-1]] for t in tokens], offsets=[c.end - 1 for c in group])

    def _forward_packed(self, start: int, tokens: list[list[int]], sizes: list[int], rows: list[int]) -> mx.array:
        """Last-position logits of rows ``rows`` of one packed prefill pass (``SlotBatch.forward_packed``)."""
        fn, head = self._body_head(None)
        out = self.batch.forward_packed(fn, start, tokens, sizes, rows)
        return head(out) if head is not None else out

    def _body_head(self, seqs: list[RowInput] | None) -> tuple[Any, Any]:
        """The forward's body (tokens -> hidden, or logits when there is no head) and the LM head (or None)."""
        if self._mm is not None and seqs is not None:  # per-row embeddings and positions (vision-language)
            return self._mm.body(seqs), self._mm.vlm.head
        return (self._split.body, self._split.head) if self._split else (self.model, None)

    def _forward(self, start: int, tokens: list[list[int]], rows: list[int] | None = None,
                 seqs: list[RowInput] | None = None, offsets: list[int] | None = None) -> mx.array:
        """Last-position logits of the given rows (all rows if ``rows`` is None) of a forward pass."""
        fn, head = self._body_head(seqs)
        out = self.batch.forward(fn, start, tokens, offsets=offsets)
        if rows is not None and len(rows) < len(tokens):
            out = out[mx.array(rows)] if rows else out[:0]
        return head(out) if head is not None else out


    def recover(self) -> bool:
        """An evaluation failed (``OutOfMemoryError``): forget what it may have touched. Every row goes and the
        layout starts from new buffers (its buffers are results of the failed evaluation: on Metal their contents
        are undefined, rows written or not), the prefixes gathered for copy-ins go, and the prefix store's blocks go
        too where a write to them is not confirmed complete. Returns whether they went: then the prefix index must
        forget every cached block. The core recomputes every row from its tokens (``Scheduler.preempt_for_memory``).
        One rule for every failure point, simpler than finding which rows and blocks a failed evaluation wrote: a
        failure is rare, and costs the batch its KV either way."""
        if self._mm is not None:
            for rid in self.batch.ids:
                self._mm.free(rid)
        keep_blocks = self._steps.store_confirmed
        self._steps.reset()
        self.batch.reset()
        if self._store is not None:
            self._store.reset(keep_blocks)
        return not keep_blocks

    def free(self, request_ids: list[str]) -> None:
        """Drop the KV of sequences that finished, were aborted or were preempted (their rows go when the next step
        starts: the step in flight may still read them)."""
        if self._mm is not None:
            for rid in request_ids:
                self._mm.free(rid)
        self._steps.free(request_ids)


@contextlib.contextmanager
def _out_of_memory() -> Iterator[None]:
    """A failed allocation raised inside, as ``OutOfMemoryError``."""
    try:
        yield
    except Exception as exc:
        if is_out_of_memory(exc):
            raise OutOfMemoryError(str(exc)) from exc
        raise


def _pad_groups(chunks: tuple[PrefillChunk, ...], admitted: list[str] | None, max_waste: float
                ) -> list[list[PrefillChunk]]:
    """Split prefill chunks into forward passes whose right-padding stays under ``max_waste`` of their real tokens.
    Inside a pass, rows already running come first, then the rows ``admitted`` this step in their order (the plan's:
    rows that share a prefix are neighbours there, and stay neighbours in the slots, where one write puts the prefix
    into all)."""
    ordered = sorted(chunks, key=lambda c: c.end - c.start, reverse=True)
    groups: list[list[PrefillChunk]] = []
    real = 0  # the last group's tokens
    for c in ordered:
        n = c.end - c.start
        if groups:
            g = groups[-1]
            if (g[0].end - g[0].start) * (len(g) + 1) <= (1 + max_waste) * (real + n):
                g.append(c)
                real += n
                continue
        groups.append([c])
        real = n
    if admitted:
        rank = {rid: i for i, rid in enumerate(admitted)}
        for g in groups:
            g.sort(key=lambda c: rank.get(c.request.request_id, -1))
    return groups
