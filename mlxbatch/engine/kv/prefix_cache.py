"""The prefix cache: KV of full prompt blocks, kept after their sequence moved on, found by content.

Owns the block tensors (per layer, ``[blocks, kv_heads, block_size, head_dim]``, grown on demand up to the
byte budget) and drives a ``BlockPool`` for the bookkeeping (ids, ref counts, chained-hash index, LRU).
A new sequence whose prompt starts with cached blocks gets their KV copied into its slot and prefills only
the rest; a sequence whose prefill finished offers its prompt's full blocks. Blocks are keyed by the hash of
their whole prefix, so a block is reused only when every token before it matches too. A full cache evicts
least recently used blocks; when nothing can be evicted it simply stores less: recomputing, never an error.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from mlxbatch.engine.outputs import Traffic
from mlxbatch.engine.sched.blocks import BlockPool, NoFreeBlocks, block_hashes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixHit:
    block_ids: tuple[int, ...]  # retained until the copy into the slot is done
    num_tokens: int


class PrefixCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: mx.Dtype, bytes_per_token: int,
                 budget_bytes: int, block_size: int = 16, traffic: Traffic | None = None) -> None:
        self.block_size = block_size
        self.traffic = traffic if traffic is not None else Traffic()
        self._token_bytes = bytes_per_token
        bytes_per_block = bytes_per_token * block_size
        self.pool = BlockPool(max(1, budget_bytes // max(1, bytes_per_block)), block_size, bytes_per_block)
        self._shape = (kv_heads, block_size, head_dim)
        self._dtype = dtype
        self._num_layers = num_layers
        self._keys: list[mx.array] = []
        self._values: list[mx.array] = []
        self._capacity = 0
        self._dirty = False
        self.lookups = 0
        self.tokens_reused = 0  # prompt tokens whose KV came from the cache
        self.plan_evictions = 0  # blocks dropped because the plan said nobody needs them any more

    def _ensure(self, max_id: int) -> None:
        if max_id < self._capacity:
            return
        cap = min(self.pool.num_blocks, max(64, 2 * self._capacity, max_id + 1))
        self.traffic.grown_bytes += self.nbytes
        self.traffic.resizes += 1
        for bufs in (self._keys, self._values):
            if not bufs:
                bufs.extend(mx.zeros((cap, *self._shape), self._dtype) for _ in range(self._num_layers))
                continue
            for i, old in enumerate(bufs):
                grown = mx.zeros((cap, *self._shape), self._dtype)
                grown[: old.shape[0]] = old
                bufs[i] = grown
        self.traffic.evaluate(self._keys, self._values)
        self._capacity = cap

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self._keys, *self._values))

    def hashes(self, tokens: Sequence[int], media: Sequence[tuple[int, str]] = ()) -> list[int]:
        """Chained hashes of the blocks a lookup of ``tokens`` can use (full blocks, one token left over).

        ``media`` are (token position, content hash) pairs of the prompt's images: two prompts whose image
        placeholders are the same tokens but whose images differ get different blocks from that image on.
        """
        usable = (len(tokens) - 1) // self.block_size * self.block_size
        return block_hashes(tokens[:usable], self.block_size, media) if usable > 0 else []

    def cached_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are cached (does not count as a lookup)."""
        n = 0
        for h in hashes:
            if not self.pool.has(h):
                break
            n += 1
        return n

    def _chain(self, tokens: Sequence[int], blocks: int, media: Sequence[tuple[int, str]],
               hashes: Sequence[int] | None) -> list[int]:
        """The hashes of the first ``blocks`` full blocks of ``tokens`` (``hashes``: already computed, longer)."""
        if hashes is not None:
            assert len(hashes) >= blocks
            return list(hashes[:blocks])
        return block_hashes(tokens[: blocks * self.block_size], self.block_size, media) if blocks > 0 else []

    def lookup(self, tokens: Sequence[int], media: Sequence[tuple[int, str]] = (),
               hashes: Sequence[int] | None = None) -> PrefixHit | None:
        """The cached blocks a sequence can start from (at least one token is always left to compute).
        ``hashes``: the chain of ``tokens``'s full blocks if the caller has it (hashing is host time)."""
        usable = (len(tokens) - 1) // self.block_size * self.block_size
        if usable <= 0:
            return None
        self.lookups += 1
        ids = self.pool.match(self._chain(tokens, usable // self.block_size, media, hashes))
        if not ids:
            return None
        self.tokens_reused += len(ids) * self.block_size
        self.pool.retain(ids)
        return PrefixHit(tuple(ids), len(ids) * self.block_size)

    def gather(self, hits: Sequence[PrefixHit]) -> tuple[list[mx.array], list[mx.array]]:
        """The blocks of all ``hits``, in order, per layer ``[blocks, H, block_size, D]`` (one gather per layer)."""
        idx = mx.array([b for h in hits for b in h.block_ids], dtype=mx.int32)
        return [k[idx] for k in self._keys], [v[idx] for v in self._values]

    def discard(self, hit: PrefixHit) -> None:
        """A hit that will not be used after all (a better source was found): released and not counted."""
        self.tokens_reused -= hit.num_tokens
        self.pool.release(list(hit.block_ids))

    def release(self, hit: PrefixHit) -> None:
        self.pool.release(list(hit.block_ids))

    def store(self, tokens: Sequence[int], row_kv: list[tuple[mx.array, mx.array]],
              media: Sequence[tuple[int, str]] = (), hashes: Sequence[int] | None = None) -> int:
        """Offer the full blocks of ``tokens`` whose KV (per layer ``[1, H, >=len, D]``) is ``row_kv``.

        Returns how many new blocks were stored; already cached blocks are skipped.
        """
        full = len(tokens) // self.block_size
        if full == 0:
            return 0
        hashes = self._chain(tokens, full, media, hashes)
        known = len(self.pool.match(hashes))
        new = hashes[known:]
        if not new:
            return 0
        try:
            ids = self.pool.allocate(len(new))
        except NoFreeBlocks:
            return 0  # everything is in use: keep computing instead
        self._ensure(max(ids))
        B = self.block_size
        idx = mx.array(ids, dtype=mx.int32)
        start, stop = known * B, (known + len(new)) * B
        for layer, (k, v) in enumerate(row_kv):
            H, D = k.shape[1], k.shape[3]
            kb = k[0, :, start:stop, :].reshape(H, len(new), B, D).transpose(1, 0, 2, 3)
            vb = v[0, :, start:stop, :].reshape(H, len(new), B, D).transpose(1, 0, 2, 3)
            self._keys[layer][idx] = kb
            self._values[layer][idx] = vb
        self.traffic.stored_bytes += len(new) * B * self._token_bytes
        self._dirty = True  # evaluated by flush(), once for every store of a step
        stored = 0
        for bid, h in zip(ids, new):
            kept = self.pool.register(bid, h)
            stored += kept == bid
        self.pool.release(ids)  # cached, unreferenced: evictable when space is needed
        return stored

    def drop_after(self, tokens: Sequence[int], keep_tokens: int, media: Sequence[tuple[int, str]] = (),
                   hashes: Sequence[int] | None = None) -> int:
        """Evict the cached blocks of ``tokens``'s chain past its first ``keep_tokens`` tokens (dead: the plan
        says no later sequence shares them). Referenced blocks stay; returns how many were evicted."""
        usable = max(0, (len(tokens) - 1) // self.block_size)
        hashes = self._chain(tokens, usable, media, hashes)[keep_tokens // self.block_size:]
        dropped = 0
        for h in hashes:
            bid = self.pool.cached_id(h)
            if bid is None:
                break
            dropped += self.pool.evict(bid)
        self.plan_evictions += dropped
        return dropped

    def flush(self) -> None:
        """Evaluate pending stores (their sources are lazy views of the running batch's slots)."""
        if self._dirty:
            self.traffic.evaluate(self._keys, self._values)
            self._dirty = False

    def stats(self) -> dict[str, int]:
        st = self.pool.stats
        return {"lookups": self.lookups, "tokens_reused": self.tokens_reused, "blocks_cached": st.blocks_cached,
                "evictions": st.evictions, "plan_evictions": self.plan_evictions, "bytes_allocated": self.nbytes, "block_size": self.block_size}
