"""Prefix planner: order, prefill floor, retention intervals and JSON, pinned exactly (pure Python)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxbatch.engine.sched.planner import Plan, Retention, common_prefix_len, plan
from mlxbatch.errors import InvalidRequestError


def trie_node_count(seqs: list[list[int]]) -> int:
    """Nodes of an explicitly built token trie, root excluded."""
    root: dict[int, dict] = {}
    count = 0
    for seq in seqs:
        node = root
        for tok in seq:
            if tok not in node:
                node[tok] = {}
                count += 1
            node = node[tok]
    return count


def trie_order(seqs: list[list[int]], rows: list[int]) -> list[int]:
    """Depth-first order of an explicitly built trie of ``rows``: at each node the rows ending there first (input
    order), then its children by rows below them (most first), ties by token."""
    root: dict = {"end": [], "kids": {}}
    for i in rows:
        node = root
        for tok in seqs[i]:
            node = node["kids"].setdefault(tok, {"end": [], "kids": {}})
        node["end"].append(i)

    def size(node: dict) -> int:
        return len(node["end"]) + sum(size(k) for k in node["kids"].values())

    def walk(node: dict) -> list[int]:
        out = list(node["end"])
        for tok in sorted(node["kids"], key=lambda t: (-size(node["kids"][t]), t)):
            out += walk(node["kids"][tok])
        return out

    return walk(root)


def naive_lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# Rows built from a small pool of prefixes, so they share prefixes (and sometimes are equal or nested).
pool_rows = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=6), min_size=1, max_size=5).flatmap(
    lambda pool: st.lists(
        st.lists(st.sampled_from(pool), min_size=0, max_size=3).map(lambda parts: [t for p in parts for t in p]),
        min_size=0, max_size=25))


def check_plan(seqs: list[list[int]], p: Plan, window: int | None, min_shared: int) -> None:
    n = len(seqs)
    size = window or max(n, 1)
    windows = [list(range(w0, min(w0 + size, n))) for w0 in range(0, n, size)]
    # order: depth first in each window's trie, larger subtrees first, stable for equal rows, windows in input order
    assert list(p.order) == [i for w in windows for i in trie_order(seqs, w)]
    assert [r.order for r in p.rows] == list(range(n))
    window_of = {i: k for k, w in enumerate(windows) for i in w}
    for k, r in enumerate(p.rows):
        assert r.num_tokens == len(seqs[r.index]) and r.window == window_of[r.index]
        first_in_window = k == 0 or p.rows[k - 1].window != r.window
        expected = 0 if first_in_window else naive_lcp(seqs[p.rows[k - 1].index], seqs[r.index])
        assert r.shared_prefix == expected
    assert p.total_tokens == sum(map(len, seqs))
    assert p.distinct_tokens == sum(trie_node_count([seqs[i] for i in w]) for w in windows)
    assert p.windowed == (len(windows) > 1)
    # retention: exactly the maximal runs of rows sharing a prefix of length L >= min_shared
    ordered = [seqs[i] for i in p.order]
    starts = {k for k, r in enumerate(p.rows) if k == 0 or p.rows[k - 1].window != r.window}
    for ret in p.retention:
        assert ret.prefix_len >= min_shared and ret.first_order < ret.last_order
        assert all(p.rows[k].window == p.rows[ret.first_order].window
                   for k in range(ret.first_order, ret.last_order + 1))
        prefix = ordered[ret.first_order][: ret.prefix_len]
        assert len(prefix) == ret.prefix_len
        assert all(ordered[k][: ret.prefix_len] == prefix for k in range(ret.first_order, ret.last_order + 1))
        if ret.first_order not in starts:
            assert ordered[ret.first_order - 1][: ret.prefix_len] != prefix
        if ret.last_order + 1 < n and ret.last_order + 1 not in starts:
            assert ordered[ret.last_order + 1][: ret.prefix_len] != prefix
        # the interval's value is exactly the minimum LCP inside it (not a shorter, wider prefix)
        assert min(p.rows[k].shared_prefix for k in range(ret.first_order + 1, ret.last_order + 1)) == ret.prefix_len
    assert len(set(p.retention)) == len(p.retention)
    # every reusable share >= min_shared is covered by a retained interval of exactly that length
    for k, r in enumerate(p.rows):
        if r.shared_prefix >= min_shared:
            assert any(t.first_order < k <= t.last_order and t.prefix_len == r.shared_prefix for t in p.retention)
    # intervals alive at a position are nested prefixes of its row; the peak is the longest alive one
    peak = 0
    for k in range(n):
        alive = [t for t in p.retention if t.first_order <= k <= t.last_order]
        for t in alive:
            assert ordered[k][: t.prefix_len] == ordered[t.first_order][: t.prefix_len]
        peak = max([peak, *(t.prefix_len for t in alive)])
    assert p.peak_retained_tokens() == peak


@settings(max_examples=300, deadline=None)
@given(pool_rows, st.integers(1, 4))
def test_whole_job_plan_properties(seqs: list[list[int]], min_shared: int) -> None:
    p = plan(seqs, min_shared_tokens=min_shared)
    check_plan(seqs, p, None, min_shared)
    assert p.distinct_tokens == trie_node_count(seqs)  # the prefill floor of the whole job


@settings(max_examples=300, deadline=None)
@given(pool_rows, st.integers(1, 7), st.integers(1, 4))
def test_windowed_plan_properties(seqs: list[list[int]], window: int, min_shared: int) -> None:
    p = plan(seqs, window=window, min_shared_tokens=min_shared)
    check_plan(seqs, p, window, min_shared)
    assert p.distinct_tokens >= trie_node_count(seqs)
    assert p.window_size == window


@given(st.lists(st.integers(0, 2), max_size=12), st.lists(st.integers(0, 2), max_size=12))
def test_common_prefix_len_matches_naive(a: list[int], b: list[int]) -> None:
    assert common_prefix_len(a, b) == naive_lcp(a, b)
    assert common_prefix_len(a, a + b) == len(a)


def test_small_example_pinned() -> None:
    a = list(range(100, 120))  # 20-token prefix
    seqs = [a + [5], [999, 9], a + [1, 2], a, a + [1, 3]]
    p = plan(seqs, min_shared_tokens=16)
    assert p.order == (3, 2, 4, 0, 1)  # a < a+[1,2] < a+[1,3] < a+[5] < [999,9]
    assert [r.shared_prefix for r in p.rows] == [0, 20, 21, 20, 0]
    assert p.retention == (Retention(20, 0, 3), Retention(21, 1, 2))
    assert p.distinct_tokens == 20 + 2 + 1 + 1 + 2
    assert p.total_tokens == 21 + 2 + 22 + 20 + 22
    assert p.peak_retained_tokens() == 21
    assert [r.new_tokens for r in p.rows] == [20, 2, 1, 1, 2]


def test_larger_subtrees_first() -> None:
    """After a shared instruction the rows of the largest subtree come first: the rows admitted together with the
    one computing the instruction share the most with it."""
    seqs = [[1, 2, 3], [1, 5, 6], [1, 5, 7], [1, 5, 8], [1, 2, 4], [1, 5, 8, 9], [0]]
    p = plan(seqs, min_shared_tokens=1)
    assert p.order == (3, 5, 1, 2, 0, 4, 6)  # [1,5] holds 4 rows, [1,2] 2; under [1,5], [1,5,8] holds 2
    assert [r.shared_prefix for r in p.rows] == [0, 3, 2, 2, 1, 2, 0]
    assert p.distinct_tokens == trie_node_count(seqs)


@settings(max_examples=200, deadline=None)
@given(pool_rows, st.integers(1, 7), st.data())
def test_skipped_rows_keep_the_order_of_the_whole(seqs: list[list[int]], window: int, data) -> None:
    """A resumed run plans the rows it skips with the rest: the others keep the order the whole plan gives them
    (planning only the rest may not: subtree sizes change), and the plan counts the rest alone."""
    skip = set(data.draw(st.lists(st.integers(0, max(len(seqs) - 1, 0)), max_size=len(seqs))) if seqs else ())
    whole = plan(seqs, window=window, min_shared_tokens=2)
    p = plan(seqs, window=window, min_shared_tokens=2, skip=skip)
    assert list(p.order) == [i for i in whole.order if i not in skip]
    assert [r.order for r in p.rows] == list(range(len(p.rows)))
    kept = [r for r in whole.rows if r.index not in skip]
    assert [r.window for r in p.rows] == [r.window for r in kept]
    assert p.total_tokens == sum(len(seqs[r.index]) for r in kept)
    for k, r in enumerate(p.rows):
        first = k == 0 or p.rows[k - 1].window != r.window
        assert r.shared_prefix == (0 if first else naive_lcp(seqs[p.rows[k - 1].index], seqs[r.index]))


def test_planning_only_the_rest_would_reorder() -> None:
    """Why ``skip`` exists: with row 0 done, [1, 2] has one row left against [1, 5]'s two."""
    seqs = [[1, 2, 3], [1, 2, 4], [1, 2, 6], [1, 5, 6], [1, 5, 7]]
    assert plan(seqs).order == (0, 1, 2, 3, 4)
    assert plan(seqs, skip={0, 1}).order == (2, 3, 4)
    assert plan(seqs[2:]).order == (1, 2, 0)  # the rest planned alone: [1, 5] first


