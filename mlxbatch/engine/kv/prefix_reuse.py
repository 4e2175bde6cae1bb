"""Prefix reuse: which KV a new sequence starts from, and what the prefix cache keeps.

Owns the runner's reuse bookkeeping (one per runner):
- **Lookup at admission.** Two sources; the longer one wins. The prefix cache gives whole 16-token blocks of
  earlier prompts, keyed by chained hashes, with image hashes at image positions. A recently admitted sequence that
  is still running can give more: its slot is copied to the token, so the shared prefix's partial last block is not
  recomputed (in the plan's order the row before is usually still running).
- **Waiting.** A sequence whose next prefix blocks an admitted sequence is computing right now can wait a step or
  two, so the shared prefix is computed once (``in_progress``).
- **Copy-in.** ``admit`` gives new rows their reused KV, with every copy of a step batched.
- **Keeping.** A finished prefill offers the blocks of its first ``cache_tokens`` prompt tokens (the plan's
  retention; ``None`` without a plan offers all). After each step's stores, newly admitted planned rows' blocks
  past their ``cache_tokens`` are evicted: no later row shares them. Without a plan, or while blocks are still
  referenced, eviction is the cache's LRU.

A prompt's block hashes are computed once per sequence.
"""

from __future__ import annotations

import collections

from mlxbatch.engine.kv.prefix_cache import PrefixCache, PrefixHit
from mlxbatch.engine.kv.slots import SlotBatch
from mlxbatch.engine.request import Request
from mlxbatch.engine.sched.blocks import block_hashes
from mlxbatch.engine.sched.planner import common_prefix_len

LIVE_SOURCES = 32  # recently admitted sequences tried as live prefix sources


