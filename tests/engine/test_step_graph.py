"""A decode step's host work per layer: the graph nodes a layer's KV write adds.

On a GPU a small model's decode step is bound by the host's work per graph node (building it in Python, MLX
encoding it: ~5-7 us each on an H200; docs/benchmarks.md), not by the device. A node added to every layer's write
costs every step ~2 x layers nodes; these tests count what a scatter-mode write (decode rows at different lengths,
the GPU path) adds per layer, so index arithmetic repeated per layer fails here rather than as a slower GPU step.
"""

from __future__ import annotations

import io
import re
from collections import Counter

import mlx.core as mx

from mlxbatch.engine.kv.slot_forward import plan_forward, write_kv

H, D, P = 2, 16, 64


def _nodes(*arrays: mx.array) -> Counter:
    buf = io.StringIO()
    mx.export_to_dot(buf, *arrays)
    return Counter(re.findall(r'label ="([^"]+)", shape=rectangle', buf.getvalue()))


def _decode_writes(layers: int, offsets: list[int], width: int = 1) -> tuple[Counter, list[mx.array]]:
    """The graph of one pass's KV writes over ``layers`` layers (new keys evaluated first: only the writes count)."""
    n = len(offsets)
    bufs = [mx.zeros((n + 2, H, P, D)) for _ in range(2 * layers)]
    new = [mx.random.normal((n, H, width, D), key=mx.random.key(i)) for i in range(2 * layers)]
    mx.eval(bufs, new)
    fp = plan_forward(0, offsets, width, batched_writes=True)
    assert fp.mode == "scatter"
    for i in range(layers):
        write_kv(bufs[2 * i], bufs[2 * i + 1], fp, new[2 * i], new[2 * i + 1])
    return _nodes(*bufs), new


def test_a_layers_write_is_its_scatters_alone():
    offsets = [3, 9, 17, 30]
    few, _ = _decode_writes(2, offsets)
    many, _ = _decode_writes(6, offsets)
    extra = many - few  # what 4 more layers added
    assert extra["Scatter"] == 8
    # the index arrays are made once a pass: 4 layers more add their scatters and each update's reshape only (the
    # old per-write index arithmetic added an arange and four broadcasts a write: 48 nodes more)
    assert sum(extra.values()) <= 16, extra
    assert few["Arange"] == many["Arange"]


def test_the_shared_index_writes_what_per_write_indices_wrote():
    """Prefill rows at different offsets (T > 1) and decode rows: every row's new KV lands at its own positions."""
    for offsets, width in (([3, 9, 17, 30], 1), ([0, 5, 11], 4)):
        n = len(offsets)
        k_buf, v_buf = mx.zeros((n + 2, H, P, D)), mx.zeros((n + 2, H, P, D))
        keys = mx.random.normal((n, H, width, D), key=mx.random.key(1))
        values = mx.random.normal((n, H, width, D), key=mx.random.key(2))
        fp = plan_forward(0, offsets, width, batched_writes=True)
        assert fp.mode == "scatter"
        k_read, v_read = write_kv(k_buf, v_buf, fp, keys, values)
        k_want, v_want = mx.zeros((n + 2, H, P, D)), mx.zeros((n + 2, H, P, D))
        for i, o in enumerate(offsets):  # row by row, as slice writes
            k_want[i, :, o : o + width] = keys[i]
            v_want[i, :, o : o + width] = values[i]
        assert mx.array_equal(k_buf, k_want).item() and mx.array_equal(v_buf, v_want).item()
        t = max(o + width for o in offsets)
        assert mx.array_equal(k_read, k_want[:n, :, :t]).item() and mx.array_equal(v_read, v_want[:n, :, :t]).item()
