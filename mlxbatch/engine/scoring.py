"""Scoring on the runner's side: the log-probability of given tokens at given positions, and whether each is the
model's greedy choice (``EngineCore.add_score_request`` makes the sequences; a prefill chunk scores the positions it
computes)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxbatch.engine.outputs import ScoredTokens
from mlxbatch.engine.sched.step import PrefillChunk
from mlxbatch.types import TokenLogprob


def score_chunk(out: mx.array, head: Any, group: list[PrefillChunk], tokens: list[list[int]], last: list[int],
                scored: dict[str, ScoredTokens], traffic: Any) -> mx.array:
    """Score what a prefill pass's outputs ``out`` (``[rows, T, dim]``; hidden states when ``head`` is the LM head,
    else logits) say about its scoring rows.

    A scoring row's ``score_targets`` pair a position with the token its logits are asked about (position ``p``
    predicts what follows it: the continuation's next prompt token, or each one-token candidate at the
    context's last position); the pairs inside this chunk are scored, each position's hidden state gathered
    once. Results go to ``scored``; returns the last-position logits of ``last`` rows.
    """
    at: dict[tuple[int, int], int] = {}  # (row, column) -> its index among the gathered positions
    picks, targets, owners = [], [], []
    for i, c in enumerate(group):
        r = c.request
        if r.score_from is None:
            continue
        for p, t in r.unscored_targets():
            if c.start <= p < c.end:
                picks.append(at.setdefault((i, p - c.start), len(at)))
                targets.append(t)
                owners.append(r.request_id)
    if picks:
        rows, cols = zip(*at)
        h = out[mx.array(rows), mx.array(cols)]
        lg = (head(h) if head is not None else h).astype(mx.float32)
        if len(at) < len(picks):
            lg = lg[mx.array(picks)]
        scored.update(score_positions(lg, targets, owners, traffic))
    if not last:
        return out[:0, 0]
    h_last = out[mx.array(last), mx.array([len(tokens[i]) - 1 for i in last])]
    return head(h_last) if head is not None else h_last


def score_positions(lg: mx.array, targets: list[int], owners: list[str], traffic: Any) -> dict[str, ScoredTokens]:
    """Each scored position's log-probability of its target and whether the target is the argmax, per owner."""
    tgt = mx.array(targets, dtype=mx.int32)
    chosen = mx.take_along_axis(lg - mx.logsumexp(lg, axis=-1, keepdims=True), tgt[:, None], axis=-1)[:, 0]
    greedy = mx.argmax(lg, axis=-1) == tgt
    traffic.evaluate(chosen, greedy)
    per_row: dict[str, tuple[list[TokenLogprob], list[bool]]] = {}
    for rid, t, lp, g in zip(owners, targets, chosen.tolist(), greedy.tolist()):
        lps, flags = per_row.setdefault(rid, ([], []))
        lps.append(TokenLogprob(t, lp))
        flags.append(bool(g))
    return {rid: ScoredTokens(tuple(lps), tuple(fl)) for rid, (lps, fl) in per_row.items()}
