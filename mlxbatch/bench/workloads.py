"""Benchmark workloads as token ids, generated from a seed (docs/benchmarks.md: the method).

Pure Python (no mlx): every section of the bench (``mlxbatch.bench``) draws its prompts from here, so the same
``(name, rows, seed, vocabulary)`` always gives the same prompts. Token ids are drawn uniformly from
``vocab`` (a range of ids without the special tokens), so no tokenizer is involved and the prompts mean
nothing: speed does not depend on what the tokens say.

Sizes scale with ``rows``; the defaults are the sizes docs/benchmarks.md names.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: int
    meta: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def trie_floor(self) -> int:
        return distinct_trie_tokens(self.prompts)

    def subset(self, indices: list[int]) -> Workload:
        return Workload(self.name, [self.prompts[i] for i in indices], self.max_tokens,
                        {**self.meta, "subset_of": self.rows})


@dataclass(frozen=True)
class Vocab:
    """Ids to draw prompt tokens from: ``[low, high)`` minus ``exclude`` (special tokens)."""

    low: int
    high: int
    exclude: frozenset[int] = frozenset()

    def draw(self, rng: random.Random, n: int) -> list[int]:
        out = []
        while len(out) < n:
            t = rng.randrange(self.low, self.high)
            if t not in self.exclude:
                out.append(t)
        return out


def distinct_trie_tokens(prompts: list[list[int]]) -> int:
    """Nodes of the token trie of all prompts: the fewest prompt tokens any plan must compute."""
    total, prev = 0, ()
    for p in sorted(tuple(p) for p in prompts):
        lcp = 0
        for a, b in zip(prev, p):
            if a != b:
                break
            lcp += 1
        total += len(p) - lcp
        prev = p
    return total


def length_quantile_subset(prompts: list[list[int]], k: int) -> list[int]:
    """Indices of ``k`` rows spread evenly over the prompt-length distribution (for a slow baseline
    run on a subset: its per-row time then stands for the whole workload's)."""
    n = len(prompts)
    if k >= n:
        return list(range(n))
    order = sorted(range(n), key=lambda i: len(prompts[i]))
    return sorted(order[int((j + 0.5) * n / k)] for j in range(k))


# -- the workloads of benchmarks.md ------------------------------------------------------------------
WorkloadFn = Callable[..., Workload]
WORKLOADS: dict[str, WorkloadFn] = {}


def workload(name: str) -> Callable[[WorkloadFn], WorkloadFn]:
    def register(fn: WorkloadFn) -> WorkloadFn:
        WORKLOADS[name] = fn
        return fn

    return register


def make(name: str, vocab: Vocab, rows: int | None = None, seed: int = 0, **kw) -> Workload:
    """The named workload; ``rows`` (None: the default size) and ``kw`` override its shape."""
    if name not in WORKLOADS:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if rows is not None:
        kw["rows"] = rows
    return WORKLOADS[name](vocab, seed=seed, **kw)


@workload("unique")
def unique(vocab: Vocab, rows: int = 256, seed: int = 0, min_len: int = 32, max_len: int = 512,
           max_tokens: int = 64) -> Workload:
    """Unrelated prompts of uniform random length: no sharing, so only overhead and padding count."""
    rng = random.Random(f"unique-{seed}")
    prompts = [vocab.draw(rng, rng.randint(min_len, max_len)) for _ in range(rows)]
    return Workload("unique", prompts, max_tokens, {"min_len": min_len, "max_len": max_len, "seed": seed})


@workload("label")
def label(vocab: Vocab, rows: int = 256, seed: int = 0, prefix_len: int = 800, item_min: int = 60,
          item_max: int = 150, max_tokens: int = 32) -> Workload:
    """One shared instruction + a distinct item per row, shuffled (dataset labeling)."""
    rng = random.Random(f"label-{seed}")
    prefix = vocab.draw(rng, prefix_len)
    prompts = [prefix + vocab.draw(rng, rng.randint(item_min, item_max)) for _ in range(rows)]
    rng.shuffle(prompts)
    return Workload("label", prompts, max_tokens, {"prefix_len": prefix_len, "seed": seed})


@workload("fewshot")
def fewshot(vocab: Vocab, rows: int = 256, seed: int = 0, prefixes: int = 8, prefix_len: int = 600,
            q_min: int = 30, q_max: int = 50, max_tokens: int = 8) -> Workload:
    """Several few-shot prefixes x short questions, rows interleaved across prefixes (evals)."""
    rng = random.Random(f"fewshot-{seed}")
    heads = [vocab.draw(rng, prefix_len) for _ in range(prefixes)]
    prompts = [heads[i % prefixes] + vocab.draw(rng, rng.randint(q_min, q_max)) for i in range(rows)]
    return Workload("fewshot", prompts, max_tokens, {"prefixes": prefixes, "prefix_len": prefix_len, "seed": seed})


@workload("chat")
def chat(vocab: Vocab, rows: int = 256, seed: int = 0, turns: int = 8, system_len: int = 60,
         user_min: int = 20, user_max: int = 80, reply_len: int = 32, max_tokens: int = 32) -> Workload:
    """Conversations where each row carries the whole history so far (nested prefixes), shuffled."""
    rng = random.Random(f"chat-{seed}")
    prompts = []
    for _ in range(max(1, rows // turns)):
        history = vocab.draw(rng, system_len)
        for _ in range(turns):
            history = history + vocab.draw(rng, rng.randint(user_min, user_max))
            prompts.append(list(history))
            history = history + vocab.draw(rng, reply_len)  # the "assistant" reply of that turn
    rng.shuffle(prompts)
    return Workload("chat", prompts[:rows], max_tokens, {"turns": turns, "seed": seed})


@workload("short")
def short(vocab: Vocab, rows: int = 8, seed: int = 0, prompt_len: int = 32, max_tokens: int = 128) -> Workload:
    """Equal short prompts, for decode throughput at a fixed concurrency (all rows run at once)."""
    rng = random.Random(f"short-{seed}-{rows}")
    return Workload("short", [vocab.draw(rng, prompt_len) for _ in range(rows)], max_tokens,
                    {"prompt_len": prompt_len, "seed": seed})
