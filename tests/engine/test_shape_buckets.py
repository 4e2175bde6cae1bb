"""Prefill passes in recurring shapes (CUDA's path, run here on the CPU): the same tokens, far fewer attention shapes.

On CUDA every new (rows, tokens, keys) attention shape costs a cuDNN graph build (~55 ms, up to 1 s); with exact
shapes nearly every prefill step of a job was new. ``slot_forward.bucketed_pass`` pads rows and tokens to four sizes
per octave and keys to a multiple of 256; padding rows write nothing.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.engine.kv import LayoutOptions
from mlxbatch.engine.kv.slot_forward import bucket
from mlxbatch.engine.kv.slots import POSITION_STEP, SlotBatch
from mlxbatch.types import SamplingParams


def test_bucket_rounds_up_by_at_most_a_quarter_to_four_sizes_an_octave():
    for x in range(1, 5000):
        assert x <= bucket(x) <= max(x, 1.25 * x), x
        assert bucket(bucket(x)) == bucket(x)
    for k in range(3, 12):  # sizes in (2^k, 2^(k+1)]
        assert len({bucket(x) for x in range(2**k + 1, 2 ** (k + 1) + 1)}) == 4, k


def test_padding_rows_write_nothing_and_real_rows_match_exact_shapes(tiny_loaded):
    """Nine rows at different offsets pad to ten (the tenth is a live row, which must keep its KV); the nine rows'
    outputs and KV equal those of the exact-shape pass."""
    mx.random.seed(0)
    results = []
    for buckets in (False, True):
        b = SlotBatch(2, options=LayoutOptions(batched_moves=True, shape_buckets=buckets))
        b.allocate(2, 32, mx.float32)
        for i in range(10):
            n = 20 + 3 * i
            kv = [(mx.random.normal((1, 2, n, 32), key=mx.random.key(10 * i + j)),
                   mx.random.normal((1, 2, n, 32), key=mx.random.key(10 * i + j + 5))) for j in range(2)]
            b.add(f"r{i}", kv, n)
        mx.eval(b.kv_arrays())
        before = [mx.array(k[9]) for k in b.kv_arrays()]
        tokens = [[(7 * i + t) % 200 + 1 for t in range(3 + i % 4)] for i in range(9)]
        out = b.forward(tiny_loaded.model, 0, tokens)
        mx.eval(out, b.kv_arrays())
        fp = b.current_pass()
        results.append((out, [k[:9] for k in b.kv_arrays()]))
        after = [k[9] for k in b.kv_arrays()]
        assert all(mx.array_equal(x, y).item() for x, y in zip(before, after)), "a padding row's KV changed"
        if buckets:
            assert (fp.stop - fp.start, fp.width, fp.written) == (10, 6, 9)  # 9 rows -> 10, 6 tokens (exact)
            assert fp.t_used % POSITION_STEP == 0 and isinstance(fp.mask, mx.array)
    (o1, kv1), (o2, kv2) = results
    assert o1.shape == o2.shape and mx.allclose(o1, o2, atol=1e-5).item()
    for x, y in zip(kv1, kv2):
        for i in range(9):  # positions the pass wrote: offset .. offset + its tokens
            lo, hi = 20 + 3 * i, 20 + 3 * i + 3 + i % 4
            assert mx.allclose(x[i, :, lo:hi], y[i, :, lo:hi], atol=1e-5).item(), i


@pytest.mark.parametrize("cache", [True, False], ids=["prefix cache", "no cache"])
def test_bucketed_engine_gives_the_same_tokens_with_far_fewer_attention_shapes(tiny_loaded, monkeypatch, cache):
    """A label-like run (shared prefix, suffixes of many lengths): greedy float32 tokens and prefill tokens equal
    to exact shapes; the prefill passes' distinct (rows, tokens, keys) shapes fall by a quarter at least (more in longer
    runs: the same shapes recur), and every one is a bucket shape."""
    shared = [(5 * j) % 300 + 20 for j in range(150)]
    # without the cache every row prefills its whole prompt: 100 rows give as many passes (79 here, 47 bucket shapes)
    # as 200 rows with it (71, 53), at half the cost
    n = 200 if cache else 100
    prompts = [shared + [(11 * i + 3 * j) % 400 + 30 for j in range(5 + (37 * i) % 90)] for i in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    shapes: dict[bool, list[tuple]] = {}
    outputs, prefill = {}, {}
    orig = SlotBatch.forward

    for buckets in (False, True):
        seen: list[tuple] = []

        def forward(self, model, start, tokens, full=False, offsets=None, seen=seen):
            out = orig(self, model, start, tokens, full, offsets)
            fp = self.current_pass()
            if fp.width > 1:
                seen.append((fp.stop - fp.start, fp.width, fp.t_used, isinstance(fp.mask, mx.array),
                             fp.stop == self.buffers.rows_cap, (max(fp.offsets) + fp.width) % POSITION_STEP == 0))
            return out

        monkeypatch.setattr(SlotBatch, "forward", forward)
        cfg = EngineConfig(max_num_seqs=48, max_num_batched_tokens=512, prefix_cache=cache, warm_up=False)
        with Engine(tiny_loaded, cfg, layout=LayoutOptions(batched_moves=True, shape_buckets=buckets)) as eng:
            outs = eng.generate(prompts, params)
            prefill[buckets] = eng.stats()["profile"]["prefill_tokens"]
        outputs[buckets] = [list(o.completions[0].token_ids) for o in outs]
        shapes[buckets] = seen
    assert outputs[True] == outputs[False]
    assert prefill[True] == prefill[False]
    monkeypatch.setattr(SlotBatch, "forward", orig)
    stay = LayoutOptions(batched_moves=True, shape_buckets=True, rows_stay=True)
    with Engine(tiny_loaded, cfg, layout=stay) as eng:  # and rows staying in their slots (CUDA): bucketed passes
        outs = eng.generate(prompts, params)
        assert eng.stats()["profile"]["prefill_tokens"] == prefill[False]
    assert [list(o.completions[0].token_ids) for o in outs] == outputs[False]
    exact, bucketed = {s[:4] for s in shapes[False]}, {s[:4] for s in shapes[True]}
    assert len(shapes[False]) >= 20 and len(exact) >= 0.8 * len(shapes[False])  # exact shapes: nearly all new
    assert len(bucketed) <= 0.75 * len(exact), (len(bucketed), len(exact))
    for rows, width, keys, masked, at_capacity, capped in shapes[True]:
        assert bucket(width) == width or capped  # tokens stop at the exact pass's 256-position end
        assert bucket(rows) == rows or at_capacity  # rows stop at the slots' end
        assert keys % POSITION_STEP == 0 or not masked


def test_padding_never_grows_the_slots_past_an_exact_pass(tiny_loaded):
    """A bucketed pass pads tokens only as far as the exact pass's end rounded up to 256 positions: the slots hold
    no more positions than admission charged for (exact: 250 + 40 -> 512; bucket(40) = 40, fine; 250 + 230 -> 512,
    bucket(230) = 256 would need 506 -> still 512; 200 + 300 -> 512, bucket(300) = 320 would need 520 -> 768)."""
    for offset, tokens, want_cap in ((250, 40, 512), (250, 230, 512), (200, 300, 512)):
        b = SlotBatch(2, options=LayoutOptions(batched_moves=True, shape_buckets=True))
        b.allocate(2, 32, mx.float32)
        kv = [(mx.zeros((1, 2, offset, 32)), mx.zeros((1, 2, offset, 32))) for _ in range(2)]
        for i in range(2):
            b.add(f"r{i}", kv, offset)
        b.forward(tiny_loaded.model, 0, [[5] * tokens, [6] * (tokens - 1)])
        mx.eval(b.kv_arrays())
        assert b.buffers.pos_cap == want_cap, (offset, tokens, b.buffers.pos_cap)
        fp = b.current_pass()
        assert max(fp.offsets) + fp.width <= want_cap
