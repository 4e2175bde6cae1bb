"""The mask cost of constrained decoding inside the engine (``mlxbatch bench constraints --engine``).

Decode-step time with every row under a long-lived JSON schema against none, at each ``--batches`` size, and the
time in the grammar calls themselves (mask fill + apply, matcher advance). A step counts when it is a pure decode
step of all rows: no prefill tokens and exactly one decode token per row (read from ``Engine.stats()``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx

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


@contextmanager
def timed_grammar_calls(engine: Engine) -> Iterator[dict[str, list[float]]]:
    """Seconds of each mask (``constrain``, evaluated) and ``advance`` call of the runner's grammars, while open.

    The engine exposes no per-step grammar timing, so this reaches the runner's ``SequenceGrammars`` (a private
    attribute) and wraps its two methods on that one instance; they are restored on exit.
    """
    grammars = engine.core.runner._grammars
    timing: dict[str, list[float]] = {"mask": [], "advance": []}
    constrain, advance = grammars.constrain, grammars.advance

    def timed_constrain(ids: list[str], logits: mx.array) -> mx.array:
        t0 = time.perf_counter()
        out = constrain(ids, logits)
        mx.eval(out)  # the step's logits are evaluated already: this is the mask alone
        timing["mask"].append(time.perf_counter() - t0)
        return out

    def timed_advance(ids: list[str], toks: list[int]) -> None:
        t0 = time.perf_counter()
        advance(ids, toks)
        timing["advance"].append(time.perf_counter() - t0)

    grammars.constrain, grammars.advance = timed_constrain, timed_advance
    try:
        yield timing
    finally:
        del grammars.constrain, grammars.advance


def _profile(engine: Engine) -> tuple[int, int]:
    p = engine.stats()["profile"]
    return p["prefill_tokens"], p["decode_tokens"]


def engine_run(engine: Engine, rows: int, constrained: bool, warm: int, steps: int) -> dict[str, Any]:
    """Median decode-step time (all ``rows`` decoding) and, when constrained, the time in the mask and advance."""
    core = engine.core
    constraint = OutputConstraint.json_schema(ENGINE_SCHEMA) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=warm + steps + 8, ignore_eos=True, constraint=constraint)
    ids = [core.add_request(f"Record {i}: write the records as JSON.", params) for i in range(rows)]
    step_s = []
    with timed_grammar_calls(engine) as timing:
        try:
            while len(step_s) < warm + steps and core.has_unfinished:
                prefill_before, decode_before = _profile(engine)
                timing["mask"].clear()
                timing["advance"].clear()
                t0 = time.perf_counter()
                core.step()
                dt = time.perf_counter() - t0
                prefill_after, decode_after = _profile(engine)
                if prefill_after == prefill_before and decode_after - decode_before == rows:
                    step_s.append((dt, sum(timing["mask"]), sum(timing["advance"])))
        finally:
            for rid in ids:
                core.abort(rid)
            core.step()
    meas = step_s[warm:]
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return {"step_ms": med([m[0] for m in meas]), "mask_ms": med([m[1] for m in meas]),
            "advance_ms": med([m[2] for m in meas]), "steps": len(meas)}


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
