"""The bench workloads: sizes and shapes as documented, reproducible from a seed, and the distinct-trie floor."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlxbatch.bench import workloads as wl

VOCAB = wl.Vocab(3, 1000, frozenset({7, 8, 9}))


def brute_floor(prompts: list[list[int]]) -> int:
    """Trie nodes counted the slow way: every distinct non-empty prefix of every prompt is one node."""
    return len({tuple(p[:i]) for p in prompts for i in range(1, len(p) + 1)})


@pytest.mark.parametrize("name", ["unique", "label", "fewshot", "chat", "short"])
def test_same_seed_same_prompts_other_seed_other_prompts(name):
    a = wl.make(name, VOCAB, 24, seed=5)
    assert a == wl.make(name, VOCAB, 24, seed=5)
    assert a.prompts != wl.make(name, VOCAB, 24, seed=6).prompts
    assert a.rows == 24
    assert all(VOCAB.low <= t < VOCAB.high and t not in VOCAB.exclude for p in a.prompts for t in p)


def test_default_sizes_and_new_tokens():
    sizes = {name: (w.rows, w.max_tokens) for name in ("unique", "label", "fewshot", "chat", "short")
             for w in [wl.make(name, VOCAB)]}
    assert sizes == {"unique": (256, 64), "label": (256, 32), "fewshot": (256, 8), "chat": (256, 32),
                     "short": (8, 128)}


def test_shapes():
    unique = wl.make("unique", VOCAB, 64)
    assert all(32 <= len(p) <= 512 for p in unique.prompts)
    label = wl.make("label", VOCAB, 32)
    head = label.prompts[0][:800]
    assert all(p[:800] == head and 60 <= len(p) - 800 <= 150 for p in label.prompts)
    fewshot = wl.make("fewshot", VOCAB, 32)
    assert len({tuple(p[:600]) for p in fewshot.prompts}) == 8
    chat = wl.make("chat", VOCAB, 16)  # two conversations of 8 turns: each turn extends an earlier one
    by_len = sorted(chat.prompts, key=len)
    assert sum(1 for i, p in enumerate(by_len) if any(p[:len(q)] == q for q in by_len[:i])) == 14
    short = wl.make("short", VOCAB, 5, prompt_len=12, max_tokens=3)
    assert [len(p) for p in short.prompts] == [12] * 5 and short.max_tokens == 3


def test_sharing_workloads_have_a_floor_well_below_their_prompt_tokens():
    for name, most in (("label", 0.2), ("fewshot", 0.3), ("chat", 0.5)):
        w = wl.make(name, VOCAB, 64)
        assert w.trie_floor == brute_floor(w.prompts)
        assert w.trie_floor < most * w.prompt_tokens, name
    unique = wl.make("unique", VOCAB, 64)
    assert unique.trie_floor == brute_floor(unique.prompts) >= unique.prompt_tokens - 64


def test_trie_floor_small_cases():
    assert wl.distinct_trie_tokens([]) == 0
    assert wl.distinct_trie_tokens([[1, 2], [1, 2]]) == 2
    assert wl.distinct_trie_tokens([[1, 2, 3], [1, 2, 4], [1, 2]]) == 4
    assert wl.distinct_trie_tokens([[5], [1, 2, 3], [1, 5]]) == 5


@given(st.lists(st.lists(st.integers(0, 3), max_size=6), max_size=12))
def test_trie_floor_counts_distinct_prefixes(prompts):
    assert wl.distinct_trie_tokens(prompts) == brute_floor(prompts)


def test_length_quantile_subset_spreads_over_lengths():
    rng = random.Random(0)
    prompts = [[0] * rng.randint(1, 1000) for _ in range(200)]
    idx = wl.length_quantile_subset(prompts, 10)
    assert idx == sorted(set(idx)) and len(idx) == 10
    lengths = sorted(len(prompts[i]) for i in idx)
    ranked = sorted(len(p) for p in prompts)
    assert lengths[0] <= ranked[20] and lengths[-1] >= ranked[-21]  # from the lowest to the highest tenth
    assert wl.length_quantile_subset(prompts[:4], 10) == [0, 1, 2, 3]


def test_subset_and_unknown_workload():
    w = wl.make("label", VOCAB, 10)
    sub = w.subset([3, 1])
    assert sub.prompts == [w.prompts[3], w.prompts[1]] and sub.max_tokens == w.max_tokens
    assert sub.meta["subset_of"] == 10
    with pytest.raises(KeyError, match="known: unique, label"):
        wl.make("nope", VOCAB)
