"""Fused projections (``model.fused``): q/k/v and gate/up as one matmul each in decode passes, on the model's own
weights (views, no copy). On CUDA the runner turns them on; here they are turned on by hand (``OwnBody.fuse``).

What must hold: no extra memory, the model's own modules give what they gave, the body's output and the engine's
greedy tokens stay the same, and a decode step's graph has fewer matmuls (what it saves: kernel launches, the bound
of a GPU decode step). Kinds the fusion does not know are left alone.
"""

from __future__ import annotations

import collections
import os
import re
import tempfile

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxbatch.engine import Engine, EngineConfig, outputs
from mlxbatch.engine.model.fused import fuse_layer, fuse_layers
from mlxbatch.engine.model.loader import ModelSpec, load_model
from mlxbatch.engine.model.split import split_model
from mlxbatch.types import SamplingParams


@pytest.fixture()
def fresh(tiny_model_path):
    """A model of its own (fusion turns its weights into views; the session's model stays as loaded)."""
    loaded = load_model(ModelSpec(str(tiny_model_path)))
    mx.eval(loaded.model.parameters())
    return loaded


def test_fusion_keeps_the_weights_and_costs_no_memory(fresh):
    body = fresh.model.model
    attn = body.layers[0].self_attn
    x = mx.random.normal((2, 3, attn.q_proj.weight.shape[1]), key=mx.random.key(1))
    before = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), body.layers[0].mlp(x)]
    mx.eval(before)
    used = mx.get_active_memory()
    fused = fuse_layers(list(body.layers))
    assert fused is not None and all(f.gate_up is not None for f in fused)
    mx.eval(x)
    assert mx.get_active_memory() - used < 64 * 1024  # the stacked arrays are the only copy of the weights
    after = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), body.layers[0].mlp(x)]
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, after))  # the modules give what they gave
    assert mx.allclose(fused[0].qkv(x), mx.concatenate(before[:3], axis=-1), atol=1e-5).item()
    h = mx.random.normal(x.shape, key=mx.random.key(4))
    assert fused[0].down_t is not None and fused[0].o_t is not None  # plain bias-free linears: adds in the matmul
    assert mx.allclose(fused[0].mlp(body.layers[0], x, h), h + before[3], atol=1e-5).item()
    out = mx.random.normal((2, 3, attn.o_proj.weight.shape[1]), key=mx.random.key(5))
    assert mx.allclose(fused[0].attn_out(attn, out, h), h + attn.o_proj(out), atol=1e-5).item()
    again = fuse_layers(list(body.layers))  # a second engine on the model: the same stacked arrays
    assert again is not None and all(a is b for a, b in zip(again, fused))
    assert mx.get_active_memory() - used < 64 * 1024


def test_fused_body_equals_mlx_lm_step_by_step(fresh):
    model = fresh.model
    own = split_model(model).body
    assert own.fuse()
    body = model.model
    ref_cache, own_cache = make_prompt_cache(model), make_prompt_cache(model)
    steps = [mx.array([[5, 9, 2, 44, 7, 31, 12], [8, 1, 3, 3, 90, 4, 6]]), mx.array([[3], [4]]),
             mx.array([[19], [20]]), mx.array([[60, 61], [62, 63]]), mx.array([[7], [8]])]
    for tokens in steps:  # prefill (apart), decode (fused), a two-token step, decode again
        want, got = body(tokens, cache=ref_cache), own(tokens, cache=own_cache)
        assert mx.allclose(want, got, atol=1e-5, rtol=1e-5).item()


