"""Per-request sampling over a batch of logits, honouring each row's own SamplingParams.

Owns the token choice for one step: penalties, temperature, top-k, top-p, min-p, seeded draws and log-probs.
Every row's draw depends only on its own logits, parameters, seed and position, never on its batch
neighbours: the random number for a row is a counter-based hash of (seed, position) and the draw is an
inverse-CDF lookup, so one uniform per row replaces a global PRNG stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx

from mlxbatch.types import SamplingParams, TokenLogprob

_MASK64 = (1 << 64) - 1


def uniform_for(seed: int, position: int) -> float:
    """A uniform in [0, 1) determined by (seed, position) alone (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def derive_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed`` (n > 1)."""
    return int(uniform_for(seed, 1_000_003 + index) * (1 << 53)) if index else seed


@dataclass(frozen=True)
class SampleRow:
    """What the sampler needs to know about one row this step."""

    params: SamplingParams
    seed: int
    position: int  # index of the token being sampled among the row's generated tokens
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    banned_ids: tuple[int, ...] = ()  # e.g. EOS while min_tokens is not reached


class SampledToken(NamedTuple):
    """One drawn token (a named tuple: a step reads one for every row it drew)."""

    token_id: int
    logprob: TokenLogprob | None


def _apply_penalties(row: mx.array, spec: SampleRow) -> mx.array:
    p = spec.params
    if p.repetition_penalty != 1.0:
        seen = mx.array(sorted(set(spec.prompt_ids) | set(spec.output_ids)), dtype=mx.int32)
        if seen.size:
            vals = row[seen]
            vals = mx.where(vals < 0, vals * p.repetition_penalty, vals / p.repetition_penalty)
            row[seen] = vals
    if (p.presence_penalty or p.frequency_penalty) and spec.output_ids:
        counts: dict[int, int] = {}
        for t in spec.output_ids:
            counts[t] = counts.get(t, 0) + 1
        ids = mx.array(list(counts), dtype=mx.int32)
        cnt = mx.array(list(counts.values()), dtype=mx.float32)
        row[ids] = row[ids] - p.presence_penalty - p.frequency_penalty * cnt
    return row


def _adjust(logits: mx.array, rows: Sequence[SampleRow]) -> mx.array:
    """Penalties and bans, applied only to the rows that ask for them."""
    touched = [i for i, r in enumerate(rows) if r.params.has_penalties or r.banned_ids]
    if not touched:
        return logits
    out = [logits[i] for i in range(len(rows))]
    vocab = logits.shape[-1]
    for i in touched:
        row = _apply_penalties(out[i], rows[i])
        banned = [t for t in rows[i].banned_ids if t < vocab]
        if banned:
            row[mx.array(banned, dtype=mx.int32)] = -mx.inf
        out[i] = row
    return mx.stack(out)


def _draw(logits: mx.array, rows: Sequence[SampleRow]) -> mx.array:
    """Sample one token per row (all rows non-greedy) by inverse CDF over the filtered distribution."""
    temps = mx.array([r.params.temperature for r in rows], dtype=mx.float32)[:, None]
    x = logits / temps
    ks = [r.params.top_k for r in rows]
    if any(ks):
        kmax = min(max(ks), x.shape[-1])
        top = mx.sort(mx.topk(x, kmax, axis=-1), axis=-1)[:, ::-1]  # descending
        kth = mx.array([min(k, kmax) - 1 if k else kmax - 1 for k in ks], dtype=mx.int32)
        thresh = mx.take_along_axis(top, kth[:, None], axis=-1)
        active = mx.array([bool(k) for k in ks])[:, None]
        x = mx.where(active & (x < thresh), -mx.inf, x)
    probs = mx.softmax(x, axis=-1)
    min_ps = [r.params.min_p for r in rows]
    if any(min_ps):
        floor = mx.max(probs, axis=-1, keepdims=True) * mx.array(min_ps, dtype=mx.float32)[:, None]
        probs = mx.where(probs < floor, 0.0, probs)
    top_ps = [r.params.top_p for r in rows]
    if any(p < 1.0 for p in top_ps):
        desc = mx.sort(probs, axis=-1)[:, ::-1]
        csum = mx.cumsum(desc, axis=-1) / mx.sum(desc, axis=-1, keepdims=True)
        # the smallest prefix whose mass reaches top_p; keep every token at least as likely as its last
        cut = mx.sum(csum < mx.array(top_ps, dtype=mx.float32)[:, None], axis=-1, keepdims=True)
        cut = mx.minimum(cut, probs.shape[-1] - 1).astype(mx.int32)
        floor = mx.take_along_axis(desc, cut, axis=-1)
        keep = mx.array([p < 1.0 for p in top_ps])[:, None]
        probs = mx.where(keep & (probs < floor), 0.0, probs)
    cdf = mx.cumsum(probs, axis=-1)
    u = mx.array([uniform_for(r.seed, r.position) for r in rows], dtype=mx.float32)[:, None]
    target = u * cdf[:, -1:]
    idx = mx.sum(cdf <= target, axis=-1)
    return mx.minimum(idx, probs.shape[-1] - 1)


@dataclass(frozen=True)
class Drawn:
    """A step's draw, still on the device: the chosen ids and the logprobs asked for. ``arrays()`` go to an
    evaluation; ``read()`` brings them back as ``SampledToken``s (a sync if they are not evaluated yet)."""

    chosen: mx.array  # [rows] int32
    lp_rows: tuple[int, ...] = ()  # rows that asked for logprobs
    ks: tuple[int, ...] = ()  # per row of ``lp_rows``: how many top alternatives it asked for
    chosen_lp: mx.array | None = None  # [len(lp_rows)]
    top_ids: mx.array | None = None  # [len(lp_rows), max(ks)]
    top_vals: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.chosen_lp, self.top_ids, self.top_vals) if a is not None]

    def read(self) -> list[SampledToken]:
        tokens = self.chosen.tolist()  # (int32: Python ints)
        out = [SampledToken(t, None) for t in tokens]
        if not self.lp_rows:
            return out
        assert self.chosen_lp is not None
        chosen_list = self.chosen_lp.tolist()
        ids_list = self.top_ids.tolist() if self.top_ids is not None else None
        vals_list = self.top_vals.tolist() if self.top_vals is not None else None
        for j, (i, k) in enumerate(zip(self.lp_rows, self.ks)):
            top = tuple(zip(ids_list[j][:k], vals_list[j][:k])) if ids_list and vals_list else ()
            out[i] = SampledToken(tokens[i], TokenLogprob(tokens[i], chosen_list[j], top))
        return out


def draw_greedy(logits: mx.array) -> Drawn:
    """The argmax of each row of ``logits`` as they are (rows with no penalty, banned token or logprobs; a float32
    copy of [rows, vocab] would change no value: bfloat16 and float16 convert exactly)."""
    return Drawn(mx.argmax(logits, axis=-1).astype(mx.int32))


def draw(logits: mx.array, rows: Sequence[SampleRow], model_logits: mx.array | None = None) -> Drawn:
    """Choose the next token of every row of ``logits`` ([rows, vocab]) under that row's parameters, lazily.

    Logprobs (rows that ask for them) are the model's own distribution: ``model_logits`` when given (the logits before
    an output constraint masked them, so a constrained label's logprob is the model's confidence in it, not 0.0 under a
    mask that left one token), else ``logits``."""
    assert logits.ndim == 2 and logits.shape[0] == len(rows)
    want_lp = [r.params.logprobs is not None for r in rows]
    if not any(want_lp) and all(r.params.greedy and not (r.params.has_penalties or r.banned_ids) for r in rows):
        return draw_greedy(logits)
    logits = logits.astype(mx.float32)
    raw = logits if model_logits is None else model_logits.astype(mx.float32)
    raw_lp = raw - mx.logsumexp(raw, axis=-1, keepdims=True) if any(want_lp) else None
    adjusted = _adjust(logits, rows)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    drawn = [i for i, r in enumerate(rows) if not r.params.greedy]
    parts: list[mx.array] = []
    order: list[int] = []
    if greedy:
        g = adjusted if len(greedy) == len(rows) else adjusted[mx.array(greedy)]
        parts.append(mx.argmax(g, axis=-1))
        order += greedy
    if drawn:
        d = adjusted if len(drawn) == len(rows) else adjusted[mx.array(drawn)]
        parts.append(_draw(d, [rows[i] for i in drawn]))
        order += drawn
    chosen = mx.concatenate(parts) if len(parts) > 1 else parts[0]
    # back to row order
    if len(parts) > 1:
        inverse = [0] * len(rows)
        for pos, i in enumerate(order):
            inverse[i] = pos
        chosen = chosen[mx.array(inverse)]
    chosen = chosen.astype(mx.int32)
    lp_rows = [i for i, w in enumerate(want_lp) if w]
    if not lp_rows:
        return Drawn(chosen)
    assert raw_lp is not None
    sel = mx.array(lp_rows)
    lp = raw_lp[sel] if len(lp_rows) < len(rows) else raw_lp
    chosen_lp = mx.take_along_axis(lp, chosen[sel][:, None], axis=-1)[:, 0]
    ks = tuple(rows[i].params.logprobs or 0 for i in lp_rows)
    kmax = max(ks)
    top_ids = top_vals = None
    if kmax:
        top_ids = mx.argpartition(-lp, kmax - 1, axis=-1)[:, :kmax]
        top_vals = mx.take_along_axis(lp, top_ids, axis=-1)
        order_k = mx.argsort(-top_vals, axis=-1)
        top_ids = mx.take_along_axis(top_ids, order_k, axis=-1)
        top_vals = mx.take_along_axis(top_vals, order_k, axis=-1)
    return Drawn(chosen, tuple(lp_rows), ks, chosen_lp, top_ids, top_vals)


def sample(logits: mx.array, rows: Sequence[SampleRow], model_logits: mx.array | None = None) -> list[SampledToken]:
    """``draw``, read back at once."""
    return draw(logits, rows, model_logits).read()
