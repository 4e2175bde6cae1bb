"""Prefix reuse decisions: which KV a new sequence starts from, and which prompt blocks the cache keeps.

Owns the prefix cache's books (a ``BlockPool``: block ids, ref counts, the chained-hash index, LRU) and every
decision about them, on the scheduler's side of the step (pure Python: the runner only copies what is decided).
- **At admission** (``match``), two sources; the longer wins. Cached blocks: whole 16-token blocks of earlier
  prompts, keyed by chained hashes (image hashes at image positions), then possibly one *partial* block: the tokens
  of a shared prefix past its last whole block (a ~50-token system prompt ends mid-block), kept for the rows the plan
  says share exactly that much, so reuse from the cache goes to the token too (a block holding a prompt's end serves
  a later identical prompt all but its last token). A running row: a sequence admitted in an earlier step and still
  running that shares more with the new prompt than the cache holds: its KV is copied to the token.
- **Twins** (``twin`` / ``fork``): a prompt identical to one an admitted sequence is prefilling now forks that
  sequence's KV and last logits when its prefill ends, as another sample of it (nothing computed).
- **Waiting** (``in_progress``): a sequence whose next prefix blocks an admitted sequence is computing right now can
  wait a step or two, so the shared prefix is computed once.
- **Keeping** (``plan_stores`` / ``commit``: its ``PrefixKeeping``, ``sched.prefix_keeping``): which blocks of a
  prompt whose prefill ends the cache keeps (the plan's retention, partial blocks where later sequences share a prompt
  to mid-block), and which blocks the plan says no later sequence shares (evicted).
Its books are small classes it composes (``sched.prefix_books``): each sequence's block hashes, computed once (the
blocks it shares with the last one hashed: taken from that one's), the partial blocks stored, the prefixes being
computed. Does not own the KV tensors (the runner's prefix store).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from mlxbatch.engine.request import Request, RequestStatus
from mlxbatch.engine.sched.blocks import BLOCK_SIZE, BlockPool
from mlxbatch.engine.sched.planner import common_prefix_len
from mlxbatch.engine.sched.prefix_books import BlockChains, InFlight, PartialBlocks
from mlxbatch.engine.sched.prefix_keeping import BlockStore, PrefixKeeping, stored_tokens

__all__ = ["LIVE_SOURCES", "BlockStore", "CachedBlocks", "PrefixIndex", "PrefixSource", "RunningRow"]

LIVE_SOURCES = 32  # recently admitted sequences tried as running-row prefix sources
_LIVE = (RequestStatus.PREFILLING, RequestStatus.DECODING)  # a running-row source's statuses (it holds KV)


@dataclass(frozen=True)
class CachedBlocks:
    """Copy these cache blocks into the new row's first ``len(block_ids) * block_size`` positions."""

    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class RunningRow:
    """Copy the first ``num_tokens`` positions of a running sequence's row (committed KV) into the new row."""

    request_id: str
    num_tokens: int


PrefixSource = CachedBlocks | RunningRow


