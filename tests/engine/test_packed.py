"""A step's prefill rows as one packed pass (CUDA's path, run here on the CPU): the same outputs, KV and tokens as
padded passes, one pass a step, writes in place.

``kv.packed`` lays a step's new tokens end to end (``[tokens, 1]``: no padding in the projections and the MLP) and
regroups them only for attention, group by group, over the slot rows' keys.
"""

from __future__ import annotations

import dataclasses
import random

import mlx.core as mx
import pytest

from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.engine.kv import LayoutOptions
from mlxbatch.engine.kv.packed import TOKEN_STEP, PackedPass, host_arrays
from mlxbatch.engine.kv.slots import POSITION_STEP, SlotBatch
from mlxbatch.engine.outputs import Traffic
from mlxbatch.types import SamplingParams


@pytest.mark.parametrize("seed", range(6))
def test_plan_maps_every_token_to_its_query_slot_and_back(seed):
    """Each real token's query slot holds that token, the way back finds it, padding slots hold a token of their
    own row, widths cover each group's longest row and keys stay within the rows' positions rounded up."""
    rng = random.Random(seed)
    sizes = [rng.randint(1, 5) for _ in range(rng.randint(1, 4))]
    n = sum(sizes)
    same = seed % 3 == 0  # every row at one offset: causal groups
    offsets = [96] * n if same else [rng.randint(0, 700) for _ in range(n)]
    lengths = [rng.randint(1, 90) for _ in range(n)]
    plan = PackedPass.plan(3, offsets, lengths, sizes, POSITION_STEP)
    tokens = sum(lengths)
    assert plan.tokens == tokens and plan.padded % TOKEN_STEP == 0 and tokens <= plan.padded < tokens + TOKEN_STEP
    owner = [r for r, k in enumerate(lengths) for _ in range(k)]
    assert plan.write_rows[:, 0].tolist() == [3 + r for r in owner]
    assert plan.write_pos[:, 0].tolist() == [offsets[r] + t for r, k in enumerate(lengths) for t in range(k)]
    assert plan.offset_array.tolist()[:tokens] == plan.write_pos[:, 0].tolist()
    back = []  # each packed token's query slot, by (group, row in the group, slot in the row)
    for g in plan.groups:
        back += [g.q_index.tolist()[i * g.width + t] for i, t in zip(g.out_rows.tolist(), g.out_pos.tolist())]
    assert len(back) == plan.padded and back[:tokens] == list(range(tokens))  # there and back
    r0 = 0
    for g, size in zip(plan.groups, sizes):
        assert (g.start, g.rows) == (3 + r0, size)
        rows = range(r0, r0 + size)
        assert g.width >= max(lengths[r] for r in rows)
        assert all(owner[t] in rows for t in g.q_index.tolist())  # padding slots read their own rows' tokens
        end = -(-max(offsets[r] + lengths[r] for r in rows) // POSITION_STEP) * POSITION_STEP
        assert g.keys <= end and (g.mask != "causal" or offsets[r0] + g.width <= end)
        assert isinstance(g.mask, str) == (len({offsets[r] for r in rows}) == 1)
        r0 += size
    assert plan.last == tuple(sum(lengths[: r + 1]) - 1 for r in range(n))


def _batch(rows: int, pos_cap: int = 512) -> SlotBatch:
    """A float32 slot batch of the tiny model's geometry, rows of random KV at different lengths."""
    b = SlotBatch(2, Traffic(), LayoutOptions(batched_moves=True))
    b.allocate(2, 32, mx.float32)
    b.ensure(rows, pos_cap)
    for i in range(rows):
        n = 20 + 9 * i
        kv = [(mx.random.normal((1, 2, n, 32), key=mx.random.key(10 * i + j)),
               mx.random.normal((1, 2, n, 32), key=mx.random.key(10 * i + j + 5))) for j in range(2)]
        b.add(f"r{i}", kv, n)
    mx.eval(b.kv_arrays())
    return b


def test_a_packed_pass_gives_each_row_what_its_own_pass_gives(tiny_loaded):
    """Nine rows at different offsets in three groups: every row's last output and the KV written equal those of
    an exact pass over the rows; rows outside the pass keep their KV; the writes go in place (no buffer copy)."""
    from mlxbatch.engine.model.own_body import OwnBody
    from mlxbatch.engine.model.split import split_model

    split = split_model(tiny_loaded.model)
    body = split.body
    assert isinstance(body, OwnBody)
    tokens = [[(7 * i + t) % 200 + 1 for t in range(1 + (5 * i) % 13)] for i in range(9)]
    exact, packed = _batch(10), _batch(10)
    want = split.head(exact.forward(body, 0, tokens))
    outside = [mx.array(k[9]) for k in packed.kv_arrays()]
    mx.eval(outside)  # (a lazy view of a buffer would keep it from being written in place)
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    got = split.head(packed.forward_packed(body, 0, tokens, [4, 3, 2], list(range(9))))
    mx.eval(got, packed.kv_arrays())
    grown = mx.get_peak_memory() - before
    assert grown < packed.nbytes // 4, grown  # the buffers were written in place
    assert mx.allclose(want, got, atol=1e-4).item()
    for x, y in zip(exact.kv_arrays(), packed.kv_arrays()):
        for i, t in enumerate(tokens):
            lo, hi = 20 + 9 * i, 20 + 9 * i + len(t)
            assert mx.allclose(x[i, :, lo:hi], y[i, :, lo:hi], atol=1e-5).item(), i
    assert all(mx.array_equal(x, k[9]).item() for x, k in zip(outside, packed.kv_arrays()))


def _run(tiny_loaded, prompts, packed: bool, stay: bool = False, **cfg) -> tuple[list, dict, list[int]]:
    # CUDA's passes (and CUDA's rows staying in their slots); the CPU's prefill would run its last layer for the last
    # tokens only (``prune_last``: off here, as on CUDA)
    cuda = LayoutOptions(batched_moves=True, shape_buckets=True, packed_prefill=packed, rows_stay=stay)
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False, **cfg), layout=cuda)
    # the runs differ in their passes only: the schedule that packed passes bring (reuse by the block, filled passes,
    # ``EngineCore.reuse_step``) is put back to the token's
    eng.core.reuse_step = eng.core.scheduler.prefix.live_margin = 1
    eng.core.scheduler.config = dataclasses.replace(eng.core.scheduler.config, fill_slots=0)
    b = eng.core.runner.batch
    passes: list[int] = []  # the step of each prefill pass
    forward, forward_packed = b.forward, b.forward_packed

    def counted(model, start, tokens, *a, **k):
        if not isinstance(tokens, mx.array) and max(len(t) for t in tokens) > 1:
            passes.append(eng.core.runner.profile.steps)
        return forward(model, start, tokens, *a, **k)

    def counted_packed(*a, **k):
        passes.append(eng.core.runner.profile.steps)
        return forward_packed(*a, **k)

    b.forward, b.forward_packed = counted, counted_packed
    outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    stats = eng.stats()["profile"]
    eng.close()
    return [o.completions[0].token_ids for o in outs], stats, passes


