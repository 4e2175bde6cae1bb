"""A process-wide registry that loads each model once and shares it between engines.

Owns the loaded models and who uses them. Sharing is the default (MLX weights are read-only during
generation); a user that needs the model alone (e.g. to apply an adapter in place or to train) asks for
exclusive use, and a conflicting request gets a ``ModelOwnershipError`` naming the current users.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from mlxbatch.engine.model.loader import LoadedModel, ModelSpec, load_model
from mlxbatch.errors import ModelOwnershipError


@dataclass
class _Entry:
    loaded: LoadedModel
    users: set[str] = field(default_factory=set)
    exclusive: bool = False


class ModelRegistry:
    def __init__(self) -> None:
        self._entries: dict[ModelSpec, _Entry] = {}
        self._lock = threading.Lock()

    def acquire(self, spec: ModelSpec, user: str, exclusive: bool = False) -> LoadedModel:
        with self._lock:
            entry = self._entries.get(spec)
            if entry is not None and entry.users:
                if entry.exclusive or exclusive:
                    raise ModelOwnershipError(
                        f"model {spec.model!r} is in {'exclusive ' if entry.exclusive else ''}use by "
                        f"{sorted(entry.users)}; {user!r} asked for {'exclusive' if exclusive else 'shared'} use"
                    )
            if entry is None:
                entry = self._entries[spec] = _Entry(load_model(spec))
            entry.users.add(user)
            entry.exclusive = exclusive
            return entry.loaded

    def release(self, spec: ModelSpec, user: str) -> None:
        """Stop using a model; the last user's release unloads it."""
        with self._lock:
            entry = self._entries.get(spec)
            if entry is None:
                return
            entry.users.discard(user)
            if not entry.users:
                del self._entries[spec]

    def users(self, spec: ModelSpec) -> set[str]:
        with self._lock:
            entry = self._entries.get(spec)
            return set(entry.users) if entry else set()

    def __len__(self) -> int:
        return len(self._entries)


REGISTRY = ModelRegistry()
