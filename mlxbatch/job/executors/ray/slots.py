"""The Ray driver's books of its engine actors: which rows each holds, what each did, and who gets which rows next.

Owns ``Slot`` (one actor as the driver sees it: the units it took and has not sent yet, the rows in flight, its
counters, the prefill floor of the order it got its rows in, its summary for report.json and progress.json) and
the rules that hand rows out: a window's rows cut into units (``units_of``: prefix-local or random,
``job.executors.ray.partition``), an actor's next rows (``next_rows``: its own unit first, then whole units from the queue while
they keep it within an even share of what is left once the input is all read) and, at the end, the tail of the
busiest actor's unsent rows for an idle one (``steal``, cut at a weak link). Nothing here imports Ray: the Ray
executor (``job.executors.ray.executor``) keeps the queue and the slots and talks to the actors.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from mlxbatch.job.executors.ray.partition import prefix_units, random_units, row_cost, split_for_steal
from mlxbatch.job.rows.feed import Submit

if TYPE_CHECKING:
    from mlxbatch.job.executors.ray.actor import ActorInfo, Placed


@dataclasses.dataclass
class Slot:
    """One engine actor as the driver sees it: what it was given and what it did."""

    name: str
    handle: Any
    state: str = "starting"  # starting | ready | dead
    calls: deque[Any] = dataclasses.field(default_factory=deque)  # pending calls, in the order the actor runs them:
    # placed() then info() while it starts, then up to PIPELINE advance() calls
    replacing: str | None = None  # the lost actor this one replaces
    placed: Placed | None = None  # its process runs on a node (the cluster had room for it)
    waiting_logged: bool = False  # its wait for room on the cluster was logged
    info: ActorInfo | None = None
    units: deque[list[Submit]] = dataclasses.field(default_factory=deque)  # taken, not sent yet (plan order)
    in_flight: dict[str, Submit] = dataclasses.field(default_factory=dict)  # sent, not returned (in send order)
    last_ids: list[int] = dataclasses.field(default_factory=list)  # the last row sent (for the prefill floor)
    rows: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    floor_tokens: int = 0  # prefill this actor cannot avoid: each row's tokens beyond what the previous one shares
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)  # the engine's latest counters
    busy_s: float = 0.0
    idle_s: float = 0.0  # time the actor held unfinished rows between calls: waiting for this driver
    error: str | None = None
    started: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def queued(self) -> int:
        return sum(len(u) for u in self.units)

    def summary(self) -> dict[str, Any]:
        i, p = self.info, self.placed
        prefill = int(self.engine.get("profile", {}).get("prefill_tokens", 0))
        return {"name": self.name, "state": self.state, "host": p.host if p else None, "pid": p.pid if p else None,
                "device": i.device if i else None, "blas": i.blas if i else None, "gpus": i.gpus if i else None,
                "device_memory": i.device_memory if i else None,
                "kv_budget_bytes": self.engine.get("kv_budget_bytes"), "rows": self.rows,
                "errors": self.errors, "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "floor_tokens": self.floor_tokens, "prefill_tokens": prefill,
                "prefill_over_floor": round(prefill / self.floor_tokens, 4) if self.floor_tokens else None,
                "busy_s": round(self.busy_s, 3), "idle_s": round(self.idle_s, 3), "error": self.error}


def units_of(rows: list[Submit], partition: str, actors: int) -> list[list[Submit]]:
    """A window's rows (plan order) as the units the queue holds: prefix-local, or dealt by key (``random``)."""
    if not rows:
        return []
    links = [r.cache_tokens or 0 for r in rows]
    costs = [row_cost(len(r.token_ids or ()), links[i - 1] if i else 0,
                      0 if r.prep.candidates is not None else r.prep.params.max_tokens * r.prep.params.n)
             for i, r in enumerate(rows)]
    if partition == "random":
        units = random_units([r.prep.key for r in rows], costs, actors)
    else:
        units = prefix_units(links, costs, actors)
    return [[rows[i] for i in u.rows] for u in units]


def next_rows(slot: Slot, n: int, queue: deque[list[Submit]], slots: list[Slot], feed_done: bool,
              limit: int) -> list[Submit]:
    """Up to ``n`` rows for ``slot``: its own unsent rows, then whole units from the queue (or stolen) while they
    keep it within an even share of what is left once the input is all read (the tail: a small job is not all
    taken by the first actor to ask)."""
    left = sum(len(u) for u in queue) + sum(len(s.in_flight) + s.queued for s in slots)
    even = -(-left // max(1, sum(s.state == "ready" for s in slots)))
    out: list[Submit] = []
    while len(out) < n:
        if not slot.units:
            held = len(slot.in_flight) + len(out)
            if held and feed_done and queue and held + len(queue[0]) > even:
                break
            unit = queue.popleft() if queue else None if held >= even else steal(slot, slots, feed_done, limit)
            if unit is None:
                break
            slot.units.append(unit)
        head = slot.units[0]
        k = n - len(out)
        out += head[:k]
        del head[:k]
        if not head:
            slot.units.popleft()
    return out


def steal(thief: Slot, slots: list[Slot], feed_done: bool, limit: int) -> list[Submit] | None:
    """Unsent rows of the busiest actor for an idle one, once nothing else is left to hand out."""
    if not feed_done:
        return None
    victim = max((s for s in slots if s is not thief and s.state == "ready"), key=lambda s: s.queued, default=None)
    if victim is None or victim.queued < 2 * limit:
        return None
    if len(victim.units) > 1:
        return victim.units.pop()
    head = victim.units[0]
    cut = split_for_steal([r.cache_tokens or 0 for r in head])
    stolen = head[cut:]
    del head[cut:]
    return stolen
