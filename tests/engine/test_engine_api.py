"""The engine's API: bad input, streaming, asyncio, out-of-memory recovery, registry and worker."""

from __future__ import annotations

import asyncio
import json
import shutil

import mlx.core as mx
import pytest

from mlxbatch import InvalidRequestError, MlxbatchError, SamplingParams
from mlxbatch.engine import AsyncEngineCore, Engine, EngineConfig, EngineCore
from mlxbatch.engine.model.loader import ModelSpec, load_model
from mlxbatch.engine.model.registry import ModelRegistry
from mlxbatch.engine.model.worker import Worker
from mlxbatch.errors import ModelLoadError, ModelOwnershipError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
     ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"top_k": -3}, "top_k"), ({"min_p": 2.0}, "min_p"),
     ({"logprobs": 99}, "logprobs"), ({"stop": ("",)}, "stop"), ({"temperature": float("nan")}, "temperature")],
)
def test_out_of_range_parameters_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert isinstance(err.value, MlxbatchError) and err.value.field == field
    assert field in str(err.value) and repr(next(iter(kwargs.values())))[:3] in str(err.value)


def test_bad_prompts_are_rejected_at_submission_and_the_engine_goes_on(engine):
    with pytest.raises(InvalidRequestError, match="prompt.*empty"):
        engine.generate([""], GREEDY)
    too_long = "word " * 5000
    with pytest.raises(InvalidRequestError, match="longer than the model's context"):
        engine.generate([too_long], GREEDY)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.generate([[1, 2, 10**7]], GREEDY)
    # a bad row in a list rejects the call, leaves nothing half-submitted, and later calls work
    with pytest.raises(InvalidRequestError):
        engine.generate(["import os", ""], GREEDY)
    assert not engine.core.has_unfinished
    assert len(engine.generate(["import os", "import sys"], GREEDY)) == 2


def test_token_id_prompts_are_taken_as_plain_ints_and_never_aliased():
    """Ids pass through as a new list (the engine's request owns it); int subclasses become ints; bools and other
    items are refused with the reason."""
    import enum

    from mlxbatch.engine.inputs import encode_prompt

    class Tok(enum.IntEnum):
        A = 7

    ids = [3, 1, 4]
    got = encode_prompt(None, ids)
    assert got == ids and got is not ids
    assert encode_prompt(None, (5, 6)) == [5, 6]
    mixed = encode_prompt(None, [Tok.A, 2])
    assert mixed == [7, 2] and [type(t) for t in mixed] == [int, int]
    for bad in ([True, 2], [1, 2.0], [1, "2"]):
        with pytest.raises(InvalidRequestError, match="token ids"):
            encode_prompt(None, bad)


def test_chat_messages_use_the_chat_template(engine):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    ids = engine.core.encode(msgs)
    text = engine.tokenizer.decode(ids)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    out = engine.generate([msgs], GREEDY)[0]
    assert out.prompt_tokens == len(ids) and len(out.token_ids) == 8


def test_stream_yields_deltas_that_add_up_to_the_output(engine):
    deltas = list(engine.stream(["import os", "while True:"], GREEDY))
    finals = {d.request_id: d.output for d in deltas if d.output is not None}
    assert len(finals) == 2
    for rid, out in finals.items():
        text = "".join(d.text for d in deltas if d.request_id == rid and d.output is None)
        assert text == out.text
        assert out.timings.first_token is not None and out.timings.total > 0


def test_async_engine_core_runs_concurrent_requests(tiny_loaded):
    async def main():
        core = AsyncEngineCore(EngineCore(tiny_loaded, EngineConfig(warm_up=False)))
        outs = await asyncio.gather(*(core.generate(p, GREEDY) for p in ["import os", "x = 1", "while True:"]))
        with pytest.raises(InvalidRequestError):
            await core.generate("", GREEDY)
        chunks = [d.text async for d in core.stream("import os", GREEDY)]
        await core.close()
        return outs, chunks

    outs, chunks = asyncio.run(main())
    sync = Engine(tiny_loaded, EngineConfig(warm_up=False)).generate(["import os", "x = 1", "while True:"], GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in sync]
    assert "".join(chunks) == sync[0].text


class FlakyModel:
    """The real model, except that one forward over more than ``limit`` rows fails like an allocation."""

    def __init__(self, model, limit: int) -> None:
        self._model, self._limit, self.failures = model, limit, 0

    def __call__(self, inputs, cache=None):
        if inputs.shape[0] > self._limit and self.failures == 0:
            self.failures += 1
            raise RuntimeError("[metal::malloc] Attempting to allocate 9999999999 bytes: out of memory")
        return self._model(inputs, cache=cache)

    def __getattr__(self, name):
        if name == "model":  # no body/head split: every forward goes through __call__
            raise AttributeError(name)
        return getattr(self._model, name)


def test_out_of_memory_shrinks_the_batch_and_loses_no_request(tiny_loaded):
    import dataclasses

    prompts = ["import os", "x = [1, 2, 3]", "while True:", "#", "def main():\n    return", "class A:"]
    expected = Engine(tiny_loaded, EngineConfig(warm_up=False)).generate(prompts, GREEDY)
    flaky = FlakyModel(tiny_loaded.model, limit=3)
    eng = Engine(dataclasses.replace(tiny_loaded, model=flaky), EngineConfig(warm_up=False, max_num_seqs=8))
    outs = eng.generate(prompts, GREEDY)
    assert flaky.failures == 1 and eng.stats()["preemptions"] == 1
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]


