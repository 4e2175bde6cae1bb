"""KV block pool: chained block hashes, ref counts, prefix index, LRU eviction and integrity (pure Python)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mlxbatch.engine.sched.blocks import BLOCK_SIZE, BlockPool, NoFreeBlocks, block_hashes
from mlxbatch.errors import InvalidRequestError, MlxbatchError


def filled(pool: BlockPool, hashes: list[int]) -> list[int]:
    """Allocate and register one block per hash (a request that computed these blocks); still referenced."""
    ids = pool.allocate(len(hashes))
    for bid, h in zip(ids, hashes):
        assert pool.register(bid, h) == bid
    pool.check_integrity()
    return ids


# -- block_hashes -------------------------------------------------------------------------------------
def test_hashes_cover_full_blocks_only() -> None:
    assert BLOCK_SIZE == 16
    assert len(block_hashes(list(range(47)), 16)) == 2
    assert len(block_hashes(list(range(48)), 16)) == 3
    assert block_hashes([1, 2, 3], 4) == []
    assert all(0 <= h < 2**64 for h in block_hashes(list(range(64))))


def test_hashes_are_chained() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4)
    b = block_hashes([0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4)  # first block differs
    assert len(a) == len(b) == 3
    assert all(x != y for x, y in zip(a, b))  # every later block differs too
    c = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 99], 4)
    assert c[:2] == a[:2] and c[2] != a[2]


def test_shared_prefix_gives_identical_leading_hashes() -> None:
    prefix = list(range(100, 140))  # 2.5 blocks of 16
    a = block_hashes(prefix + [1] * 30, 16)
    b = block_hashes(prefix + [2] * 30, 16)
    assert a[:2] == b[:2] and a[2:] != b[2:] and a[2] != b[2]


def test_hashes_are_stable_and_deterministic() -> None:
    # Pinned value: the hash must not depend on the process (no salted hash()) or platform.
    assert block_hashes([1, 2, 3, 4], 4) == block_hashes((1, 2, 3, 4), 4)
    assert block_hashes(list(range(16)))[0] == 15419130808853295947
    assert block_hashes([1, 2, 3, 4], 4, media=[(2, "img")])[0] == 6096457144569331007


def test_media_hashes_change_their_block_and_after() -> None:
    tokens = [7] * 12
    plain = block_hashes(tokens, 4)
    img_a = block_hashes(tokens, 4, media=[(5, "sha-a")])
    img_b = block_hashes(tokens, 4, media=[(5, "sha-b")])
    assert img_a[0] == plain[0] == img_b[0]  # block 0 holds no media
    assert img_a[1] != img_b[1] and img_a[2] != img_b[2] and img_a[1] != plain[1]
    assert block_hashes(tokens, 4, media=[(5, "sha-a")]) == img_a
    assert block_hashes(tokens, 4, media=[(6, "sha-a")])[1] != img_a[1]  # position matters
    assert block_hashes(tokens, 4, media=[(13, "x")]) == plain  # media in the partial tail: no full block
    two = [(1, "a"), (9, "b")]
    assert block_hashes(tokens, 4, media=two) == block_hashes(tokens, 4, media=two[::-1])


def test_bad_block_size() -> None:
    with pytest.raises(InvalidRequestError):
        block_hashes([1], 0)
    with pytest.raises(InvalidRequestError):
        BlockPool(4, block_size=0)
    with pytest.raises(InvalidRequestError):
        BlockPool(0)


# -- pool round trips -----------------------------------------------------------------------------------
def test_allocate_register_release_match_retain_round_trip() -> None:
    pool = BlockPool(4, block_size=4, bytes_per_block=100)
    hashes = block_hashes(list(range(12)), 4)
    ids = filled(pool, hashes)
    assert ids == [0, 1, 2]
    assert [pool.block(i).ref_count for i in ids] == [1, 1, 1]
    assert pool.block(0).num_tokens == 4 and pool.block(0).block_hash == hashes[0]
    pool.release(ids)
    pool.check_integrity()
    assert pool.stats.blocks_cached == 3 and pool.stats.blocks_free == 1 and pool.stats.blocks_referenced == 0
    assert pool.match(hashes) == ids
    pool.retain(ids)
    pool.check_integrity()
    assert pool.stats.blocks_referenced == 3
    pool.release(ids)
    pool.check_integrity()


def test_unregistered_block_released_goes_free() -> None:
    pool = BlockPool(2, block_size=4)
    [a] = pool.allocate(1)
    pool.retain([a])
    pool.release([a])
    assert pool.block(a).ref_count == 1
    pool.release([a])
    pool.check_integrity()
    assert pool.stats.blocks_free == 2 and pool.stats.blocks_cached == 0
    with pytest.raises(AssertionError):
        pool.retain([a])  # a free block must be allocated, not retained
    with pytest.raises(AssertionError):
        pool.release([a])


def test_match_returns_longest_cached_prefix_only() -> None:
    pool = BlockPool(8, block_size=4)
    h = block_hashes(list(range(20)), 4)  # 5 blocks
    ids = filled(pool, [h[0], h[1], h[3]])  # block 2 missing: 3 is unreachable
    pool.release(ids)
    assert pool.match(h) == ids[:2]
    assert pool.match(h[:1]) == ids[:1]
    assert pool.match(block_hashes(list(range(1, 21)), 4)) == []
    assert pool.match([]) == []
    s = pool.stats
    assert (s.queries, s.hits, s.tokens_reused) == (4, 3, 12)
    assert s.hit_rate == 0.75


def test_lru_evicts_least_recently_used_unreferenced() -> None:
    pool = BlockPool(3, block_size=1)
    a, b, c = filled(pool, [10, 20, 30])
    pool.release([a])
    pool.release([b])
    pool.release([c])  # LRU order now a, b, c
    pool.match([20])  # b used: order a, c, b
    [x] = pool.allocate(1)
    assert x == a and pool.match([10]) == [] and pool.stats.evictions == 1
    pool.check_integrity()
    [y] = pool.allocate(1)
    assert y == c and pool.match([20]) == [b]
    pool.check_integrity()


def test_lru_never_evicts_referenced() -> None:
    pool = BlockPool(3, block_size=1)
    a, b, c = filled(pool, [10, 20, 30])
    pool.release([a, c])  # b stays referenced
    got = pool.allocate(2)
    assert sorted(got) == [a, c] and b not in got
    assert pool.match([20]) == [b]
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    pool.check_integrity()


def test_release_of_a_chain_evicts_tail_first() -> None:
    pool = BlockPool(3, block_size=1)
    ids = filled(pool, [1, 2, 3])
    pool.release(ids)
    assert pool.allocate(1) == [ids[2]]
    assert pool.match([1, 2, 3]) == ids[:2]  # the head is still useful
    assert pool.allocate(1) == [ids[1]]


def test_no_free_blocks_when_everything_referenced() -> None:
    pool = BlockPool(2, block_size=4)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocks) as e:
        pool.allocate(1)
    assert isinstance(e.value, MlxbatchError) and (e.value.needed, e.value.available) == (1, 0)
    pool.check_integrity()
    assert pool.allocate(0) == []


def test_allocate_is_all_or_nothing() -> None:
    pool = BlockPool(3, block_size=1)
    filled(pool, [1])
    with pytest.raises(NoFreeBlocks):
        pool.allocate(3)
    assert pool.stats.blocks_free == 2
    pool.check_integrity()


def test_explicit_evict() -> None:
    pool = BlockPool(3, block_size=2)
    a, b = filled(pool, [5, 6])
    assert not pool.evict(a)  # referenced: stays
    pool.release([a])
    assert pool.evict(a)
    assert pool.match([5]) == [] and pool.block(a).block_hash is None
    assert not pool.evict(a)  # already free
    assert pool.stats.evictions == 1 and pool.stats.blocks_free == 2
    pool.release([b])  # b was not evicted while referenced: still cached
    assert pool.match([5, 6]) == [] and pool.match([6]) == [b]
    pool.check_integrity()


def test_duplicate_register_keeps_existing_block() -> None:
    pool = BlockPool(4, block_size=2)
    [a] = filled(pool, [42])
    pool.release([a])
    [dup] = pool.allocate(1)  # a second request computed the same block
    assert pool.register(dup, 42) == a
    pool.retain([a])  # switch to the cached block
    pool.release([dup])  # the duplicate goes back to the free list
    pool.check_integrity()
    assert pool.block(dup).block_hash is None and pool.block(a).ref_count == 1
    assert pool.stats.blocks_free == 3 and pool.stats.blocks_cached == 1
    assert pool.register(a, 42) == a  # idempotent for the block already registered


def test_stats_bytes_held() -> None:
    pool = BlockPool(5, block_size=2, bytes_per_block=1000)
    assert pool.stats.bytes_held == 0
    ids = filled(pool, [1, 2])
    [c] = pool.allocate(1)
    assert pool.stats.bytes_held == 3000
    pool.release([c])  # unregistered: free again
    pool.release(ids)  # registered: cached, still held
    s = pool.stats
    assert s.bytes_held == 2000 and s.blocks_cached == 2 and s.blocks_free == 3 and s.blocks_referenced == 0
    pool.evict(ids[0])
    assert pool.stats.bytes_held == 1000


def test_blocks_are_handed_out_never_used_first_then_freed_ones_in_order() -> None:
    """A block's books are made when it is first handed out (a small model's default pool is 131k blocks): the order
    is the one queue of every block, never-used ids first, then freed ones as they were freed."""
    pool = BlockPool(6, bytes_per_block=10)
    assert pool.num_available == 6 and pool.block(5).ref_count == 0 and pool.block(5).block_hash is None
    assert pool.allocate(3) == [0, 1, 2]
    pool.release([1])
    pool.release([0])
    assert pool.stats.blocks_free == 5 and pool.stats.bytes_held == 10
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.allocate(2) == [1, 0]
    pool.check_integrity()
    with pytest.raises(IndexError):
        pool.block(6)


# -- random operations ------------------------------------------------------------------------------------
HASHES = st.integers(0, 5)


class PoolMachine(RuleBasedStateMachine):
    """Random operations on a tiny pool, checked against a model of the references the callers hold."""

    @initialize(num_blocks=st.integers(2, 6))
    def setup(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks, block_size=2, bytes_per_block=10)
        self.held: list[int] = []  # one entry per reference the callers hold (a multiset)

    @rule(n=st.integers(0, 4))
    def allocate(self, n: int) -> None:
        referenced = len(set(self.held))
        if n > self.pool.num_blocks - referenced:
            with pytest.raises(NoFreeBlocks):
                self.pool.allocate(n)
            return
        ids = self.pool.allocate(n)
        assert len(set(ids)) == n and not set(ids) & set(self.held)
        assert all(self.pool.block(i).block_hash is None for i in ids)
        self.held.extend(ids)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        bid = data.draw(st.sampled_from(self.held))
        self.held.remove(bid)
        self.pool.release([bid])

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def retain(self, data: st.DataObject) -> None:
        bid = data.draw(st.sampled_from(self.held))
        self.pool.retain([bid])
        self.held.append(bid)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), h=HASHES)
    def register(self, data: st.DataObject, h: int) -> None:
        bid = data.draw(st.sampled_from(self.held))
        if self.pool.block(bid).block_hash is not None:
            return  # registering twice is a caller bug (asserted)
        got = self.pool.register(bid, h)
        assert self.pool.block(got).block_hash == h
        if got != bid:  # duplicate: switch to the cached block
            self.pool.retain([got])
            self.held.append(got)

    @rule(chain=st.lists(HASHES, max_size=4), keep=st.booleans())
    def match(self, chain: list[int], keep: bool) -> None:
        ids = self.pool.match(chain)
        assert [self.pool.block(i).block_hash for i in ids] == chain[: len(ids)]
        if len(ids) < len(chain):
            assert self.pool.match([chain[len(ids)]]) == []
        if keep:
            self.pool.retain(ids)
            self.held.extend(ids)

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        bid = data.draw(st.integers(0, self.pool.num_blocks - 1))
        b = self.pool.block(bid)
        cached = b.ref_count == 0 and b.block_hash is not None
        assert self.pool.evict(bid) == cached
        assert self.pool.block(bid).block_hash is None or not cached

    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.check_integrity()
        for bid in set(self.held):
            assert self.pool.block(bid).ref_count == self.held.count(bid)
        s = self.pool.stats
        assert s.blocks_referenced == len(set(self.held))
        assert s.bytes_held == (s.blocks_referenced + sum(
            1 for i in range(self.pool.num_blocks)
            if self.pool.block(i).ref_count == 0 and self.pool.block(i).block_hash is not None)) * 10


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_pool_random_operations = PoolMachine.TestCase


def test_hashes_from_known_leading_blocks_equal_hashing_it_all():
    """``block_hashes(..., known=...)`` takes the first blocks' hashes as given (a prompt sharing them with one hashed
    before) and hashes only the rest: the same chain as hashing everything, media after the known blocks included."""
    shared = list(range(100, 180))  # 5 blocks of 16
    a = shared + [1] * 37
    b = shared[:70] + [2] * 50  # shares 4 whole blocks with ``a``, then differs mid-block
    chain_a = block_hashes(a, 16)
    for k in range(0, 5):
        assert block_hashes(b, 16, known=chain_a[:k]) == block_hashes(b, 16)
    media = [(90, "img")]
    assert block_hashes(b, 16, media, known=chain_a[:4]) == block_hashes(b, 16, media)
    assert block_hashes(b, 16, known=chain_a[:4]) != block_hashes(b, 16, media)
    assert block_hashes(b[:40], 16, known=chain_a[:4]) == block_hashes(b[:40], 16)  # more known than blocks: cut
