"""The slot buffers shrink only once they have stayed oversized (``SlotBatch.shrink_if_settled``): a batch that empties
and fills again every step (prefill-only rows: one-token labels, scoring) or dips for a few steps between waves of
admissions is not copied whole twice a step, and a batch left small for long still gives its memory back."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxbatch import SamplingParams
from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.engine.kv import LayoutOptions, slots
from mlxbatch.engine.kv.slots import SlotBatch
from mlxbatch.engine.outputs import Traffic


def test_oversized_buffers_shrink_after_the_calls_in_a_row_only():
    b = SlotBatch(2, Traffic())
    b.allocate(2, 8, mx.float32)
    for i in range(40):
        b.add(f"r{i}")
        b.advance(f"r{i}", 300)
    b.ensure(40, 301)
    big, grown = b.nbytes, b.traffic.resizes
    b.remove_many([f"r{i}" for i in range(38)])  # 2 rows left of 64: oversized
    for _ in range(slots.SHRINK_CALLS - 1):
        b.shrink_if_settled()
    assert b.nbytes == big and b.traffic.resizes == grown
    b.add("again")  # not enough to need the capacity: the count goes on
    b.shrink_if_settled()
    assert b.nbytes < big and b.traffic.resizes == grown + 1
    assert b.row_view("r38")[0][0].shape[2] >= 300  # the rows kept their KV through it


def test_a_batch_needed_again_resets_the_count():
    b = SlotBatch(2, Traffic())
    b.allocate(2, 8, mx.float32)
    names = [f"r{i}" for i in range(40)]
    for rid in names:
        b.add(rid)
    b.ensure(40, 64)
    grown = b.traffic.resizes
    for _ in range(3):  # oversized for fewer calls than needed, then full again: never shrunk
        b.remove_many(names)
        for _ in range(slots.SHRINK_CALLS - 1):
            b.shrink_if_settled()
        for rid in names:
            b.add(rid)
        b.shrink_if_settled()
    assert b.traffic.resizes == grown
    b.remove_many(names)  # then left small for long: it shrinks, once
    for _ in range(2 * slots.SHRINK_CALLS):
        b.shrink_if_settled()
    assert b.traffic.resizes == grown + 1


@pytest.mark.parametrize("stay", [False, True], ids=["rows move", "rows stay in their slots (CUDA path)"])
def test_one_token_rows_do_not_resize_the_batch_every_step(tiny_loaded, stay):
    """Rows that leave right after their prefill empty the batch every step; the next step's admissions fill it."""
    shared = list(range(100, 164))
    prompts = [shared + [(300 + 7 * i + j) % 900 + 50 for j in range(20 + i % 9)] for i in range(200)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    cfg = EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, warm_up=False)
    with Engine(tiny_loaded, cfg, layout=LayoutOptions(batched_moves=stay, rows_stay=stay, prune_last=True)) as eng:
        outs = eng.generate(prompts, params)
        steps = eng.stats()["profile"]["steps"]
        resizes = eng.core.runner.traffic.resizes
    assert all(len(o.token_ids) == 1 for o in outs)
    assert steps >= 12 and resizes <= 4, (steps, resizes)  # the first fill's growths; not two a step
