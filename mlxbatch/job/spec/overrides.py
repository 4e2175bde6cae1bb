"""Changes to a job without editing its file: ``--set key.path=value``, ``--limit N``, ``--output DIR`` (and the
same as keyword arguments of ``mlxbatch.run_job``).

Owns turning them into edits of the job's raw mapping *before* it is parsed, so every value is typed and checked
by the one spec parser and a bad one is reported with its key path like any other problem in the file. A value
is read as YAML (``0.7`` is a number, ``[a, b]`` a list, ``true`` a boolean). Shorthand sections
(``model: smollm2``, ``output: out/x``) are expanded when a key below them is set. Also which changes make a
run a trial (``trial_changes``): any outside the run settings (``RUN_SETTINGS``).
"""

from __future__ import annotations

import copy
import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# a section given as a plain string means this key of the section
SHORTHAND = {"model": "path", "input": "path", "prompt": "template", "output": "path"}
# how and where a job runs, not what its results are: changing them on the command line is not a trial
RUN_SETTINGS = ("engine", "checkpoint", "executor", "plan", "max_error_rate", "output.path", "output.overwrite")
_UNSET = object()


@dataclass(frozen=True)
class JobOverrides:
    sets: Sequence[str] = ()  # "key.path=value" (command line)
    merge: Mapping[str, Any] = field(default_factory=dict)  # nested mappings merged into the job (Python API)
    limit: int | None = None  # input.limit: only the first N rows
    output: str | os.PathLike[str] | None = None  # output.path, relative to the current directory

    def __bool__(self) -> bool:
        return bool(self.sets or self.merge or self.limit is not None or self.output is not None)

    def describe(self) -> str:
        parts = [f"--set {s}" for s in self.sets] + [f"{k}={v!r}" for k, v in self.merge.items()]
        parts += [f"--limit {self.limit}"] * (self.limit is not None) + [f"--output {self.output}"] * bool(self.output)
        return ", ".join(parts)


def _named(text: str, name: str) -> io.StringIO:
    stream = io.StringIO(text)
    stream.name = name  # type: ignore[misc]  # YAML's errors name it instead of "<unicode string>"
    return stream


def _section(raw: dict[str, Any], name: str) -> dict[str, Any]:
    value = raw.get(name)
    if isinstance(value, str) and name in SHORTHAND:
        value = {SHORTHAND[name]: value}
    elif not isinstance(value, dict):
        value = {}
    raw[name] = value
    return value


def _set(raw: dict[str, Any], path: list[str], value: Any) -> None:
    node = raw
    for i, part in enumerate(path[:-1]):
        node = _section(node, part) if i == 0 else node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"{'.'.join(path[:i + 1])} is not a mapping")
    if len(path) == 1 and path[0] in SHORTHAND and isinstance(raw.get(path[0]), dict) and not isinstance(value, dict):
        raw[path[0]][SHORTHAND[path[0]]] = value  # --set output=out/x keeps the rest of the output section
    else:
        node[path[-1]] = value


def _merge(target: dict[str, Any], changes: Mapping[str, Any], top: bool) -> None:
    for key, value in changes.items():
        if isinstance(value, Mapping):
            node = _section(target, key) if top else target.setdefault(key, {})
            if isinstance(node, dict):
                _merge(node, value, False)
                continue
        if top and key in SHORTHAND and isinstance(target.get(key), dict) and not isinstance(value, Mapping):
            target[key][SHORTHAND[key]] = value
        else:
            target[key] = value


def apply_overrides(raw: dict[str, Any], overrides: JobOverrides | None) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """A copy of ``raw`` with the changes made, and the problems of changes that could not be made (key, reason)."""
    if not overrides:
        return raw, []
    out = copy.deepcopy(raw)
    problems: list[tuple[str, str]] = []
    for item in overrides.sets:
        key, sep, text = item.partition("=")
        path = key.strip().split(".")
        if not sep or not all(path):
            problems.append(("--set", f"expected key.path=value (e.g. sampling.temperature=0.7), got {item!r}"))
            continue
        try:
            value = yaml.safe_load(_named(text, f"--set {key}")) if text.strip() else ""
        except yaml.YAMLError as exc:
            problems.append((key, f"--set value is not valid YAML: {exc}"))
            continue
        try:
            _set(out, path, value)
        except ValueError as exc:
            problems.append((key, f"--set: {exc}"))
    _merge(out, overrides.merge, True)
    if overrides.limit is not None:
        _section(out, "input")["limit"] = overrides.limit
    if overrides.output is not None:
        _section(out, "output")["path"] = str(Path(overrides.output).expanduser().resolve())
    return out, problems


def _leaves(node: Any, path: str = "") -> dict[str, Any]:
    """Every value of a job mapping by its key path (shorthand sections expanded; lists are values)."""
    if not isinstance(node, dict):
        return {path: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        where = f"{path}.{key}" if path else str(key)
        if not path and key in SHORTHAND and not isinstance(value, dict):
            value = {SHORTHAND[key]: value}
        out.update(_leaves(value, where))
    return out


def trial_changes(raw: dict[str, Any], changed: dict[str, Any]) -> tuple[str, ...]:
    """The key paths whose values the changes made (``changed`` is ``raw`` after ``apply_overrides``) outside the
    run settings: a run with any is a trial, whose results are not the job file's. () when there are none."""
    before, after = _leaves(raw), _leaves(changed)
    paths = sorted(k for k in before.keys() | after.keys() if before.get(k, _UNSET) != after.get(k, _UNSET))
    return tuple(p for p in paths if not any(p == s or p.startswith(s + ".") for s in RUN_SETTINGS))

