"""The vision-feature cache: image content hash -> the vision tower's features (the seed's MLLMCacheManager, made
correct: keyed by what the image *is*, never by its size or its place in a batch).

Owns the entries (least recently used first, bounded by bytes), and the counters the run report shows: hits,
misses, images encoded, encoder seconds spent, and encoder seconds saved (each hit is credited with what encoding
that image cost when it was a miss). Values are opaque arrays with ``nbytes``; who computes them and when is the
vision-language runner's business. Pure Python: no mlx import.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_BUDGET_BYTES = 1 << 30


@dataclass
class _Entry:
    features: Any
    nbytes: int
    cost_s: float  # encoder seconds it took (its share of a batched encoder call)


class VisionCache:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        assert budget_bytes >= 0
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.images_encoded = 0
        self.encoder_s = 0.0
        self.encoder_s_saved = 0.0

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, content_hash: str) -> Any | None:
        """The cached features of an image (a hit), or None (a miss: the caller encodes and ``put``s them)."""
        entry = self._entries.get(content_hash)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(content_hash)
        self.hits += 1
        self.encoder_s_saved += entry.cost_s
        return entry.features

    def put(self, content_hash: str, features: Any, cost_s: float) -> None:
        """Store freshly encoded features (counted as encoder work); evicts least recently used entries to fit."""
        self.images_encoded += 1
        self.encoder_s += cost_s
        size = int(getattr(features, "nbytes", 0))
        old = self._entries.pop(content_hash, None)
        if old is not None:
            self._bytes -= old.nbytes
        if size > self.budget_bytes:
            return  # larger than the whole cache: used once, not kept
        while self._entries and self._bytes + size > self.budget_bytes:
            _, gone = self._entries.popitem(last=False)
            self._bytes -= gone.nbytes
            self.evictions += 1
        self._entries[content_hash] = _Entry(features, size, cost_s)
        self._bytes += size

    def stats(self) -> dict[str, Any]:
        lookups = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses, "hit_rate": round(self.hits / lookups, 4) if lookups else 0.0,
                "images_encoded": self.images_encoded, "entries": len(self._entries), "bytes": self._bytes,
                "evictions": self.evictions, "encoder_s": round(self.encoder_s, 4),
                "encoder_s_saved": round(self.encoder_s_saved, 4)}
