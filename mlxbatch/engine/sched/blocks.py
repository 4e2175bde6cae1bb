"""KV block pool: which block ids are free, which hold a cached prefix block, and who references them.

The KV tensors live elsewhere (a runner-owned pool tensor indexed by block id); this module only keeps the
books. A sequence's tokens are cut into blocks of ``block_size``; each *full* block gets a chained hash
(``block_hashes``) covering its whole prefix, so a cached block is reused only when everything before it
matches too. The pool owns every ``CacheBlock`` and its ref count, the prefix index (hash -> block id) and
the LRU order of cached blocks nobody references. Every block is in exactly one state:

* free: ref count 0, not registered, on the free list;
* cached: ref count 0, registered in the prefix index, evictable (LRU order);
* referenced: ref count > 0 (registered or not).

``allocate`` takes free blocks first and then evicts cached ones, least recently used first; it raises
``NoFreeBlocks`` only when too many blocks are referenced, and callers then degrade to recomputing.
Does not own: which request holds which blocks, when a prefix is no longer needed (the planner's retention plan,
acted on through ``evict``), or the tensors. Pure Python: no mlx.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mlxbatch.errors import InvalidRequestError, MlxbatchError

BLOCK_SIZE = 16
_ROOT_HASH = 0  # the "previous hash" of a sequence's first block


class NoFreeBlocks(MlxbatchError):
    """Every block that could be handed out is referenced: the caller recomputes instead of caching."""

    def __init__(self, needed: int, available: int) -> None:
        self.needed, self.available = needed, available
        super().__init__(f"needed {needed} KV blocks, only {available} are free or evictable")


def block_hashes(tokens: Sequence[int], block_size: int = BLOCK_SIZE,
                 media: Sequence[tuple[int, str]] = (), known: Sequence[int] = ()) -> list[int]:
    """Chained 64-bit hashes of the full blocks of ``tokens`` (a trailing partial block gets none).

    ``hash_i = blake2b(hash_{i-1}, tokens of block i, media in block i)``, where ``media`` holds
    (token position, content hash) pairs, e.g. image placeholders keyed by the image's content: two
    prompts with the same placeholder tokens but different images get different hashes from that block on.
    Stable across processes and machines (not Python's salted ``hash``). ``known``: the hashes of the first
    ``len(known)`` blocks, taken as given (a prompt sharing those blocks with one hashed before: only the rest is
    hashed).
    """
    if block_size < 1:
        raise InvalidRequestError("block_size", block_size, "must be >= 1")
    by_block: dict[int, list[tuple[int, str]]] = {}
    for pos, content in sorted(media):
        by_block.setdefault(pos // block_size, []).append((pos, content))
    n = len(tokens) // block_size
    first = min(len(known), n)
    packed = array("q", tokens[first * block_size : n * block_size])
    if sys.byteorder == "big":
        packed.byteswap()  # hash little-endian bytes everywhere
    raw = memoryview(packed).cast("B")  # the tokens' bytes, once (a block's are a slice: no copy)
    step = 8 * block_size
    blake2b = hashlib.blake2b
    out: list[int] = list(known[:first])
    prev = (out[-1] if out else _ROOT_HASH).to_bytes(8, "little")  # a hash's 8 little-endian bytes are its digest
    for i in range(first, n):
        j = i - first  # block i's place in ``raw``
        if i in by_block:
            h = blake2b(prev, digest_size=8)
            h.update(raw[j * step : (j + 1) * step])  # fixed length (block_size ids): media bytes cannot alias tokens
            for pos, content in by_block[i]:
                data = content.encode()
                h.update(pos.to_bytes(8, "little"))
                h.update(len(data).to_bytes(8, "little"))
                h.update(data)
            prev = h.digest()
        else:
            prev = blake2b(prev + raw[j * step : (j + 1) * step], digest_size=8).digest()
        out.append(int.from_bytes(prev, "little"))
    return out


def prompt_block_hashes(token_ids: Sequence[int]) -> list[int]:
    """A text prompt's full blocks' chained hashes at the engine's block size, as its prefix index computes them: what
    a caller that prepares prompts off the engine's step loop hands in with them (``add_request(block_hashes=)``)."""
    return block_hashes(token_ids, BLOCK_SIZE)


def partial_hash(prev: int | None, tokens: Sequence[int]) -> int:
    """The key of a partial block: the ``len(tokens) < block_size`` tokens that follow the full block ``prev`` (None:
    the prompt's start). A separate namespace from full blocks, so a partial block never stands for a full one."""
    packed = array("q", tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    h = hashlib.blake2b(digest_size=8, person=b"mlxb-partial")
    h.update((_ROOT_HASH if prev is None else prev).to_bytes(8, "little"))
    h.update(len(tokens).to_bytes(8, "little"))
    h.update(packed.tobytes())
    return int.from_bytes(h.digest(), "little")


def stable_hash(text: str) -> int:
    """A 64-bit hash of ``text`` that is the same in every process (Python's ``hash`` of a str is salted)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


@dataclass(slots=True)
class CacheBlock:
    """One block's books. Owned by ``BlockPool``: read it, never write it."""

    block_id: int
    block_hash: int | None = None  # None while not registered in the prefix index
    ref_count: int = 0
    num_tokens: int = 0  # block_size once registered (only full blocks are registered)
    last_used: int = 0  # the pool's logical clock at the last allocate / match / release


@dataclass(frozen=True, slots=True)
class PoolStats:
    hits: int  # blocks returned by match
    queries: int  # match calls
    tokens_reused: int  # hits * block_size
    evictions: int  # cached blocks dropped, by allocate or evict
    blocks_cached: int  # registered in the prefix index (referenced or not)
    blocks_free: int  # on the free list
    blocks_referenced: int
    bytes_held: int  # (cached + referenced blocks) * bytes_per_block

    @property
    def hit_rate(self) -> float:
        """Matched blocks per query (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE, bytes_per_block: int = 0) -> None:
        if num_blocks < 1:
            raise InvalidRequestError("num_blocks", num_blocks, "must be >= 1")
        if block_size < 1:
            raise InvalidRequestError("block_size", block_size, "must be >= 1")
        if bytes_per_block < 0:
            raise InvalidRequestError("bytes_per_block", bytes_per_block, "must be >= 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        # a block's books are made when it is first handed out: a pool is sized by the prefix cache's bytes (a small
        # model's 2 GiB are 131k blocks, whose books took 0.15 s to make at every engine's start on a CPU)
        self._blocks: list[CacheBlock] = []  # ids from len(self._blocks) up were never handed out: free
        self._free: deque[int] = deque()  # handed out, then freed: after the never-used ones, as one queue
        self._index: dict[int, int] = {}  # block hash -> block id
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0; least recently used first
        self._clock = 0
        self._hits = self._queries = self._evictions = 0
        self._referenced = 0

    def block(self, block_id: int) -> CacheBlock:
        """The block's books (read only)."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(block_id)
        return self._blocks[block_id] if block_id < len(self._blocks) else CacheBlock(block_id)

    @property
    def _fresh(self) -> int:
        """Blocks never handed out (free)."""
        return self.num_blocks - len(self._blocks)

    @property
    def num_available(self) -> int:
        """Blocks ``allocate`` can hand out now: free plus evictable."""
        return self._fresh + len(self._free) + len(self._evictable)

    # -- allocation and ref counts ----------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` unregistered blocks with ref count 1: free ones first, then LRU evictions. All or nothing."""
        if n < 0:
            raise InvalidRequestError("n", n, "must be >= 0")
        if n > self.num_available:
            raise NoFreeBlocks(n, self.num_available)
        self._clock += 1
        ids: list[int] = []
        for _ in range(n):
            if self._fresh:
                bid = len(self._blocks)
                self._blocks.append(CacheBlock(bid))
            elif self._free:
                bid = self._free.popleft()
            else:
                bid, _ = self._evictable.popitem(last=False)
                self._drop_from_index(bid)
            b = self._blocks[bid]
            b.ref_count, b.num_tokens, b.last_used = 1, 0, self._clock
            ids.append(bid)
        self._referenced += n
        return ids

    def retain(self, block_ids: Iterable[int]) -> None:
        """One more reference to each block (e.g. to blocks ``match`` returned). Free blocks cannot be retained."""
        for bid in block_ids:
            b = self._blocks[bid]
            if b.ref_count == 0:
                assert b.block_hash is not None, f"block {bid} is free: allocate it instead"
                del self._evictable[bid]
                self._referenced += 1
            b.ref_count += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. At 0 a registered block stays cached (evictable), others go free.

        Blocks reaching 0 in one call are queued for eviction last-first: a chain's tail is evicted before
        its head, because a head's eviction makes every block after it unreachable anyway.
        """
        self._clock += 1
        for bid in reversed(block_ids):
            b = self._blocks[bid]
            assert b.ref_count > 0, f"block {bid} released more often than retained"
            b.ref_count -= 1
            b.last_used = self._clock
            if b.ref_count == 0:
                self._referenced -= 1
                if b.block_hash is None:
                    b.num_tokens = 0
                    self._free.append(bid)
                else:
                    self._evictable[bid] = None

    # -- prefix index ---------------------------------------------------------------------------------
    def register(self, block_id: int, block_hash: int) -> int:
        """Put a full, referenced block into the prefix index under ``block_hash``; returns the cached id.

        If the hash is already cached, the existing block is kept and its id returned: the caller switches
        to it (``retain``) and releases ``block_id``, which then goes back to the free list.
        """
        b = self._blocks[block_id]
        assert b.ref_count > 0, f"block {block_id} must be referenced by its writer to be registered"
        existing = self._index.get(block_hash)
        if existing is not None:
            return existing
        assert b.block_hash is None, f"block {block_id} is already registered"
        b.block_hash, b.num_tokens = block_hash, self.block_size
        self._index[block_hash] = block_id
        return block_id

    def match(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of the hash chain ``hashes``; marks them used (not retained)."""
        ids: list[int] = []
        index, blocks, evictable = self._index, self._blocks, self._evictable
        for h in hashes:
            bid = index.get(h)
            if bid is None:
                break
            ids.append(bid)
        self._clock += 1
        clock = self._clock
        for bid in reversed(ids):  # head most recently used, so the tail is evicted first
            blocks[bid].last_used = clock
            if bid in evictable:
                evictable.move_to_end(bid)
        self._queries += 1
        self._hits += len(ids)
        return ids

    def has(self, block_hash: int) -> bool:
        """Whether a block with this chained hash is cached (no side effects)."""
        return block_hash in self._index

    def cached_id(self, block_hash: int) -> int | None:
        """The id of the block cached under this chained hash, if any (no side effects)."""
        return self._index.get(block_hash)

    def evict(self, block_id: int) -> bool:
        """Drop a cached block from the index now (the planner's "prefix no longer needed").

        Only an unreferenced cached block is evicted; returns False (and changes nothing) for a referenced
        or free block. A referenced block stays registered and is cached again when released.
        """
        if block_id not in self._evictable:
            return False
        del self._evictable[block_id]
        self._drop_from_index(block_id)
        self._free.append(block_id)
        return True

    def _drop_from_index(self, block_id: int) -> None:
        b = self._blocks[block_id]
        assert b.block_hash is not None and self._index[b.block_hash] == block_id
        del self._index[b.block_hash]
        b.block_hash, b.num_tokens = None, 0
        self._evictions += 1

    # -- accounting -------------------------------------------------------------------------------------
    @property
    def stats(self) -> PoolStats:
        return PoolStats(
            hits=self._hits, queries=self._queries, tokens_reused=self._hits * self.block_size,
            evictions=self._evictions, blocks_cached=len(self._index), blocks_free=self._fresh + len(self._free),
            blocks_referenced=self._referenced,
            bytes_held=(len(self._blocks) - len(self._free)) * self.bytes_per_block,
        )

    def check_integrity(self) -> None:
        """Assert every invariant of the books (tests call it after every operation)."""
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate ids on the free list"
        assert all(0 <= i < len(self._blocks) for i in free), "a never-used id on the free list"
        referenced = 0
        for i, b in enumerate(self._blocks):
            assert b.block_id == i and b.ref_count >= 0, b
            states = (i in free, i in self._evictable, b.ref_count > 0)
            assert sum(states) == 1, f"block {i} is not in exactly one state: {states} {b}"
            if i in free:
                assert b.block_hash is None and b.num_tokens == 0, b
            if i in self._evictable:
                assert b.block_hash is not None, b
            if b.block_hash is not None:
                assert self._index.get(b.block_hash) == i, f"block {i} registered but not indexed"
                assert b.num_tokens == self.block_size, b
            referenced += b.ref_count > 0
        for h, bid in self._index.items():
            assert self._blocks[bid].block_hash == h, f"index {h} -> block {bid} with another hash"
        assert referenced == self._referenced
        assert self._fresh + len(free) + len(self._evictable) + referenced == self.num_blocks
        stamps = [self._blocks[bid].last_used for bid in self._evictable]
        assert stamps == sorted(stamps), "LRU order disagrees with last_used"
        assert all(s <= self._clock for s in stamps)