class PrefixIndex:
    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE, bytes_per_block: int = 0,
                 live_margin: int = 1) -> None:
        self.block_size = block_size
        # a running row is copied from only when it gives this many tokens more than the cache (the engine's reuse
        # step: where prefill passes are packed, a copy for a few tokens costs more than computing them)
        self.live_margin = max(1, live_margin)
        self.pool = BlockPool(max(1, num_blocks), block_size, bytes_per_block)
        self._recent: collections.deque[Request] = collections.deque(maxlen=LIVE_SOURCES)
        self._admitted_at: dict[str, int] = {}  # request id -> the step it was admitted in
        self._step = 0
        self._admitted_now = 0  # sequences admitted this step: the last ones in ``_recent``
        self.chains = BlockChains(block_size)  # each sequence's block hashes
        self.partials = PartialBlocks()  # the partial blocks stored after each full block
        self._inflight = InFlight()  # the blocks admitted sequences are computing now, and who waits for them
        self.keeping = PrefixKeeping(self.pool, self.chains, self.partials, self._inflight)
        # a whole prompt -> the admitted sequence prefilling it last (text, not scoring): a twin forks its KV
        self._prompts: dict[tuple[int, int, tuple[int, ...]], Request] = {}
        self._prompt_keys: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        self.lookups = 0
        self.tokens_reused = 0  # prompt tokens whose KV came from the cache
        self.live_tokens_reused = 0  # ... or from a running row

    @property
    def plan_evictions(self) -> int:
        """Blocks dropped because the plan said nobody needs them any more."""
        return self.keeping.plan_evictions

    # -- keeping (``PrefixKeeping``) -----------------------------------------------------------------
    def plan_stores(self, finishing: Sequence[Request]) -> tuple[BlockStore, ...]:
        """Cache blocks for the prompts whose prefill ends this step (registered by ``commit`` if it succeeds)."""
        return self.keeping.plan_stores(finishing)

    def commit(self, stores: Sequence[BlockStore], finished_prefills: Sequence[Request]) -> None:
        """The step succeeded: stored blocks join the index; then the plan's dead prefixes go."""
        self.keeping.commit(stores, finished_prefills)

    def abort_step(self, stores: Sequence[BlockStore]) -> None:
        """The step failed: its stores never happened."""
        self.keeping.abort_step(stores)

    def drop_cached(self) -> None:
        """Forget every cached block: a failed evaluation wrote the store, whose blocks are all undefined now (the
        runner's store starts empty). Called after every row was preempted: no block is referenced."""
        for bid in range(self.pool.num_blocks):
            if self.pool.block(bid).block_hash is not None:
                evicted = self.pool.evict(bid)
                assert evicted, f"block {bid} is still referenced"

    # -- admission ------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self._step += 1
        self._admitted_now = 0
        self._inflight.new_step()

    def match(self, request: Request) -> PrefixSource | None:
        """Where ``request``'s reused KV comes from (None: nothing to reuse); counts it as admitted this step."""
        tokens = request.tokens(0, request.num_tokens)
        chain = self.chains.chain(request)
        # a scoring sequence must compute the position before its continuation (it predicts the first token)
        cached = self._cached(tokens if request.score_from is None else tokens[: request.score_from], chain,
                              request.request_id, to_the_end=not request.media)
        usable = (len(tokens) - 1) // self.block_size
        hashes = chain[: min(usable, stored_tokens(request) // self.block_size)]
        self._inflight.start(request.request_id, hashes)  # (it waits no more)
        live = self._running_row(request, tokens, cached.num_tokens if cached is not None else 0)
        self._recent.append(request)
        self._admitted_now += 1
        self._admitted_at[request.request_id] = self._step
        if self._forkable(request):
            self._prompts[self._prompt_key(request)] = request
        self.keeping.admitted(request)
        if live is not None:  # a running sequence holds more of this prefix than the cache's whole blocks
            if cached is not None:
                self.pool.release(list(cached.block_ids))
                self.tokens_reused -= cached.num_tokens
            self.live_tokens_reused += live.num_tokens
            return live
        if cached is not None:
            self.keeping.hold(cached.block_ids)
        return cached

    def _cached(self, tokens: Sequence[int], chain: list[int], rid: str, to_the_end: bool = True) -> CachedBlocks | None:
        """Whole cached blocks of ``tokens``, then the longest cached block after them: a partial one, or (text rows:
        ``to_the_end``) one that also holds ``tokens``' last position (at least one token is always left to compute: a
        block holding all of ``tokens``, as a row identical to an earlier one finds it, gives all but the last). A row
        with images takes no block past its last reusable token (its picture is encoded as before)."""
        B = self.block_size
        limit = len(tokens) - 1
        if limit <= 0:
            return None
        self.lookups += 1
        ids = self.pool.match(chain[: limit // B])
        n = len(ids) * B
        prev = chain[len(ids) - 1] if ids else None
        if to_the_end and len(ids) == limit // B < len(chain) and self.pool.has(chain[len(ids)]):
            ids += self.pool.match([chain[len(ids)]])  # the prompt ends in this block: its last token is computed
            n = limit
        elif n < limit and (stored := self.partials.after(prev)) is not None:
            most = min(B - 1, (len(tokens) if to_the_end else limit) - n)
            for r in sorted((r for r in stored if r <= most), reverse=True):
                h = self.partials.find(prev, tokens[n : n + r])
                if h is not None and self.pool.has(h):
                    ids += self.pool.match([h])
                    self.keeping.matched_partial(rid, h, n + r)
                    n = min(n + r, limit)
                    break
        if not ids:
            return None
        self.pool.retain(ids)
        self.tokens_reused += n
        return CachedBlocks(tuple(ids), n)

    def _running_row(self, request: Request, tokens: list[int], at_least: int) -> RunningRow | None:
        """A sequence admitted in an earlier step and still running whose committed KV shares more than
        ``at_least`` leading tokens with ``request`` (by ``live_margin`` or more), and at least a block's worth (a
        copy of a few tokens out of a running row's buffers costs more than computing them). Rows with images are left out: their placeholder
        tokens do not say which picture they stand for."""
        if request.media:
            return None
        limit = len(tokens) - 1 if request.score_from is None else request.score_from - 1
        best: RunningRow | None = None
        k = max(at_least + self.live_margin - 1, self.block_size - 1)
        if k >= limit:
            return None
        # the sequences admitted this step (the last ones) are not visited: their rows are not filled before this
        # step's copies (in a wave of admissions they are most of ``_recent``)
        for src in itertools.islice(self._recent, max(0, len(self._recent) - self._admitted_now)):
            # to be taken, ``src`` must share token k (and all before it): one comparison rejects most rows
            # before the whole prefix is compared (rows of one job share their instruction, not what follows it)
            ids = src.prompt_token_ids
            if len(ids) <= k or ids[k] != tokens[k] or ids[0] != tokens[0] or src.num_computed_tokens <= k:
                continue
            if src.status not in _LIVE or src.media:
                continue
            if self._admitted_at.get(src.request_id, self._step) >= self._step:
                continue  # admitted again this step (an earlier entry of it), or freed: no row to copy from now
            n = min(common_prefix_len(tokens, ids), src.num_computed_tokens, limit)
            if n > k:
                best = RunningRow(src.request_id, n)
                k = n
                if k >= limit:
                    break
        return best

    def twin(self, request: Request, prefilling: set[str]) -> Request | None:
        """An admitted sequence prefilling exactly ``request``'s prompt now (ids in ``prefilling``), whose KV and last
        logits ``request`` can fork when that prefill ends instead of computing anything (a row identical to an
        earlier one: even reuse to the token leaves its last token to compute). Text prompts that generate only."""
        if not self._forkable(request):
            return None
        src = self._prompts.get(self._prompt_key(request))
        if (src is None or src.request_id not in prefilling or not self._forkable(src)
                or src.prompt_token_ids != request.prompt_token_ids):
            return None
        return src

    def fork(self, request: Request, parent: Request) -> None:
        """``request`` forks ``parent``'s KV (``twin``): all its prompt is reused, and the parent keeps (offers the
        cache) what the plan says later sequences share with either."""
        self.live_tokens_reused += request.num_prompt_tokens
        if parent.cache_tokens is not None:
            if request.cache_tokens is None:
                parent.cache_tokens = None
                self.keeping.fork_points(parent.request_id, None)
                return
            self.keeping.fork_points(parent.request_id, (parent.cache_tokens, request.cache_tokens))
            parent.cache_tokens = max(parent.cache_tokens, request.cache_tokens)

    @staticmethod
    def _forkable(r: Request) -> bool:
        return not r.media and r.score_from is None and r.fork_parent is None and not r.output_token_ids

    def _prompt_key(self, r: Request) -> tuple[int, int, tuple[int, ...]]:
        """The whole prompt, by its full blocks' chained hash and the tokens after them (computed once)."""
        key = self._prompt_keys.get(r.request_id)
        if key is None:
            chain = self.chains.chain(r)
            n = len(chain) * self.block_size
            key = self._prompt_keys[r.request_id] = (r.num_prompt_tokens, chain[-1] if chain else 0,
                                                     tuple(r.prompt_token_ids[n:]))
        return key

    def in_progress(self, request: Request) -> bool:
        """Whether an admitted sequence is computing the next blocks of ``request``'s prefix right now.

        Admitting it later (once those blocks are cached) computes a shared prefix once instead of once per
        sequence admitted in the meantime.
        """
        if not self._inflight.busy:
            return False
        hashes = self.chains.chain(request)[: (request.num_tokens - 1) // self.block_size]
        cached = 0
        for h in hashes:
            if not self.pool.has(h):
                break
            cached += 1
        waits = cached < len(hashes) and self._inflight.count(hashes[cached]) > 0
        if waits:
            self._inflight.wait(request, hashes[cached], hashes)
        return waits

    # -- freeing --------------------------------------------------------------------------------------
    def free(self, request_id: str) -> None:
        self._inflight.forget(request_id)
        self.chains.forget(request_id)
        self.keeping.forget(request_id)
        self._admitted_at.pop(request_id, None)
        key = self._prompt_keys.pop(request_id, None)
        src = self._prompts.get(key) if key is not None else None
        if src is not None and src.request_id == request_id:
            del self._prompts[key]

    def stats(self) -> dict[str, int]:
        st = self.pool.stats
        return {"lookups": self.lookups, "tokens_reused": self.tokens_reused + self.live_tokens_reused,
                "tokens_reused_live": self.live_tokens_reused, "blocks_cached": st.blocks_cached,
                "evictions": st.evictions, "plan_evictions": self.plan_evictions, "block_size": self.block_size}
