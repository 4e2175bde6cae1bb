"""The prefix store keeps the prefixes it last gathered in a row's layout (``PrefixStore.gather_prefix``): a wave of
admissions from one cached instruction gathers it once, a write to any of its blocks drops it, and the engine's
outputs are the same as with the cache off."""

from __future__ import annotations

import mlx.core as mx

from mlxbatch import SamplingParams
from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.engine.kv import prefix_store
from mlxbatch.engine.kv.prefix_store import PrefixStore
from mlxbatch.engine.outputs import Traffic

L, H, D, B = 2, 2, 8, 16
POS_BYTES = 2 * L * H * D * 4


def filled(num_blocks: int = 64) -> tuple[PrefixStore, Traffic]:
    tr = Traffic()
    store = PrefixStore(L, H, D, mx.float32, POS_BYTES, num_blocks, B, tr)
    keys = [mx.arange(8 * H * B * D, dtype=mx.float32).reshape(8, H, B, D) + 1000 * layer for layer in range(L)]
    store.write_blocks(list(range(8)), keys, [-k for k in keys])
    tr.evaluate(*store.pending())
    return store, tr


def as_lists(kv: list[mx.array]) -> list:
    return [a.tolist() for a in kv]


def test_a_second_gather_of_the_same_blocks_takes_the_kept_prefix():
    store, tr = filled()
    first = store.gather_prefix([3, 1, 2])
    mx.eval(first)
    again = store.gather_prefix([3, 1, 2])
    assert (tr.prefix_gathers, tr.hot_prefix_hits) == (1, 1)
    assert all(a is b for a, b in zip(first, again))  # no new array, no gather
    # the kept prefix is the blocks' content in a row's layout: keys then values, each [H, blocks * B, D]
    k, _ = store.gather([3, 1, 2])
    assert as_lists(again[:L]) == as_lists([x.transpose(1, 0, 2, 3).reshape(H, 3 * B, D) for x in k])
    assert store.gather_prefix([3, 1]) is not None and tr.prefix_gathers == 2  # other blocks: gathered


def test_a_write_to_one_of_its_blocks_drops_the_kept_prefix():
    store, tr = filled()
    mx.eval(store.gather_prefix([0, 1]))
    mx.eval(store.gather_prefix([4, 5]))
    new = [mx.full((1, H, B, D), 7.0) for _ in range(L)]
    store.write_blocks([1], new, new)
    tr.evaluate(*store.pending())
    fresh = store.gather_prefix([0, 1])
    assert tr.prefix_gathers == 3  # gathered again, with the block's new content
    assert fresh[0][:, B:, :].tolist() == mx.full((H, B, D), 7.0).tolist()
    store.gather_prefix([4, 5])
    assert tr.hot_prefix_hits == 1  # untouched by that write: still kept


def test_kept_prefixes_are_bounded_in_number_and_bytes():
    store, tr = filled()
    for i in range(prefix_store.HOT_PREFIXES + 1):
        store.gather_prefix([i])
    store.gather_prefix([0])  # the least recently used went first
    assert tr.hot_prefix_hits == 0
    assert len(store._hot) == prefix_store.HOT_PREFIXES
    # an eighth of the store's blocks' bytes: 8 blocks of 64 are the most kept, so a prefix of 9 blocks is not
    small, tr = filled(64)
    store_bytes = small.nbytes
    small.gather_prefix(list(range(8)) + [0])
    assert small._hot == {} and small.nbytes == store_bytes
    small.gather_prefix(list(range(8)))
    assert small.nbytes == store_bytes + 8 * B * POS_BYTES  # counted in the store's bytes (the engine's stats)


def test_engine_outputs_with_kept_prefixes_equal_cache_off(tiny_loaded):
    shared = list(range(100, 164))  # 4 whole blocks: later rows start from cached blocks
    prompts = [shared + [300 + 11 * i + j for j in range(3 + i % 5)] for i in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = {}
    for cache in (True, False):
        with Engine(tiny_loaded, EngineConfig(max_num_seqs=4, warm_up=False, prefix_cache=cache)) as eng:
            outs[cache] = [o.token_ids for o in eng.generate(prompts, params)]
            tr = eng.core.runner.traffic
            if cache:
                assert tr.hot_prefix_hits >= 3 and tr.prefix_gathers < tr.hot_prefix_hits
    assert outs[True] == outs[False]
