"""Executes one scheduled step on the model: ``SchedulerOutput`` -> forward passes -> ``RunnerOutput``.

Owns the KV of every admitted sequence (a ``KVLayout``: fixed slots), the prefix cache's block tensors, the
structured-output matchers of constrained sequences, and the step profile. The scheduler never sees the layout: it
gets a cost function (``kv_cost``) to admit by memory, and it decides every reuse; the runner copies what the
``SchedulerOutput`` lists (new rows' prefixes, finished prompts' blocks). All decoding sequences run as one batched
forward; prefill chunks run batched too, in groups of similar length so right-padding stays small; the rows whose
next token is due are sampled together. KV positions are committed only when the whole step succeeded, so a failed
(out-of-memory) step leaves nothing half-counted. With ``batch_invariant`` the forwards run in fixed shapes instead
(``kv.fixed_forwards``: slices, key widths and row tiles fixed by each row alone); sampling and commit are shared.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import mlx.core as mx

from mlxbatch.engine.decoding.sampling import SampleRow, sample, sample_greedy
from mlxbatch.engine.decoding.structured import Matcher, SequenceGrammars
from mlxbatch.engine.kv import KVLayout, reuse
from mlxbatch.engine.kv.decode_attention import DecodeAttention
from mlxbatch.engine.kv.fixed_forwards import FixedForwards
from mlxbatch.engine.kv.invariant import InvariantSlots, check_rows, shapes_for, smallest_linear_out
from mlxbatch.engine.kv.prefix_store import PrefixStore
from mlxbatch.engine.kv.slots import SlotBatch
from mlxbatch.engine.model.own_body import OwnBody
from mlxbatch.engine.model.split import split_model
from mlxbatch.engine.model.worker import KVGeometry
from mlxbatch.engine.outputs import RunnerOutput, RunnerStats, ScoredTokens, StepProfile
from mlxbatch.engine.request import Request
from mlxbatch.engine.sched.scheduler import PrefillChunk, SchedulerOutput
from mlxbatch.engine.vision.rows import RowInput, VisionLanguageRows
from mlxbatch.errors import InvalidRequestError, OutOfMemoryError
from mlxbatch.types import TokenLogprob

log = logging.getLogger(__name__)

_OOM_MARKERS = ("out of memory", "outofmemory", "bad_alloc", "malloc", "failed to allocate")


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _OOM_MARKERS)


class ModelRunner:
    def __init__(self, model: Any, geometry: KVGeometry, prefix_blocks: int = 0, block_size: int = 16,
                 vlm: Any = None, vision_cache_bytes: int = 1 << 30, batch_invariant: bool = False) -> None:
        self.model = model
        self._split = split_model(model)
        # vision-language models: rows are fed embeddings and multimodal positions instead of token ids
        self._mm = VisionLanguageRows(vlm, vision_cache_bytes) if vlm is not None else None
        self.geometry = geometry
        dtype = getattr(mx, geometry.dtype)
        self.profile = StepProfile()
        self.traffic = self.profile.traffic  # the layout and the prefix store count their copies and syncs here
        self._fixed: FixedForwards | None = None  # batch-invariant mode: fixed-shape forwards
        slots = (InvariantSlots if batch_invariant else SlotBatch)(geometry.num_layers, self.traffic)
        slots.allocate(geometry.kv_heads, geometry.head_dim, dtype)
        if batch_invariant:
            if vlm is not None:
                raise InvalidRequestError("batch_invariant", True, "is not supported for vision-language models yet")
            assert isinstance(slots, InvariantSlots)
            body, head = (self._split.body, self._split.head) if self._split else (model, None)
            device = "cpu" if mx.default_device() == mx.cpu else "gpu"
            shapes = shapes_for(device, geometry.dtype, smallest_linear_out(model))
            failed = check_rows(body, head, shapes)
            if failed:
                hint = ("; OpenBLAS's float32 kernel for this CPU is not row-invariant: OPENBLAS_CORETYPE=Sandybridge "
                        "(x86-64) selects one that is" if device == "cpu" and geometry.dtype == "float32" else "")
                raise InvalidRequestError("batch_invariant", True, f"cannot hold on this device: {failed}{hint}")
            self._fixed = FixedForwards(slots, shapes, body, head, self.profile)
        # prefill chunks and reused prefixes start at multiples of this (0: anywhere), for the scheduler
        self.invariant_slice = self._fixed.shapes.slice_tokens if self._fixed is not None else 0
        # CUDA: prefill passes in recurring shapes (each new attention shape is a cuDNN graph build there)
        slots.shape_buckets = (vlm is None and not batch_invariant and mx.default_device() == mx.gpu
                               and not mx.metal.is_available())
        # CUDA decode steps: attention over each row's own keys, fused (MLX runs rows of different lengths unfused)
        if isinstance(self._split.body if self._split else None, OwnBody) and vlm is None and not batch_invariant:
            assert self._split is not None
            slots.decode_attention = DecodeAttention.create(self._split.body.heads, geometry.kv_heads,
                                                            geometry.head_dim, dtype)
        self.batch: KVLayout = slots
        self._store = (PrefixStore(geometry.num_layers, geometry.kv_heads, geometry.head_dim, dtype,
                                   geometry.bytes_per_token, prefix_blocks, block_size, self.traffic)
                       if prefix_blocks > 0 else None)
        # CPU: prefill's last layer only where logits are needed (an extra small forward a step; on a GPU that
        # launch costs more than 1/L of the prefill saves)
        self._prune_last = mx.default_device() == mx.cpu
        self._grammars = SequenceGrammars()  # structured outputs: constrained sequences' matchers

    def kv_cost(self, reserved_lengths: list[int]) -> int:
        if self._fixed is not None:
            return self._fixed.shapes.kv_cost_positions(reserved_lengths) * self.geometry.bytes_per_token
        return SlotBatch.cost_positions(reserved_lengths) * self.geometry.bytes_per_token

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
        return RunnerStats(self.profile.as_dict(), self.batch.nbytes,
                           self._store.nbytes if self._store is not None else 0,
                           self._mm.stats() if self._mm is not None else None)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run the step: copy-ins, forwards, sampling, commit."""
        try:
            return self._execute(out)
        except Exception as exc:
            if is_out_of_memory(exc):
                raise OutOfMemoryError(str(exc)) from exc
            raise

    def _execute(self, out: SchedulerOutput) -> RunnerOutput:
        if self._fixed is not None:
            return self._execute_fixed(out)
        prof, batch = self.profile, self.batch
        scored: dict[str, ScoredTokens] = {}
        due: list[Request] = []
        logits: list[mx.array] = []
        if out.decodes:
            t0 = time.perf_counter()
            assert len(out.decodes) == batch.n_decode, "every decoding sequence runs every step"
            by_id = {r.request_id: r for r in out.decodes}
            rows = [by_id[rid] for rid in batch.ids[: batch.n_decode]]
            seqs = [RowInput(r, r.num_tokens - 1, 1) for r in rows] if self._mm is not None else None
            step_logits = self._forward(0, [[r.last_token] for r in rows], seqs=seqs)
            if out.prefills:  # evaluated before the prefill passes write KV; a decode-only step's forward is
                self.traffic.evaluate(step_logits)  # evaluated with its sampling: one sync a step, not two
            prof.decode_s += time.perf_counter() - t0
            prof.decode_tokens += len(rows)
            due += rows
            logits.append(step_logits)
        if out.prefills:
            t0 = time.perf_counter()
            reuse.admit(batch, self._store, out.admissions)  # new rows start from the KV they reuse
            groups = _pad_groups(out.prefills)
            # arrange once, before any forward: rows move by committed length, and this step's writes
            # are not committed yet
            batch.arrange([c.request.request_id for g in groups for c in g])
            start = batch.n_decode
            for group in groups:
                for i, c in enumerate(group):
                    rid = c.request.request_id
                    assert batch.ids[start + i] == rid and batch.committed(rid) == c.start
                last = [i for i, c in enumerate(group) if c.last and c.request.score_from is None]
                tokens = [c.request.tokens(c.start, c.end) for c in group]
                seqs = [RowInput(c.request, c.start, c.end - c.start) for c in group]
                if any(c.request.score_from is not None for c in group):
                    chunk_logits = self._score(start, group, tokens, last, seqs, scored)
                elif self._prune_last and self._mm is None and len(last) == len(group) \
                        and all(len(t) > 1 for t in tokens):
                    chunk_logits = self._prefill_pruned(start, group, tokens)
                else:
                    chunk_logits = self._forward(start, tokens, rows=last, seqs=seqs)
                start += len(group)
                if last:
                    logits.append(chunk_logits)
                    due += [group[i].request for i in last]
                    self.traffic.evaluate(chunk_logits)
                else:  # no logits needed: evaluating only the KV lets MLX skip the LM head
                    self.traffic.evaluate(batch.kv_arrays())
                prof.prefill_tokens += sum(c.end - c.start for c in group)
            prof.prefill_s += time.perf_counter() - t0
        return self._sample_commit(out, due, logits, scored)

    def _execute_fixed(self, out: SchedulerOutput) -> RunnerOutput:
        """The step in batch-invariant mode: fixed-shape forwards, then the shared sampling and commit."""
        fx = self._fixed
        assert fx is not None and len(out.decodes) == self.batch.n_decode, "every decoding sequence runs every step"
        step = fx.run(out.decodes, out.prefills, lambda: reuse.admit(self.batch, self._store, out.admissions))
        scored: dict[str, ScoredTokens] = {}
        if step.score_hidden:
            lg = fx.logits(step.score_hidden).astype(mx.float32)
            scored = score_positions(lg, step.score_targets, step.score_owners, self.traffic)
        return self._sample_commit(out, step.due, [fx.logits(step.hidden)] if step.due else [], scored)

    def _sample_commit(self, out: SchedulerOutput, due: list[Request], logits: list[mx.array],
                       scored: dict[str, ScoredTokens]) -> RunnerOutput:
        """Sample every due row (forked samples from their parent's logits), then commit the step."""
        prof = self.profile
        if not due:
            self._commit(out)
            return RunnerOutput(scored=scored)
        all_logits = mx.concatenate(logits, axis=0) if len(logits) > 1 else logits[0]
        if out.forks:  # each forked sample draws its first token from its parent's last logits
            pos = {r.request_id: i for i, r in enumerate(due)}
            all_logits = mx.concatenate([all_logits, all_logits[mx.array([pos[p.request_id] for p, _ in out.forks])]])
            due += [child for _, child in out.forks]
        t0 = time.perf_counter()
        due_ids = [r.request_id for r in due]
        if not len(self._grammars) and all(r.plain_greedy for r in due):  # nothing per row to build
            tokens_out = sample_greedy(all_logits)
        else:
            rows_s = [SampleRow(r.params, r.seed, len(r.output_token_ids), r.prompt_token_ids, r.output_token_ids,
                                r.banned_ids) for r in due]
            t1 = time.perf_counter()
            constrained = self._grammars.constrain(due_ids, all_logits)
            prof.grammar_mask_s += time.perf_counter() - t1
            tokens_out = sample(constrained, rows_s, all_logits if constrained is not all_logits else None)
        self.traffic.syncs += 1  # the sampled ids are read back
        if out.decodes and not out.prefills and self._fixed is None:  # the forward ran in this evaluation
            prof.decode_s += time.perf_counter() - t0
        else:
            prof.sampling_s += time.perf_counter() - t0
        self._commit(out)
        t1 = time.perf_counter()
        self._grammars.advance(due_ids, [t.token_id for t in tokens_out])  # once the step can no longer fail
        prof.grammar_advance_s += time.perf_counter() - t1
        done = frozenset(rid for rid in due_ids if self._grammars.done(rid))
        return RunnerOutput({r.request_id: t for r, t in zip(due, tokens_out)}, scored, done)

    def _score(self, start: int, group: list[PrefillChunk], tokens: list[list[int]], last: list[int],
               seqs: list[RowInput], scored: dict[str, ScoredTokens]) -> mx.array:
        """A prefill forward that also scores tokens (log-probability and greedy match).

        A scoring row's ``score_targets`` pair a position with the token its logits are asked about (position ``p``
        predicts what follows it: the continuation's next prompt token, or each one-token candidate at the
        context's last position); the pairs inside this chunk are scored, each position's hidden state gathered
        once. Results go to ``scored``; returns the last-position logits of ``last`` rows.
        """
        fn, head = self._body_head(seqs)
        out = self.batch.forward(fn, start, tokens, full=True)  # [rows, T, dim]
        at: dict[tuple[int, int], int] = {}  # (row, column) -> its index among the gathered positions
        picks, targets, owners = [], [], []
        for i, c in enumerate(group):
            r = c.request
            if r.score_from is None:
                continue
            for p, t in r.score_targets():
                if c.start <= p < c.end:
                    picks.append(at.setdefault((i, p - c.start), len(at)))
                    targets.append(t)
                    owners.append(r.request_id)
        if picks:
            rows, cols = zip(*at)
            h = out[mx.array(rows), mx.array(cols)]
            lg = (head(h) if head is not None else h).astype(mx.float32)
            if len(at) < len(picks):
                lg = lg[mx.array(picks)]
            scored.update(score_positions(lg, targets, owners, self.traffic))
        if not last:
            return out[:0, 0]
        h_last = out[mx.array(last), mx.array([len(tokens[i]) - 1 for i in last])]
        return head(h_last) if head is not None else h_last

    def _prefill_pruned(self, start: int, group: list[PrefillChunk], tokens: list[list[int]]) -> mx.array:
        """Rows whose prompt ends in this chunk: every token but the last is run for its KV only, which lets MLX
        skip the last layer's attention output and MLP for them (as mlx-lm's prefill does: half the work of a
        2-layer model, 1/L of an L-layer one); the last tokens then run as one ``T = 1`` forward for the logits."""
        fn, _ = self._body_head(None)
        self.batch.forward(fn, start, [t[:-1] for t in tokens], full=True)
        self.traffic.evaluate(self.batch.kv_arrays())
        return self._forward(start, [[t[-1]] for t in tokens], offsets=[c.end - 1 for c in group])

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

    def _commit(self, out: SchedulerOutput) -> None:
        """The step succeeded: its KV positions count, finished prompts' blocks go to the prefix store, and
        finished prefills join the decode rows."""
        for r in out.decodes:
            self.batch.advance(r.request_id, 1)
        for c in out.prefills:
            self.batch.advance(c.request.request_id, c.end - c.start)
        if out.stores:
            assert self._store is not None
            reuse.store_blocks(self.batch, self._store, out.stores)  # before any row moves again
        for parent, child in out.forks:  # n > 1: the prompt was prefilled once, each sample gets a copy
            self.batch.add(child.request_id, self.batch.extract(parent.request_id), parent.num_prompt_tokens)
        # only after every length is committed (promotion moves rows by length), and in row order: a finished
        # prefill row already at the head of the prefill region joins the decode rows without moving
        done = {c.request.request_id for c in out.prefills if c.last} | {c.request_id for _, c in out.forks}
        self.batch.promote_many([rid for rid in self.batch.ids[self.batch.n_decode :] if rid in done])

    def free(self, request_ids: list[str]) -> None:
        """Drop the KV of sequences that finished, were aborted or were preempted."""
        if self._mm is not None:
            for rid in request_ids:
                self._mm.free(rid)
        self.batch.remove_many(request_ids)
        if request_ids:
            self.batch.shrink()


