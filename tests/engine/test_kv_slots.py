"""SlotBatch keeps every row's KV intact through admissions, promotions, swaps and removals."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from mlxbatch.engine.kv import LayoutOptions
from mlxbatch.engine.kv.packed import is_run
from mlxbatch.engine.kv.slots import SlotBatch


@pytest.fixture(scope="module")
def model(tiny_loaded):
    return tiny_loaded.model


def _reference_last_logits(model, ids):
    return model(mx.array([ids]))[0, -1]


class _Reference:
    """Each row's last logits from mlx-lm's own single-sequence forward, kept as the row grows: a cache of its own per
    row, so a check runs the row's new tokens only (a forward of the whole sequence at every check was 90% of the
    random-operations test)."""

    def __init__(self, model) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.model, self.make, self.caches = model, make_prompt_cache, {}

    def extend(self, rid: str, tokens: list[int]) -> mx.array:
        """The logits after the row's tokens so far and ``tokens``, which it now holds."""
        cache = self.caches.setdefault(rid, self.make(self.model))
        return self.model(mx.array([tokens]), cache=cache)[0, -1]


def _same(logits: mx.array, refs: list[mx.array]) -> list[bool]:
    """Whether each row's logits match its reference (evaluated together: one sync a step, not one a row)."""
    return mx.stack([mx.allclose(logits[i], r, atol=1e-4) for i, r in enumerate(refs)]).tolist()