def _decode_graph(eng: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list, collections.Counter]:
    """The engine's tokens, and the primitives of its last decode launch's graph by kind."""
    graphs: list[collections.Counter] = []
    launch = outputs.Traffic.launch

    def recorded(self, kind, *arrays, **how):
        if kind == "decode":
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "step.dot")
                drawn = how.get("drawn")  # (a step's draw goes by keyword)
                wanted = [*arrays, *(drawn.arrays() if drawn is not None else ())]
                mx.export_to_dot(path, *[a for a in wanted if isinstance(a, mx.array)])
                with open(path) as f:
                    graphs.append(collections.Counter(re.findall(r'label ="([A-Za-z]+)', f.read())))
        return launch(self, kind, *arrays, **how)

    outputs.Traffic.launch = recorded
    try:
        tokens = [list(o.completions[0].token_ids) for o in eng.generate(prompts, params)]
    finally:
        outputs.Traffic.launch = launch
    return tokens, graphs[-1]


def test_engine_decodes_the_same_tokens_with_fewer_matmuls_and_adds(fresh):
    """Three engines: projections apart; fused with the residual adds apart; fused with the adds in the o and down
    projections' matmuls (``mx.addmm``). The same greedy tokens; 3 matmuls a layer fewer, then 2 adds a layer fewer."""
    prompts = [[(7 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate([5, 40, 17, 90, 33, 61, 8, 120])]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    layers = len(fresh.model.model.layers)
    runs = {}
    for mode in ("apart", "fused", "fused+addmm"):
        cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, warm_up=False)
        with Engine(fresh, cfg) as eng:
            if mode != "apart":
                assert eng.core.runner._split.body.fuse(residual_in_matmul=mode == "fused+addmm")
            runs[mode] = _decode_graph(eng, prompts, params)
    assert runs["apart"][0] == runs["fused"][0] == runs["fused+addmm"][0]
    matmuls = {m: g["Matmul"] + g["AddMM"] for m, (_, g) in runs.items()}
    # a layer: q, k, v, o, gate, up, down -> qkv, o, gate_up, down (attention's own matmuls are the same in both)
    assert matmuls["apart"] - matmuls["fused"] == 3 * layers
    assert matmuls["fused+addmm"] == matmuls["fused"]
    fused, addmm = runs["fused"][1], runs["fused+addmm"][1]
    assert fused["Add"] - addmm["Add"] == 2 * layers  # the two residual adds of each layer ...
    assert addmm["AddMM"] - fused["AddMM"] == 2 * layers  # ... ride in the o and down projections


def test_kinds_it_does_not_know_are_left_alone(fresh):
    layers = fresh.model.model.layers
    attn = layers[0].self_attn
    bias = attn.k_proj.bias
    del attn.k_proj["bias"]  # k without the bias q and v have: not one kind
    assert fuse_layer(layers[0]) is None
    attn.k_proj.bias = bias

    class GeluMLP(nn.Module):  # gate, up and down, but not swiglu: its MLP stays apart
        def __init__(self, mlp):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

        def __call__(self, x):
            return self.down_proj(nn.gelu(self.gate_proj(x)) * self.up_proj(x))

    layers[1].mlp = GeluMLP(layers[1].mlp)
    fused = fuse_layer(layers[1])
    assert fused is not None and fused.gate_up is None
    x = mx.random.normal((1, 2, attn.q_proj.weight.shape[1]), key=mx.random.key(2))
    h = mx.random.normal(x.shape, key=mx.random.key(3))
    assert mx.array_equal(fused.mlp(layers[1], x, h), h + layers[1].mlp(x)).item()


def test_quantized_projections_fuse_too(fresh):
    """4-bit weights: the packed weights, scales and biases stack along the output axis as plain weights do."""
    model = fresh.model
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    assert type(model.model.layers[0].self_attn.q_proj) is nn.QuantizedLinear
    used = mx.get_active_memory()
    own = split_model(model).body
    assert own.fuse() and all(f.gate_up is not None for f in own.fused)
    assert mx.get_active_memory() - used < 64 * 1024
    ref_cache, own_cache = make_prompt_cache(model), make_prompt_cache(model)
    for tokens in (mx.array([[5, 9, 2, 44, 7, 31, 12]]), mx.array([[3]]), mx.array([[19]])):
        want, got = model.model(tokens, cache=ref_cache), own(tokens, cache=own_cache)
        assert mx.allclose(want, got, atol=1e-5, rtol=1e-5).item()
