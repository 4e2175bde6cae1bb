"""A packed pass's attention in one launch a layer (``attention.packed``, CUDA), its host side run on the CPU.

The kernel itself runs only on CUDA, where ``PackedAttention.create`` checks it against ``reference`` before the engine
uses it. Here: its unit table covers every (token, query head) once with the right row, tokens and offset;
``reference`` is what the packed pass's grouped attention computes; and an engine whose packed passes go through a
stand-in that reads only the unit table (no groups planned) gives the same tokens as the grouped passes.
"""

from __future__ import annotations

import dataclasses
import random

import mlx.core as mx
import pytest

from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.engine.attention import AttentionKernels
from mlxbatch.engine.attention import packed as pa
from mlxbatch.engine.backend import CPU, Backend
from mlxbatch.engine.kv import LayoutOptions
from mlxbatch.engine.kv import packed as pk
from mlxbatch.engine.kv.packed import PackedPass
from mlxbatch.engine.kv.slots import POSITION_STEP
from mlxbatch.types import SamplingParams


@pytest.mark.parametrize("rep", [1, 2, 7])
def test_units_cover_every_query_row_once(rep):
    rng = random.Random(rep)
    lengths = [rng.randint(1, 70) for _ in range(9)]
    offsets = [rng.randint(0, 500) for _ in lengths]
    table = pa.units(5, offsets, lengths, rep)
    assert len(table) % pa.FIELDS == 0
    first = [sum(lengths[:r]) for r in range(len(lengths))]
    seen: list[tuple[int, int]] = []
    for u in range(len(table) // pa.FIELDS):
        row, tok0, n, m0, off = table[u * pa.FIELDS : (u + 1) * pa.FIELDS]
        r = row - 5
        assert (tok0, n, off) == (first[r], lengths[r], offsets[r]) and m0 % pa.UNIT == 0
        seen += [(tok0 + m // rep, m % rep) for m in range(m0, min(m0 + pa.UNIT, n * rep))]
    assert sorted(seen) == [(t, h) for t in range(sum(lengths)) for h in range(rep)]  # each exactly once
    assert len(seen) == len(set(seen))


def test_a_compiled_pass_table_is_its_tokens_then_padding_and_empty_units():
    """``PackedPass.table``: each real token at its row's slot and position, the padding tokens at the scratch
    (the first row's slot, the capacity's last position), and the unit table padded by empty units."""
    rng = random.Random(3)
    lengths = [1] * 20 + [rng.randint(2, 90) for _ in range(7)]
    offsets = [rng.randint(0, 300) for _ in lengths]
    slots = rng.sample(range(64), len(lengths))
    padded, pos, rows, units = PackedPass.table(slots, offsets, lengths, 7, 512)
    n = sum(lengths)
    assert padded % 128 == 0 and padded >= n > padded - 128
    assert rows[:n].tolist() == [s for s, k in zip(slots, lengths) for _ in range(k)]
    assert pos[:n].tolist() == [o + i for o, k in zip(offsets, lengths) for i in range(k)]
    assert set(rows[n:].tolist()) <= {slots[0]} and set(pos[n:].tolist()) <= {511}
    real = pa.units(slots, offsets, lengths, 7)
    assert units.reshape(-1)[: len(real)].tolist() == real
    count = len(real) // pa.FIELDS
    assert units.shape == (pk.bucket(count), pa.FIELDS)
    assert all(u == [slots[0], n, 0, 0, -1] for u in units[count:].tolist())


def _buffers(rows: int, kv_heads: int, cap: int, dim: int):
    k = mx.random.normal((rows, kv_heads, cap, dim), key=mx.random.key(1))
    v = mx.random.normal((rows, kv_heads, cap, dim), key=mx.random.key(2))
    return k, v


def test_reference_is_what_the_grouped_pass_computes():
    """``reference`` (what the GPU probe checks the kernel against) equals the packed pass's attention by groups, on
    rows of different offsets and lengths, GQA, with padding tokens."""
    offsets, lengths, sizes = [0, 37, 300, 5, 256, 130], [40, 1, 90, 3, 64, 17], [2, 3, 1]
    heads, kv_heads, dim = 8, 2, 32
    k, v = _buffers(9, kv_heads, 512, dim)
    plan = PackedPass.plan(1, offsets, lengths, sizes, POSITION_STEP)
    q = mx.random.normal((plan.padded, heads + kv_heads, 1, dim), key=mx.random.key(3))[:, :heads]
    got = pa.reference(q, k, v, 1, offsets, lengths, dim ** -0.5)
    want = plan.attend(q, k, v, dim ** -0.5)
    n = plan.tokens
    assert got.shape == want.shape == (plan.padded, heads, 1, dim)
    assert mx.allclose(got[:n], want[:n], atol=1e-5).item()
    assert mx.all(got[n:] == 0).item()


class TableAttention:
    """A stand-in for the CUDA kernel: the same call, computed through ``reference`` from the unit table alone."""

    def __init__(self, heads: int, kv_heads: int) -> None:
        self.rep = heads // kv_heads
        self.calls = 0

    def __call__(self, queries, k_buf, v_buf, units, scale):
        self.calls += 1
        rows: dict[int, tuple[int, int, int, list[int]]] = {}
        for row, tok0, n, m0, off in units.tolist():
            rows.setdefault(row, (tok0, n, off, []))[3].append(m0)
        order = sorted(rows)
        assert order == list(range(order[0], order[0] + len(order)))  # a pass's rows are consecutive slots
        for row in order:
            tok0, n, off, m0s = rows[row]
            assert sorted(m0s) == list(range(0, n * self.rep, pa.UNIT))
        assert [rows[r][0] for r in order] == [sum(rows[s][1] for s in order[:i]) for i in range(len(order))]
        return pa.reference(queries, k_buf, v_buf, order[0], [rows[r][2] for r in order],
                            [rows[r][1] for r in order], scale)


def _run(tiny_loaded, prompts, kernel: bool):
    args = tiny_loaded.model.args
    stand_in = TableAttention(args.num_attention_heads, args.num_key_value_heads) if kernel else None
    cuda = LayoutOptions(batched_moves=True, shape_buckets=True, packed_prefill=True,  # CUDA's path
                         attention=AttentionKernels(packed=stand_in))
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=32, max_num_batched_tokens=1024,
                                           prefill_chunk_size=256), layout=cuda)
    b = eng.core.runner.batch
    plans: list[PackedPass] = []
    forward_packed = b.forward_packed

    def recorded(*a, **k):
        out = forward_packed(*a, **k)
        plans.append(b.passes.last_pass)
        return out

    b.forward_packed = recorded
    outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    stats = eng.stats()["profile"]
    eng.close()
    return [o.completions[0].token_ids for o in outs], stats, plans, stand_in


def test_an_engine_through_the_unit_table_gives_the_grouped_passes_tokens(tiny_loaded):
    """Label-like rows (a shared prefix, items of many lengths) and long prompts in chunks: with the kernel's call
    every packed pass plans no groups and attends once a layer, with the same greedy tokens and prefill tokens."""
    rng = random.Random(5)
    shared = [(7 * j) % 300 + 20 for j in range(120)]
    prompts = [shared + [rng.randint(30, 900) for _ in range(rng.randint(3, 80))] for _ in range(60)]
    prompts += [[rng.randint(30, 900) for _ in range(rng.randint(100, 600))] for _ in range(8)]
    tok_a, stats_a, plans_a, _ = _run(tiny_loaded, prompts, False)
    tok_b, stats_b, plans_b, stand_in = _run(tiny_loaded, prompts, True)
    assert tok_a == tok_b
    assert stats_a["prefill_tokens"] == stats_b["prefill_tokens"]
    assert all(p.groups for p in plans_a) and not any(p.groups for p in plans_b)
    assert all(p.units is not None and p.kernel is stand_in for p in plans_b)
    layers = len(tiny_loaded.model.layers)
    assert stand_in.calls == layers * len(plans_b)


def test_create_declines_without_cuda():
    for backend in (CPU, Backend("metal")):  # the CPU and Metal keep MLX's ops
        assert pa.PackedAttention.create(backend, 8, 2, 64, mx.bfloat16) is None
    assert not pa.PackedAttention.supports(8, 2, 96, mx.bfloat16)
    assert not pa.PackedAttention.supports(8, 2, 64, mx.float32)


class ArrayTableAttention:
    """The kernel's call computed from the unit table by array ops alone, as the kernel reads it (a token's row and
    offset from the unit that holds it; empty units hold none): it traces, so packed passes compile around it."""

    def __init__(self, heads: int, kv_heads: int) -> None:
        self.rep = heads // kv_heads
        self.calls = 0

    def __call__(self, queries, k_buf, v_buf, units, scale):
        self.calls += 1
        row, first, n, off = units[:, 0], units[:, 1], units[:, 2], units[:, 4]
        t = mx.arange(queries.shape[0])
        inside = (t[:, None] >= first[None]) & (t[:, None] < (first + n)[None])  # [tokens, units]
        j = mx.argmax(inside.astype(mx.int32), axis=1)
        pos = off[j] + t - first[j]
        k, v = k_buf[row[j]], v_buf[row[j]]  # each token's row's keys [tokens, kv_heads, capacity, dim]
        mask = (mx.arange(k.shape[2])[None, :] <= pos[:, None])[:, None, None, :]
        o = mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
        return mx.where(mx.any(inside, axis=1)[:, None, None, None], o, 0)  # padding tokens: zeros


def _generate(loaded, prompts, layout, overlap: bool = False):
    """Greedy tokens, the step profile and the packed passes run (``SlotBatch.forward_packed`` calls)."""
    cfg = EngineConfig(warm_up=False, max_num_seqs=8, max_num_batched_tokens=256, prefill_chunk_size=256,
                       overlap_steps=overlap)
    with Engine(loaded, cfg, layout=layout) as eng:
        b, passes = eng.core.runner.batch, []
        forward_packed = b.forward_packed
        b.forward_packed = lambda *a, **k: passes.append(len(a) > 5 and a[5] is not None) or forward_packed(*a, **k)
        outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0))
        stats = eng.stats()["profile"]
    return [[(t.token_id, t.logprob) for t in o.completions[0].logprobs] for o in outs], stats, passes


