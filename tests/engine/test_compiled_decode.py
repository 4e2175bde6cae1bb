"""Decode passes replayed from compiled graphs (``kv.compiled``; the engine uses them on CUDA).

A compiled pass must give what a built pass gives, write each step's KV where that step's rows are (nothing per step
baked into a trace), and write the buffers in place (no copy of a whole buffer). The CUDA kernel's call path runs here
with MLX's attention in the kernel's place (same arguments: full buffers, slot rows, key lengths; traceable).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.engine.attention import AttentionKernels
from mlxbatch.engine.attention.decode import DecodeAttention
from mlxbatch.engine.kv import LayoutOptions
from mlxbatch.engine.kv.compiled import CompiledPasses
from mlxbatch.engine.kv.slots import SlotBatch
from mlxbatch.types import SamplingParams


class FullBuffers(DecodeAttention):
    """The fused kernel's call path with MLX's attention inside, as a graph (no host read: it traces)."""

    def __init__(self) -> None:
        super().__init__(0, 0, 0, mx.float32)
        self.calls = 0

    def _check(self, layout: int) -> bool:  # (nothing to compile: both layouts agree)
        return True

    def __call__(self, queries, k_buf, v_buf, rows, lengths, scale):
        self.calls += 1
        k, v = k_buf[rows], v_buf[rows]
        mask = (mx.arange(k.shape[2])[None, :] < lengths[:, None])[:, None, None, :]
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)


def _tokens(loaded, compiled: bool, kernel: FullBuffers | None, overlap: bool = False,
            stay: bool = False) -> tuple[list[list[int]], CompiledPasses | None]:
    # rows of different lengths, more rows than slots (rows finish and join: decode shapes come and go)
    prompts = [[(7 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate([5, 40, 17, 90, 33, 61, 8, 120] * 3)]
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * (i % 5), ignore_eos=True) for i in range(len(prompts))]
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, warm_up=False, overlap_steps=overlap)
    with Engine(loaded, cfg) as eng:
        assert eng.core.runner.batch.compiled_decode is None  # CPU: passes are built (the engine compiles them on CUDA)
    # (CUDA: rows stay in their slots, so decode rows are scattered over them)
    layout = LayoutOptions(compiled_decode=compiled, rows_stay=stay, prune_last=True,
                           attention=AttentionKernels(decode=kernel))
    with Engine(loaded, cfg, layout=layout) as eng:
        cd = eng.core.runner.batch.compiled_decode
        assert (cd is not None) == compiled
        outs = eng.generate(prompts, params)
        if cd is not None:
            stats = eng.stats()["profile"]
            assert stats["decode_compiled_passes"] == cd.passes and stats["decode_traces"] == cd.traces
    return [list(o.completions[0].token_ids) for o in outs], cd


@pytest.mark.parametrize("overlap", [False, True], ids=["steps one at a time", "overlapped steps"])
@pytest.mark.parametrize("kernel", [False, True, "stay"], ids=["masked attention", "kernel call path",
                                                              "kernel call path, rows stay in their slots"])
def test_compiled_passes_give_the_built_passes_tokens(tiny_loaded, kernel, overlap):
    """Overlapped, a decode pass is fed the step before's draw while it is still on the device (a lazy input)."""
    built, _ = _tokens(tiny_loaded, False, FullBuffers() if kernel else None, overlap)
    stand_in = FullBuffers() if kernel else None
    got, compiled = _tokens(tiny_loaded, True, stand_in, overlap, stay=kernel == "stay")
    assert got == built and compiled is not None
    assert compiled.traces >= 1 and compiled.passes > 2 * compiled.traces  # shapes recur: replays, not traces
    if stand_in is not None:  # traced once per shape: the kernel is called in traces and built passes only
        assert stand_in.calls > 0


