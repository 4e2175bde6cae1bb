"""Executes one scheduled step on the model: SchedulerOutput -> forward passes -> sampled tokens.

Owns the KV of every admitted sequence (through its ``SlotBatch``). The scheduler never sees this layout;
it only gets a cost function (``kv_cost``) to admit by memory. All decoding sequences run as one batched
forward; prefill chunks run batched too, in groups of similar length so right-padding stays small; the rows
whose next token is due are sampled together. KV positions are committed only when the whole step
succeeded, so a failed (out-of-memory) step leaves nothing half-counted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlxbatch.engine.decoding.sampling import SampledToken, SampleRow, sample
from mlxbatch.engine.decoding.structured import SequenceGrammars
from mlxbatch.engine.kv.prefix_cache import PrefixCache
from mlxbatch.engine.kv.prefix_reuse import PrefixReuse
from mlxbatch.engine.kv.slots import SlotBatch
from mlxbatch.engine.model.worker import KVGeometry
from mlxbatch.engine.outputs import Traffic
from mlxbatch.engine.request import Request
from mlxbatch.engine.sched.scheduler import PrefillChunk, SchedulerOutput
from mlxbatch.engine.vision.rows import RowInput, VisionLanguageRows
from mlxbatch.errors import OutOfMemoryError
from mlxbatch.types import TokenLogprob

log = logging.getLogger(__name__)

_OOM_MARKERS = ("out of memory", "outofmemory", "bad_alloc", "malloc", "failed to allocate")


@dataclass
class StepProfile:
    """Where step time goes, summed over the engine's life (seconds), and what the steps moved (``traffic``)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    sampling_s: float = 0.0
    total_s: float = 0.0
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    traffic: Traffic = field(default_factory=Traffic)

    @property
    def host_s(self) -> float:
        """Scheduling, bookkeeping, detokenization: step time not spent in the model or sampler."""
        return max(0.0, self.total_s - self.prefill_s - self.decode_s - self.sampling_s)

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps, "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
            "sampling_s": round(self.sampling_s, 4), "host_s": round(self.host_s, 4),
            "total_s": round(self.total_s, 4), "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens, **self.traffic.as_dict(),
        }


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _OOM_MARKERS)


@dataclass(frozen=True)
class SplitModel:
    """A model seen as body (tokens -> hidden states) and head (hidden -> logits).

    Prefill needs logits at each row's last position only; running the LM head on the last positions
    alone saves its cost (~30% of a 0.5B model's prefill FLOPs) and the [rows, T, vocab] logits buffer.
    """

    body: Any
    head: Any


def split_model(model: Any) -> SplitModel | None:
    """The body/head split of an mlx-lm model, if calling them in turn equals calling the model."""
    body = getattr(model, "model", None)
    if body is None or not callable(body):
        return None
    head = getattr(model, "lm_head", None)
    if head is None:
        embed = getattr(body, "embed_tokens", None)
        head = getattr(embed, "as_linear", None)
    if head is None:
        return None
    probe = mx.array([[1, 2, 3, 4]], dtype=mx.int32)
    try:
        full = model(probe)
        split = head(body(probe))
        same = full.shape == split.shape and mx.allclose(full, split, atol=1e-4, rtol=1e-3).item()
    except Exception:  # an architecture whose body takes other arguments: use the whole model
        return None
    return SplitModel(body, head) if same else None


