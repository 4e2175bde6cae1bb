"""The batch an engine runs when its config leaves it unset (``engine.sched.sizing``), over injected device facts: an
80 GB CUDA GPU, Macs of 16, 36 and 128 GB, a CPU; and a real engine on this machine choosing, reporting and logging it."""

from __future__ import annotations

import logging

import pytest

from mlxbatch.config import EngineConfig
from mlxbatch.engine.kv.slots import SlotBatch
from mlxbatch.engine.sched.sizing import BatchSize, DeviceFacts, device_defaults, rows_in_budget, size_batch

GiB = 1 << 30
QWEN_05B_KV = 12_288  # bytes a token: 24 layers x 2 KV heads x 64 x (K and V) x bf16
QWEN_7B_KV = 57_344  # 28 layers x 4 KV heads x 128 x 2 x 2

H100 = DeviceFacts("cuda", 80 * GiB)
MAC_16, MAC_36, MAC_128 = (DeviceFacts("metal", n * GiB) for n in (16, 36, 128))
CPU = DeviceFacts("cpu", 24 * GiB)


def slot_cost(bytes_per_token: int):
    """The slot layout's charge, as the runner's ``kv_cost`` makes it for a model of this KV size."""
    return lambda lengths: SlotBatch.cost_positions(lengths) * bytes_per_token


@pytest.mark.parametrize("device, seqs, tokens", [(H100, 1024, 16384), (DeviceFacts("cuda", 24 * GiB), 256, 4096),
                                                  (DeviceFacts("cuda", 16 * GiB), 128, 4096), (MAC_16, 64, 2048),
                                                  (MAC_36, 128, 4096), (MAC_128, 256, 8192), (CPU, 128, 2048)])
def test_with_memory_to_spare_each_device_gets_its_own_cap_and_step(device, seqs, tokens):
    # issue 47's labeling job: ~137 prompt tokens and 8 new, a 0.5B model with 38.6 GB of KV (the H100's budget)
    got = size_batch(device, int(38.6 * GiB), slot_cost(QWEN_05B_KV), expected_row_tokens=145)
    assert (got.max_num_seqs, got.max_num_batched_tokens) == (seqs, tokens)
    assert got.seqs_from == "device" and got.tokens_from == "device" and got.budget_rows >= seqs
    assert device_defaults(device) == BatchSize(seqs, tokens, "device", "device")


def test_a_small_budget_holds_fewer_rows_than_the_device_runs():
    # a 7B model on a 16 GB Mac: ~2 GiB of slots, rows of 4,096 tokens reserve 235 MB each: 8 of them fit (9 would
    # not fit a power of two's rows: the slot buffers grow to 16)
    got = size_batch(MAC_16, 2 * GiB, slot_cost(QWEN_7B_KV), expected_row_tokens=4096)
    assert got.max_num_seqs == 8 and got.seqs_from == "memory" and got.budget_rows == 8
    assert slot_cost(QWEN_7B_KV)([4096] * 8) <= 2 * GiB < slot_cost(QWEN_7B_KV)([4096] * 16)
    # the same rows on an H100's 38.6 GB: 128 fit, under its cap of 1024
    assert size_batch(H100, int(38.6 * GiB), slot_cost(QWEN_7B_KV), 4096).max_num_seqs == 128
    # without a length hint a row counts as the layout's smallest (256 positions): memory binds later, not sooner
    assert size_batch(MAC_16, 2 * GiB, slot_cost(QWEN_7B_KV), None).max_num_seqs == 64
    # not even one row: one (the scheduler runs a row alone when nothing else runs)
    assert rows_in_budget(GiB, slot_cost(QWEN_7B_KV), 32_768) == 0
    assert size_batch(MAC_16, GiB, slot_cost(QWEN_7B_KV), 32_768).max_num_seqs == 1


def test_what_the_config_sets_always_wins():
    tiny = size_batch(CPU, 1 << 20, slot_cost(QWEN_7B_KV), 4096, max_num_seqs=32)
    assert (tiny.max_num_seqs, tiny.seqs_from, tiny.budget_rows) == (32, "set", None)  # memory admits rows, not this
    both = size_batch(H100, 38 * GiB, slot_cost(QWEN_05B_KV), 145, max_num_seqs=1024, max_num_batched_tokens=1000)
    assert (both.max_num_seqs, both.max_num_batched_tokens, both.tokens_from) == (1024, 1000, "set")
    assert not both.chosen and tiny.chosen
    assert tiny.describe() == "max_num_seqs 32 (set in the config), max_num_batched_tokens 2048 (the device's default)"
    # many rows set by hand: a step's decode rows leave half of it to prefill
    many = size_batch(CPU, 38 * GiB, slot_cost(QWEN_05B_KV), 145, max_num_seqs=2048)
    assert (many.max_num_batched_tokens, many.tokens_from) == (4096, "rows")
    assert "twice max_num_seqs" in many.describe() and "set in the config" in many.describe()


def test_a_real_engine_runs_reports_and_logs_the_batch_it_chose(tiny_loaded, caplog):
    from mlxbatch.engine import EngineCore

    with caplog.at_level(logging.INFO, logger="mlxbatch.engine.core"):
        core = EngineCore(tiny_loaded, EngineConfig(warm_up=False, expected_row_tokens=300))
    try:
        here = core.worker.device.batch_defaults  # this machine's (a CPU: 128 rows, 2048 tokens)
        seqs, tokens = here.max_num_seqs, here.max_num_batched_tokens
        assert (core.config.max_num_seqs, core.config.max_num_batched_tokens) == (seqs, tokens)
        assert core.scheduler.config.max_num_seqs == seqs and core.scheduler.config.max_num_batched_tokens == tokens
        batch = core.stats()["batch"]
        assert batch["max_num_seqs"] == seqs and batch["max_num_seqs_from"] == "device"
        assert batch["rows_in_kv_budget"] >= seqs
        assert [r.message for r in caplog.records if "engine batch" in r.message] == [
            "engine batch: " + core.batch_size.describe()]
    finally:
        core.shutdown()
    # a budget of 8 rows of 512 positions (the hint: 300 tokens) and the prefix cache inside it: 4 rows run at once
    per_row = 512 * core.worker.geometry.bytes_per_token
    small = EngineCore(tiny_loaded, EngineConfig(warm_up=False, expected_row_tokens=300, kv_budget_bytes=8 * per_row))
    try:
        assert small.config.max_num_seqs == 4 and small.batch_size.seqs_from == "memory"
    finally:
        small.shutdown()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mlxbatch.engine.core"):
        mine = EngineCore(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=16, max_num_batched_tokens=512))
    try:
        assert (mine.config.max_num_seqs, mine.config.max_num_batched_tokens) == (16, 512)
        assert mine.stats()["batch"]["max_num_seqs_from"] == "set"
        assert not any("engine batch" in r.message for r in caplog.records)  # nothing chosen: nothing to say
    finally:
        mine.shutdown()
