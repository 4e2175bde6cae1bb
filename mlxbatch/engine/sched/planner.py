"""Prefix planner: the order an offline job runs its rows in, and how long each shared prefix's KV is kept.

An offline job knows every prompt before it starts. The rows are visited in depth-first order of their token
trie (sorted lexicographically, then each node's larger subtrees first), so rows sharing a prefix run back to back
and each distinct trie token has to be prefilled only once: ``distinct_tokens`` (the trie's node count) is the
prefill floor, reached when every row reuses the KV of ``shared_prefix`` tokens it shares with the row before it.

Retention comes from the LCP array of the sorted rows (``lcp[k]`` = tokens row ``k`` shares with row
``k - 1``): each *LCP interval* ``[i, j]`` with value ``L`` (``min(lcp[i+1..j]) == L`` and the interval
cannot be widened) is a prefix of length ``L`` shared by exactly the rows ``i..j``; its KV is computed with
row ``i`` and may be dropped once row ``j`` has been admitted. Only intervals with
``L >= min_shared_tokens`` are kept (shorter prefixes are not worth holding), and only those at least
``min_step_tokens`` longer than the enclosing interval's kept prefix (the engine's reuse step: where it reuses by
whole blocks, a kept point a few tokens past another costs a partial block's store and copy-in for a few tokens).

Jobs too big to plan whole are planned window by window (consecutive input rows); windows are planned
independently, so nothing is reused or retained across a window boundary and a window's plan depends only
on its own rows (it can be planned while the previous one runs).

Owns only the decision; the prefix cache (block granularity, eviction) and the scheduler act on it.
Pure Python: no mlx, no numpy.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from mlxbatch.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class PlannedRow:
    index: int  # position in the input
    order: int  # position in the plan
    num_tokens: int
    shared_prefix: int  # tokens shared with the previous row in plan order (0 at a window's first row)
    window: int  # which window planned it (0 when not windowed)
    kept_prefix: int = 0  # of those, the tokens whose KV the plan keeps for it (the prefix it reuses; see ``plan``)

    @property
    def new_tokens(self) -> int:
        """Tokens this row must prefill when the shared prefix's KV is reused."""
        return self.num_tokens - self.shared_prefix

    @property
    def planned_tokens(self) -> int:
        """Tokens this row prefills when the kept prefix's KV is reused."""
        return self.num_tokens - self.kept_prefix


@dataclass(frozen=True, slots=True)
class Retention:
    """The first ``prefix_len`` tokens of the row at ``first_order``, needed by rows first..last_order."""

    prefix_len: int
    first_order: int
    last_order: int  # after this row is admitted the prefix's KV can be dropped