class ModelRunner:
    def __init__(self, model: Any, geometry: KVGeometry, prefix_cache_bytes: int = 0, vlm: Any = None,
                 vision_cache_bytes: int = 1 << 30) -> None:
        self.model = model
        self._split = split_model(model)
        # vision-language models: rows are fed embeddings and multimodal positions instead of token ids
        self.mm = VisionLanguageRows(vlm, vision_cache_bytes) if vlm is not None else None
        self.geometry = geometry
        dtype = getattr(mx, geometry.dtype)
        self.profile = StepProfile()
        self.traffic = self.profile.traffic  # the slot batch and the prefix cache count their copies and syncs here
        self.batch = SlotBatch(geometry.num_layers, self.traffic)
        self.batch.allocate(geometry.kv_heads, geometry.head_dim, dtype)
        self.prefix = (PrefixCache(geometry.num_layers, geometry.kv_heads, geometry.head_dim, dtype,
                                   geometry.bytes_per_token, prefix_cache_bytes, traffic=self.traffic)
                       if prefix_cache_bytes > 0 else None)
        self.reuse = PrefixReuse(self.prefix, self.batch) if self.prefix is not None else None
        # scoring rows of the last step: request id -> (token log-probabilities, greedy flags), in token order
        self.scored: dict[str, tuple[list[TokenLogprob], list[bool]]] = {}
        # CPU: prefill's last layer only where logits are needed (an extra small forward a step; on a GPU that
        # launch costs more than 1/L of the prefill saves)
        self._prune_last = mx.default_device() == mx.cpu
        self.grammars = SequenceGrammars()  # structured outputs: constrained sequences' matchers (core sets them)

    def lookup_prefix(self, request: Request) -> int:
        """Tokens of ``request`` whose KV can be reused (the scheduler starts its prefill there)."""
        return self.reuse.lookup(request) if self.reuse is not None else 0

    def prefix_in_progress(self, request: Request) -> bool:
        """Whether an admitted sequence is computing the next part of ``request``'s prefix right now."""
        return self.reuse is not None and self.reuse.in_progress(request)

    def kv_cost(self, reserved_lengths: list[int]) -> int:
        return SlotBatch.cost_positions(reserved_lengths) * self.geometry.bytes_per_token

    @property
    def kv_bytes(self) -> int:
        return self.batch.nbytes

    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """Run the step; returns the next token of every sequence whose next token became due."""
        try:
            return self._execute(out)
        except Exception as exc:
            if is_out_of_memory(exc):
                raise OutOfMemoryError(str(exc)) from exc
            raise

    def _execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        prof, batch = self.profile, self.batch
        self.scored = {}
        due: list[Request] = []
        logits: list[mx.array] = []
        if out.decodes:
            t0 = time.perf_counter()
            assert len(out.decodes) == batch.n_decode, "every decoding sequence runs every step"
            by_id = {r.request_id: r for r in out.decodes}
            rows = [by_id[rid] for rid in batch.ids[: batch.n_decode]]
            step_logits = self._forward(0, [[r.last_token] for r in rows],
                                        seqs=[RowInput(r, r.num_tokens - 1, 1) for r in rows])
            self.traffic.evaluate(step_logits)
            prof.decode_s += time.perf_counter() - t0
            prof.decode_tokens += len(rows)
            due += rows
            logits.append(step_logits)
        if out.prefills:
            t0 = time.perf_counter()
            new = [c.request for c in out.prefills if c.request.request_id not in batch]
            if self.reuse is not None:
                self.reuse.admit(new)  # new rows start from the KV they reuse
            else:
                for r in new:
                    batch.add(r.request_id)
            groups = _pad_groups(out.prefills)
            # arrange once, before any forward: rows move by committed length, and this step's writes
            # are not committed yet
            batch.arrange([c.request.request_id for g in groups for c in g])
            start = batch.n_decode
            for group in groups:
                for i, c in enumerate(group):
                    assert batch.ids[start + i] == c.request.request_id and batch.lengths[start + i] == c.start
                last = [i for i, c in enumerate(group) if c.last and c.request.score_from is None]
                tokens = [c.request.tokens(c.start, c.end) for c in group]
                seqs = [RowInput(c.request, c.start, c.end - c.start) for c in group]
                if any(c.request.score_from is not None for c in group):
                    chunk_logits = self._score(start, group, tokens, last, seqs)
                elif self._prune_last and self.mm is None and len(last) == len(group) \
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
        if not due:
            self._commit(out)
            return {}
        all_logits = mx.concatenate(logits, axis=0) if len(logits) > 1 else logits[0]
        if out.forks:  # each forked sample draws its first token from its parent's last logits
            pos = {r.request_id: i for i, r in enumerate(due)}
            all_logits = mx.concatenate([all_logits, all_logits[mx.array([pos[p.request_id] for p, _ in out.forks])]])
            due += [child for _, child in out.forks]
        t0 = time.perf_counter()
        rows_s = [
            SampleRow(r.params, r.seed, len(r.output_token_ids), r.prompt_token_ids, r.output_token_ids,
                      r.banned_ids)
            for r in due
        ]
        due_ids = [r.request_id for r in due]
        tokens_out = sample(self.grammars.constrain(due_ids, all_logits), rows_s)
        self.traffic.syncs += 1  # the sampled ids are read back
        prof.sampling_s += time.perf_counter() - t0
        self._commit(out)
        self.grammars.advance(due_ids, [t.token_id for t in tokens_out])  # once the step can no longer fail
        return {r.request_id: t for r, t in zip(due, tokens_out)}

    def _score(self, start: int, group: list[PrefillChunk], tokens: list[list[int]], last: list[int],
               seqs: list[RowInput]) -> mx.array:
        """A prefill forward that also scores continuation tokens (log-probability and greedy match).

        For a scoring row, position ``p`` of its chunk predicts prompt token ``p + 1``; every position from the
        one before the continuation up to the last but one is scored (a target in the next chunk is known: it
        is in the prompt). Results go to ``self.scored``; returns the last-position logits of ``last`` rows.
        """
        fn, head = self._body_head(seqs)
        out = self.batch.forward(fn, start, tokens, full=True)  # [rows, T, dim]
        rows, cols, targets, owners = [], [], [], []
        for i, c in enumerate(group):
            r = c.request
            if r.score_from is None:
                continue
            for p in range(max(c.start, r.score_from - 1), min(c.end, r.num_prompt_tokens - 1)):
                rows.append(i)
                cols.append(p - c.start)
                targets.append(r.prompt_token_ids[p + 1])
                owners.append(r)
        if rows:
            h = out[mx.array(rows), mx.array(cols)]
            lg = (head(h) if head is not None else h).astype(mx.float32)
            tgt = mx.array(targets, dtype=mx.int32)
            chosen = mx.take_along_axis(lg - mx.logsumexp(lg, axis=-1, keepdims=True), tgt[:, None], axis=-1)[:, 0]
            greedy = mx.argmax(lg, axis=-1) == tgt
            self.traffic.evaluate(chosen, greedy)
            for r, t, lp, g in zip(owners, targets, chosen.tolist(), greedy.tolist()):
                scores, flags = self.scored.setdefault(r.request_id, ([], []))
                scores.append(TokenLogprob(t, lp))
                flags.append(bool(g))
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
        if self.mm is not None and seqs is not None:  # per-row embeddings and positions (vision-language)
            return self.mm.body(seqs), self.mm.vlm.head
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
        """The step succeeded: its KV positions count, and finished prefills join the decode rows."""
        for r in out.decodes:
            self.batch.advance(r.request_id, 1)
        for c in out.prefills:
            self.batch.advance(c.request.request_id, c.end - c.start)
        if self.reuse is not None:  # finished prompts offer their blocks; the plan's dead prefixes go
            self.reuse.commit([c.request for c in out.prefills if c.last])
        for parent, child in out.forks:  # n > 1: the prompt was prefilled once, each sample gets a copy
            self.batch.add(child.request_id, self.batch.extract(parent.request_id), parent.num_prompt_tokens)
        # only after every length is committed (promotion moves rows by length), and in row order: a finished
        # prefill row already at the head of the prefill region joins the decode rows without moving
        done = {c.request.request_id for c in out.prefills if c.last} | {c.request_id for _, c in out.forks}
        for rid in [rid for rid in self.batch.ids[self.batch.n_decode :] if rid in done]:
            self.batch.promote(rid)

    def free(self, request_ids: list[str]) -> None:
        """Drop the KV of sequences that finished, were aborted or were preempted."""
        for rid in request_ids:
            if self.reuse is not None:
                self.reuse.free(rid)
            if self.mm is not None:
                self.mm.free(rid)
        self.batch.remove_many(request_ids)
        if request_ids:
            self.batch.shrink()


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
