"""What the engine asks the device to move and to wait for: KV bytes copied, and host syncs.

Owns the counters (one ``Traffic`` per runner, shared with its slot batch and prefix cache, which add to it).
Compute is not counted here, only copies: a step's forward writes its own new KV in place and that is the work
itself. What is counted is every copy of KV that already exists (row moves, prefix copy-ins, cache stores, forks)
and buffer growth, so that tests can check that what a step moves scales with the rows and tokens it moves — not
with slot capacity, cache size or the rows already running (a copy that does costs seconds on a GPU and nothing
visible on a CPU). ``syncs`` counts the points where the host waits for the device (evaluations, reads of results).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx


@dataclass
class Traffic:
    moved_bytes: int = 0  # existing KV copied to another place: row moves, copy-ins (running rows, cached blocks), forks
    stored_bytes: int = 0  # KV copied into the prefix cache
    grown_bytes: int = 0  # buffers copied when they grow or shrink (amortised: capacity doubles)
    resizes: int = 0  # buffer growths and shrinks (each one sync)
    syncs: int = 0  # host waits for the device: evaluations and reads of results

    def evaluate(self, *arrays: Any) -> None:
        """``mx.eval`` counted as one sync."""
        self.syncs += 1
        mx.eval(*arrays)

    def snapshot(self) -> Traffic:
        return Traffic(**asdict(self))

    def since(self, before: Traffic) -> Traffic:
        """What was added after ``before`` (a snapshot)."""
        return Traffic(**{k: v - getattr(before, k) for k, v in asdict(self).items()})

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