def test_registry_shares_a_model_and_reports_ownership_conflicts(tiny_model_path):
    reg = ModelRegistry()
    spec = ModelSpec(str(tiny_model_path))
    a = reg.acquire(spec, "job-a")
    b = reg.acquire(spec, "job-b")
    assert a is b and reg.users(spec) == {"job-a", "job-b"}
    with pytest.raises(ModelOwnershipError, match="job-a"):
        reg.acquire(spec, "trainer", exclusive=True)
    reg.release(spec, "job-a")
    reg.release(spec, "job-b")
    assert len(reg) == 0
    c = reg.acquire(spec, "trainer", exclusive=True)
    with pytest.raises(ModelOwnershipError, match="exclusive"):
        reg.acquire(spec, "job-c")
    assert c is not a  # unloaded after the last release, loaded anew


def test_load_errors_name_the_path(tmp_path, tiny_model_path):
    with pytest.raises(ModelLoadError, match="no-such-model"):
        load_model(ModelSpec(str(tmp_path / "no-such-model")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(ModelSpec(str(tmp_path / "empty")))
    bad_adapter = tmp_path / "adapter"
    bad_adapter.mkdir()
    (bad_adapter / "adapter_config.json").write_text(json.dumps({"num_layers": 2, "lora_parameters": {}}))
    (bad_adapter / "adapters.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="adapter_path"):
        load_model(ModelSpec(str(tiny_model_path), adapter_path=str(bad_adapter)))
    with pytest.raises(ModelLoadError, match="adapter_path"):
        load_model(ModelSpec(str(tiny_model_path), adapter_path=str(tmp_path / "missing")))
    with pytest.raises(ModelLoadError, match="dtype"):
        ModelSpec(str(tiny_model_path), dtype="int3")


def test_quantized_checkpoint_is_dequantized_on_cpu_and_kept_quantized_on_a_gpu(tmp_path, tiny_model_path):
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load as mlx_load
    from mlx_lm.utils import quantize_model, save_model

    model, tok, cfg = mlx_load(str(tiny_model_path), return_config=True)
    qmodel, qcfg = quantize_model(model, cfg, group_size=32, bits=4)
    qpath = tmp_path / "q4"
    shutil.copytree(tiny_model_path, qpath)
    save_model(qpath, qmodel)
    (qpath / "config.json").write_text(json.dumps(qcfg))
    loaded = load_model(ModelSpec(str(qpath)))
    quantized = any(isinstance(m, nn.QuantizedLinear) for _, m in loaded.model.named_modules())
    if mx.default_device() == mx.cpu:  # the CPU has no quantized kernels worth using: float32, dequantized
        assert loaded.dtype == "float32" and not quantized
        assert all(p.dtype == mx.float32 for _, p in tree_flatten(loaded.model.parameters()))
    else:  # Metal and CUDA run the 4-bit weights as they are
        assert quantized and any(p.dtype == mx.uint32 for _, p in tree_flatten(loaded.model.parameters()))
    out = Engine(loaded, EngineConfig(warm_up=False)).generate(["import os"], GREEDY)[0]
    assert len(out.token_ids) == 8


def test_worker_knows_its_device_and_kv_geometry(tiny_loaded):
    w = Worker(tiny_loaded)
    cfg = tiny_loaded.config
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    kind = "cpu" if mx.default_device() == mx.cpu else ("metal" if mx.metal.is_available() else "cuda")
    assert w.device.kind == kind and w.device.total_memory > 0 and w.device.available_memory > 0
    kv_bytes = getattr(mx, tiny_loaded.dtype).size  # the KV is kept in the model's dtype (float32 on the CPU)
    assert w.geometry.dtype == tiny_loaded.dtype
    assert w.geometry.bytes_per_token == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * kv_bytes
    assert 0 < w.kv_budget_bytes(0.5) <= w.device.available_memory
    assert w.warm_up() > 0
    health = w.health_check()
    assert health.ok and health.device == kind
    w.shutdown()


def test_profile_accounts_for_step_time(engine):
    engine.generate(["import os", "x = 1"], SamplingParams(temperature=0.5, seed=1, max_tokens=16, ignore_eos=True))
    prof = engine.stats()["profile"]
    assert prof["prefill_s"] > 0 and prof["decode_s"] > 0 and prof["sampling_s"] > 0
    assert prof["prefill_s"] + prof["decode_s"] + prof["sampling_s"] + prof["host_s"] == pytest.approx(
        prof["total_s"], rel=0.05, abs=1e-3)
    assert prof["decode_tokens"] == 2 * 15


def test_lora_adapter_is_applied(tmp_path, tiny_model_path, tiny_loaded):
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load as mlx_load

    cfg = {"fine_tune_type": "lora", "num_layers": 2,
           "lora_parameters": {"rank": 4, "scale": 20.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "mlp.down_proj"]}}
    model, _ = mlx_load(str(tiny_model_path))
    linear_to_lora_layers(model, cfg["num_layers"], cfg["lora_parameters"])
    mx.random.seed(1)
    weights = {k: (mx.random.normal(v.shape) * 0.5 if k.endswith("lora_b") else v)
               for k, v in tree_flatten(model.trainable_parameters()) if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b")}
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    mx.save_safetensors(str(adapter / "adapters.safetensors"), weights)
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    tuned = load_model(ModelSpec(str(tiny_model_path), adapter_path=str(adapter)))
    assert tuned.identity != tiny_loaded.identity
    prompts = ["import os", "while True:"]
    base = Engine(tiny_loaded, EngineConfig(warm_up=False)).generate(prompts, GREEDY)
    lora = Engine(tuned, EngineConfig(warm_up=False)).generate(prompts, GREEDY)
    assert [o.token_ids for o in lora] != [o.token_ids for o in base]
