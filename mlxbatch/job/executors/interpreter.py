"""The interpreter's settings while a run generates rows: the GIL's switch interval and the cyclic garbage collector.

Owns both for the duration of a run's pass over its rows (``generating``), and the time the collector spent; the
engine's own process (``job.executors.process``) steps under them too. The previous settings come back when the pass
ends, also when it fails: a notebook's ``run_job`` leaves its process as it found it.

- **Switch interval.** The step loop hands the GIL back at every MLX call (the device encoding a pass) and then waits
  for it while the feed's and the checkpoint writer's threads run Python: up to a whole interval each time (Python's
  default is 5 ms). A 4.2 ms loop of a GIL-free call and 0.2 ms of Python took 9.6 ms beside a busy thread at 5 ms,
  5.3 ms at 0.5 ms (docs/benchmarks.md).
- **Collector.** A job holds hundreds of thousands of tracked objects (a window's prepared rows and token lists, the
  plan's trie, the requests in flight) and allocates hundreds more a row, so at the default thresholds (700
  allocations) a young collection starts every few rows and a full one, which walks the whole heap, every few thousand
  rows: a 4,000-row CPU job spent 0.66 s in 751 collections, five of them full at ~0.1 s each, growing with the heap.
  Next to nothing a run makes is cyclic (reference counts free it), so the objects alive when the pass starts (the
  model, the imported modules) are frozen out of every collection (``gc.freeze``, as vLLM does after its start-up)
  and young collections wait for ``YOUNG_THRESHOLD`` allocations. A 30,000-row job on an H100's host: 3.6-3.8 s in
  2,690 collections (13 full) at the defaults, 0.2 s while rows ran with a threshold of 50,000 (docs/benchmarks.md,
  ``84a1614``). At 50,000 the 100k-row job still spent 1.1-1.5 s collecting (an H100's and an H200's host; 1.46 s in
  22 young collections and one of the middle generation on a CPU): each window of 10,000 prepared rows (their token
  lists, walked item by item) outgrew it while it ran. At 500,000 that job on a CPU ran no collection at all; the
  cyclic garbage a run could leave waiting is bounded by it (tens of MB). A process that had frozen objects of its
  own keeps what this froze frozen (its freeze cannot be told from ours).
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

SWITCH_INTERVAL_S = 0.0005  # the GIL switch interval while rows run
YOUNG_THRESHOLD = 500_000  # allocations (net of deallocations) between young collections while rows run


@dataclass
class CollectorTime:
    """Seconds the collector ran while the block was open."""

    seconds: float = 0.0


@contextmanager
def generating() -> Iterator[CollectorTime]:
    """The short switch interval and the quiet collector until the block ends; yields the collector's time inside the
    block (filled as it runs)."""
    spent = CollectorTime()
    started: list[float] = []

    def timer(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            spent.seconds += time.perf_counter() - started.pop()

    switch, threshold, frozen = sys.getswitchinterval(), gc.get_threshold(), gc.get_freeze_count()
    gc.collect()  # what is garbage now is not frozen with the rest
    gc.freeze()
    gc.set_threshold(max(threshold[0], YOUNG_THRESHOLD), *threshold[1:])
    gc.callbacks.append(timer)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        yield spent
    finally:
        sys.setswitchinterval(switch)
        gc.callbacks.remove(timer)
        gc.set_threshold(*threshold)
        if not frozen:
            gc.unfreeze()