def test_min_shared_tokens_drops_short_prefixes() -> None:
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]]
    assert plan(seqs, min_shared_tokens=2).retention == (Retention(2, 0, 2), Retention(3, 0, 1))
    assert plan(seqs, min_shared_tokens=3).retention == (Retention(3, 0, 1),)
    assert plan(seqs, min_shared_tokens=4).retention == ()


def test_label_like_workload() -> None:
    rng = random.Random(0)
    prefix = [rng.randrange(1000, 50_000) for _ in range(500)]
    suffixes = [[i, *(rng.randrange(1000, 50_000) for _ in range(rng.randrange(5, 30)))] for i in range(200)]
    p = plan([prefix + s for s in suffixes])
    assert p.distinct_tokens == len(prefix) + sum(map(len, suffixes))  # unique first suffix token: exact
    assert p.retention == (Retention(500, 0, 199),)
    assert p.peak_retained_tokens() == 500
    assert p.saving > 0.9


def test_fewshot_like_workload_groups_rows_by_prefix() -> None:
    rng = random.Random(1)
    prefixes = [[1000 + k, *(rng.randrange(2000, 50_000) for _ in range(300))] for k in range(8)]
    seqs, which = [], []
    for r in range(8 * 32):  # interleaved: prefix 0, 1, ..., 7, 0, 1, ...
        which.append(r % 8)
        seqs.append(prefixes[r % 8] + [r, *(rng.randrange(2000, 50_000) for _ in range(20))])
    p = plan(seqs)
    groups = [which[i] for i in p.order]
    assert groups == sorted(groups)  # each prefix's rows run back to back, prefixes in token order
    assert len(p.retention) == 8 and all(t.prefix_len == 301 for t in p.retention)
    assert sorted(t.last_order - t.first_order + 1 for t in p.retention) == [32] * 8
    assert p.distinct_tokens == 8 * 301 + 8 * 32 * 21
    assert p.peak_retained_tokens() == 301