def score_positions(lg: mx.array, targets: list[int], owners: list[str], traffic: Any) -> dict[str, ScoredTokens]:
    """Each scored position's log-probability of its target and whether the target is the argmax, per owner."""
    tgt = mx.array(targets, dtype=mx.int32)
    chosen = mx.take_along_axis(lg - mx.logsumexp(lg, axis=-1, keepdims=True), tgt[:, None], axis=-1)[:, 0]
    greedy = mx.argmax(lg, axis=-1) == tgt
    traffic.evaluate(chosen, greedy)
    per_row: dict[str, tuple[list[TokenLogprob], list[bool]]] = {}
    for rid, t, lp, g in zip(owners, targets, chosen.tolist(), greedy.tolist()):
        lps, flags = per_row.setdefault(rid, ([], []))
        lps.append(TokenLogprob(t, lp))
        flags.append(bool(g))
    return {rid: ScoredTokens(tuple(lps), tuple(fl)) for rid, (lps, fl) in per_row.items()}


def _pad_groups(chunks: tuple[PrefillChunk, ...], max_waste: float = 0.25) -> list[list[PrefillChunk]]:
    """Split prefill chunks into forward passes whose right-padding stays under ``max_waste``."""
    ordered = sorted(chunks, key=lambda c: c.end - c.start, reverse=True)
    groups: list[list[PrefillChunk]] = []
    for c in ordered:
        if groups:
            g = groups[-1]
            width = g[0].end - g[0].start
            real = sum(x.end - x.start for x in g) + (c.end - c.start)
            if width * (len(g) + 1) <= (1 + max_waste) * real:
                g.append(c)
                continue
        groups.append([c])
    return groups