@pytest.mark.parametrize("mode", ["per-row", "batched", "stay"],
                         ids=["per-row moves", "batched moves (GPU path)", "rows stay in their slots (CUDA path)"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_match_single_sequence_forward(model, seed, mode):
    rng = random.Random(seed)
    batched = mode != "per-row"
    batch = SlotBatch(len(model.layers), options=LayoutOptions(batched_moves=batched, rows_stay=mode == "stay"))
    scattered = 0  # passes over rows whose slots are not one run (rows stay: their writes scatter, reads gather)
    k = model.layers[0].self_attn
    batch.allocate(k.n_kv_heads, model.args.hidden_size // model.args.num_attention_heads, mx.float32)
    seqs: dict[str, list[int]] = {}  # tokens whose KV is committed
    reference = _Reference(model)  # a single-sequence forward of each row's tokens
    pending: dict[str, list[int]] = {}  # prompt tokens not yet prefilled
    next_id = 0
    for _step in range(40):
        # admit
        for _ in range(rng.randint(0, 3)):
            rid = f"r{next_id}"
            next_id += 1
            batch.add(rid)
            seqs[rid] = []
            pending[rid] = [rng.randrange(3, 900) for _ in range(rng.randint(1, 40))]
        # retire a random row now and then
        if seqs and rng.random() < 0.3:
            gone = rng.sample(sorted(seqs), k=min(len(seqs), rng.randint(1, 3)))
            if len(gone) == 1:
                batch.remove(gone[0])
            else:  # several rows retire at once (the batched path moves every hole-filler in one go)
                batch.remove_many(gone)
            for rid in gone:
                del seqs[rid]
                pending.pop(rid, None)
            batch.check_integrity()
        dec = batch.ids[: batch.n_decode]
        scattered += bool(dec) and not is_run([batch.slot_of(r) for r in dec])
        if dec:
            new = [rng.randrange(3, 900) for _ in dec]
            logits = batch.forward(model, 0, [[t] for t in new])
            same = _same(logits, [reference.extend(rid, [new[i]]) for i, rid in enumerate(dec)])
            assert all(same), (seed, _step, [r for r, ok in zip(dec, same) if not ok])
            for rid, t in zip(dec, new):
                seqs[rid].append(t)
                batch.advance(rid, 1)
        pre = [rid for rid in batch.ids[batch.n_decode :] if pending.get(rid)]
        rng.shuffle(pre)
        if pre:
            batch.arrange(pre)
            chunks = {rid: pending[rid][: rng.randint(1, 16)] for rid in pre}
            logits = batch.forward(model, batch.n_decode, [chunks[r] for r in pre])
            same = _same(logits, [reference.extend(rid, chunks[rid]) for rid in pre])
            assert all(same), (seed, _step, [r for r, ok in zip(pre, same) if not ok], "prefill")
            done = []
            for rid in pre:
                seqs[rid] += chunks[rid]
                pending[rid] = pending[rid][len(chunks[rid]) :]
                batch.advance(rid, len(chunks[rid]))
                if not pending[rid]:
                    done.append(rid)
            if rng.random() < 0.5:  # several rows join the decode rows at once, in any order
                batch.promote_many(done)
            else:
                for rid in done:
                    batch.promote(rid)
            assert batch.ids[batch.n_decode - len(done) : batch.n_decode] == done or not done or not batched
        assert sorted(batch.ids) == sorted(seqs)
        batch.check_integrity()
        for rid in batch.ids:
            assert batch.committed(rid) == len(seqs[rid])
    if mode == "stay":  # no KV moved, and passes ran over scattered slots
        assert batch.traffic.row_moved_bytes == 0 and scattered > 0
    else:
        assert batch.traffic.row_moved_bytes > 0 or not batched


def test_rows_that_stay_keep_their_slots_and_kv_through_retirements_and_a_shrink(model):
    """Where rows stay (CUDA), a retired row's slot goes to the next admitted row (the lowest free first), the others
    never move, and a shrink first moves the rows held past the smaller capacity into free slots below it."""
    batch = SlotBatch(len(model.layers), options=LayoutOptions(batched_moves=True, rows_stay=True))
    batch.allocate(model.layers[0].self_attn.n_kv_heads,
                   model.args.hidden_size // model.args.num_attention_heads, mx.float32)
    prompts = {f"r{i}": [(11 * i + j) % 400 + 3 for j in range(5 + i % 7)] for i in range(40)}
    for rid in prompts:
        batch.add(rid)
    batch.forward(model, 0, list(prompts.values()))
    for rid, p in prompts.items():
        batch.advance(rid, len(p))
    batch.promote_many(list(prompts))
    assert [batch.slot_of(r) for r in prompts] == list(range(40))
    kept = ["r3", "r17", "r36", "r39"]  # three of them past the 8 slots the shrink leaves
    batch.remove_many([r for r in prompts if r not in kept])
    assert [batch.slot_of(r) for r in kept] == [3, 17, 36, 39] and batch.traffic.row_moved_bytes == 0
    batch.add("new")  # the lowest free slot
    assert batch.slot_of("new") == 0 and batch.row_of("new") == 4
    batch.remove_many(["new"])
    before = {r: [mx.array(x) for kv in batch.row_view(r) for x in kv] for r in kept}
    mx.eval(before)
    batch.shrink()
    batch.check_integrity()
    assert batch.kv_arrays()[0].shape[0] == 8 and batch.slot_of("r3") == 3
    assert sorted(batch.slot_of(r) for r in kept) == [0, 1, 2, 3]
    assert batch.traffic.row_moved_bytes == 3 * max(len(prompts[r]) for r in kept[1:]) * batch.position_bytes
    for r in kept:  # each row's KV where its slot now is, and each still decodes what a lone sequence would
        assert all(mx.array_equal(x, y).item() for x, y in zip(before[r], [x for kv in batch.row_view(r) for x in kv]))
    logits = batch.forward(model, 0, [[9]] * len(kept))
    for i, r in enumerate(kept):
        assert mx.allclose(logits[i], _reference_last_logits(model, prompts[r] + [9]), atol=1e-4).item(), r


def test_extract_returns_the_rows_own_kv(model):
    batch = SlotBatch(len(model.layers))
    batch.allocate(model.layers[0].self_attn.n_kv_heads,
                   model.args.hidden_size // model.args.num_attention_heads, mx.float32)
    batch.add("a")
    batch.add("b")
    batch.forward(model, 0, [[5, 6, 7], [8, 9]])
    batch.advance("a", 3)
    batch.advance("b", 2)
    kv = batch.extract("b")
    assert kv[0][0].shape[2] == 2
    batch2 = SlotBatch(len(model.layers))
    batch2.allocate(model.layers[0].self_attn.n_kv_heads,
                    model.args.hidden_size // model.args.num_attention_heads, mx.float32)
    batch2.add("b2", kv, 2)
    out = batch2.forward(model, 0, [[10]])
    assert mx.allclose(out[0], _reference_last_logits(model, [8, 9, 10]), atol=1e-4).item()


def test_cost_is_what_the_buffers_allocate(model):
    assert SlotBatch.cost_positions([]) == 0
    assert SlotBatch.cost_positions([10, 300]) == 4 * 512  # 4 rows is the smallest capacity
    batch = SlotBatch(len(model.layers))
    kv_heads, head_dim = model.layers[0].self_attn.n_kv_heads, model.args.hidden_size // model.args.num_attention_heads
    batch.allocate(kv_heads, head_dim, mx.float32)
    lengths = [40, 300, 7, 120, 299]
    for i, n in enumerate(lengths):  # sequences admitted one by one, each reserving n positions
        batch.add(f"r{i}")
        batch.ensure(len(batch.ids), n)
    per_position = 2 * len(model.layers) * kv_heads * head_dim * 4
    assert batch.nbytes == SlotBatch.cost_positions(lengths) * per_position  # 8 rows x 512 positions
    # after many rows finished the buffers shrink and then grow again, always to a capacity cost_positions charges
    # for (a power of two: 5 rows left keep 16 and 11 rows stay in 16, not 10 and then 20)
    for i in range(15):
        batch.add(f"m{i}")
        batch.ensure(len(batch.ids), 300)
    assert batch.nbytes == SlotBatch.cost_positions([300] * 20) * per_position  # 32 rows x 512 positions
    batch.remove_many([f"m{i}" for i in range(15)])
    batch.shrink()
    for i in range(6):
        batch.add(f"n{i}")
        batch.ensure(len(batch.ids), 300)
        rows = batch.nbytes // (512 * per_position)
        assert rows & (rows - 1) == 0 and rows <= 16, rows


def test_rows_starting_together_give_rope_one_offset_and_others_one_per_row():
    """As mlx-lm's own cache does, a pass whose rows all start at one offset hands RoPE a number (its scalar path);
    rows at different offsets, and fixed-width (batch-invariant, masked bucketed) passes, a per-row array."""
    from mlxbatch.engine.kv.slot_forward import plan_forward

    assert plan_forward(0, [7, 7, 7], 1, True).offset_array == 7
    assert plan_forward(0, [0, 0], 16, False).offset_array == 0
    ragged = plan_forward(0, [3, 7], 1, True).offset_array
    assert isinstance(ragged, mx.array) and ragged.tolist() == [3, 7]
    fixed = plan_forward(0, [7, 7], 1, True, kv_width=256).offset_array
    assert isinstance(fixed, mx.array) and fixed.tolist() == [7, 7]
