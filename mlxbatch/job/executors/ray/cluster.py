"""A Ray cluster for the Ray executor: connecting (or starting one on this machine), sizing the actor pool, and the
model's tokenizer for the driver.

Owns the driver's side of Ray's process: ``connected`` joins the cluster at an address (or ``$RAY_ADDRESS``, or,
as ``ray.init()`` does, the cluster ``ray start`` runs on this machine, or starts a local one with enough logical
CPUs for the actors) and leaves it afterwards only if it joined; Ray's own
SIGTERM handler is undone so the run loop's signal handling stays in charge. The driver loads the tokenizer
only (no weights): it tokenizes and plans, the actors run the model.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayError

from mlxbatch.engine import resolve_path
from mlxbatch.job.executors.base import ExecutorError
from mlxbatch.job.spec import JobSpec

log = logging.getLogger(__name__)


def kill(handle: Any) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except (RayError, ValueError):  # already gone
        pass


def fitting_actors(num_cpus: float, num_gpus: float, resources: dict[str, float]) -> int:
    """As many actors as the cluster's resources hold (at least one)."""
    total = ray.cluster_resources()
    wanted = {"CPU": num_cpus, "GPU": num_gpus, **resources}
    fits = [int(total.get(name, 0) // amount) for name, amount in wanted.items() if amount > 0]
    return max(1, min(fits, default=1))


def driver_tokenizer(spec: JobSpec) -> Any:
    """The model's tokenizer without its weights: the driver tokenizes and plans, the actors run the model."""
    from mlx_lm.utils import load_tokenizer

    m = spec.model
    source = resolve_path(m.path)  # a folder, or a hub id (mlx-lm then fetches the tokenizer files only)
    return load_tokenizer(Path(source) if Path(source).exists() else source,
                          {"trust_remote_code": m.trust_remote_code})  # always explicit: transformers never asks


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
def connected(address: str | None, actors: int | None, num_cpus: float) -> Iterator[str]:
    """Ray, connected (a local cluster when no address is given and $RAY_ADDRESS is unset); shut down after only
    when this block connected. Ray's own SIGTERM handler is undone: the run loop's handlers stay in charge."""
    if ray.is_initialized():
        yield ray.get_runtime_context().gcs_address
        return
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "namespace": "mlxbatch"}
    local: dict[str, Any] = {}  # how to start a local cluster, if this run starts one
    if address is None and not os.environ.get("RAY_ADDRESS"):
        need = math.ceil((actors or 1) * num_cpus)
        local = {"num_cpus": max(os.cpu_count() or 1, need), "include_dashboard": False}
    target = address or os.environ.get("RAY_ADDRESS")
    why = unreachable(target) if target else None
    if why is not None:
        raise ExecutorError(f"could not connect to the Ray cluster at {target}: {why}; start one there "
                            "(`ray start --head`) or leave the address out to run a local cluster")
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
        raise ExecutorError(f"could not connect to {where}: {type(exc).__name__}: {exc}") from exc
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