@pytest.mark.parametrize("overlap", [False, True], ids=["decode rows fed from the host", "fed the draw on the device"])
def test_one_compiled_pass_a_step_gives_the_built_passes_tokens(tiny_loaded, overlap):
    """With the packed kernel a step is one packed pass (the decode rows rows of one token), replayed from a compiled
    graph when its shape recurs (``kv.compiled``: tokens padded to a multiple of 128, the unit table to a bucket size,
    padding tokens written at a scratch position): the same greedy tokens and logprobs as grouped prefill passes and
    separate decode passes, on label-like rows (step shapes recur) and long prompts in chunks."""
    rng = random.Random(9)
    shared = [(5 * j) % 300 + 20 for j in range(40)]
    prompts = [shared + [rng.randint(30, 900) for _ in range(rng.randint(20, 40))] for _ in range(120)]
    prompts[50:50] = [[rng.randint(30, 900) for _ in range(rng.randint(100, 400))] for _ in range(4)]
    cuda = LayoutOptions(batched_moves=True, shape_buckets=True, packed_prefill=True, rows_stay=True)
    built, stats_built, _ = _generate(tiny_loaded, prompts, cuda, overlap)
    args = tiny_loaded.model.args
    stand_in = ArrayTableAttention(args.num_attention_heads, args.num_key_value_heads)
    layout = dataclasses.replace(cuda, compiled_prefill=True, attention=AttentionKernels(packed=stand_in))
    got, stats, fed = _generate(tiny_loaded, prompts, layout, overlap)
    passes = len(fed)
    assert any(fed) == overlap  # overlapped steps feed the decode rows the draw still on the device
    assert [[t for t, _ in row] for row in got] == [[t for t, _ in row] for row in built]
    assert max(abs(a[1] - b[1]) for x, y in zip(got, built) for a, b in zip(x, y)) < 1e-4  # the same numbers
    assert stats["prefill_tokens"] == stats_built["prefill_tokens"]
    assert stats_built["one_pass_steps"] == 0 and stats["one_pass_steps"] > 0.8 * passes  # most steps decode too
    assert stats["decode_tokens"] == stats_built["decode_tokens"]
    compiled_passes, traces = stats["prefill_compiled_passes"], stats["prefill_traces"]
    assert traces >= 1 and compiled_passes > 2 * traces  # shapes recur: replays, not traces
    # the kernel's Python runs in built passes and traces only: a replay calls no Python
    assert stand_in.calls == len(tiny_loaded.model.layers) * (passes - compiled_passes + traces)
