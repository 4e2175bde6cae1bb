"""Plan figures without weights follow the loader's rules: the compute/KV dtype of the device, quantized weights at
their bits on a GPU (injected here), dequantized float32 on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxbatch.job.check.model_size import config_sizes

QWEN_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "intermediate_size": 4864, "vocab_size": 151936, "torch_dtype": "bfloat16"}


def folder(tmp_path: Path, **extra) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**QWEN_05B, **extra}))
    return tmp_path


def test_dense_checkpoint_kv_follows_the_device(tmp_path):
    d = folder(tmp_path)
    per_layer = 2 * 2 * 64  # keys and values, 2 KV heads of 64
    cpu, gpu = config_sizes(d, on_gpu=False), config_sizes(d, on_gpu=True)
    assert (cpu.dtype, cpu.kv_bytes_per_token, cpu.weight_bytes_per_param) == ("float32", 24 * per_layer * 4, 4.0)
    assert (gpu.dtype, gpu.kv_bytes_per_token, gpu.weight_bytes_per_param) == ("bfloat16", 24 * per_layer * 2, 2.0)
    half = config_sizes(d, "float16", on_gpu=False)  # an explicit model.dtype wins everywhere
    assert (half.dtype, half.kv_bytes_per_token) == ("float16", 24 * per_layer * 2)


@pytest.mark.parametrize("key", ["quantization", "quantization_config"])
def test_four_bit_checkpoint_reads_a_quarter_of_fp16_on_a_gpu(tmp_path, key):
    d = folder(tmp_path, torch_dtype="float16", **{key: {"bits": 4, "group_size": 64}})
    gpu = config_sizes(d, on_gpu=True)
    assert gpu.quantized_bits == 4 and gpu.dtype == "float16"
    assert gpu.weight_bytes_per_param == pytest.approx(0.5 + 4 / 64)  # 4 bits + a 2-byte scale and bias per 64
    cpu = config_sizes(d, on_gpu=False)  # dequantized for the CPU
    assert (cpu.weight_bytes_per_param, cpu.quantized_bits, cpu.dtype) == (4.0, None, "float32")


def test_vision_language_config_reads_its_text_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": QWEN_05B, "torch_dtype": "bfloat16"}))
    assert config_sizes(tmp_path, on_gpu=True).kv_bytes_per_token == 24 * 2 * 2 * 64 * 2
