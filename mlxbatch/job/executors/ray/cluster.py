"""A Ray cluster for the Ray executor: connecting (or starting one on this machine), sizing the actor pool, and the
model's tokenizer for the driver.

Owns the driver's side of Ray's process: ``connected`` joins the cluster at an address (or ``$RAY_ADDRESS``, or,
as ``ray.init()`` does, the cluster ``ray start`` runs on this machine, or starts a local one with enough logical
CPUs for the actors) and leaves it afterwards only if it joined; Ray's own
SIGTERM handler is undone so the run loop's signal handling stays in charge. The driver loads the tokenizer
only (no weights): it tokenizes and plans, the actors run the model.

Sizing (``actor_plan``): ``executor.actors`` when set; otherwise as many actors as the cluster's resources fit, except
on Macs. On a cluster whose nodes declare GPUs (Ray counts a node's NVIDIA GPUs itself, or ``ray start --num-gpus``)
each actor asks for one GPU unless ``executor.num_gpus`` says otherwise, so the default is one actor per GPU: Ray sets
each actor's ``CUDA_VISIBLE_DEVICES`` to its own GPU before the actor's code runs, MLX's CUDA backend then sees that
one device as its device 0, and the engine budgets KV from that GPU's free memory alone. Without a GPU each, every
actor on a node would see all of its GPUs and run on the first. A Mac has one GPU that every process on it shares,
and Ray may count none there, so resources would give one actor per CPU core, each loading the model and budgeting KV
from the same free memory as if alone. On a cluster of Macs (every node's ``sys.platform`` asked by a task pinned to
it) the default is one actor per Mac, its engine's budget the host's, placed by a placement group that spreads one
bundle per Mac (a replacement actor takes the bundle its predecessor left). Ray itself refuses multi-machine clusters
on macOS unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1`` is set (for ``ray start`` on every Mac and for the driver); a
failed connection from a Mac without it names it.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayError

from mlxbatch.job.executors.base import ExecutorError
from mlxbatch.job.spec import ExecutorSection

log = logging.getLogger(__name__)

MAC_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # Ray's own switch (ray._private.ray_constants)
AUTH_MODE_ENV = "RAY_AUTH_MODE"  # Ray's own (ray._private.authentication): token | disabled
PROBE_NODE_TIMEOUT_S = 60.0


def kill(handle: Any) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except (RayError, ValueError):  # already gone
        pass


def fitting_actors(num_cpus: float, num_gpus: float, resources: dict[str, float], total: Mapping[str, float]) -> int:
    """As many actors as the cluster's resources (``total``) hold (at least one)."""
    wanted = {"CPU": num_cpus, "GPU": num_gpus, **resources}
    fits = [int(total.get(name, 0) // amount) for name, amount in wanted.items() if amount > 0]
    return max(1, min(fits, default=1))


def mac_cluster_hint(platform: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """What to add to a failed connection's message on a Mac without Ray's cluster switch ("" elsewhere)."""
    env = os.environ if env is None else env
    if (platform or _node_platform()) != "darwin" or env.get(MAC_CLUSTER_ENV, "").lower() in ("1", "true"):
        return ""
    return (f"; on macOS, Ray serves or joins a cluster of several machines only with {MAC_CLUSTER_ENV}=1 set, for "
            "`ray start` on every Mac and for this command (README: Distributed runs)")


def auth_hint(env: Mapping[str, str] | None = None) -> str:
    """What to add to a failed connection's message to a given address while ``RAY_AUTH_MODE`` is unset: Ray
    enables token authentication for a driver given an address only when told ("" when it is set)."""
    env = os.environ if env is None else env
    if env.get(AUTH_MODE_ENV):
        return ""
    return (f"; if the cluster uses token authentication (`ray start` turns it on where ~/.ray/auth_token exists), "
            f"set {AUTH_MODE_ENV}=token for this command, with that token in ~/.ray/auth_token or $RAY_AUTH_TOKEN")


def _node_platform() -> str:
    """This process's platform (the driver's, or a node's when run there as a task)."""
    return sys.platform


@dataclass(frozen=True)
class NodeFacts:
    node_id: str
    platform: str  # sys.platform on that node ("darwin", "linux", "" when it did not answer)
    resources: dict[str, float]


@dataclass(frozen=True)
class ActorPlan:
    """How many engine actors to start, the GPUs each asks for and, on a cluster of Macs, the bundles of the placement
    group that puts one on each Mac (``actor_plan`` makes it and the actor options that use it)."""

    count: int
    num_gpus: float = 0.0  # per actor: executor.num_gpus, else 1 on a cluster with GPUs (one actor per GPU), else 0
    bundles: list[dict[str, float]] = field(default_factory=list)  # one per Mac: a STRICT_SPREAD placement group
    macs: int = 0  # Mac nodes in the cluster
    gpus: float = 0.0  # GPUs the cluster's nodes declare

    def options(self, x: ExecutorSection) -> dict[str, Any]:
        """The resources each actor asks Ray for."""
        out: dict[str, Any] = {"num_cpus": x.num_cpus, "num_gpus": self.num_gpus}
        if x.resources:
            out["resources"] = dict(x.resources)
        return out


def plan_actors(x: ExecutorSection, nodes: list[NodeFacts]) -> ActorPlan:
    """The sizing rule (pure: ``nodes`` are what ``cluster_nodes`` found)."""
    macs = [n for n in nodes if n.platform == "darwin"]
    gpus = sum(n.resources.get("GPU", 0.0) for n in nodes)
    num_gpus = x.num_gpus if x.num_gpus is not None else 1.0 if gpus >= 1 else 0.0
    if x.num_gpus == 0 and gpus and len(macs) < len(nodes):
        log.warning("executor.num_gpus=0 on a cluster with %g GPU(s): every actor sees all of its node's GPUs and runs "
                    "on the first; leave num_gpus out (one actor per GPU)", gpus)
    if x.actors is not None:
        if macs and x.actors > len(macs):
            log.warning("executor.actors=%d on %d Mac(s): actors on one Mac share its GPU, and each takes its KV "
                        "budget from the same free memory as if alone; leave executor.actors out (one per Mac) or "
                        "lower engine.kv_memory_fraction", x.actors, len(macs))
        return ActorPlan(x.actors, num_gpus, macs=len(macs), gpus=gpus)
    if macs and len(macs) == len(nodes):
        mac_gpus = x.num_gpus or 0.0
        bundle = {"CPU": x.num_cpus or 0.01, **({"GPU": mac_gpus} if mac_gpus else {}), **x.resources}
        return ActorPlan(len(macs), mac_gpus, [dict(bundle) for _ in macs], len(macs), gpus)
    if macs:
        log.warning("the cluster mixes %d Mac(s) with other machines: sizing by resources (their actors compute in "
                    "other dtypes, and the driver refuses those whose model identity differs)", len(macs))
    total: dict[str, float] = {}
    for n in nodes:
        for name, amount in n.resources.items():
            total[name] = total.get(name, 0.0) + amount
    count = fitting_actors(x.num_cpus, num_gpus, x.resources, total)
    if x.num_gpus is None and num_gpus:
        log.info("one engine actor per GPU: %d actor(s) for the cluster's %g GPU(s)", count, gpus)
    return ActorPlan(count, num_gpus, macs=len(macs), gpus=gpus)


def cluster_nodes() -> list[NodeFacts]:
    """Every live node of the cluster with its platform (a zero-CPU task pinned to each node asks it)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0, max_retries=0)(_node_platform)
    live = [n for n in ray.nodes() if n.get("Alive")]
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
            for n in live]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PROBE_NODE_TIMEOUT_S)
    done = set(ready)
    out = []
    for n, ref in zip(live, refs):
        try:
            platform = ray.get(ref) if ref in done else ""
        except RayError:
            platform = ""
        out.append(NodeFacts(n["NodeID"], platform, dict(n.get("Resources") or {})))
    return out


@contextmanager
def actor_plan(x: ExecutorSection) -> Iterator[tuple[ActorPlan, dict[str, Any]]]:
    """The plan and the actor options it adds (one per Mac: a placement group, removed afterwards)."""
    plan = plan_actors(x, cluster_nodes())
    if not plan.bundles:
        yield plan, {}
        return
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group(plan.bundles, strategy="STRICT_SPREAD", name="mlxbatch-one-actor-per-mac")
    log.info("one engine actor on each of the %d Mac(s) of the cluster", plan.count)
    try:
        yield plan, {"scheduling_strategy": PlacementGroupSchedulingStrategy(group), "num_cpus": plan.bundles[0]["CPU"]}
    finally:
        remove_placement_group(group)


PROBE_TIMEOUT_S = 5.0


def unreachable(address: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why nothing answers at a ``host:port`` or ``ray://host:port`` address (None: something listens, or the address
    is one Ray resolves itself, e.g. ``auto``). Ray's own connect waits minutes with log lines and no error."""
    rest = address.split("://", 1)[-1]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except TimeoutError:
        return f"no answer from {host}:{port} within {timeout:.0f} s"
    except OSError as exc:
        return f"nothing answers at {host}:{port} ({exc.strerror or exc})"
    return None


@contextmanager
def connected(address: str | None, actors: int | None, num_cpus: float,
              worker_setup: str | None = None) -> Iterator[str]:
    """Ray, connected (a local cluster when no address is given and $RAY_ADDRESS is unset); shut down after only
    when this block connected. Ray's own SIGTERM handler is undone: the run loop's handlers stay in charge.
    ``worker_setup``: a function (``module.name``) each worker process of this run calls first (a connection made
    earlier, e.g. a notebook's, keeps its own)."""
    if ray.is_initialized():
        yield ray.get_runtime_context().gcs_address
        return
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "namespace": "mlxbatch"}
    if worker_setup is not None:
        kwargs["runtime_env"] = {"worker_process_setup_hook": worker_setup}
    local: dict[str, Any] = {}  # how to start a local cluster, if this run starts one
    if address is None and not os.environ.get("RAY_ADDRESS"):
        need = math.ceil((actors or 1) * num_cpus)
        local = {"num_cpus": max(os.cpu_count() or 1, need), "include_dashboard": False}
    target = address or os.environ.get("RAY_ADDRESS")
    why = unreachable(target) if target else None
    if why is not None:
        raise ExecutorError(f"could not connect to the Ray cluster at {target}: {why}; start one there "
                            f"(`ray start --head`) or leave the address out to run a local cluster{mac_cluster_hint()}")
    try:
        try:
            ray.init(address=address, **kwargs, **local)
        except ValueError:
            if not local:
                raise
            # ray.init() without an address joins the cluster `ray start` runs on this machine, and then refuses
            # num_cpus (the cluster's resources are its own): join it as ray.init() does, with nothing to size
            ray.init(address=None, **kwargs)
            log.info("joined the Ray cluster already running on this machine (%s); it keeps running after the "
                     "run", ray.get_runtime_context().gcs_address)
    except Exception as exc:  # a bad address, no cluster there, a temp dir Ray cannot use, ...
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        hint = (auth_hint() + mac_cluster_hint()) if target else ""
        raise ExecutorError(f"could not connect to {where}: {type(exc).__name__}: {exc}{hint}") from exc
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