def _batch(model, lengths: list[int], stay: bool = False, compiled: bool = False) -> SlotBatch:
    """Rows ``r0 ..`` of these lengths, decoding; with ``stay``, rows stay in their slots and run in reverse order;
    with ``compiled``, decode passes of a recurring shape replay a compiled graph (``batch.compiled_decode``)."""
    batch = SlotBatch(len(model.layers), options=LayoutOptions(rows_stay=stay, compiled_decode=compiled))
    attn = model.layers[0].self_attn
    batch.allocate(attn.n_kv_heads, model.args.hidden_size // model.args.num_attention_heads, mx.float32)
    for i, n in enumerate(lengths):
        batch.add(f"r{i}")
        if n:
            batch.forward(model, i, [[(3 * i + j) % 200 + 5 for j in range(n)]])
            batch.advance(f"r{i}", n)
    if stay:
        batch.arrange(list(reversed(batch.ids)))
    batch.promote_many(list(batch.ids))  # every row decodes (they are in place: nothing moves)
    return batch


@pytest.mark.parametrize("stay", [False, True], ids=["row i in slot i", "rows stay in their slots"])
def test_each_replay_writes_at_its_own_rows_offsets(tiny_loaded, stay):
    """Same shape, new offsets every step: a replay must not write where the trace's step wrote."""
    model = tiny_loaded.model
    lengths = [3, 11, 6, 20]
    built, comp = _batch(model, lengths), _batch(model, lengths, stay, compiled=True)
    cd = comp.compiled_decode
    for step in range(5):
        tokens = [[17 + step + r] for r in range(len(lengths))]
        # each sequence gets the same token in both (the compiled batch's rows may be in another order)
        want = built.forward(model, 0, [tokens[comp.row_of(rid)] for rid in built.ids])
        got = comp.forward(model, 0, tokens)
        mx.eval(want, got, *built.kv_arrays(), *comp.kv_arrays())
        order = mx.array([built.row_of(rid) for rid in comp.ids])
        assert mx.allclose(want[order], got, atol=1e-5).item()
        for rid in built.ids:
            built.advance(rid, 1)
            comp.advance(rid, 1)
        for (kb, vb), (kc, vc) in zip(built.row_view("r0"), comp.row_view("r0")):
            assert mx.allclose(kb, kc, atol=1e-6).item() and mx.allclose(vb, vc, atol=1e-6).item()
        for rid in built.ids:  # every row's keys, its new one included, and nothing written past it
            row, n, slot = built.row_of(rid), built.committed(rid), comp.slot_of(rid)
            for kb, kc in zip(built.kv_arrays(), comp.kv_arrays()):
                assert mx.allclose(kb[row, :, :n], kc[slot, :, :n], atol=1e-6).item()
                assert not mx.any(kc[slot, :, n:]).item()  # positions past the row's length were never written
    assert cd.traces == 1 and cd.passes == 4  # the first pass was built, the second traced, then replays


def test_a_replay_takes_its_offsets_from_the_last_pass_on_the_device(tiny_loaded):
    """Where every row advanced by one since the last compiled pass, the pass's offsets are that pass's offsets + 1
    (a device array it returned), not an array made from host data (on CUDA a host-written unified buffer, which the
    device faults in); where a row did not advance, they are made from the host's lengths again."""
    model = tiny_loaded.model
    batch = _batch(model, [3, 11, 6, 20], compiled=True)
    cd = batch.compiled_decode
    run, fed, carried = cd.run, [], []

    def spy(slots, model, tokens, args, keys, values):
        fed.append(args[0])
        outs = run(slots, model, tokens, args, keys, values)
        carried.append(outs[1] if outs is not None else None)  # the pass's offsets + 1, on the device
        return outs

    cd.run = spy
    for step in range(6):
        out = batch.forward(model, 0, [[9 + step] for _ in range(4)])
        mx.eval(out, *batch.kv_arrays())
        lengths = list(batch.lengths[:4])
        assert fed[-1].tolist() == lengths  # the pass's offsets are the rows' lengths, however they were made
        for rid in batch.ids[: 3 if step == 3 else 4]:  # at step 3 the last row does not advance
            batch.advance(rid, 1)
    assert cd.passes == 5  # the first pass was built (a shape's first sighting), then compiled ones
    # passes 2 and 3 (fed[2], fed[3]) take the pass before's offsets + 1; pass 4 follows a row that did not advance
    assert fed[2] is carried[1] and fed[3] is carried[2]
    assert fed[4] is not carried[3] and fed[5] is carried[4]


def _address(a: mx.array) -> int:
    view = np.array(a, copy=False)  # the buffer itself (a view, dropped at once: it would keep the buffer held)
    address = view.__array_interface__["data"][0]
    del view
    return address


def test_a_replay_writes_the_buffers_in_place(tiny_loaded):
    """The buffers are the compiled graph's inputs and its outputs: a replay must write them where they are (MLX
    writes in place only when nothing else holds the old buffer; a copy of every buffer at every step would cost a
    GPU seconds and show nowhere else: the peak stays flat when the old buffers are freed as the new ones fill)."""
    model = tiny_loaded.model
    batch = _batch(model, [4, 9, 2, 7], compiled=True)
    cd = batch.compiled_decode
    for step in range(4):
        mx.eval(*batch.kv_arrays())
        before = [_address(b) for b in batch.kv_arrays()]
        out = batch.forward(model, 0, [[5 + step] for _ in range(4)])
        mx.eval(out, *batch.kv_arrays())
        for rid in batch.ids:
            batch.advance(rid, 1)
        assert [_address(b) for b in batch.kv_arrays()] == before, step
    assert cd.passes == 3 and batch.traffic.moved_bytes == 0  # the first pass was built, the second traced


def test_shapes_compile_on_their_second_sighting_and_only_the_last_are_kept(tiny_loaded):
    model = tiny_loaded.model
    batch = _batch(model, [4, 9, 2, 7, 5, 3], compiled=True)
    cd = batch.compiled_decode
    assert cd.after == 2
    cd.keep = 2
    for rows in (2, 3, 2, 4, 3, 2, 4, 5, 2, 3):  # passes over the first ``rows`` rows (same buffers)
        batch.forward(model, 0, [[7]] * rows)
        mx.eval(*batch.kv_arrays())
    # built at its first sighting (5: only one), traced at its second (2, 3, 4), replayed after (2 twice); 3 was
    # dropped when 4 came (two kept) and is traced again at its third sighting, which drops 4
    assert cd.traces == 4 and cd.passes == 6
    assert [key[0][0] for key in cd._fns] == [2, 3]
