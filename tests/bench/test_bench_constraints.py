"""The constrained-decoding bench runs: the library worker (llguidance) and the mask cost inside the engine."""

from __future__ import annotations

import pytest

from mlxbatch.bench.constraints import run_worker
from mlxbatch.bench.constraints_engine import engine_run
from mlxbatch.engine import Engine, EngineConfig


def test_llguidance_worker_on_the_tiny_tokenizer(tiny_model_path):
    pytest.importorskip("llguidance")
    res = run_worker("llguidance", "tiny", [3], steps=4)
    assert res["vocab"] == 1024
    for kind in ("choice", "regex", "json_schema"):
        assert res[f"compile_{kind}_s"] > 0
    for kind in ("choice", "regex", "json_schema", "mixed"):
        assert res[f"mask_{kind}_3_ms"] > 0  # masks filled and every valid token found allowed (asserted inside)


def test_engine_mask_cost_counts_pure_decode_steps(tiny_loaded):
    with Engine(tiny_loaded, EngineConfig(max_num_seqs=4, max_num_batched_tokens=512)) as engine:
        free = engine_run(engine, 3, constrained=False, warm=1, steps=3)
        held = engine_run(engine, 3, constrained=True, warm=1, steps=3)
        assert not engine.core.has_unfinished  # every request aborted and cleared after the measurement
    assert free["steps"] == held["steps"] == 3
    assert held["step_ms"] > 0 and held["mask_ms"] > 0 and held["advance_ms"] > 0
    assert (free["constrained_rows"], held["constrained_rows"]) == (0, 3)  # matchers only for constrained rows