@pytest.mark.parametrize("shape", ["label", "chat", "long prompts"])
def test_packed_engine_gives_the_same_tokens_in_one_pass_a_step(tiny_loaded, shape):
    """A label-like run (a shared prefix, items of many lengths), a chat-like one (nested prefixes) and long prompts
    prefilled in chunks: packed, every prefill step is one pass (padded: one per group of similar lengths), with the
    same greedy tokens and prefill tokens as padded passes."""
    rng = random.Random(3)
    if shape == "label":
        shared = [(5 * j) % 300 + 20 for j in range(150)]
        prompts = [shared + [rng.randint(30, 900) for _ in range(rng.randint(5, 90))] for _ in range(120)]
    elif shape == "chat":
        prompts, history = [], []
        for i in range(60):
            history = (history if i % 6 else [rng.randint(30, 900) for _ in range(20)]) + \
                [rng.randint(30, 900) for _ in range(rng.randint(5, 40))]
            prompts.append(list(history))
        rng.shuffle(prompts)
    else:
        prompts = [[rng.randint(30, 900) for _ in range(rng.randint(100, 700))] for _ in range(24)]
    cfg = {"max_num_seqs": 32, "max_num_batched_tokens": 1024, "prefill_chunk_size": 256}
    tok_a, stats_a, passes_a = _run(tiny_loaded, prompts, False, **cfg)
    tok_b, stats_b, passes_b = _run(tiny_loaded, prompts, True, **cfg)
    assert tok_a == tok_b
    assert stats_a["prefill_tokens"] == stats_b["prefill_tokens"]
    assert len(passes_b) == len(set(passes_b)), "a packed step ran more than one prefill pass"
    assert len(passes_b) < len(passes_a), (len(passes_b), len(passes_a))
    # rows that stay in their slots (CUDA): the same tokens and prefill, and no KV moved from row to row
    tok_c, stats_c, passes_c = _run(tiny_loaded, prompts, True, stay=True, **cfg)
    assert tok_c == tok_a and stats_c["prefill_tokens"] == stats_a["prefill_tokens"] and passes_c == passes_b
    # what still moves is a shrink's (rows held past the smaller capacity, as the run drains); the copy-ins are the same
    assert stats_c["row_moved_bytes"] * 4 < stats_b["row_moved_bytes"] or stats_c["row_moved_bytes"] == 0
    copy_ins = stats_b["moved_bytes"] - stats_b["row_moved_bytes"]
    assert stats_c["moved_bytes"] - stats_c["row_moved_bytes"] == copy_ins and (copy_ins > 0 or shape == "long prompts")


def test_host_arrays_are_views_of_one_array_in_order():
    """A pass's host-made index lists become int32 arrays of their own lengths and values (views of one array made
    from host data: on CUDA one unified-memory buffer a pass, ``kv.packed.host_arrays``), empty lists included."""
    parts = [[5, 6, 7], [], [1], list(range(40))]
    got = host_arrays(*parts)
    assert [a.tolist() for a in got] == parts
    assert all(a.dtype == mx.int32 and a.shape == (len(p),) for a, p in zip(got, parts))
