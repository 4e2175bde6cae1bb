"""Prefix keeping: which prompt blocks the prefix cache keeps when a prefill ends, and which the plan says are dead.

The keeping side of the prefix index's decisions (``sched.prefix``: its ``PrefixKeeping``), on the books they share
(``sched.prefix_books``, the block pool). A prefill that ends this step
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
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from mlxbatch.engine.request import Request
from mlxbatch.engine.sched.blocks import BlockPool, NoFreeBlocks, partial_hash
from mlxbatch.engine.sched.planner import common_prefix_len
from mlxbatch.engine.sched.prefix_books import BlockChains, InFlight, PartialBlocks


@dataclass(frozen=True)
class BlockStore:
    """After the step: the sequence's prompt blocks ``first_block ..`` are copied into these cache blocks."""

    request_id: str
    first_block: int
    block_ids: tuple[int, ...]
    hashes: tuple[int, ...]


def stored_tokens(request: Request) -> int:
    """Prompt tokens whose full blocks this sequence offers the cache once its prefill is done (and keeps past its
    admission): the plan's retention, and for a scoring sequence its context too (its siblings need it)."""
    n = request.num_prompt_tokens
    if request.cache_tokens is None:
        return n
    keep = max(request.cache_tokens, request.score_from - 1) if request.has_score_siblings else request.cache_tokens
    return min(n, keep)


class PrefixKeeping:
    """Plans, commits and evicts the prefix cache's blocks. Owns what a step matched and admitted with a plan (until
    its stores are planned and committed), the retention points of prompts forked by twins, the partial blocks
    sequences matched, and the count of blocks the plan evicted."""

    def __init__(self, pool: BlockPool, chains: BlockChains, partials: PartialBlocks, inflight: InFlight) -> None:
        self.block_size = pool.block_size
        self.pool = pool
        self._chains = chains
        self._partials = partials
        self._inflight = inflight
        self._planned: list[Request] = []  # admitted this step with a plan retention to apply
        self._held: list[tuple[int, ...]] = []  # blocks matched this step, retained until its stores are allocated
        # a prompt forked by twins -> the retention points its twins had besides its own ``cache_tokens`` (a twin's
        # next row shares less with it): the prompt keeps a partial block at each, as the twin would have
        self._fork_points: dict[str, set[int]] = {}
        self._partials_seen: dict[str, tuple[int, int]] = {}  # request id -> (hash, tokens) of the partial it matched
        self.plan_evictions = 0  # blocks dropped because the plan said nobody needs them any more

    # -- what admissions leave for the keeping ------------------------------------------------------
    def admitted(self, request: Request) -> None:
        """``request`` was admitted this step (with a plan: its blocks past its retention go when the step commits)."""
        if request.cache_tokens is not None:
            self._planned.append(request)

    def hold(self, block_ids: tuple[int, ...]) -> None:
        """Cache blocks an admission copies this step: retained until the step's stores are allocated."""
        self._held.append(block_ids)

    def matched_partial(self, request_id: str, h: int, tokens: int) -> None:
        """The sequence matched the partial block ``h`` (its prefix ends at ``tokens``)."""
        self._partials_seen[request_id] = (h, tokens)

    def fork_points(self, parent_id: str, points: tuple[int, ...] | None) -> None:
        """A twin forked ``parent_id``'s prompt: it keeps a partial block at these retention points too (None: the
        twin has no plan, so neither has the prompt: forget them)."""
        if points is None:
            self._fork_points.pop(parent_id, None)
        else:
            self._fork_points.setdefault(parent_id, set()).update(points)

    def forget(self, request_id: str) -> None:
        self._fork_points.pop(request_id, None)
        self._partials_seen.pop(request_id, None)

    # -- a step's stores ------------------------------------------------------------------------------
    def plan_stores(self, finishing: Sequence[Request]) -> tuple[BlockStore, ...]:
        """Cache blocks for the prompts whose prefill ends this step (registered by ``commit`` if it succeeds).

        The blocks matched this step are released first: their copies run before this step's stores are written.
        """
        for held in self._held:
            self.pool.release(list(held))
        self._held = []
        self._partials.prune(self.pool.has, self.pool.num_blocks)
        stores = []
        planned: set[int] = set()
        for r in finishing:
            full = stored_tokens(r) // self.block_size
            if full == 0:
                continue
            hashes = self._chains.chain(r)[:full]
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
                for h in self._inflight.hashes_of(r.request_id):
                    by_hash.setdefault(h, r)
        points: dict[str, set[int]] = {}
        for w, h in self._inflight.take_waiters():
            r = by_hash.get(h)
            if r is None:
                continue
            tokens = w.prompt_token_ids if w.score_from is None else w.prompt_token_ids[: w.score_from]
            n = min(common_prefix_len(r.prompt_token_ids, tokens), r.num_prompt_tokens)
            if n % B and n // B <= stored_tokens(r) // B:
                points.setdefault(r.request_id, set()).add(n)
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
        chain = self._chains.chain(r)
        prev, tokens = chain[k - 1] if k else None, r.prompt_token_ids[k * B : point]
        h = self._partials.find(prev, tokens)  # noted if stored before (rows of a job keep their instruction's)
        if h is None:
            h = partial_hash(prev, tokens)
        if self.pool.has(h) or h in planned:
            return None
        try:
            (bid,) = self.pool.allocate(1)
        except NoFreeBlocks:
            return None
        planned.add(h)
        self._partials.note(prev, tokens, h)
        return BlockStore(r.request_id, k, (bid,), (h,))

    def commit(self, stores: Sequence[BlockStore], finished_prefills: Sequence[Request]) -> None:
        """The step succeeded: stored blocks join the index; then the plan's dead prefixes go (after the stores,
        which may have offered those very blocks again)."""
        for s in stores:
            for bid, h in zip(s.block_ids, s.hashes):
                self.pool.register(bid, h)
            self.pool.release(list(s.block_ids))  # cached, unreferenced: evictable when space is needed
        for r in finished_prefills:
            self._inflight.done(r.request_id)
        if self._planned:
            spared = self._inflight.spared()
            for r in self._planned:
                self._drop_after(r, spared)
        self._planned = []

    def abort_step(self, stores: Sequence[BlockStore]) -> None:
        """The step failed: its stores never happened."""
        for s in stores:
            self.pool.release(list(s.block_ids))
        self._planned = []

    def _drop_after(self, r: Request, spared: AbstractSet[int] = frozenset()) -> None:
        """Evict the cached blocks of ``r``'s chain past its first ``cache_tokens`` tokens (dead: the plan says no
        later sequence shares them), but those in ``spared`` (a sequence that waited for them is not admitted yet).
        Referenced blocks stay."""
        whole = r.num_prompt_tokens // self.block_size  # the last may hold the prompt's end (an identical row uses it)
        for h in self._chains.chain(r)[:whole][stored_tokens(r) // self.block_size:]:
            if h in spared:
                continue
            bid = self.pool.cached_id(h)
            if bid is None:
                break
            self.plan_evictions += self.pool.evict(bid)
        seen = self._partials_seen.pop(r.request_id, None)
        # dead when the rows after ``r`` share less with it (in trie order no later row shares more with that prefix
        # than with ``r``); when they share more, the rows after them may again share exactly the partial's tokens
        if seen is not None and stored_tokens(r) < seen[1]:
            bid = self.pool.cached_id(seen[0])
            if bid is not None:
                self.plan_evictions += self.pool.evict(bid)
