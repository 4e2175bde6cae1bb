"""Prefill attention on CUDA's path (run here on the CPU): a new shape's attention through MLX's unfused ops, the
fused attention once the shape has recurred; the same attention and the same tokens either way."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import pytest

from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.engine.attention import AttentionKernels
from mlxbatch.engine.attention.prefill import PrefillAttention, unfused
from mlxbatch.engine.kv import LayoutOptions
from mlxbatch.types import SamplingParams


def _qkv(B, heads, kv_heads, T, S, D=32):
    k = mx.random.split(mx.random.key(3), 3)
    return (mx.random.normal((B, heads, T, D), key=k[0]), mx.random.normal((B, kv_heads, S, D), key=k[1]),
            mx.random.normal((B, kv_heads, S, D), key=k[2]))


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)], ids=["MHA", "GQA"])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive"])
def test_unfused_attention_equals_mlx_attention(heads, kv_heads, mask_kind):
    B, T, S = 3, 5, 12
    q, k, v = _qkv(B, heads, kv_heads, T, S)
    T = 1 if mask_kind == "none" else T
    q = q[:, :, :T]
    pos = mx.array([4, 7, 11])[:, None] - mx.arange(T)[::-1][None, :]  # each row's query positions
    bool_mask = (mx.arange(S)[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, S]
    mask = {"none": None, "causal": "causal", "bool": bool_mask,
            "additive": mx.where(bool_mask, 0.0, -1e9).astype(q.dtype)}[mask_kind]
    scale = 32 ** -0.5
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    got = unfused(q, k, v, scale, mask)
    assert got.shape == want.shape == (B, heads, T, 32)
    assert mx.allclose(got, want, atol=1e-5).item()


def test_a_shape_runs_unfused_until_it_has_run_after_times():
    p = PrefillAttention(4, 2, 32, mx.bfloat16, after=3, seen=Counter())
    runs = [p.fused(8, 64, 256, 512, "causal") for _ in range(5)]
    assert runs == [False, False, False, True, True]
    assert p.fused(8, 64, 256, 768, "causal") is False  # other strides (slot capacity): another cuDNN graph
    assert p.fused(8, 64, 256, 512, mx.zeros((8, 1, 64, 256), dtype=mx.bool_)) is False  # a mask array: another
    assert p.unfused_passes == 5
    other = PrefillAttention(4, 2, 32, mx.bfloat16, after=3, seen=p.seen)  # a later engine in the process
    assert other.fused(8, 64, 256, 512, "causal") is True
    assert PrefillAttention(4, 2, 64, mx.bfloat16, after=3, seen=p.seen).fused(8, 64, 256, 512, "causal") is False
    big = PrefillAttention(4, 2, 32, mx.bfloat16, after=3, max_scores=8 * 4 * 64 * 256 - 1, seen=Counter())
    assert big.fused(8, 64, 256, 512, "causal") is True  # scores too large to materialise: fused at once
    assert big.unfused_passes == 0


def test_the_engine_gives_the_same_tokens_with_new_shapes_unfused(tiny_loaded):
    """A shared prefix and suffixes of many lengths, greedy float32: the same tokens with the policy as without,
    and the policy ran some passes unfused and some fused (shapes that recurred)."""
    shared = [(5 * j) % 300 + 20 for j in range(100)]
    prompts = [shared + [(11 * i + 3 * j) % 400 + 30 for j in range(5 + (37 * i) % 60)] for i in range(160)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs, policies = [], []
    for on in (False, True):
        cfg = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, warm_up=False)
        args = tiny_loaded.model.args
        policy = PrefillAttention(args.num_attention_heads, args.num_key_value_heads,
                                  args.hidden_size // args.num_attention_heads, mx.float32, after=1,
                                  seen=Counter()) if on else None
        with Engine(tiny_loaded, cfg, layout=LayoutOptions(prune_last=True,
                                                           attention=AttentionKernels(prefill=policy))) as eng:
            outputs.append([list(o.completions[0].token_ids) for o in eng.generate(prompts, params)])
            policies.append(policy)
    assert outputs[0] == outputs[1]
    p = policies[1]
    assert p is not None and p.unfused_passes > 0 and sum(p.seen.values()) > p.unfused_passes
