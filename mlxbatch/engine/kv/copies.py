"""Large copies in bounded slices: what a copy allocates beside its result is at most about one slice.

Growing every KV buffer at once held every old buffer beside every new one (a doubling peaked at three times the
old size), and gathering all of a step's copy-ins at once made a transient as large as all of them (~1.4 GB for
~200 fewshot rows on the 0.5B shape). Both run in slices of at most ``MAX_COPY_BYTES``, one sync each. A small copy
is still one slice and one sync: a sync per buffer made the decode table's steps 2.08 -> 4.67 syncs on the H200,
the step 0.87x -> 0.74x of a bare forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import mlx.core as mx

from mlxbatch.engine.outputs import Traffic

T = TypeVar("T")

MAX_COPY_BYTES = 256 << 20  # read at each call (tests lower it)


def slices(items: Sequence[T], size: Callable[[T], int], limit: int | None = None) -> list[list[T]]:
    """Consecutive groups of ``items`` whose sizes add up to at most ``limit`` (default ``MAX_COPY_BYTES``; an item
    larger than it goes alone)."""
    cap = MAX_COPY_BYTES if limit is None else limit
    out: list[list[T]] = []
    total = 0
    for item in items:
        n = size(item)
        if not out or total + n > cap:
            out.append([])
            total = 0
        out[-1].append(item)
        total += n
    return out


def replace_each(lists: Sequence[list[mx.array]], make: Callable[[mx.array], mx.array], traffic: Traffic) -> None:
    """``bufs[i] = make(bufs[i])`` for every buffer of every list (a resize: each new buffer is made from its old
    one), evaluated in slices whose new buffers add up to at most ``MAX_COPY_BYTES``. Once a slice is evaluated its
    old buffers are freed, so at the peak only one slice's old buffers sit beside the new ones. Each sync is also
    counted in ``traffic.resize_syncs``."""
    pending: list[mx.array] = []
    size = 0
    for bufs in lists:
        for i in range(len(bufs)):
            bufs[i] = make(bufs[i])
            pending.append(bufs[i])
            size += bufs[i].nbytes
            if size >= MAX_COPY_BYTES:
                traffic.evaluate(*pending)
                traffic.resize_syncs += 1
                pending, size = [], 0
    if pending:
        traffic.evaluate(*pending)
        traffic.resize_syncs += 1
