"""The ETA of ``mlxbatch plan``: measured on this machine with the job's own model, settings and first rows.

Owns the calibration. The model is loaded through the engine's public API and an ``EngineCore`` is built with the
job's engine settings (its start-up is timed: the run pays it too), warmed up on the start of the first row. Then
short real phases on the job's first rows (as many as run at once):
1. **prefill**: the first rows (as many as run at once, up to ``PREFILL_PROBE_TOKENS`` predicted prefill tokens),
   each with the sampling the run gives it (``output.choice`` / ``regex`` / ``json_schema`` or its
   ``constraint_column`` value, overrides, seed) and one token, submitted as the run submits them (the plan's order
   and retention): seconds per prefill token the engine computed, so the rate holds what the engine does for such
   rows (prefix copies, reuse), and the plan's prediction of the run's prefill tokens (within 2% of the run's count)
   scales it. (Submitted in input order, the demo's first 32 rows computed 873 tokens against a floor of 512: the
   rate per predicted token was 1.7x the run's.) A row that ended on that token (a one-token label, an EOS) is
   as long as the run makes it;
2. **length**: the other rows again, with the same sampling, ``max_tokens`` capped at ``DECODE_PROBE_TOKENS``: how
   many tokens a row generates (rows the cap cut are counted at their ``max_tokens``, an upper bound). (Every row
   ran again before: the demo's one-token rows recomputed 376 of their 416 prompt tokens to learn nothing new);
3. **step**: only where some row decodes (rows of one token take theirs from the prefill step): as many short rows
   as the run keeps running at once, a few greedy tokens each: seconds per decode step at the run's batch size; the
   length phase's own decode steps (the first rows' contexts, rows finishing and moving) when they take longer.
ETA = start-up + predicted prefill tokens x seconds per token + decode steps x seconds per step + host time
(preparing and tokenizing every row twice: the run's feed and its final pass; timed by the plan).
Without weights (a tokenizer-only folder) ``estimate`` gives the older FLOPs figure: the plan's prefill and every
row at ``max_tokens`` over this device's measured matmul speed and memory bandwidth.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxbatch.job.check.model_size import config_sizes, read_config
from mlxbatch.job.spec import JobSpec

DECODE_PROBE_TOKENS = 24  # generated tokens per row at most while measuring how long rows are
PREFILL_PROBE_TOKENS = 1024  # predicted prefill tokens of the first rows timed for prefill, at most
# the short rows that time a decode step at the run's batch size: a decode step's cost is the weights and the rows,
# their few keys hardly count, so their prompts are 2 tokens (8 before: 320 prompt tokens for label's 40 rows, the
# probe's cost, and no other step time)
STEP_PROBE_PROMPT, STEP_PROBE_TOKENS = 2, 6
WARM_UP_TOKENS = 16  # the warm-up runs the first row's start (first kernels, buffers; label's whole row: 5 s on a CPU)


@dataclass(frozen=True)
class Eta:
    prefill_s: float
    decode_s: float
    method: str = "flops"  # measured (a real run of the model here) | flops (no weights: an estimate from sizes)
    startup_s: float = 0.0
    host_s: float = 0.0
    matmul_gflops: float | None = None
    bandwidth_gbs: float | None = None
    prefill_s_per_token: float | None = None
    decode_s_per_step: float | None = None
    tokens_per_row: float | None = None  # generated tokens per row (measured on the first rows)

    @property
    def total_s(self) -> float:
        return self.startup_s + self.prefill_s + self.decode_s + self.host_s

    def summary(self) -> str:
        if self.method == "measured":
            # rows of one token (a label, scored rows) take no decode step: none was timed
            step = f"{self.decode_s_per_step:.3f} s a decode step" if self.decode_s_per_step else "no decode steps"
            return (f"ETA: ~{self.total_s / 60:.1f} min ({self.total_s:.0f} s: start {self.startup_s:.0f} s, prefill "
                    f"{self.prefill_s:.0f} s, decode {self.decode_s:.0f} s, host {self.host_s:.0f} s), measured on "
                    f"this machine: {1 / max(self.prefill_s_per_token or 1e-9, 1e-9):.0f} prefill tok/s, "
                    f"{step}, ~{self.tokens_per_row or 0:.1f} tokens a row")
        return (f"ETA: ~{self.total_s / 60:.1f} min (prefill {self.prefill_s:.0f} s, decode <= {self.decode_s:.0f} s) "
                f"on this device ({self.matmul_gflops or 0:.0f} GFLOP/s matmul, {self.bandwidth_gbs or 0:.0f} GB/s "
                "measured); an estimate from FLOPs, not measured (--no-calibrate, or no weights here): every row "
                "generating max_tokens, attention and host time not counted")

    def as_dict(self) -> dict[str, Any]:
        out = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items()}
        return {**out, "total_s": round(self.total_s, 4)}


def _engine(spec: JobSpec, loaded: Any) -> Any:
    from mlxbatch.engine import EngineCore
    from mlxbatch.job.executors.base import engine_config, row_tokens_hint

    return EngineCore(loaded, engine_config(spec.engine, spec.seed, row_tokens_hint(spec)))


@dataclass(frozen=True)
class _Probe:
    wall_s: float
    prefill_tokens: int  # computed by the engine
    decode_step_s: float | None  # the median step that computed no prefill
    outputs: list[Any]


def _run(core: Any, prompts: list[Any], params: Any, cache_tokens: list[int | None] | None = None) -> _Probe:
    """Run ``prompts`` to the end (``params``: one ``SamplingParams`` for all, or a list, one per prompt; with the
    plan's ``cache_tokens``, one per prompt), timing each engine step. Outputs come in the prompts' order."""
    before = core.stats()["profile"]["prefill_tokens"]
    t0 = time.perf_counter()
    per_row = params if isinstance(params, list) else [params] * len(prompts)
    keep = cache_tokens if cache_tokens is not None else [None] * len(prompts)
    order = {core.add_request(p, sp, cache_tokens=k): i
             for i, (p, sp, k) in enumerate(zip(prompts, per_row, keep, strict=True))}
    outs, decode_steps, done = [], [], before
    while core.has_unfinished:
        t1 = time.perf_counter()
        outs += [d.output for d in core.step() if d.output is not None]
        dt = time.perf_counter() - t1
        now = core.stats()["profile"]["prefill_tokens"]
        if now == done:
            decode_steps.append(dt)
        done = now
    decode_steps.sort()
    outs.sort(key=lambda o: order[o.request_id])
    return _Probe(time.perf_counter() - t0, done - before,
                  decode_steps[len(decode_steps) // 2] if decode_steps else None, outs)


def measured_eta(spec: JobSpec, loaded: Any, sample: list[Any], prefill_tokens: int, gen_rows: int,
                 host_s: float, predicted: Callable[[list[Any]], int],
                 sample_params: list[Any] | None = None) -> Eta | None:
    """The ETA from short real runs of the job's first rows ``sample`` (token ids or encoded prompts).
    ``predicted(rows)`` is the plan's prefill prediction for those rows alone (it sizes the probe); prefill is timed
    per token the engine computed, the probe's rows submitted in the plan's order with its retention.
    ``sample_params``: each sample row's ``SamplingParams`` as the run prepares it (output constraint included);
    None: the job's sampling with its output constraint (``output.choice`` / ``regex`` / ``json_schema``)."""
    from mlxbatch.types import SamplingParams

    if not sample:
        return None
    probe = sample[:1]  # the first rows, as many as run at once, up to PREFILL_PROBE_TOKENS predicted tokens
    for p in sample[1:]:
        if predicted(probe + [p]) > PREFILL_PROBE_TOKENS:
            break
        probe.append(p)
    params = spec.sampling.params
    if spec.task.constraint is not None:
        params = dataclasses.replace(params, constraint=spec.task.constraint)
    # each probe row's sampling as the run gives it (scored rows generate nothing: one greedy token each)
    rows = (list(sample_params[:len(probe)]) if sample_params else [params] * len(probe)) if gen_rows \
        else [SamplingParams(temperature=0, max_tokens=1)] * len(probe)
    t0 = time.perf_counter()
    core = _engine(spec, loaded)
    startup = time.perf_counter() - t0
    try:
        warm = sample[0][:WARM_UP_TOKENS] if isinstance(sample[0], list) else sample[0]
        _run(core, [warm], SamplingParams(temperature=0, max_tokens=2))  # warm-up: first kernels, buffers
        core.shutdown()
        core = _engine(spec, loaded)  # a fresh prefix cache: the probe computes what the run would
        if any(p.constraint is not None for p in rows):
            _ = core.compiler  # built once per run, before its first step: not a cost of each token
        order, keep = _as_planned(probe, core.reuse_step)
        firsts = [_capped(rows[i], spec.seed, 1) for i in order]
        first = _run(core, [probe[i] for i in order], firsts, keep)
        per_token = first.wall_s / max(first.prefill_tokens, 1)
        decode_s = step = per_row = 0.0
        if gen_rows:
            # how long rows are: a row that ended on its first token is done (its length is the run's); the others
            # run again (their prompts' retained prefixes cached), capped at DECODE_PROBE_TOKENS
            lengths: list[int | None] = [None] * len(probe)
            for i, c, o in zip(order, firsts, first.outputs, strict=True):
                lengths[i] = _length(rows[i], c, o) if rows[i].n == 1 else None
            again = [i for i, n in enumerate(lengths) if n is None]
            own = None
            if again:
                capped = [_capped(rows[i], spec.seed) for i in again]
                own = _run(core, [probe[i] for i in again], capped)
                for i, c, o in zip(again, capped, own.outputs, strict=True):
                    n = _length(rows[i], c, o)
                    lengths[i] = rows[i].max_tokens * rows[i].n if n is None else n  # cut by the cap: an upper bound
            per_row = sum(lengths) / len(lengths)  # type: ignore[arg-type]
            longest = max(lengths)  # type: ignore[type-var]
            if longest > 1:
                # a decode step at the run's batch size: as many short rows as run at once
                at_once = max(1, min(core.config.max_num_seqs, gen_rows * params.n))
                short = [list(range(7 + i, 7 + i + STEP_PROBE_PROMPT)) for i in range(at_once)]
                timed = _run(core, short, SamplingParams(temperature=0, max_tokens=STEP_PROBE_TOKENS, ignore_eos=True))
                # the larger of the short rows' step at the run's batch size and the first rows' own decode step
                # (their contexts' attention, the rows that finish and move): the run's steps have both (label: 0.14
                # and 0.35 s on 2 CPU cores, the run's 0.43)
                step = max(timed.decode_step_s or 0.0, (own.decode_step_s if own else None) or 0.0)
                # continuous batching packs rows: all tokens over the rows at once, plus the last wave's longest
                # rows (rows admitted in waves decode a step behind their prefill, so the first token counts too);
                # rows of one token (a one-token label) take theirs from the prefill step and need no decode step
                steps = math.ceil(gen_rows * per_row / at_once) + longest - per_row
                decode_s = steps * step
    finally:
        core.shutdown()
    return Eta(per_token * prefill_tokens, decode_s, "measured", startup, host_s, prefill_s_per_token=per_token,
               decode_s_per_step=step, tokens_per_row=per_row)


def _as_planned(rows: list[Any], reuse_step: int = 1) -> tuple[list[int], list[int | None]]:
    """The order the run submits ``rows`` in and each one's retention, as the job's feed plans a window (with the
    engine's ``reuse_step``): text rows (token id lists) in the plan's submission order, then rows with images in
    input order."""
    from mlxbatch.engine import plan, submission_order

    text = [i for i, r in enumerate(rows) if isinstance(r, list)]
    subs = submission_order(plan([rows[i] for i in text], min_step_tokens=reuse_step)) if text else []
    order = [text[s.index] for s in subs] + [i for i, r in enumerate(rows) if not isinstance(r, list)]
    keep = [s.cache_tokens for s in subs] + [None] * (len(rows) - len(subs))
    return order, keep


def _capped(params: Any, seed: int, cap: int = DECODE_PROBE_TOKENS) -> Any:
    """A row's sampling for a probe: ``max_tokens`` (and ``min_tokens``) capped at ``cap``; one sample for the
    prefill phase's one token (``cap`` 1)."""
    capped = dataclasses.replace(params, max_tokens=min(params.max_tokens, cap), min_tokens=min(params.min_tokens, cap),
                                 **({"n": 1} if cap == 1 else {}))
    if capped.seed is None and not capped.greedy:
        capped = dataclasses.replace(capped, seed=seed)
    return capped


def _length(params: Any, capped: Any, out: Any) -> int | None:
    """Tokens the run generates for a row whose probe ran with ``capped`` and gave ``out``; None where the cap cut
    it (the run goes on)."""
    from mlxbatch.types import FinishReason

    if capped.max_tokens < params.max_tokens and out.finish_reason is FinishReason.LENGTH:
        return None
    return out.generated_tokens


def estimate(spec: JobSpec, model_dir: Path, rows: int, floor_tokens: int, new_tokens: int,
             max_num_seqs: int) -> Eta | None:
    """FLOPs of the predicted prefill and of decoding ``new_tokens`` at ``max_num_seqs`` rows a step, over this
    device's measured matmul speed and memory bandwidth (decode steps are bound by the larger of reading every
    weight and the batch's FLOPs). No weights are loaded: sizes come from config.json."""

    from mlxbatch.engine import measure_device_speed as measure

    _, c = read_config(model_dir)
    try:
        h, layers, inter = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["intermediate_size"])
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or h // heads)
        kv = int(c.get("num_key_value_heads") or heads) * head_dim
        vocab = int(c["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return None  # an architecture whose config this estimate does not know
    body = layers * (2 * h * heads * head_dim + 2 * h * kv + 3 * h * inter)
    head = vocab * h
    sizes = config_sizes(model_dir, spec.model.dtype)
    speed = measure(h, inter, sizes.dtype)
    weight_bytes = (body + head) * sizes.weight_bytes_per_param  # 4-bit checkpoints read a quarter of fp16's
    C = max_num_seqs
    step = max(weight_bytes / speed.bandwidth, 2 * (body + head) * C / speed.matmul_flops)
    prefill = (2 * body * floor_tokens + 2 * head * rows) / speed.matmul_flops
    return Eta(prefill, -(-new_tokens // C) * step, "flops", matmul_gflops=speed.matmul_flops / 1e9,
               bandwidth_gbs=speed.bandwidth / 1e9)
