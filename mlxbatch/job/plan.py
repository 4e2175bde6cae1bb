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

from mlxbatch.engine.loader import resolve_path
from mlxbatch.engine.planner import plan
from mlxbatch.io import InputFormat, InputSpec, open_reader, resolve_inputs
from mlxbatch.job.prepare import RowPreparer
from mlxbatch.job.spec import JobSpec
from mlxbatch.job.tokenize import PromptEncoder

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
        ])


def _kv_bytes_per_token(model_dir: Path) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = int(cfg.get("num_attention_heads", 1))
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 0)) // max(1, heads))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return 2 * int(cfg.get("num_hidden_layers", 0)) * kv_heads * head_dim * 4


def plan_job(spec: JobSpec, window: int = DEFAULT_WINDOW) -> PlanReport:
    from mlx_lm.utils import load_tokenizer  # tokenizer files only: no weights are read

    t0 = time.perf_counter()
    model_dir = Path(resolve_path(spec.model.path))
    tok = load_tokenizer(model_dir)
    ispec = InputSpec(spec.input.path, format=spec.input.format, id_column=spec.input.id_column, split=spec.input.split)
    openai = any(r.format is InputFormat.OPENAI_BATCH for r in resolve_inputs(ispec))
    preparer = RowPreparer(spec, "plan", openai)
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
    return PlanReport(rows, planned, skipped, total, distinct, saving, peak, _kv_bytes_per_token(model_dir),
                      windows > 1, window, time.perf_counter() - t0)


def as_dict(r: PlanReport) -> dict[str, Any]:
    return {**{k: getattr(r, k) for k in r.__dataclass_fields__}, "peak_retained_bytes": r.peak_retained_bytes}
