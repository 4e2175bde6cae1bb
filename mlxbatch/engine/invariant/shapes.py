"""Batch-invariant forward shapes: every operation a row goes through has a shape fixed by that row alone.

Owns the shape rules of ``EngineConfig(batch_invariant=True)`` and the slot layout that runs them
(``InvariantSlots``). Why rows differ otherwise (measured on CPU, float32, OpenBLAS 0.3.21; see
docs/architecture.md, "Batch invariance"): a kernel's reduction order is a function of the shapes it is called
with, and in a batched forward those shapes depend on the other rows. The matmul of the linear layers takes
``M`` = rows x tokens of the whole forward (OpenBLAS switches to a small-matrix kernel when ``M * N <= 1200``;
cuBLASLt and MLX's Metal GEMM pick tiles, split-K and GEMV paths by ``M``); attention takes the key length of the
longest row (``N``: OpenBLAS small kernels below ``T * N <= 1200``; Metal and CUDA decode kernels switch from one
pass to two at ~1024 keys and pick their split by ``N``) and the query width (``T``: the vector kernel below 9
queries). So in these forwards:

- **Key width.** A row's queries read exactly ``kv_width(n)`` keys, where ``n`` is the row's own length after the
  forward (a bucket: 256, 512, 768, 1024, 1536, 2048, ...), through an array mask. Rows of different buckets never
  share a forward.
- **Query width.** Decode runs ``T = 1``; prefill runs slices of exactly ``slice_tokens`` tokens (the last one
  right-padded), starting at multiples of ``slice_tokens``, so a position is always computed in the same slice,
  whatever the step's token budget, and a cached block's KV is the KV a cold run computes.
- **Rows.** ``exact`` (GPU): every forward holds exactly ``decode_rows`` / ``prefill_rows`` rows and the LM head
  exactly ``head_rows`` (padding rows are computed and dropped), so every kernel is chosen by the same shapes.
  Otherwise (CPU) at least that many: above OpenBLAS's small-matrix cut-off every ``M`` runs the same blocked
  kernel (measured: one result class for every ``M`` from 10 to 2048), and MLX's own bfloat16/float16 CPU GEMM
  reduces in a fixed order whatever ``M`` (no floor needed).

The rules rest on one assumption: a kernel's per-row result is a function of the call's shapes, not of the row's
position in the batch or of other rows' values (true of every GEMM without cross-row reductions and of attention
kernels, which treat batch entries independently). ``check_rows`` tests it once per engine; what differs per backend
is only which shapes must be fixed exactly (``shapes_for``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from mlxbatch.engine.kv.slots import POSITION_STEP
from mlxbatch.engine.sched.blocks import BLOCK_SIZE

KV_WIDTH_STEP = 256
OPENBLAS_SMALL_MN = 1200  # OpenBLAS (0.3.x, x86-64) runs x @ W.T through its small-matrix kernel when M * N <= this
ENV_OVERRIDE = "MLXBATCH_INVARIANT_SHAPES"  # e.g. "slice=64,decode=128,prefill=8,head=128" (measurement only)


@dataclass(frozen=True)
class Shapes:
    slice_tokens: int  # prefill query width, and the alignment of prefill chunks and of reused prefixes
    decode_rows: int  # rows of a decode forward
    prefill_rows: int  # rows of a prefill forward
    head_rows: int  # rows of an LM-head call
    exact: bool  # True: forwards hold exactly these many rows; False: at least these many

    def __post_init__(self) -> None:
        assert self.slice_tokens >= 1 and min(self.decode_rows, self.prefill_rows, self.head_rows) >= 1

    def kv_width(self, n: int) -> int:
        """Keys read by queries whose row holds ``n`` positions after the forward: a multiple of 256 up to 1024,
        then 1536, 2048, 3072, 4096, ... (coarse enough that rows share forwards, fine enough that little of the
        attention reads padding)."""
        if n <= 1024:
            return max(KV_WIDTH_STEP, -(-n // KV_WIDTH_STEP) * KV_WIDTH_STEP)
        width = 1024
        while width < n:
            width = width * 3 // 2 if width & (width - 1) == 0 else width // 3 * 4
        return width

    def kv_cost_positions(self, reserved: Sequence[int]) -> int:
        """KV positions the slot buffers hold for sequences of these reserved lengths (``rows_cost_positions``)."""
        return self.rows_cost_positions(len(reserved), max(reserved)) if reserved else 0

    def rows_cost_positions(self, rows: int, longest: int) -> int:
        """KV positions the slot buffers hold for ``rows`` sequences of at most ``longest`` reserved positions: their
        rows plus the padding rows a forward may run past them, times the widest key width (in whole position
        steps)."""
        if not rows:
            return 0
        width = self.kv_width(longest + self.slice_tokens)
        return (rows + self.decode_rows) * -(-width // POSITION_STEP) * POSITION_STEP

    def spans(self, members: Sequence[int], rows: int) -> list[tuple[int, int]]:
        """Row ranges ``[lo, hi)`` of the forwards that run these rows (sorted row indices). ``exact``: ranges of
        exactly ``rows`` rows, each starting at a member; otherwise ranges of at least ``rows`` rows, split where
        members lie more than ``rows`` apart. Rows of a range that are not members pad it."""
        out: list[tuple[int, int]] = []
        k = 0
        while k < len(members):
            lo = members[k]
            if self.exact:
                hi = lo + rows
            else:
                e = k
                while e + 1 < len(members) and members[e + 1] - members[e] <= rows:
                    e += 1
                hi = max(members[e] + 1, lo + rows)
            out.append((lo, hi))
            while k < len(members) and members[k] < hi:
                k += 1
        return out


def shapes_for(device: str, dtype: str, smallest_out: int) -> Shapes:
    """The fixed shapes on this device for a model whose narrowest linear layer has ``smallest_out`` outputs
    (``MLXBATCH_INVARIANT_SHAPES`` overrides them, for measurements)."""
    if device == "cpu":
        slice_tokens = 16
        # float32 goes through OpenBLAS: at least enough token rows that no linear layer takes its small-matrix
        # kernel; MLX's own bfloat16 / float16 GEMM reduces in one order whatever M (no floor needed)
        floor = OPENBLAS_SMALL_MN // max(1, smallest_out) + 1 if dtype == "float32" else 1
        shapes = Shapes(slice_tokens, floor, -(-floor // slice_tokens), floor, exact=False)
    else:  # GPU: kernels are chosen by shape, so every forward has one of these shapes exactly
        shapes = Shapes(64, 128, 8, 128, exact=True)
    spec = os.environ.get(ENV_OVERRIDE, "")
    if spec:
        names = {"slice": "slice_tokens", "decode": "decode_rows", "prefill": "prefill_rows", "head": "head_rows"}
        kv = dict(part.split("=") for part in spec.split(",") if part)
        shapes = replace(shapes, **{names[k.strip()]: int(v) for k, v in kv.items() if k.strip() in names},
                         **({"exact": kv["exact"].strip() in ("1", "true")} if "exact" in kv else {}))
    if shapes.slice_tokens % BLOCK_SIZE:
        raise ValueError(f"{ENV_OVERRIDE}: slice={shapes.slice_tokens} must be a multiple of the prefix cache's "
                         f"{BLOCK_SIZE}-token blocks")
    return shapes


def smallest_linear_out(model: Any) -> int:
    """Outputs of the model's narrowest linear layer (its matmuls' smallest ``N``)."""
    import mlx.nn as nn

    outs = [m.weight.shape[0] for m in model.modules() if isinstance(m, nn.Linear | nn.QuantizedLinear)]
    return min(outs, default=1)


def check_rows(body: Any, head: Any, shapes: Shapes, vocab_size: int = 16) -> str | None:
    """Test the assumption the shapes rest on, once, on this device: a row's output does not change with the rows
    beside it, its position among them, or (``exact`` off) their number above the floor. Returns what failed (None:
    it held). A few small forwards of the body (``T = 1``, no cache, token ids below ``vocab_size``) and of the head."""
    import numpy as np

    rng = np.random.default_rng(0)

    def two_ways(rows: int) -> tuple[mx.array, mx.array, int]:
        """Token ids for ``rows`` rows, and for ``n`` rows holding the first one's token at row ``n // 2``."""
        n = rows if shapes.exact else 2 * rows + 3
        a = rng.integers(0, vocab_size, size=(rows, 1))
        b = rng.integers(0, vocab_size, size=(n, 1))
        b[n // 2, 0] = a[0, 0]
        return mx.array(a, dtype=mx.int32), mx.array(b, dtype=mx.int32), n // 2

    def same(out_a: mx.array, out_b: mx.array, at: int) -> bool:
        mx.eval(out_a, out_b)
        return np.array_equal(np.array(out_a[0].astype(mx.float32)), np.array(out_b[at].astype(mx.float32)))

    try:
        a, b, at = two_ways(shapes.decode_rows)
        if not same(body(a), body(b), at):
            return f"the model gives a row other bits among other rows ({a.shape[0]} vs {b.shape[0]} rows)"
        if head is not None:
            a, b, at = two_ways(shapes.head_rows)
            if not same(head(body(a)), head(body(b)), at):  # the body's rows are checked above: this is the head's
                return f"the LM head gives a row other bits among other rows ({a.shape[0]} vs {b.shape[0]} rows)"
    except (TypeError, ValueError):  # a body that needs more than token ids: nothing to check this way
        return None
    return None
