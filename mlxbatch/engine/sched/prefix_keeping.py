"""Prefix keeping: which prompt blocks the prefix cache keeps when a prefill ends, and which the plan says are dead.

The keeping side of the prefix index's decisions (``sched.prefix``), on its books. A prefill that ends this step
offers the blocks of its first ``cache_tokens`` prompt tokens (the plan's retention; ``None`` without a plan offers
all), and a partial block up to exactly ``cache_tokens`` (for a scoring sequence: its context but the last token) and
at each depth a sequence that waited for its blocks this step shares it to (served to the token once admitted);
their cache blocks are allocated when the step is scheduled (``plan_stores``) and registered when it succeeded
(``commit``). A prompt forked by twins also keeps a partial block at each twin's retention point. Then newly admitted
planned sequences' blocks past their ``cache_tokens`` are evicted: no later sequence shares them (but blocks a
sequence that waited for them still needs: it is admitted after rows the plan put behind it), and a partial block
they matched when they share less than it with later rows. Rows that finish in their prefill step (one-token
answers) leave no running row to copy from, so the run reaches the plan's reuse through these blocks alone. Without
a plan, or while blocks are still referenced, eviction is the pool's LRU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlxbatch.engine.request import Request
from mlxbatch.engine.sched.blocks import NoFreeBlocks, partial_hash
from mlxbatch.engine.sched.planner import common_prefix_len


@dataclass(frozen=True)
class BlockStore:
    """After the step: the sequence's prompt blocks ``first_block ..`` are copied into these cache blocks."""

    request_id: str
    first_block: int
    block_ids: tuple[int, ...]
    hashes: tuple[int, ...]