@dataclass(frozen=True)
class Plan:
    rows: tuple[PlannedRow, ...]  # in plan order
    retention: tuple[Retention, ...]  # sorted by (first_order, prefix_len)
    total_tokens: int
    distinct_tokens: int  # sum of new_tokens: trie node count per window (the prefill floor)
    windowed: bool  # more than one window: distinct_tokens may exceed the whole-job trie's node count
    window_size: int | None
    min_shared_tokens: int
    min_step_tokens: int = 1

    @property
    def planned_tokens(self) -> int:
        """Tokens the plan prefills: ``distinct_tokens`` plus the short extensions it does not keep."""
        return sum(r.planned_tokens for r in self.rows)

    @property
    def order(self) -> tuple[int, ...]:
        """Input indices in plan order."""
        return tuple(r.index for r in self.rows)

    @property
    def saving(self) -> float:
        """Share of prefill work the plan can avoid: ``1 - distinct / total`` (0.0 for an empty job)."""
        return 1.0 - self.distinct_tokens / self.total_tokens if self.total_tokens else 0.0

    def peak_retained_tokens(self) -> int:
        """The most prefix tokens the plan ever asks the cache to hold at once.

        At plan position ``p`` (while row ``p`` is admitted) the alive intervals are those with
        ``first_order <= p <= last_order``. They all contain ``p``, so they are all prefixes of row ``p``
        and nest along its trie path: the longer one's KV contains the shorter one's, so their memory is
        the longest alive ``prefix_len`` (counted once), never their sum. This is the depth of the current
        path, bounded by the longest retained prefix and independent of the number of rows. The KV of
        rows that are running (their own suffixes and generated tokens) is the scheduler's, not counted.
        """
        return max((r.prefix_len for r in self.retention), default=0)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix; compares slices (C speed) in a binary search."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _kept(lcp: list[int], start: int, min_len: int, step: int) -> tuple[list[Retention], list[int]]:
    """The LCP intervals of one window (``lcp[0]`` is its first row, always 0) that are kept, and each row's kept
    prefix (the KV it reuses from the row before it).

    The intervals nest in a tree (the stack algorithm of Abouelhoda, Kurtz, Ohlebusch 2004 builds it; positions are
    offset by ``start``). Decided from the root down: an interval is kept when its value is at least ``min_len`` and
    at least ``step`` tokens longer than what its parent keeps; otherwise its rows keep the parent's (a prefix a few
    tokens longer than one kept already is computed again, not kept: where the engine reuses by whole blocks, each
    kept point costs a partial block's store and copy-in). A row's kept prefix is the kept value of the smallest
    interval holding it and the row before it (the one whose value is what they share)."""
    nodes: list[list[int]] = [[0, 0, len(lcp) - 1, -1]]  # [value, left, right, parent]; node 0: the root
    stack = [0]
    row_node = [0] * len(lcp)
    for k in range(1, len(lcp) + 1):
        cur = lcp[k] if k < len(lcp) else 0
        left = k - 1
        last = -1  # the last interval closed here: its parent may be the one opened for ``cur``
        while cur < nodes[stack[-1]][0]:
            i = stack.pop()
            nodes[i][2] = k - 1
            left = nodes[i][1]
            if nodes[stack[-1]][0] >= cur:
                nodes[i][3] = stack[-1]
            else:
                last = i
        if cur > nodes[stack[-1]][0]:
            nodes.append([cur, left, -1, stack[-1]])
            stack.append(len(nodes) - 1)
        if last >= 0:
            nodes[last][3] = stack[-1]
        if k < len(lcp):
            row_node[k] = stack[-1]
    kept: list[int | None] = [None] * len(nodes)
    kept[0] = 0
    for i in range(1, len(nodes)):
        path = []
        j = i
        while kept[j] is None:
            path.append(j)
            j = nodes[j][3]
        for j in reversed(path):
            value, parent = nodes[j][0], kept[nodes[j][3]]
            assert parent is not None
            kept[j] = value if value >= min_len and value - parent >= step else parent
    out = [Retention(v, start + left, start + right) for (v, left, right, _), kv in zip(nodes, kept)
           if v and kv == v]
    return out, [kept[row_node[k]] if k else 0 for k in range(len(lcp))]  # type: ignore[misc]


def _largest_subtree_first(idx: list[int], lcp: list[int], seqs: Sequence[Sequence[int]]) -> list[int]:
    """``idx`` (rows in lexicographic order, ``lcp[k]`` shared by rows ``k - 1`` and ``k``) in depth-first order of
    their trie with each node's larger subtrees (more rows) first; rows that end at a node stay before its children.

    The first rows admitted after a shared prefix then share the most with each other: they come from one subtree,
    the row computing that prefix among them. The trie is built bottom-up from the LCP array (the stack algorithm of
    ``_kept``): O(rows)."""
    # a node: [depth, rows below it, children]; a leaf: the row's position in ``idx``
    root: list = [0, 0, []]
    stack: list[list] = [root]
    for k in range(1, len(idx) + 1):
        cur = lcp[k] if k < len(lcp) else 0
        last: int | list = k - 1
        while cur < stack[-1][0]:
            node = stack.pop()
            node[2].append(last)
            node[1] = sum(c[1] if isinstance(c, list) else 1 for c in node[2])
            last = node
        if cur > stack[-1][0]:
            stack.append([cur, 0, [last]])
        else:
            stack[-1][2].append(last)

    def key(child: int | list, depth: int) -> tuple[int, int]:
        if isinstance(child, list):
            return 1, -child[1]
        return (0, 0) if len(seqs[idx[child]]) == depth else (1, -1)

    out: list[int] = []
    todo: list[int | list] = [root]
    while todo:
        item = todo.pop()
        if isinstance(item, list):
            todo.extend(reversed(sorted(item[2], key=lambda c, d=item[0]: key(c, d))))  # stable: ties lexicographic
        else:
            out.append(idx[item])
    return out


