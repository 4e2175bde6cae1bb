"""The batch an engine runs when its config does not size it: ``max_num_seqs`` and ``max_num_batched_tokens`` from
the device, the KV budget, the model's KV bytes per token (inside the runner's ``kv_cost``) and the rows' expected
length.

Owns the rule (one definition). A value the config sets always wins. The scheduler admits a row only when every
running row's KV at its reserved length (prompt + max_tokens) fits the slot budget, so ``max_num_seqs`` is a cap on
top of memory: the rows a step usefully runs on this device (``seq_cap``), lowered to the rows the budget holds at
the expected length when that is fewer. The expected length is a hint (``expected_row_tokens``: a job passes its
``max_tokens``, which admission reserves a row on top of its prompt), so the cap errs high rather than low: admission
still charges each row its own length. vLLM sizes the same way, with fixed tables by device class (offline: 256 sequences
and 8192 tokens, 1024 and 16384 on GPUs of 70 GiB or more) over a KV pool sized from its memory share.

The device caps, and why:
- CUDA: a decode step is bound by the host's work and the weights' read, not by the rows (H100, 0.5B shape: 15.6k
  tok/s at 64 rows, 52.8k at 256, 3.7 ms of host work a step either way; docs/benchmarks.md), so rows up to 256 are
  nearly free: 256 from 20 GiB, 128 below. On GPUs of 70 GiB or more, 1024 rows and 16384-token steps (vLLM's
  offline table for that class): a step's fixed host work (MLX encoding ~100 matmuls, ~8 ms on an H100) is paid
  once for 4x the rows, and steps overlap with the launch thread (``engine.launcher``): issue 47's 100k-row
  labeling job ran at 2,386 rows/s with 256 rows x 4096 tokens, 2,688 with 512 x 8192 and 2,820 / 2,728 with
  1024 x 16384 (H100, one lease, `3fb1924`; MLX's peak 4.3, 6.9 and 9.5 GB). Rows with few new tokens are bound
  by the step's tokens rather than by this cap: with T prefill tokens a step, prompts of P tokens computed and N new
  tokens, about T x N / (P + N) rows are in flight (4096 x 8 / 145: ~230 for that job), whatever the cap above it.
- Metal: the same reasoning on a smaller GPU and a smaller memory shared with macOS: by the machine's RAM (a proxy
  for the chip: base, Pro, Max / Ultra), 64 up to 16 GiB, 128 up to 48 GiB, 256 above.
- CPU: compute-bound; a step's cost grows with its rows, and batching saves the per-step host work only: 128
  (measured on issue 47's labeling job with the tiny model: within a few percent of the best of 16-512).

``max_num_batched_tokens`` (prefill tokens a step, decode rows included) is the device's step size
(``default_step_tokens``), raised to twice ``max_num_seqs`` when that is more, so that a step's decode rows leave
half of it to prefill. Pure Python: device facts are injected (``DeviceFacts``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxbatch.engine.sched.step import KVCost

GiB = 1 << 30
LARGE_GPU = 70 * GiB  # a CUDA GPU with this much memory or more (H100, H200, A100 80 GB) gets the large batch
SMALL_MAC = 16 * GiB  # a Mac with this much RAM or less gets smaller defaults (engine.model.memory too)
MOST_ROWS = 1 << 16  # rows_in_budget looks no further


@dataclass(frozen=True)
class DeviceFacts:
    kind: str  # "cuda" | "metal" | "cpu"
    memory: int  # CUDA: the GPU's memory; Metal and CPU: the machine's RAM (a Mac's chip class goes with it)


@dataclass(frozen=True)
class BatchSize:
    """What an engine runs a step, and where each figure came from (the report and the log line show it)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    seqs_from: str  # "set" | "device" | "memory"
    tokens_from: str  # "set" | "device" | "rows"
    budget_rows: int | None = None  # rows of the expected length the slot budget holds (``rows_in_budget``)

    @property
    def chosen(self) -> bool:
        """Whether either figure was chosen here rather than set."""
        return self.seqs_from != "set" or self.tokens_from != "set"

    def describe(self) -> str:
        if self.seqs_from == "set":
            seqs = "set in the config"
        elif self.seqs_from == "memory":
            seqs = "what the KV budget holds at the expected row length"
        else:
            held = self.budget_rows or 0
            seqs = f"the device's default; the KV budget holds {held:,}{'+' if held >= MOST_ROWS else ''} rows"
        tokens = {"set": "set in the config", "device": "the device's default",
                  "rows": "twice max_num_seqs"}[self.tokens_from]
        return (f"max_num_seqs {self.max_num_seqs} ({seqs}), max_num_batched_tokens {self.max_num_batched_tokens} "
                f"({tokens})")

    def as_dict(self) -> dict[str, object]:
        return {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                "max_num_seqs_from": self.seqs_from, "max_num_batched_tokens_from": self.tokens_from,
                "rows_in_kv_budget": self.budget_rows}


