"""The job file's ``executor`` section: where rows run, this process or engine actors on a Ray cluster.

Owns the section's keys, defaults and checks (``parse_executor``, reporting to the spec's ``Checker`` like every
other section). The command line's choice of executor (``with_executor``) is applied in ``job.spec.job``.
Kept apart from ``job.spec.sections`` (the single-machine sections) so each module stays one concept.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mlxbatch.job.spec.checker import Checker


@dataclass(frozen=True)
class ExecutorSection:
    """Where rows run: ``local`` (this process, one engine) or ``ray`` (engine actors on a Ray cluster)."""

    kind: str = "local"  # local | ray (``mlxbatch run --ray`` sets ray, ``--local`` sets local)
    address: str | None = None  # ray: the cluster (None: $RAY_ADDRESS, else a local cluster on this machine)
    actors: int | None = None  # ray: engine actors (None: as many as the cluster's resources fit)
    num_cpus: float = 1.0  # ray: logical CPUs per actor
    num_gpus: float | None = None  # ray: GPUs per actor (None: 1 on a cluster with GPUs, one actor per GPU; else 0)
    resources: dict[str, float] = field(default_factory=dict)  # ray: custom resources per actor, e.g. {mac: 1}
    max_restarts: int | None = None  # ray: replacement actors started after deaths, in all (None: one per actor)
    partition: str = "prefix"  # ray: prefix (rows sharing a prefix on one actor) | random (for comparison)
    start_timeout_s: float = 300.0  # ray: how long to wait for the actors to load the model


EXECUTOR_KEYS = frozenset(f.name for f in dataclasses.fields(ExecutorSection))


def parse_executor(c: Checker, raw: dict[str, Any]) -> ExecutorSection:
    """``executor``: local or ray, and for ray the cluster, the actors and their resources."""
    x = c.section(raw, "executor", keys=EXECUTOR_KEYS)
    d = ExecutorSection()
    kind = c.typed(x, "executor", "kind", str, d.kind)
    if kind not in ("local", "ray"):
        c.bad("executor.kind", f"expected local or ray, got {kind!r}")
    partition = c.typed(x, "executor", "partition", str, d.partition)
    if partition not in ("prefix", "random"):
        c.bad("executor.partition", f"expected prefix or random, got {partition!r}")
    resources = c.typed(x, "executor", "resources", dict, {})
    for name, amount in resources.items():
        if not isinstance(name, str) or isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
            c.bad(f"executor.resources.{name}", f"expected a resource name and an amount >= 0, got {amount!r}")
    section = ExecutorSection(
        kind, c.typed(x, "executor", "address", str, None), c.typed(x, "executor", "actors", int, None),
        c.typed(x, "executor", "num_cpus", float, d.num_cpus), c.typed(x, "executor", "num_gpus", float, None),
        dict(resources), c.typed(x, "executor", "max_restarts", int, None), partition,
        c.typed(x, "executor", "start_timeout_s", float, d.start_timeout_s))
    if section.actors is not None:
        c.positive("executor.actors", section.actors)
    for name in ("num_cpus", "num_gpus", "max_restarts"):
        value = getattr(section, name)
        if value is not None and value < 0:
            c.bad(f"executor.{name}", f"must be >= 0, got {value}")
    c.positive("executor.start_timeout_s", section.start_timeout_s)
    return section
