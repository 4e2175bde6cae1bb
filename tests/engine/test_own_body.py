"""The engine's own run of a model's layers (``model.own_body``) and the decode attention it hands to the slot cache.

The body must give mlx-lm's output exactly, with and without a KV cache; models it does not know, or whose output it
does not reproduce, keep mlx-lm's body. The fused decode kernel itself runs on CUDA only (its probes check it there
against MLX's masked attention, ``DecodeAttention.probe``); here its call path runs with ``decode_attention.reference``
in its place: same arguments (full buffers, slot rows, key lengths), MLX's attention inside.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.engine.attention import AttentionKernels
from mlxbatch.engine.attention import decode as decode_attention
from mlxbatch.engine.backend import CPU, Backend
from mlxbatch.engine.kv import LayoutOptions
from mlxbatch.engine.model.own_body import OwnBody, own_body
from mlxbatch.engine.model.split import split_model
from mlxbatch.types import SamplingParams


def test_own_body_is_chosen_and_equals_mlx_lm_step_by_step(tiny_loaded):
    model = tiny_loaded.model
    split = split_model(model)
    assert split is not None and isinstance(split.body, OwnBody)
    body, own = model.model, split.body
    assert own.heads == body.layers[0].self_attn.n_heads
    ref_cache, own_cache = make_prompt_cache(model), make_prompt_cache(model)
    steps = [mx.array([[5, 9, 2, 44, 7, 31, 12]]), mx.array([[3]]), mx.array([[19]]), mx.array([[60, 61]])]
    for tokens in steps:  # a prefill, two decode steps and a two-token step: RoPE offsets and the cache move on
        want, got = body(tokens, cache=ref_cache), own(tokens, cache=own_cache)
        assert mx.array_equal(want, got).item()
    assert mx.array_equal(body(steps[0]), own(steps[0])).item()  # no cache: causal attention


def test_models_it_does_not_know_keep_mlx_lm_body(tiny_loaded):
    model = tiny_loaded.model
    body = model.model
    assert own_body(SimpleNamespace(model_type="gemma2"), body) is None

    class Shifted:  # the same modules, but the body's output is not what they give in mlx-lm's order
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, inputs, cache=None):
            return self.inner(inputs, cache=cache) + 1

    assert own_body(model, Shifted(body)) is None  # the probe, not the attribute check, rejects it
    layer = body.layers[0]
    layer.use_sliding = True  # a sliding-window layer (Llama's mixed attention): not this body's
    try:
        assert own_body(model, body) is None
    finally:
        del layer.use_sliding
    assert own_body(model, body) is not None


class StandIn(decode_attention.DecodeAttention):
    """``decode_attention.reference`` in the kernel's place; each layout's probe answers ``agrees[layout]`` and is
    recorded in ``probed``."""

    def __init__(self, agrees: tuple[bool, bool] = (True, True)) -> None:
        super().__init__(0, 0, 0, mx.float32)
        self.agrees, self.probed, self.calls = agrees, [], 0

    def _check(self, layout: int) -> bool:
        self.probed.append(layout)
        return self.agrees[layout]

    def __call__(self, queries, k_buf, v_buf, rows, lengths, scale):
        self.calls += 1
        return decode_attention.reference(queries, k_buf, v_buf, rows, lengths, scale)


def test_decode_through_full_buffers_gives_the_same_tokens(tiny_loaded):
    """Rows of different lengths decode together: with a decode attention set, each decode pass reads the full slot
    buffers by slot row and key length instead of a masked slice; the tokens stay the same."""
    prompts = [[(7 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate([5, 40, 17, 90, 33, 61, 8, 120])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    calls = {"decode": 0}

    class Counted(StandIn):
        def __call__(self, queries, k_buf, v_buf, rows, lengths, scale):
            calls["decode"] += 1
            assert queries.shape[2] == 1 and k_buf.ndim == 4 and rows.shape == lengths.shape == (queries.shape[0],)
            return super().__call__(queries, k_buf, v_buf, rows, lengths, scale)

    outs = {}
    for fused in (False, True):
        cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, warm_up=False)
        layout = LayoutOptions(prune_last=True, attention=AttentionKernels(decode=Counted())) if fused else None
        with Engine(tiny_loaded, cfg, layout=layout) as eng:
            assert (eng.core.runner.batch.decode_attention is None) != fused  # CPU: MLX's attention
            outs[fused] = [list(o.completions[0].token_ids) for o in eng.generate(prompts, params)]
    assert calls["decode"] >= 11 * tiny_loaded.model.args.num_hidden_layers
    assert outs[True] == outs[False]
    assert all(len(t) == 12 for t in outs[True])


@pytest.mark.parametrize("heads,kv_heads,dim,ok", [(14, 2, 64, True), (32, 8, 128, True), (14, 2, 80, False),
                                                    (64, 2, 64, False), (14, 4, 64, False)])
def test_kernel_takes_head_layouts_its_shared_memory_holds(heads, kv_heads, dim, ok):
    assert decode_attention.DecodeAttention.supports(heads, kv_heads, dim, mx.bfloat16) is ok
    for backend in (CPU, Backend("metal")):  # CUDA only: elsewhere MLX's attention
        assert decode_attention.DecodeAttention.create(backend, heads, kv_heads, dim, mx.bfloat16) is None


def test_few_long_rows_keep_mlx_attention():
    """A block reads its keys tile after tile: few rows of many keys would leave the GPU idle."""
    worth = decode_attention.DecodeAttention.worth
    assert worth(256, 2, 16384) and worth(64, 2, 4096) and worth(16, 8, 8192)  # blocks enough
    assert worth(1, 2, 1024) and worth(8, 2, 300)  # short rows
    assert not worth(1, 2, 4096) and not worth(8, 2, 16384) and not worth(32, 2, 1025)


@pytest.mark.parametrize("long_agrees", [True, False])
def test_the_long_row_layout_is_probed_once_when_the_buffers_first_grow_past_it(tiny_loaded, long_agrees):
    """Each of the kernel's layouts compiles on its own (NVRTC, every process): the long-row one is probed only once
    the buffers hold more than 512 positions, and where it disagrees those passes keep MLX's attention, same tokens."""
    short = [[(7 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate([5, 40, 90, 120])]
    long = [[(5 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate([530, 600, 70])]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, warm_up=False)

    def tokens(eng: Engine, prompts: list[list[int]]) -> list[list[int]]:
        return [list(o.completions[0].token_ids) for o in eng.generate(prompts, params)]

    with Engine(tiny_loaded, cfg) as eng:
        want = tokens(eng, short), tokens(eng, long)
    kernel = StandIn(agrees=(True, long_agrees))
    with Engine(tiny_loaded, cfg, layout=LayoutOptions(prune_last=True, attention=AttentionKernels(decode=kernel))) as eng:
        assert tokens(eng, short) == want[0]
        assert kernel.probed == [0] and kernel.calls > 0
        calls = kernel.calls
        assert eng.core.runner.batch.buffers.pos_cap <= 512
        assert tokens(eng, long) == want[1]
        assert eng.core.runner.batch.buffers.pos_cap > 512
    assert kernel.probed == [0, 1]  # once each
    assert (kernel.calls > calls) == long_agrees  # (the buffers stay grown: every long-run pass reads > 512)