class PrefixReuse:
    def __init__(self, cache: PrefixCache, batch: SlotBatch) -> None:
        self.cache = cache
        self.batch = batch
        self._hits: dict[str, PrefixHit] = {}  # looked up at admission, copied in at the first chunk
        self._live: dict[str, tuple[str, int]] = {}  # admitted, to copy (source row, tokens) at the first chunk
        self._recent: collections.deque[Request] = collections.deque(maxlen=LIVE_SOURCES)
        # block hashes that admitted sequences are computing now (cached once their prefill ends)
        self._computing: dict[str, list[int]] = {}
        self._computing_count: collections.Counter[int] = collections.Counter()
        self._chains: dict[str, list[int]] = {}  # request id -> its tokens' block hashes (until it is freed)
        self._planned: list[Request] = []  # admitted this step with a plan retention to apply
        self.live_tokens_reused = 0

    # -- admission ------------------------------------------------------------------------------------
    def lookup(self, request: Request) -> int:
        """Tokens of ``request`` whose KV is reused (the scheduler starts its prefill there)."""
        tokens = request.tokens(0, request.num_tokens)
        chain = self._chain(request)
        # a scoring sequence must compute the position before its continuation (it predicts the first token)
        hit = self.cache.lookup(tokens if request.score_from is None else tokens[: request.score_from],
                                request.media, chain)
        usable = (len(tokens) - 1) // self.cache.block_size
        hashes = chain[: min(usable, self._stored_tokens(request) // self.cache.block_size)]
        self._computing[request.request_id] = hashes
        self._computing_count.update(hashes)
        live = self._live_prefix(request, tokens, hit.num_tokens if hit is not None else 0)
        self._recent.append(request)
        if live is not None:  # a running sequence holds more of this prefix than the cache's whole blocks
            if hit is not None:
                self.cache.discard(hit)
            self._live[request.request_id] = live
            self.live_tokens_reused += live[1]
            return live[1]
        if hit is None:
            return 0
        self._hits[request.request_id] = hit
        return hit.num_tokens

    def _live_prefix(self, request: Request, tokens: list[int], at_least: int) -> tuple[str, int] | None:
        """(row, tokens) of a recently admitted sequence still running whose computed KV shares more than
        ``at_least`` leading tokens with ``request``. Rows with images are left out: their placeholder tokens do not
        say which picture they stand for."""
        if request.media:
            return None
        limit = len(tokens) - 1 if request.score_from is None else request.score_from - 1
        best: tuple[str, int] | None = None
        for src in self._recent:
            rid = src.request_id
            if src.media or rid not in self.batch:
                continue
            if not src.prompt_token_ids or src.prompt_token_ids[0] != tokens[0]:
                continue
            committed = self.batch.lengths[self.batch.ids.index(rid)]
            n = min(common_prefix_len(tokens, src.prompt_token_ids), committed, limit)
            if n > (best[1] if best else at_least):
                best = (rid, n)
        return best

    def in_progress(self, request: Request) -> bool:
        """Whether an admitted sequence is computing the next blocks of ``request``'s prefix right now.

        Admitting it later (once those blocks are cached) computes a shared prefix once instead of once per
        sequence admitted in the meantime.
        """
        if not self._computing_count:
            return False
        hashes = self._chain(request)[: (request.num_tokens - 1) // self.cache.block_size]
        cached = self.cache.cached_blocks(hashes)
        return cached < len(hashes) and self._computing_count[hashes[cached]] > 0

    def admit(self, requests: list[Request]) -> None:
        """Rows for newly admitted sequences, starting from the KV they reuse: a running row's prefix or cached
        blocks. All copies are batched (one gather and one scatter per buffer on a GPU, two syncs a step)."""
        batch = self.batch
        live: list[tuple[str, str, int]] = []
        hits: list[tuple[str, PrefixHit]] = []
        for r in requests:
            rid = r.request_id
            source = self._live.pop(rid, None)
            hit = self._hits.pop(rid, None)
            if source is not None:
                batch.add(rid)
                live.append((rid, *source))
            elif hit is not None:
                batch.add(rid, length=hit.num_tokens)
                hits.append((rid, hit))
            else:
                batch.add(rid)
            if r.cache_tokens is not None:
                self._planned.append(r)
        batch.copy_prefixes(live)
        if hits:
            keys, values = self.cache.gather([h for _, h in hits])
            B = self.cache.block_size
            batch.write_blocks([(rid, j * B) for rid, h in hits for j in range(len(h.block_ids))], keys, values, B)
            batch.traffic.evaluate(batch.kv_arrays())  # one sync for every copy-in, before the blocks may be reused
            for _, hit in hits:
                self.cache.release(hit)

    # -- after a step ---------------------------------------------------------------------------------
    def commit(self, finished: list[Request]) -> None:
        """The step succeeded: finished prompts offer their blocks; then the plan's dead prefixes go (after the
        stores, which may have offered those very blocks again). One sync for all stores."""
        for r in finished:
            keep = self._stored_tokens(r)
            if keep >= self.cache.block_size:
                self.cache.store(r.prompt_token_ids[:keep], self.batch.row_view(r.request_id), r.media, self._chain(r))
            self._done_computing(r.request_id)
        for r in self._planned:
            self.cache.drop_after(r.prompt_token_ids, r.cache_tokens or 0, r.media, self._chain(r))
        self._planned = []
        self.cache.flush()  # before the slots are written again

    def free(self, request_id: str) -> None:
        self._done_computing(request_id)
        self._live.pop(request_id, None)
        self._chains.pop(request_id, None)
        hit = self._hits.pop(request_id, None)
        if hit is not None:
            self.cache.release(hit)

    # -- helpers --------------------------------------------------------------------------------------
    def _chain(self, request: Request) -> list[int]:
        B = self.cache.block_size
        chain = self._chains.get(request.request_id)
        if chain is None or len(chain) < request.num_tokens // B:  # a preempted sequence also has output tokens
            n = request.num_tokens // B * B
            chain = self._chains[request.request_id] = block_hashes(request.tokens(0, n), B, request.media)
        return chain

    @staticmethod
    def _stored_tokens(request: Request) -> int:
        """Prompt tokens whose full blocks this sequence offers the cache once its prefill is done."""
        n = request.num_prompt_tokens
        return n if request.cache_tokens is None else min(n, request.cache_tokens)

    def _done_computing(self, rid: str) -> None:
        hashes = self._computing.pop(rid, None)
        if hashes:
            self._computing_count.subtract(hashes)
            self._computing_count += collections.Counter()  # drop zero counts
