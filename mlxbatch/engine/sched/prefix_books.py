"""The prefix index's books, each a small class owning one map (pure Python): the sequences' block hashes
(``BlockChains``), the partial blocks stored after each full block (``PartialBlocks``) and the prefixes admitted
sequences are computing now (``InFlight``). The prefix index (``sched.prefix``) and its keeping (``sched.prefix_keeping``)
read and write them through their methods only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet

from mlxbatch.engine.request import Request
from mlxbatch.engine.sched.blocks import BLOCK_SIZE, block_hashes


class BlockChains:
    """Each sequence's full blocks' chained hashes, computed once (until the sequence is freed)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._chains: dict[str, list[int]] = {}  # request id -> its tokens' block hashes
        self._last_hashed: tuple[list[int], list[int]] | None = None  # the last text prompt hashed: tokens, chain

    def chain(self, request: Request) -> list[int]:
        """``request``'s full blocks' chained hashes. Sequences come mostly in the plan's order, next to the ones they
        share a prefix with: the blocks a text prompt shares with the last one hashed are taken from its chain (a
        few-shot job's rows share hundreds of tokens and differ in their last few blocks)."""
        B = self.block_size
        chain = self._chains.get(request.request_id)
        if chain is None and request.prompt_hashes is not None and B == BLOCK_SIZE:  # hashed by the caller
            chain = self._chains[request.request_id] = list(request.prompt_hashes)
        if chain is None or len(chain) < request.num_tokens // B:  # a preempted sequence also has output tokens
            n = request.num_tokens // B * B
            tokens = request.tokens(0, n)
            known: list[int] = chain or []  # a sequence's tokens only grow: its own chain so far stays valid
            if not known and not request.media and self._last_hashed is not None:
                last_tokens, last_chain = self._last_hashed
                known = last_chain[: _equal_blocks(tokens, last_tokens, B)]
            chain = self._chains[request.request_id] = block_hashes(tokens, B, request.media, known)
            self._last_hashed = None if request.media else (tokens, chain)
        return chain

    def forget(self, request_id: str) -> None:
        self._chains.pop(request_id, None)


def _equal_blocks(a: list[int], b: list[int], block_size: int) -> int:
    """How many leading whole blocks ``a`` and ``b`` have equal: ``common_prefix_len(a, b) // block_size``. One is
    often all of the other's start (the nested prompts of a chat): one comparison; else a block at a time (the rows
    of a label job share a block or a few: a binary search over the whole prompt costs more)."""
    n = min(len(a), len(b)) // block_size
    if a[: n * block_size] == b[: n * block_size]:
        return n
    k = 0
    while a[k * block_size : (k + 1) * block_size] == b[k * block_size : (k + 1) * block_size]:
        k += 1  # (stops before n: the blocks differ somewhere before it)
    return k


class PartialBlocks:
    """The partial blocks stored after each full block (its hash; None: the prompt's start): their lengths there (a
    lookup tries only those) and their hashes by their tokens (a lookup finds a stored partial's hash without hashing
    the tokens again: each admission tries a length or two). A superset of those cached: ``prune`` prunes it."""

    def __init__(self) -> None:
        self.lengths: dict[int | None, dict[int, set[int]]] = {}  # (read only outside)
        self._hashes: dict[tuple[int | None, tuple[int, ...]], int] = {}  # (full block, tokens) -> ``partial_hash``
        self.noted = 0

    def after(self, prev: int | None) -> dict[int, set[int]] | None:
        """The partials stored after full block ``prev``: their lengths -> their hashes (None: none)."""
        return self.lengths.get(prev)

    def find(self, prev: int | None, tokens: Sequence[int]) -> int | None:
        """The hash of the partial block of ``tokens`` after the full block ``prev``, if one was stored (None: none)."""
        return self._hashes.get((prev, tuple(tokens)))

    def note(self, prev: int | None, tokens: Sequence[int], h: int) -> None:
        """A partial block of ``tokens`` after the full block ``prev`` is stored under ``h`` (their ``partial_hash``)."""
        self.lengths.setdefault(prev, {}).setdefault(len(tokens), set()).add(h)
        self._hashes[(prev, tuple(tokens))] = h
        self.noted += 1

    def prune(self, has: Callable[[int], bool], num_blocks: int) -> None:
        """Forget the partials the pool no longer holds (``has``), once there are more than a few times the pool's
        ``num_blocks`` (at a step's start: every partial noted before is cached by now, or evicted, or its step
        failed)."""
        if self.noted <= max(1024, 2 * num_blocks):
            return
        pruned: dict[int | None, dict[int, set[int]]] = {}
        for prev, by_length in self.lengths.items():
            for length, hashes in by_length.items():
                held = {h for h in hashes if has(h)}
                if held:
                    pruned.setdefault(prev, {})[length] = held
        self.lengths = pruned
        self._hashes = {key: h for key, h in self._hashes.items() if has(h)}
        self.noted = sum(len(hs) for by_length in pruned.values() for hs in by_length.values())


