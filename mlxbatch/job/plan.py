"""``mlxbatch plan``: a dry run that tokenizes a job's prompts and plans it, without loading model weights.

Owns the plan report: rows, prompt tokens, the distinct-trie-token floor (the least prefill any order can do),
the expected prefill saving, and the peak KV the plan retains for shared prefixes. Prompts are rendered one by one
and tokenized in large batches through the fast tokenizer, exactly as the engine would tokenize them (text prompts
with the tokenizer's special tokens, chat renders without). Rows are kept as compact ``array('i')`` token sequences
(4 bytes a token); jobs larger than ``window`` rows are planned window by window while the input is read, so
memory holds one window, whatever the job's size.
"""

from __future__ import annotations

import json
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxbatch.engine import PromptEncoder, is_vlm_folder, plan, resolve_path
from mlxbatch.io import InputFormat, InputSpec, open_reader, resolve_inputs
from mlxbatch.job.prepare import RowPreparer
from mlxbatch.job.spec import JobSpec

DEFAULT_WINDOW = 100_000
TOKENIZE_BATCH = 4096


@dataclass(frozen=True)
class PlanReport:
    rows: int
    planned_rows: int
    skipped_rows: int  # rows that cannot run (input or render errors, prompts the tokenizer rejects)
    prompt_tokens: int
    distinct_tokens: int
    saving: float
    peak_retained_tokens: int
    kv_bytes_per_token: int
    windowed: bool
    window: int
    seconds: float
    eta: Eta | None = None

    @property
    def peak_retained_bytes(self) -> int:
        return self.peak_retained_tokens * self.kv_bytes_per_token

    def summary(self) -> str:
        return "\n".join([
            f"rows: {self.rows} ({self.planned_rows} planned, {self.skipped_rows} would be error rows)",
            f"prompt tokens: {self.prompt_tokens}",
            f"distinct trie tokens (prefill floor): {self.distinct_tokens}",
            f"expected prefill saving: {self.saving:.1%} (prefill {self.distinct_tokens} instead of "
            f"{self.prompt_tokens} tokens)",
            f"peak shared-prefix KV retained: {self.peak_retained_tokens} tokens "
            f"({self.peak_retained_bytes / 2**20:.1f} MiB at {self.kv_bytes_per_token} bytes/token, float32)",
            f"planned {'in windows of ' + str(self.window) + ' rows' if self.windowed else 'whole'} "
            f"in {self.seconds:.1f} s",
        ] + ([self.eta.summary()] if self.eta is not None else []))


@dataclass(frozen=True)
class Eta:
    """A rough run time from FLOPs and bytes: the plan's prefill floor and every row at ``max_tokens``."""

    prefill_s: float
    decode_s: float
    matmul_gflops: float
    bandwidth_gbs: float

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    def summary(self) -> str:
        return (f"ETA: ~{self.total_s / 60:.1f} min (prefill {self.prefill_s:.0f} s, decode <= {self.decode_s:.0f} s) "
                f"on this device ({self.matmul_gflops:.0f} GFLOP/s matmul, {self.bandwidth_gbs:.0f} GB/s measured); "
                "an estimate: every row generating max_tokens, attention and host time not counted")


def _config(model_dir: Path) -> dict[str, Any]:
    cfg = json.loads((model_dir / "config.json").read_text())
    return cfg.get("text_config", cfg)


def estimate(spec: JobSpec, model_dir: Path, rows: int, floor_tokens: int) -> Eta | None:
    """FLOPs of the plan's prefill floor and of decoding every row to ``max_tokens`` at ``max_num_seqs`` rows a
    step, over this device's measured matmul speed and memory bandwidth (decode steps are bound by the larger of
    reading every weight and the batch's FLOPs). No weights are loaded: sizes come from config.json."""
    import mlx.core as mx

    from mlxbatch.engine import measure_device_speed as measure

    c = _config(model_dir)
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
    on_gpu = mx.default_device() == mx.gpu
    dtype = "bfloat16" if on_gpu else "float32"
    speed = measure(h, inter, dtype)
    weight_bytes = (body + head) * (2 if on_gpu else 4)
    p = spec.sampling.params
    new_tokens = 0 if spec.task.kind == "score" else rows * p.max_tokens * p.n
    C = spec.engine.max_num_seqs
    step = max(weight_bytes / speed.bandwidth, 2 * (body + head) * C / speed.matmul_flops)
    prefill = (2 * body * floor_tokens + 2 * head * rows) / speed.matmul_flops
    return Eta(prefill, -(-new_tokens // C) * step, speed.matmul_flops / 1e9, speed.bandwidth / 1e9)


def _kv_bytes_per_token(model_dir: Path) -> int:
    cfg = _config(model_dir)
    heads = int(cfg.get("num_attention_heads", 1))
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 0)) // max(1, heads))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return 2 * int(cfg.get("num_hidden_layers", 0)) * kv_heads * head_dim * 4


def plan_job(spec: JobSpec, window: int = DEFAULT_WINDOW, with_eta: bool = True) -> PlanReport:
    from mlx_lm.utils import load_tokenizer  # tokenizer files only: no weights are read

    t0 = time.perf_counter()
    model_dir = Path(resolve_path(spec.model.path))
    tok = load_tokenizer(model_dir)
    ispec = InputSpec(spec.input.path, format=spec.input.format, id_column=spec.input.id_column, split=spec.input.split)
    openai = any(r.format is InputFormat.OPENAI_BATCH for r in resolve_inputs(ispec))
    preparer = RowPreparer(spec, "plan", openai, takes_images=is_vlm_folder(model_dir))
    seqs: list[array[int]] = []
    rows = skipped = planned = windows = total = distinct = peak = 0

    def plan_window(n: int) -> None:
        """Plan the first ``n`` pending rows as one window and drop them: memory stays one window deep."""
        nonlocal planned, windows, total, distinct, peak
        p = plan(seqs[:n])
        del seqs[:n]
        planned, windows = planned + n, windows + 1
        total, distinct = total + p.total_tokens, distinct + p.distinct_tokens
        peak = max(peak, p.peak_retained_tokens())

    batch: list[Any] = []  # prompts waiting to be tokenized together
    encoder = PromptEncoder(tok)

    def flush() -> None:
        nonlocal skipped
        for ids in encoder.encode_many(batch):
            if isinstance(ids, str):  # the engine would reject it: an error row, not part of the plan
                skipped += 1
            else:
                seqs.append(array("i", ids))
        batch.clear()

    for row in open_reader(ispec):
        rows += 1
        prep = preparer.prepare(row)
        if prep.error is not None or prep.prompt is None:
            skipped += 1
            continue
        batch.append(prep.prompt)
        if len(batch) >= TOKENIZE_BATCH:
            flush()
            while len(seqs) >= window:
                plan_window(window)
    flush()
    while seqs:
        plan_window(min(window, len(seqs)))
    saving = 1 - distinct / total if total else 0.0
    seconds = time.perf_counter() - t0
    eta = estimate(spec, model_dir, planned, distinct) if with_eta else None
    return PlanReport(rows, planned, skipped, total, distinct, saving, peak, _kv_bytes_per_token(model_dir),
                      windows > 1, window, seconds, eta)


def as_dict(r: PlanReport) -> dict[str, Any]:
    out = {**{k: getattr(r, k) for k in r.__dataclass_fields__}, "peak_retained_bytes": r.peak_retained_bytes}
    if r.eta is not None:
        out["eta"] = {**{k: round(getattr(r.eta, k), 4) for k in r.eta.__dataclass_fields__},
                      "total_s": round(r.eta.total_s, 4)}
    return out
