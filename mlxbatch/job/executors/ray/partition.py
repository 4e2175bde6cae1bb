"""Prefix-local partitions: one window's planned rows cut into units, each of which runs on one engine.

Owns the rule that decides which rows must stay together when several engines share a job. In the plan's
submission order a row's retention (``cache_tokens``) is what it shares with the row after it, and it is > 0 only
when they share a prefix worth keeping: such runs of rows are prefix groups. A group is one unit, so each of its
shared prefixes is computed once, on one engine. A group larger than a share (the window's rows over the engines)
is cut into units of at most a share at its weakest links (the smallest sharing between neighbours near each cut), so that
balance never waits on one engine; each cut costs one recomputation of what the two sides share. Units are handed
out largest first (longest processing time first), so a window ends on small units. ``random`` partitions deal the
rows by a hash of their key instead (for comparison: groups are spread over every engine).

Works on plain sequences (``links``: tokens each row shares with the next; ``costs``: each row's work), so the
Ray executor and the partitioner simulation in scripts/ray_bench.py share it. Pure Python: no engine, no Ray.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Unit:
    """Rows (indices into the window's rows, in plan order) that go to one engine, and their estimated work."""

    rows: tuple[int, ...]
    cost: int


def row_cost(prompt_tokens: int, shared_with_previous: int, decode_tokens: int) -> int:
    """A row's work when it follows the row it shares ``shared_with_previous`` tokens with on the same engine:
    the prompt tokens it must prefill plus the tokens it generates (both cost about one token-step each)."""
    return prompt_tokens - shared_with_previous + decode_tokens


def span_cost(links: Sequence[int], costs: Sequence[int], start: int, end: int) -> int:
    """Work of rows ``start:end`` on one engine: their costs, plus the prefix the first row shares with the row
    before it (a unit cut out of a group recomputes it)."""
    return sum(costs[start:end]) + (links[start - 1] if start > 0 else 0)


def prefix_groups(links: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of rows joined by links > 0 (a row with link 0 ends its group)."""
    out, start = [], 0
    for i, link in enumerate(links):
        if link <= 0:
            out.append((start, i + 1))
            start = i + 1
    if start < len(links):
        out.append((start, len(links)))
    return out


def weakest_cut(links: Sequence[int], lo: int, hi: int, target: int) -> int:
    """The row to start a new unit at, in ``lo..hi`` (inclusive): the one sharing least with its predecessor,
    nearest ``target`` among equals."""
    return min(range(lo, hi + 1), key=lambda c: (links[c - 1], abs(c - target)))


def split_group(links: Sequence[int], start: int, end: int, share: int) -> list[tuple[int, int]]:
    """Cut rows ``start:end`` into pieces of at most ``share`` rows (whole when it fits), each cut at the weakest
    link among the last quarter of a share's rows."""
    share = max(1, share)
    bounds = [start]
    while end - bounds[-1] > share:
        s = bounds[-1]
        bounds.append(weakest_cut(links, s + max(1, share - share // 4), s + share, s + share))
    return list(zip(bounds, bounds[1:] + [end]))


def prefix_units(links: Sequence[int], costs: Sequence[int], engines: int) -> list[Unit]:
    """One window's rows as units: prefix groups, those larger than a share cut into shares; largest first."""
    share = -(-len(links) // max(1, engines))
    spans = [piece for s, e in prefix_groups(links) for piece in split_group(links, s, e, share)]
    units = [Unit(tuple(range(s, e)), span_cost(links, costs, s, e)) for s, e in spans]
    return sorted(units, key=lambda u: -u.cost)  # stable: equal costs keep plan order


def random_units(keys: Sequence[str], costs: Sequence[int], engines: int) -> list[Unit]:
    """One window's rows dealt to ``engines`` units by a hash of their key (plan order kept inside each)."""
    dealt: list[list[int]] = [[] for _ in range(max(1, engines))]
    for i, key in enumerate(keys):
        dealt[int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big") % len(dealt)].append(i)
    return [Unit(tuple(rows), sum(costs[i] for i in rows)) for rows in dealt if rows]


def split_for_steal(links: Sequence[int]) -> int:
    """Where to cut a run of unsent rows in two for an idle engine (``links``: what each shares with the next):
    the weakest link near the middle. Returns the index the stolen part starts at (0 < index < len(links))."""
    n = len(links)
    return weakest_cut(links, max(1, n // 4), max(1, min(n - 1, 3 * n // 4)), n // 2)