def test_windowed_never_reorders_across_windows() -> None:
    seqs = [[3], [1], [2], [0], [9], [5], [4]]
    p = plan(seqs, window=3)
    assert p.order == (1, 2, 0, 3, 5, 4, 6)
    assert p.windowed and [r.window for r in p.rows] == [0, 0, 0, 1, 1, 1, 2]
    assert not plan(seqs, window=7).windowed


def test_empty_job_and_empty_rows() -> None:
    p = plan([])
    assert p.rows == () and p.retention == () and p.saving == 0.0 and p.peak_retained_tokens() == 0
    p = plan([[], [1], []])
    assert p.order == (0, 2, 1) and p.distinct_tokens == 1


def test_rejects_bad_arguments() -> None:
    with pytest.raises(InvalidRequestError):
        plan([[1]], window=0)
    with pytest.raises(InvalidRequestError):
        plan([[1]], min_shared_tokens=0)


def kept_reference(p: Plan, min_shared: int, step: int) -> list[int]:
    """Each row's kept prefix, quadratic: the values of the LCP intervals holding it and the row before it (the
    minima of ``shared_prefix`` over every run of rows around that pair, in its window), decided from the shortest
    (the root, 0) to the longest: one is kept when it is ``min_shared`` or more and ``step`` or more past the last
    kept one."""
    rows = p.rows
    out = []
    for k, r in enumerate(rows):
        if k == 0 or rows[k - 1].window != r.window:
            out.append(0)
            continue
        lo = k
        while lo > 0 and rows[lo - 1].window == r.window:
            lo -= 1
        hi = k
        while hi + 1 < len(rows) and rows[hi + 1].window == r.window:
            hi += 1
        values = {min(rows[j].shared_prefix for j in range(a + 1, b + 1)) for a in range(lo, k) for b in range(k, hi + 1)}
        kept = 0
        for v in sorted(values):
            if v >= min_shared and v - kept >= step:
                kept = v
        out.append(kept)
    return out