class InFlight:
    """The block hashes admitted sequences are computing now (cached once their prefill ends), and the sequences that
    wait for them: this step's waiters, and those that waited and are not admitted yet."""

    def __init__(self) -> None:
        self._computing: dict[str, list[int]] = {}
        self._count: dict[int, int] = {}  # block hash -> admitted sequences computing it (never 0)
        self.waiters: list[tuple[Request, int]] = []  # waiting this step, with the block they wait for (read only)
        # sequences that waited and are not admitted yet -> their reusable whole blocks' hashes: the plan's eviction
        # (``PrefixKeeping._drop_after``) spares these, since such a sequence is admitted after rows the plan put behind
        # it (a prefix's last planned user may be admitted before a sequence that still shares it)
        self._pending: dict[str, list[int]] = {}
        # block hash -> pending sequences holding it (never 0): ``spared``, counted as they come and go (hundreds of
        # sequences wait at once in a job of nested prompts: their union was rebuilt every step)
        self._spared: dict[int, int] = {}

    @property
    def busy(self) -> bool:
        """Whether any admitted sequence is computing blocks."""
        return bool(self._count)

    def count(self, h: int) -> int:
        """Admitted sequences computing block ``h`` now."""
        return self._count.get(h, 0)

    def hashes_of(self, request_id: str) -> list[int]:
        return self._computing.get(request_id, [])

    def start(self, request_id: str, hashes: list[int]) -> None:
        """An admitted sequence computes these blocks (it was admitted: it waits no more)."""
        _uncount(self._spared, self._pending.pop(request_id, None) or ())
        self._computing[request_id] = hashes
        _count(self._count, hashes)

    def done(self, request_id: str) -> None:
        """The sequence's prefill ended (or it was freed): its blocks are no longer being computed."""
        _uncount(self._count, self._computing.pop(request_id, None) or ())

    def wait(self, request: Request, block: int, hashes: list[int]) -> None:
        """``request`` waits this step for ``block`` (of its reusable whole blocks ``hashes``)."""
        self.waiters.append((request, block))
        before = self._pending.get(request.request_id)
        if before == hashes:
            return  # it waited before, for the same blocks
        _uncount(self._spared, before or ())
        self._pending[request.request_id] = hashes
        _count(self._spared, hashes)

    def new_step(self) -> None:
        self.waiters = []

    def take_waiters(self) -> list[tuple[Request, int]]:
        """This step's waiters, forgotten."""
        waiters, self.waiters = self.waiters, []
        return waiters

    def spared(self) -> AbstractSet[int]:
        """The blocks of every sequence that waited and is not admitted yet (a live view)."""
        return self._spared.keys()

    def forget(self, request_id: str) -> None:
        self.done(request_id)
        _uncount(self._spared, self._pending.pop(request_id, None) or ())


def _count(counts: dict[int, int], hashes: Iterable[int]) -> None:
    """One more holder of each of ``hashes``."""
    for h in hashes:
        counts[h] = counts.get(h, 0) + 1


def _uncount(counts: dict[int, int], hashes: Iterable[int]) -> None:
    """One holder fewer of each of ``hashes``; a count that reaches 0 goes (an empty map: nobody holds anything)."""
    for h in hashes:
        left = counts[h] - 1
        if left > 0:
            counts[h] = left
        else:
            del counts[h]
