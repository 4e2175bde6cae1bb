"""Engine counters of several engines (the actors of a distributed run) merged into one engine's report shape.

Owns the merge rule: counts, token totals, bytes and seconds add up; a setting (``block_size``) is kept; a rate
(``hit_rate``) is recomputed from the merged counts; each engine's batch (``batch``: set or sized by its device) is
kept once if every engine's is the same, else listed. Pure Python.
"""

from __future__ import annotations

from typing import Any

_KEPT = {"block_size"}


def _merge(dicts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    present = [d for d in dicts if d]
    if not present:
        return None
    out: dict[str, Any] = {}
    for d in present:
        for key, value in d.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in _KEPT:
                out[key] = round(out.get(key, 0) + value, 4)
            else:
                out.setdefault(key, value)
    if "hit_rate" in out:
        lookups = out.get("hits", 0) + out.get("misses", 0)
        out["hit_rate"] = round(out.get("hits", 0) / lookups, 4) if lookups else 0.0
    return out


def _batches(stats: list[dict[str, Any]]) -> dict[str, Any] | list[dict[str, Any]] | None:
    distinct: list[dict[str, Any]] = []
    for s in stats:
        if s.get("batch") and s["batch"] not in distinct:
            distinct.append(s["batch"])
    return distinct[0] if len(distinct) == 1 else distinct or None


def merge_engine_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """``EngineCore.stats()`` of each engine -> one dict of the same shape (``device``: the kinds, joined)."""
    if not stats:
        return {}
    return {"profile": _merge([s.get("profile") for s in stats]) or {}, "batch": _batches(stats),
            "kv_budget_bytes": sum(s.get("kv_budget_bytes", 0) for s in stats),
            "kv_bytes": sum(s.get("kv_bytes", 0) for s in stats),
            # each engine's own process and device: the largest of them, not a sum
            "peak_memory_bytes": max(s.get("peak_memory_bytes", 0) for s in stats),
            "preemptions": sum(s.get("preemptions", 0) for s in stats),
            "prefix_cache": _merge([s.get("prefix_cache") for s in stats]),
            "vision_cache": _merge([s.get("vision_cache") for s in stats]),
            "device": ",".join(sorted({str(s.get("device")) for s in stats}))}