@settings(max_examples=300, deadline=None)
@given(pool_rows, st.integers(1, 7), st.integers(1, 4), st.integers(1, 5))
def test_kept_prefixes_match_the_reference(seqs: list[list[int]], window: int, min_shared: int, step: int) -> None:
    """With a reuse step, a row keeps the longest shared prefix decided from the root down, and the retention is
    exactly the intervals whose value is kept (with step 1: every interval, as without one)."""
    p = plan(seqs, window=window, min_shared_tokens=min_shared, min_step_tokens=step)
    kept = kept_reference(p, min_shared, step)
    assert [r.kept_prefix for r in p.rows] == kept
    assert all(r.kept_prefix <= r.shared_prefix for r in p.rows)
    assert p.planned_tokens == p.total_tokens - sum(kept) >= p.distinct_tokens
    assert [(r.index, r.shared_prefix) for r in p.rows] == \
        [(r.index, r.shared_prefix) for r in plan(seqs, window=window, min_shared_tokens=min_shared).rows]
    for k, r in enumerate(p.rows):  # a kept prefix is a retained interval's, alive from before the row to it
        if r.kept_prefix:
            assert any(t.first_order < k <= t.last_order and t.prefix_len == r.kept_prefix for t in p.retention)
    assert {t.prefix_len for t in p.retention} <= set(kept)
    if step == 1:
        base = plan(seqs, window=window, min_shared_tokens=min_shared)
        assert p.retention == base.retention
        assert kept == [r.shared_prefix if r.shared_prefix >= min_shared else 0 for r in p.rows]


def test_a_block_step_keeps_an_instruction_not_its_one_token_extensions() -> None:
    """A 40-token instruction and rows whose texts start alike (1-3 tokens): with a 16-token step every row keeps
    the instruction only; a 20-token shared extension is kept."""
    inst = list(range(1000, 1040))
    seqs = [inst + [7, 1, 2], inst + [7, 1, 3], inst + [7, 8], inst + [9, 4], inst + [5] + list(range(20)) + [1],
            inst + [5] + list(range(20)) + [2]]
    p = plan(seqs, min_shared_tokens=16, min_step_tokens=16)
    assert p.order == (0, 1, 2, 4, 5, 3)  # [7 ..] holds 3 rows, [5 ..] 2, [9 ..] 1
    assert [r.shared_prefix for r in p.rows] == [0, 42, 41, 40, 61, 40]
    assert [r.kept_prefix for r in p.rows] == [0, 40, 40, 40, 61, 40]
    assert p.planned_tokens == p.distinct_tokens + 2 + 1
    assert sorted(t.prefix_len for t in p.retention) == [40, 61]
    assert plan(seqs, min_shared_tokens=16).retention != p.retention  # step 1 keeps 41 and 42 too
    with pytest.raises(InvalidRequestError, match="min_step_tokens"):
        plan(seqs, min_step_tokens=0)
