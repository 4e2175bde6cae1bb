"""The vision-feature cache's books (pure Python): hits, misses, LRU by bytes, encoder time saved."""

from __future__ import annotations

from dataclasses import dataclass

from mlxbatch.engine.vision.cache import VisionCache


@dataclass
class Feats:
    nbytes: int


def test_hits_misses_and_saved_encoder_time():
    c = VisionCache(budget_bytes=1000)
    assert c.get("a") is None
    c.put("a", Feats(100), cost_s=0.5)
    assert c.get("a").nbytes == 100 and c.get("a") is not None
    st = c.stats()
    assert (st["hits"], st["misses"], st["images_encoded"], st["entries"], st["bytes"]) == (2, 1, 1, 1, 100)
    assert st["encoder_s"] == 0.5 and st["encoder_s_saved"] == 1.0 and st["hit_rate"] == 0.6667


def test_least_recently_used_goes_first_and_oversized_entries_are_not_kept():
    c = VisionCache(budget_bytes=300)
    for k in "abc":
        c.put(k, Feats(100), 0.1)
    c.get("a")  # a is now the most recent
    c.put("d", Feats(100), 0.1)
    assert "b" not in c and all(k in c for k in "acd") and c.nbytes == 300 and c.evictions == 1
    c.put("huge", Feats(301), 0.1)
    assert "huge" not in c and len(c) == 3 and c.stats()["images_encoded"] == 5
    c.put("a", Feats(50), 0.1)  # re-put replaces, bytes stay exact
    assert c.nbytes == 250