class PrefixKeeping:
    """A base of ``PrefixIndex``: plans, commits and evicts on its books (``block_size``, ``pool``, ``_held``,
    ``_computing``, ``_waiters``, ``_pending``, ``_planned``, ``_fork_points``, ``_partials_seen``,
    ``plan_evictions``); calls its ``_chain``, ``_stored_tokens``, ``_done_computing``, ``_note_partial`` and ``_prune_partials``."""

    def plan_stores(self, finishing: Sequence[Request]) -> tuple[BlockStore, ...]:
        """Cache blocks for the prompts whose prefill ends this step (registered by ``commit`` if it succeeds).

        The blocks matched this step are released first: their copies run before this step's stores are written.
        """
        for held in self._held:
            self.pool.release(list(held.block_ids))
        self._held = []
        self._prune_partials()
        stores = []
        planned: set[int] = set()
        for r in finishing:
            full = self._stored_tokens(r) // self.block_size
            if full == 0:
                continue
            hashes = self._chain(r)[:full]
            known = 0
            for h in hashes:
                if not (self.pool.has(h) or h in planned):
                    break
                known += 1
            self.pool.match(hashes[:known])  # a cached prefix is used again: most recently used
            new = hashes[known:]
            if not new:
                continue
            try:
                ids = self.pool.allocate(len(new))
            except NoFreeBlocks:
                continue  # everything is in use: keep computing instead
            planned.update(new)
            stores.append(BlockStore(r.request_id, known, tuple(ids), tuple(new)))
        waiting = self._waiting_points(finishing)
        for r in finishing:
            points = self._partial_points(r) | waiting.get(r.request_id, set())
            for point in sorted(points):
                partial = self._partial_store(r, point, planned)
                if partial is not None:
                    stores.append(partial)
        return tuple(stores)

    def _waiting_points(self, finishing: Sequence[Request]) -> dict[str, set[int]]:
        """Where the sequences that waited this step for a planned prompt's blocks (``in_progress``) share it up to,
        when that ends mid-block and within what the prompt keeps: its partial block there serves them to the token
        once admitted, even when the prompt has finished by then (its retention point serves only the next row)."""
        B = self.block_size
        by_hash: dict[int, Request] = {}
        for r in finishing:
            if r.cache_tokens is not None:
                for h in self._computing.get(r.request_id, ()):
                    by_hash.setdefault(h, r)
        points: dict[str, set[int]] = {}
        for w, h in self._waiters:
            r = by_hash.get(h)
            if r is None:
                continue
            tokens = w.prompt_token_ids if w.score_from is None else w.prompt_token_ids[: w.score_from]
            n = min(common_prefix_len(r.prompt_token_ids, tokens), r.num_prompt_tokens)
            if n % B and n // B <= self._stored_tokens(r) // B:
                points.setdefault(r.request_id, set()).add(n)
        self._waiters = []
        return points

    def _partial_points(self, r: Request) -> set[int]:
        """Where later sequences share exactly ``r``'s prompt, when that ends mid-block: the plan's ``cache_tokens``,
        and a scoring sequence's context but its last token (its siblings compute that one: it predicts their first
        candidate token)."""
        points = {r.cache_tokens} if r.cache_tokens else set()
        points |= self._fork_points.get(r.request_id, set())
        if r.has_score_siblings:
            points.add(r.score_from - 1)  # type: ignore[operator]
        return {p for p in points if p % self.block_size and p <= r.num_prompt_tokens}

    def _partial_store(self, r: Request, point: int, planned: set[int]) -> BlockStore | None:
        """A partial block of ``r``'s prompt ending at ``point`` (registered by ``commit``), unless already cached."""
        B = self.block_size
        k = point // B
        chain = self._chain(r)
        h = partial_hash(chain[k - 1] if k else None, r.prompt_token_ids[k * B : point])
        if self.pool.has(h) or h in planned:
            return None
        try:
            (bid,) = self.pool.allocate(1)
        except NoFreeBlocks:
            return None
        planned.add(h)
        self._note_partial(chain[k - 1] if k else None, point - k * B, h)
        return BlockStore(r.request_id, k, (bid,), (h,))

    def commit(self, stores: Sequence[BlockStore], finished_prefills: Sequence[Request]) -> None:
        """The step succeeded: stored blocks join the index; then the plan's dead prefixes go (after the stores,
        which may have offered those very blocks again)."""
        for s in stores:
            for bid, h in zip(s.block_ids, s.hashes):
                self.pool.register(bid, h)
            self.pool.release(list(s.block_ids))  # cached, unreferenced: evictable when space is needed
        for r in finished_prefills:
            self._done_computing(r.request_id)
        if self._planned:  # (the spared set spans every waiting sequence's chain: built only when it is read)
            spared = {h for hashes in self._pending.values() for h in hashes}
            for r in self._planned:
                self._drop_after(r, spared)
        self._planned = []

    def abort_step(self, stores: Sequence[BlockStore]) -> None:
        """The step failed: its stores never happened."""
        for s in stores:
            self.pool.release(list(s.block_ids))
        self._planned = []

    def _drop_after(self, r: Request, spared: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        """Evict the cached blocks of ``r``'s chain past its first ``cache_tokens`` tokens (dead: the plan says no
        later sequence shares them), but those in ``spared`` (a sequence that waited for them is not admitted yet).
        Referenced blocks stay."""
        whole = r.num_prompt_tokens // self.block_size  # the last may hold the prompt's end (an identical row uses it)
        for h in self._chain(r)[:whole][self._stored_tokens(r) // self.block_size:]:
            if h in spared:
                continue
            bid = self.pool.cached_id(h)
            if bid is None:
                break
            self.plan_evictions += self.pool.evict(bid)
        seen = self._partials_seen.pop(r.request_id, None)
        # dead when the rows after ``r`` share less with it (in trie order no later row shares more with that prefix
        # than with ``r``); when they share more, the rows after them may again share exactly the partial's tokens
        if seen is not None and self._stored_tokens(r) < seen[1]:
            bid = self.pool.cached_id(seen[0])
            if bid is not None:
                self.plan_evictions += self.pool.evict(bid)