def plan(token_seqs: Sequence[Sequence[int]], window: int | None = None, min_shared_tokens: int = 16,
         skip: Collection[int] = (), min_step_tokens: int = 1) -> Plan:
    """Order the rows along their token trie and derive which prefix to keep until when.

    Order: depth first along the token trie, a node's larger subtrees (more rows) first and otherwise
    lexicographic by token ids (a row that is a prefix of another comes first), equal rows in input order. With
    ``window`` each run of ``window`` consecutive input rows is ordered on its own and the windows follow each other
    in input order. ``skip``: input indices ordered with the others and then left out (rows a resumed run has done:
    the rest keep the first run's order, which depends on every row's subtree). ``min_step_tokens``: a shared prefix
    is kept only when it is at least this much longer than the prefix kept for its rows anyway (``_kept``; 1: every
    shared prefix of ``min_shared_tokens`` or more; the engine's reuse step, a block where it reuses by blocks).
    """
    if window is not None and window < 1:
        raise InvalidRequestError("window", window, "must be a positive number of rows or None")
    if min_shared_tokens < 1:
        raise InvalidRequestError("min_shared_tokens", min_shared_tokens, "must be >= 1")
    if min_step_tokens < 1:
        raise InvalidRequestError("min_step_tokens", min_step_tokens, "must be >= 1")
    seqs = [s if isinstance(s, list) else list(s) for s in token_seqs]
    n = len(seqs)
    size = window if window is not None else max(n, 1)
    rows: list[PlannedRow] = []
    retention: list[Retention] = []
    total = distinct = 0
    for w, w0 in enumerate(range(0, n, size)):
        idx = sorted(range(w0, min(w0 + size, n)), key=seqs.__getitem__)  # stable: equal rows keep input order
        idx = _largest_subtree_first(idx, _lcp(idx, seqs), seqs)
        if skip:
            idx = [i for i in idx if i not in skip]
        lcp = _lcp(idx, seqs)
        start = len(rows)
        kept_intervals, kept = _kept(lcp, start, min_shared_tokens, min_step_tokens)
        for k, i in enumerate(idx):
            rows.append(PlannedRow(i, start + k, len(seqs[i]), lcp[k], w, kept[k]))
            total += len(seqs[i])
            distinct += len(seqs[i]) - lcp[k]
        retention.extend(kept_intervals)
    retention.sort(key=lambda r: (r.first_order, r.prefix_len))
    return Plan(tuple(rows), tuple(retention), total, distinct, windowed=n > size, window_size=window,
                min_shared_tokens=min_shared_tokens, min_step_tokens=min_step_tokens)


def _lcp(idx: list[int], seqs: list[list[int]]) -> list[int]:
    """``lcp[k]``: tokens row ``idx[k]`` shares with row ``idx[k - 1]`` (0 for the first)."""
    return [common_prefix_len(seqs[idx[k - 1]], seqs[i]) if k else 0 for k, i in enumerate(idx)]


@dataclass(frozen=True, slots=True)
class Submission:
    """One row as the engine gets it: its input index and how many prompt tokens later rows reuse."""

    index: int
    cache_tokens: int | None  # prompt tokens worth keeping in the prefix cache for later rows (None: unknown)


def submission_order(p: Plan) -> list[Submission]:
    """The order to submit ``p``'s rows in, with each row's retention (how much of its prefix to keep).

    Rows that reuse a kept prefix from a neighbour (``PlannedRow.kept_prefix``) form groups, submitted in trie order
    so each kept prefix is computed once and dropped after its last user. Rows that share nothing worth keeping are
    submitted after the groups of their window, longest first: neighbours of similar length batch their prefill
    with little padding (trie order would interleave lengths at random). A row's ``cache_tokens`` is what it
    shares with the next submitted row: in trie order no later row shares more, so its prefix KV beyond that
    is dead once it is admitted (the plan's retention, acted on by the prefix cache); the plan keeps for it the
    prefix the next row reuses (``kept_prefix``), not a few tokens more.
    """
    m = p.min_shared_tokens
    out: list[Submission] = []
    rows = p.rows
    k = 0
    while k < len(rows):
        w = rows[k].window
        end = k
        while end < len(rows) and rows[end].window == w:
            end += 1
        group: list[PlannedRow] = []
        alone: list[PlannedRow] = []
        for j in range(k, end):
            shares_prev = j > k and rows[j].kept_prefix >= m
            shares_next = j + 1 < end and rows[j + 1].kept_prefix >= m
            (group if shares_prev or shares_next else alone).append(rows[j])
        for j, r in enumerate(group):
            nxt = group[j + 1].kept_prefix if j + 1 < len(group) and group[j + 1].kept_prefix >= m else 0
            out.append(Submission(r.index, nxt))
        out.extend(Submission(r.index, 0) for r in sorted(alone, key=lambda r: -r.num_tokens))
        k = end
    return out
