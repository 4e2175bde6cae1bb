"""Continuous-batching scheduler: who runs this step, and how many tokens each computes.

Owns the waiting queue and the running set. Each step it gives every decoding sequence one token, then
spends the rest of the token budget on prefill chunks: first of sequences already prefilling, then of
newly admitted ones. A sequence is admitted only if the KV memory of every admitted sequence at its full
reserved length (prompt + max_tokens), costed by the runner's KV layout, fits the budget the worker
computed; ``max_num_seqs`` is a cap on top of that, never the only limit. On an out-of-memory step the
newest sequences go back to the queue (their KV is recomputed later) and the budget shrinks.
With a prefix index, each admission says where the sequence's reused KV comes from (cached blocks or a running
row) and each prompt that ends this step which cache blocks it fills: the runner only copies what the
``SchedulerOutput`` lists. Pure Python: no mlx.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence

from mlxbatch.engine.request import Request, RequestStatus
from mlxbatch.engine.sched.prefix import CachedBlocks, PrefixIndex, PrefixSource, RunningRow
from mlxbatch.engine.sched.step import Admission, KVCost, PrefillChunk, RowsCost, SchedulerConfig, SchedulerOutput

__all__ = ["Admission", "KVCost", "PrefillChunk", "RowsCost", "Scheduler", "SchedulerConfig", "SchedulerOutput"]

log = logging.getLogger(__name__)

# the statuses as module names: the loops over the running rows compare them for every row every step, and on Python
# 3.11 an Enum's class attribute is looked up through ``EnumType.__getattr__``, several times a global's cost
WAITING, PREFILLING, DECODING, FINISHED = (RequestStatus.WAITING, RequestStatus.PREFILLING, RequestStatus.DECODING,
                                           RequestStatus.FINISHED)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cost: KVCost, prefix: PrefixIndex | None = None,
                 rows_cost: RowsCost | None = None) -> None:
        self.config = config
        self._kv_cost = kv_cost
        self._rows_cost = rows_cost  # ``kv_cost`` by the rows' count and the longest (None: the layout gives none)
        self.prefix = prefix
        self._budget = config.kv_budget_bytes
        self._max_seqs = config.max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        # running sequences without a KV row: forked samples until their fork, prefills restarted after a failure
        self._rowless: set[str] = set()
        self.num_preemptions = 0
        self._calm_steps = 0  # steps since the last out-of-memory failure
        self.lookahead = 4 * config.max_num_seqs  # queue entries admission looks at per step
        self._held = False  # admission waited the last step for more free slots (``fill_slots``)

    # -- queue ---------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        assert request.status is WAITING
        self.waiting.append(request)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        ids = set(request_ids)
        gone = [r for r in (*self.waiting, *self.running) if r.request_id in ids]
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        self.running = [r for r in self.running if r.request_id not in ids]
        self._rowless -= ids
        for r in gone:
            r.abort()
            self._forget(r)
        return gone

    def _forget(self, r: Request) -> None:
        if self.prefix is not None:
            self.prefix.free(r.request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def kv_budget_bytes(self) -> int:
        return self._budget

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        if self.prefix is not None:
            self.prefix.begin_step()
        decodes: list[Request] = []
        others: list[Request] = []  # the running sequences not decoding, in running order
        prefilling: set[str] = set()  # sequences whose KV a sibling sample can still fork (prompt-only prefill in progress)
        for r in self.running:
            if r.status is DECODING:
                decodes.append(r)
                continue
            others.append(r)
            if r.status is PREFILLING and not r.output_token_ids:
                prefilling.add(r.request_id)
        budget = cfg.max_num_batched_tokens - len(decodes)
        prefills: list[PrefillChunk] = []
        for r in others:
            if r.fork_parent is not None and r.fork_parent not in prefilling:
                r.fork_parent = None  # its parent was preempted or finished: it prefills on its own
        admissions: list[Admission] = []
        for r in others:
            if budget <= 0:
                break
            if r.status is PREFILLING and r.fork_parent is None:
                if r.request_id in self._rowless:  # it prefills on its own now: a plain row
                    self._rowless.discard(r.request_id)
                    admissions.append(Admission(r))
                chunk = self._chunk(r, budget)
                prefills.append(chunk)
                budget -= chunk.end - chunk.start
        free = self._max_seqs - len(self.running)
        # a pass for a few new rows waits one step for more (``SchedulerConfig.fill_slots``)
        hold = (0 < free < cfg.fill_slots and bool(decodes) and not prefills and not self._held
                and len(self.waiting) > free)
        self._held = hold
        admits = bool(self.waiting) and free > 0 and not hold
        charge = _Charge(self._kv_cost, self._rows_cost, [r.reserved_tokens for r in self.running] if admits else [])
        # Admission in queue order, except that a sequence whose shared prefix an admitted sequence is computing
        # right now waits for that KV (computed once) while the sequences behind it go ahead: waiting at the head
        # of the queue serialised chains of nested prompts (multi-turn chats) to one admission a step.
        held: set[str] = set()  # passed over this step (their prefix is in progress), with their later samples
        i = 0
        while admits and i < len(self.waiting) and i < self.lookahead and len(self.running) < self._max_seqs:
            nxt = self.waiting[i]
            parent = nxt.fork_parent
            if parent is not None and parent in held:
                held.add(nxt.request_id)
                i += 1
                continue
            if parent is not None and parent not in prefilling:
                nxt.fork_parent = parent = None  # too late to fork: its parent's prefill is over
            twin = self.prefix.twin(nxt, prefilling) if parent is None and self.prefix is not None else None
            if twin is not None:  # the same prompt is being prefilled: fork it as another sample of it
                parent = twin.request_id
            if parent is not None:  # admitted with its parent: shares its prefill, takes no tokens of the budget
                if charge.with_row(nxt.reserved_tokens) > self._budget:
                    nxt.fork_parent = None  # no room to fork now: it prefills on its own later
                    break
                if twin is not None:
                    assert self.prefix is not None
                    self.prefix.fork(nxt, twin)
                    nxt.fork_parent = parent
                    nxt.num_cached_tokens = nxt.num_prompt_tokens
                del self.waiting[i]
                nxt.status = PREFILLING
                self.running.append(nxt)
                self._rowless.add(nxt.request_id)  # its row is a copy of its parent's, made when the parent's prefill ends
                charge.add(nxt.reserved_tokens)
                continue
            if budget <= 0:
                break
            if self.running and self.prefix is not None and self.prefix.in_progress(nxt):
                held.add(nxt.request_id)  # admitted once that KV is cached; the next in line may go first
                i += 1
                continue
            cost = charge.with_row(nxt.reserved_tokens)
            if cost > self._budget and self.running:
                break  # it waits for memory; an empty engine admits it anyway (nothing else can free)
            if cost > self._budget:
                log.warning("request %s needs %d KV bytes, more than the %d budget; running it alone",
                            nxt.request_id, cost, self._budget)
            del self.waiting[i]
            nxt.status = PREFILLING
            source = self._aligned(self.prefix.match(nxt), nxt) if self.prefix is not None else None
            if source is not None:  # the runner copies that KV in before the first chunk runs
                nxt.num_computed_tokens = source.num_tokens
                nxt.num_cached_tokens = max(nxt.num_cached_tokens, min(source.num_tokens, nxt.num_prompt_tokens))
            admissions.append(Admission(nxt, source))
            self.running.append(nxt)
            charge.add(nxt.reserved_tokens)
            prefilling.add(nxt.request_id)
            chunk = self._chunk(nxt, budget)
            prefills.append(chunk)
            budget -= chunk.end - chunk.start
        ending = {c.request.request_id: c.request for c in prefills if c.last}
        forks = tuple((ending[r.fork_parent], r) for r in self.running
                      if r.fork_parent is not None and r.fork_parent in ending) if ending else ()
        stores = self.prefix.plan_stores(list(ending.values())) if self.prefix is not None else ()
        return SchedulerOutput(tuple(decodes), tuple(prefills), forks, tuple(admissions), stores)

    def _chunk(self, r: Request, budget: int) -> PrefillChunk:
        C = self.config.invariant_slice
        if C:  # whole slices (the last one may end the prompt), even past the budget by less than one slice
            left = r.num_prompt_tokens - r.num_computed_tokens
            size = min(self.config.prefill_chunk_size, budget, left)
            size = size if size == left else min(left, max(C, size // C * C))
            end = r.num_computed_tokens + size
            return PrefillChunk(r, r.num_computed_tokens, end, end == r.num_prompt_tokens)
        # a preempted sequence recomputes the KV of its prompt and generated tokens alike
        left = r.num_tokens - r.num_computed_tokens
        size = min(self.config.prefill_chunk_size, budget, left)
        if self.config.fill_slots and left <= self.config.prefill_chunk_size // 2:
            size = left  # whole, past the budget's edge: its tail would cost a pass of its own
        end = r.num_computed_tokens + size
        return PrefillChunk(r, r.num_computed_tokens, end, end == r.num_tokens)

    def _aligned(self, source: PrefixSource | None, r: Request) -> PrefixSource | None:
        """Batch-invariant mode: reuse whole slices of the prompt only, and never all of it (its last position is
        computed by the prefill, in its own slice). The blocks left out stay held until the step's stores, as all
        matched blocks do."""
        C = self.config.invariant_slice
        if not C or source is None:
            return source
        n = min(source.num_tokens, r.num_prompt_tokens - 1) // C * C
        if n == source.num_tokens:
            return source
        if n == 0:
            return None
        if isinstance(source, CachedBlocks):
            assert self.prefix is not None and C % self.prefix.block_size == 0
            return CachedBlocks(source.block_ids[: n // self.prefix.block_size], n)
        return RunningRow(source.request_id, n)

    def finish_step(self, out: SchedulerOutput) -> list[Request]:
        """Record computed tokens after the runner ran ``out``; returns (and drops) the sequences that are done."""
        for chunk in out.prefills:
            chunk.request.num_computed_tokens = chunk.end
            if chunk.last and not chunk.request.status.finished:
                chunk.request.status = DECODING
        for parent, child in out.forks:
            self._rowless.discard(child.request_id)
            child.fork_parent = None
            child.num_computed_tokens = parent.num_prompt_tokens
            if not child.status.finished:
                child.status = DECODING
        for r in out.decodes:
            r.num_computed_tokens += 1
        if self.prefix is not None:
            self.prefix.commit(out.stores, [c.request for c in out.prefills if c.last])
        self._recover_limits()
        return self.reap()

    def reap(self) -> list[Request]:
        """Drop (and return) the running sequences that are done: finished, or drawing their last token in the step
        in flight (``Request.length_done``: the row is not fed again, so its KV can go now)."""
        keep: list[Request] = []
        done: list[Request] = []
        for r in self.running:
            if r.status is FINISHED or r.length_done:
                done.append(r)
            else:
                keep.append(r)
        if done:
            self.running = keep
            for r in done:
                self._forget(r)
        return done

    def _recover_limits(self, calm: int = 64) -> None:
        """After ``calm`` good steps since an out-of-memory failure, double the limits back towards the config's."""
        if self._max_seqs >= self.config.max_num_seqs and self._budget >= self.config.kv_budget_bytes:
            return
        self._calm_steps += 1
        if self._calm_steps >= calm:
            self._calm_steps = 0
            self._max_seqs = min(self.config.max_num_seqs, 2 * self._max_seqs)
            self._budget = min(self.config.kv_budget_bytes, 2 * self._budget)

    def preempt_for_memory(self, failed: SchedulerOutput, unread: Sequence[Request] = ()) -> list[Request]:
        """An allocation failed during ``failed``: shrink the batch and return whose KV must be dropped: everyone's.

        The newest half of the running sequences go back to the queue front; the others restart their prefill
        (prompt and generated tokens) in place. Every resident KV row is dropped, not only the failed step's
        prefills: on a GPU the row moves of a step run lazily in the same command buffer as its forward, so after a
        failure the rows may not hold what the books say (on Metal a failed command buffer is not retried).
        ``unread``: sequences that left the running set on their last token, drawn in a step whose tokens the failure
        discarded; they run again with the others.
        """
        running = {r.request_id for r in self.running}
        self.running += [r for r in unread if not r.status.finished and r.request_id not in running]
        self.num_preemptions += 1
        self._calm_steps = 0
        keep = max(1, len(self.running) // 2)
        victims = self.running[keep:]
        self.running = self.running[:keep]
        self._max_seqs = keep
        self._budget = max(1, min(self._budget, self._kv_cost([r.reserved_tokens for r in self.running])))
        for r in reversed(victims):
            self._rowless.discard(r.request_id)
            r.status = WAITING
            r.num_computed_tokens = 0
            self.waiting.appendleft(r)
        restarted = list(self.running)
        for r in restarted:
            if r.fork_parent is None:  # (a forked sample keeps waiting for its parent's prefill)
                r.status = PREFILLING
            r.num_computed_tokens = 0
            self._rowless.add(r.request_id)
        if self.prefix is not None:
            self.prefix.abort_step(failed.stores)
            for r in victims + restarted:
                self._forget(r)
        log.warning("out of memory: %d sequence(s) back to the queue, %d recompute their KV; now at most %d at once",
                    len(victims), len(restarted), self._max_seqs)
        return victims + restarted


class _Charge:
    """What admission charges for the running sequences and those it admits this step: the layout's KV cost of their
    reserved lengths, from their count and the longest where the layout gives that form (``RowsCost``: no scan of every
    running row for each row weighed), else from the lengths themselves."""

    def __init__(self, kv_cost: KVCost, rows_cost: RowsCost | None, reserved: list[int]) -> None:
        self._kv_cost, self._rows_cost = kv_cost, rows_cost
        self._reserved = reserved
        self._longest = max(reserved, default=0)

    def with_row(self, reserved: int) -> int:
        """The cost if a sequence of ``reserved`` positions joins them."""
        if self._rows_cost is not None:
            return self._rows_cost(len(self._reserved) + 1, max(self._longest, reserved))
        return self._kv_cost([*self._reserved, reserved])

    def add(self, reserved: int) -> None:
        """A sequence of ``reserved`` positions joined them."""
        self._reserved.append(reserved)
        self._longest = max(self._longest, reserved)
