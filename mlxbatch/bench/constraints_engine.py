"""The mask cost of constrained decoding inside the engine (``mlxbatch bench constraints --engine``).

Decode-step time with every row under a long-lived JSON schema against none, at each ``--batches`` size, and the
host time in the grammar calls themselves (mask fill, matcher advance: the engine's step profile; the mask's apply
runs on the device inside the sampling step). A step counts when it is a pure decode
step of all rows: no prefill tokens and exactly one decode token per row (read from ``Engine.stats()``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from mlxbatch.bench.constraint_libs import SCHEMA
from mlxbatch.engine import Engine, EngineConfig, LoadedModel, ModelSpec, load_model, resolve_path
from mlxbatch.models.random_model import build_random_model
from mlxbatch.types import OutputConstraint, SamplingParams

ENGINE_SCHEMA = {  # long-lived: a list of at least 50 records, so no row completes inside the measured steps
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 50, "items": SCHEMA}},
    "required": ["records"],
}


def engine_model(name: str) -> LoadedModel:
    if name in ("tiny", "0.5b"):
        path = build_random_model(Path.home() / ".cache" / "mlxbatch" / "bench" / name, name)
    else:
        path = Path(resolve_path(name))
    return load_model(ModelSpec(str(path), dtype="float32"))


def _profile(engine: Engine) -> tuple[int, int, float, float]:
    p = engine.core.runner.profile  # unrounded: one step's grammar time is a few microseconds
    return p.prefill_tokens, p.decode_tokens, p.grammar_mask_s, p.grammar_advance_s


def engine_run(engine: Engine, rows: int, constrained: bool, warm: int, steps: int) -> dict[str, Any]:
    """Median decode-step time (all ``rows`` decoding) and, when constrained, the time in the mask and advance."""
    core = engine.core
    constraint = OutputConstraint.json_schema(ENGINE_SCHEMA) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=warm + steps + 8, ignore_eos=True, constraint=constraint)
    ids = [core.add_request(f"Record {i}: write the records as JSON.", params) for i in range(rows)]
    step_s = []
    constrained_rows = 0
    try:
        while len(step_s) < warm + steps and core.has_unfinished:
            prefill_before, decode_before, mask_before, adv_before = _profile(engine)
            t0 = time.perf_counter()
            core.step()
            dt = time.perf_counter() - t0
            prefill_after, decode_after, mask_after, adv_after = _profile(engine)
            if prefill_after == prefill_before and decode_after - decode_before == rows:
                step_s.append((dt, mask_after - mask_before, adv_after - adv_before))
                constrained_rows = max(constrained_rows, core.runner.num_constrained)
    finally:
        for rid in ids:
            core.abort(rid)
        core.step()
    meas = step_s[warm:]
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return {"step_ms": med([m[0] for m in meas]), "mask_ms": med([m[1] for m in meas]),
            "advance_ms": med([m[2] for m in meas]), "steps": len(meas), "constrained_rows": constrained_rows}


def engine_bench(args: argparse.Namespace) -> None:
    loaded = engine_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    engine = Engine(loaded, EngineConfig(max_num_seqs=max(batches), max_num_batched_tokens=4096))
    compiler = engine.core.compiler  # build the grammar tokenizer outside the timed steps
    print(f"model {args.model}: logits width {compiler.vocab_size}, tokenizer {compiler.tokenizer_vocab} ids; "
          f"JSON schema rows (greedy), median of {args.steps} decode steps")
    print("| rows | step ms, none | step ms, all constrained | mask ms (fill + apply; range over runs) | advance ms | "
          "overhead | mask / unconstrained step |")
    print("|---|---|---|---|---|---|---|")
    for b in batches:
        runs = [engine_run(engine, b, kind, 3, args.steps) for kind in (False, True) * args.repeats]
        # the machine is shared: of each kind's runs, the one with the fastest median step
        none = min(runs[0::2], key=lambda r: r["step_ms"])
        con = min(runs[1::2], key=lambda r: r["step_ms"])
        over = (con["step_ms"] - none["step_ms"]) / none["step_ms"] * 100
        masks = sorted(r["mask_ms"] for r in runs[1::2])
        mask = statistics.median(masks)
        spread = f" ({masks[0]:.1f}-{masks[-1]:.1f})" if len(masks) > 1 else ""
        print(f"| {b} | {none['step_ms']:.1f} | {con['step_ms']:.1f} | {mask:.2f}{spread} | "
              f"{con['advance_ms']:.2f} | {over:+.1f}% | {mask / none['step_ms'] * 100:.1f}% |")
    engine.close()