def seq_cap(device: DeviceFacts) -> int:
    """The most rows a step usefully runs on this device (the module's docstring says why)."""
    if device.kind == "cuda":
        return 1024 if device.memory >= LARGE_GPU else 256 if device.memory >= 20 * GiB else 128
    if device.kind == "metal":
        return 64 if device.memory <= SMALL_MAC else 128 if device.memory <= 48 * GiB else 256
    return 128


def device_defaults(device: DeviceFacts) -> BatchSize:
    """The batch on this device before a model's memory is known (``mlxbatch info``, ``mlxbatch plan``): a run may
    choose fewer rows, where its KV budget holds fewer at its rows' length."""
    seqs = seq_cap(device)
    tokens, tokens_from = _step_tokens(device, seqs)
    return BatchSize(seqs, tokens, "device", tokens_from)


def _step_tokens(device: DeviceFacts, seqs: int) -> tuple[int, str]:
    """A step's tokens for ``seqs`` rows: the device's step size, or twice the rows where that is more (a step's
    decode rows leave half of it to prefill)."""
    step = default_step_tokens(device.kind, device.memory)
    return (step, "device") if step >= 2 * seqs else (2 * seqs, "rows")


def default_step_tokens(kind: str, memory: int) -> int:
    """Prefill tokens per step (``memory``: a GPU's, or the machine's RAM): a multi-second step on a base M-series
    chip stalls every decoding row (and the desktop). On CUDA 4096, and 16384 on GPUs of 70 GiB or more (the module's
    docstring): a step's transient grows with its prefill tokens (activations, attention scores) and MLX's memory
    limit only slows it (``MemoryLimits.step_bound``): 8192-token steps overshot the 2 GiB step bound to 4.1-4.4 GiB
    on the H200 (0.5B shape), 16384-token ones peaked at 9.5 GB of MLX memory on an H100 (weights and 3 GB of KV
    included), room such a GPU has."""
    if kind == "cpu":
        return 2048
    if kind == "metal":
        return 2048 if memory <= SMALL_MAC else 4096 if memory <= 48 * GiB else 8192
    return 16384 if memory >= LARGE_GPU else 4096


def rows_in_budget(slot_budget: int, kv_cost: KVCost, row_tokens: int | None) -> int:
    """The most rows of ``row_tokens`` each (None: one token, the layout's smallest reservation) whose KV fits the slot
    budget as admission charges it (``kv_cost``: the runner's layout), in powers of two: the slot layout's rows grow
    so (``kv.slots.row_capacity``), and a cap between two would hold memory it never fills. 0: not even one."""
    length = max(1, row_tokens or 1)
    if kv_cost([length]) > slot_budget:
        return 0
    n = 1
    while n < MOST_ROWS and kv_cost([length] * (2 * n)) <= slot_budget:
        n *= 2
    return n


def size_batch(device: DeviceFacts, slot_budget: int, kv_cost: KVCost, expected_row_tokens: int | None,
               max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None) -> BatchSize:
    """The batch for an engine: ``max_num_seqs`` / ``max_num_batched_tokens`` as set (None: chosen here)."""
    if max_num_seqs is not None:
        seqs, seqs_from, held = max_num_seqs, "set", None
    else:
        held = rows_in_budget(slot_budget, kv_cost, expected_row_tokens)
        cap = seq_cap(device)
        seqs, seqs_from = (cap, "device") if held >= cap else (max(1, held), "memory")
    if max_num_batched_tokens is not None:
        return BatchSize(seqs, max_num_batched_tokens, seqs_from, "set", held)
    tokens, tokens_from = _step_tokens(device, seqs)
    return BatchSize(seqs, tokens, seqs_from, tokens_from, held)
