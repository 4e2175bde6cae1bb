"""The run's prefill, predicted row by row: the engine's reuse rules (``engine.sched``) replayed without a model.

Owns a model of the prefix cache (``BlockCacheModel``) and of the rows recently admitted (``ReuseModel``), which
``mlxbatch plan`` feeds in the order the run submits rows:
- as in the engine, a row identical to one admitted in its step forks it (computes nothing); another row starts
  from the longest prefix a row admitted in an earlier step shares with it (to the token: a running row, when that
  is a block's worth or more and the engine's reuse step more than the cache, or a partial block cached where it
  shares it), or from the prefix cache's blocks, which outlive a window. The steps follow the engine's admission:
  a row waits for a row computing whole blocks of its prefix, and at most ``max_num_seqs`` rows are admitted in a
  step; a row admitted with the row it shares the most with recomputes the tail of their shared prefix past what
  the cache holds;
- rows with images reuse whole 16-token blocks of the prefix cache, keyed by the images' content.
No model and no device: token ids in, token counts out.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

from mlxbatch.engine import BLOCK_SIZE, LIVE_SOURCES, block_hashes, common_prefix_len


class BlockCacheModel:
    """The prefix cache as the engine keeps it: whole blocks (chained hashes) and the partial blocks of planned
    rows' retention points, each with the step whose prefill cached it; never evicted but by a partial's last user
    (in trie order no later row needs more of a row than its retention)."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}  # whole block hash -> the step that cached it
        self.partials: dict[tuple[int, tuple[int, ...]], int] = {}  # (previous block hash, tokens) -> its step

    def cached(self, tokens: Sequence[int], media: Sequence[tuple[int, str]] = (),
               chain: Sequence[int] | None = None, step: int | None = None) -> tuple[int, tuple | None]:
        """Leading tokens of ``tokens`` whose KV the cache holds (never the last token: its logits are needed) and
        the partial block they end in (None: whole blocks only). ``chain``: the tokens' block hashes, when the caller
        has them already. With ``step`` (the admission's), as ``engine.sched.prefix`` matches: then the longest
        partial block, or a block holding the prompt's end, cached by an earlier step, counts to the token."""
        chain = block_hashes(list(tokens), BLOCK_SIZE, media) if chain is None else chain
        limit = len(tokens) - 1
        usable = min(limit // BLOCK_SIZE, len(chain))
        hits = 0
        while hits < usable and chain[hits] in self.seen:
            hits += 1
        n = hits * BLOCK_SIZE
        if step is None or hits < limit // BLOCK_SIZE or n >= limit:
            return n, None
        if hits < len(chain) and self.seen.get(chain[hits], step) < step:
            return limit, None
        prev = chain[hits - 1] if hits else 0
        for r in range(min(BLOCK_SIZE - 1, len(tokens) - n), 0, -1):
            key = (prev, tuple(tokens[n : n + r]))
            if self.partials.get(key, step) < step:
                return min(n + r, limit), key
        return n, None

    def store(self, tokens: Sequence[int], media: Sequence[tuple[int, str]] = (),
              chain: Sequence[int] | None = None, step: int = 0, point: int | None = None) -> frozenset[int]:
        """Cache the tokens' whole blocks, and the partial block ending at ``point`` (a planned row's retention);
        returns the whole blocks' hashes that were not cached yet (what the prefill adds)."""
        chain = block_hashes(list(tokens), BLOCK_SIZE, media) if chain is None else chain
        added = frozenset(h for h in chain if h not in self.seen)
        self.seen.update(dict.fromkeys(added, step))
        if point and point % BLOCK_SIZE and point <= len(tokens):
            k = point // BLOCK_SIZE
            self.partials.setdefault((chain[k - 1] if k else 0, tuple(tokens[k * BLOCK_SIZE : point])), step)
        return added

    def prefill(self, tokens: Sequence[int], media: Sequence[tuple[int, str]] = ()) -> int:
        """Tokens computed for ``tokens`` (then cached): whole blocks only (image rows are not planned)."""
        chain = block_hashes(list(tokens), BLOCK_SIZE, media)
        computed = len(tokens) - self.cached(tokens, chain=chain)[0]
        self.store(tokens, chain=chain)
        return computed


@dataclass(frozen=True)
class _Submitted:
    """A recently submitted row, as the prediction follows it: its tokens, the whole blocks its prefill adds to
    the cache, and the step it is predicted to be admitted in."""

    tokens: Sequence[int]
    added: frozenset[int]
    step: int


class ReuseModel:
    """The rows recently admitted and the prefix cache, across windows, as the engine's admission sees them."""

    def __init__(self, max_num_seqs: int, forks: bool, live_margin: int = 1) -> None:
        self.cache = BlockCacheModel()
        self.recent: collections.deque[_Submitted] = collections.deque(maxlen=LIVE_SOURCES)
        self.max_num_seqs = max_num_seqs
        self.forks = forks  # a generating row identical to one being prefilled forks it (not a scoring row)
        self.live_margin = max(1, live_margin)  # a running row must give this many more tokens than the cache
        self.submitted = 0  # rows submitted so far (text rows), for the step a row can be admitted in at the earliest
        self.base_step = 0  # the step the next window's rows can start in
        self.last_of_step: dict[int, Sequence[int]] = {}  # the last row admitted in each step (from the latest on)

    def start_window(self) -> None:
        """The next window's rows are fed after the last window's."""
        self.base_step = max([self.base_step] + [r.step + 1 for r in self.recent])

    def reuse(self, seq: Sequence[int], cache_tokens: int | None = None) -> int:
        """Tokens ``seq`` computes, submitted now with the plan's retention ``cache_tokens``, by the engine's admission
        rules (``engine.sched``).

        A row identical to one admitted in the step it can be admitted in forks that row's KV and logits (nothing
        to compute). Else it waits while a recent row computes whole blocks of its prefix (``in_progress``), so it
        runs a step after that row. It then starts from the longest prefix a row admitted in an earlier step
        shares with it, to the token: a running row's KV, or the partial block that row's prefill cached where the
        rows waiting for its blocks share it (in trie order the last row of the latest earlier step shares the
        most), or the cache's blocks (whole ones, then a partial block cached at an earlier row's retention point).
        A row admitted in the same step as the row it shares the most with cannot read that row's KV and recomputes
        the tail of their shared prefix past what the cache holds. At most ``max_num_seqs`` rows are admitted in
        one step."""
        earliest = self.base_step + self.submitted // self.max_num_seqs
        self.submitted += 1
        if self.forks and any(r.step >= earliest and len(r.tokens) == len(seq) and r.tokens == seq
                              for r in self.recent):
            return 0  # the same prompt is admitted in that step: this row forks its KV and logits
        chain = block_hashes(list(seq), BLOCK_SIZE)  # hashed once for the wait, the cache's hits and the store
        needed = set(chain[: (len(seq) - 1) // BLOCK_SIZE])
        step = max([earliest] + [r.step + 1 for r in self.recent if r.added & needed])
        cached, partial = self.cache.cached(seq, chain=chain, step=step)
        earlier = max((k for k in self.last_of_step if k < step), default=None)
        live = [common_prefix_len(seq, r.tokens) for r in self.recent if r.step < step]
        # the partial block cached where the rows that waited for it share it: the cache's, whatever the margin
        waited = common_prefix_len(seq, self.last_of_step[earlier]) if earlier is not None else 0
        # a running row gives a block's worth or more, and the engine's margin (its reuse step) more than the cache
        reuse = max([cached] + [n for n in live if n >= BLOCK_SIZE and n >= cached + self.live_margin]
                    + ([waited] if waited >= BLOCK_SIZE else []))
        self.last_of_step[step] = seq
        oldest = max((k for k in self.last_of_step if k < earliest), default=None)  # later rows start >= earliest
        for k in [k for k in self.last_of_step if oldest is not None and k < oldest]:
            del self.last_of_step[k]
        if partial is not None and (cache_tokens or 0) < cached // BLOCK_SIZE * BLOCK_SIZE + len(partial[1]):
            del self.cache.partials[partial]  # the row matched it and shares less with later rows: dead
        self.recent.append(_Submitted(seq, self.cache.store(seq, chain=chain, step=step, point=cache_tokens), step))
        return len(seq) - min(reuse, len(seq) - 1)
