"""Helpers for the Ray executor tests: a job whose rows form prefix groups, CLI runs, shard and progress reading."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from mlxbatch.io.schema import read_shard

TOPICS = {  # preambles that differ from their first token, so each topic is its own prefix group
    "astro": "Astronomy notes: stars, orbits, comets, nebulae, telescopes and the long patient nights of observing "
             "the sky from a cold hill far from any city light.",
    "baking": "Baking journal: flour, butter, sugar, proofing times, oven temperatures and the crust of a loaf "
              "that rose overnight in a warm kitchen by the window.",
    "chess": "Chess study: openings, pins, forks, endgames with rooks and pawns, and the quiet moves that decide "
             "a long tournament game in the final hour.",
    "diving": "Diving log: reefs, currents, depth limits, decompression stops and the blue silence under the "
              "boat on a calm morning off the rocky coast.",
}
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


def grouped_rows(per_topic: int, alone: int) -> list[dict[str, Any]]:
    rows = []
    for t, (topic, preamble) in enumerate(TOPICS.items()):
        for i in range(per_topic):
            q = " ".join(WORDS[(i + k + t) % len(WORDS)] for k in range(2 + i % 4))
            rows.append({"id": f"{topic}-{i:03d}", "topic": topic, "preamble": preamble, "q": q})
    for i in range(alone):
        rows.append({"id": f"alone-{i:03d}", "topic": None, "preamble": f"{i} {WORDS[i % 10]} {i * 7}",
                     "q": " ".join(WORDS[(i * 3 + k) % 10] for k in range(3))})
    order = sorted(range(len(rows)), key=lambda k: (k * 7919) % len(rows))  # interleave topics in the input
    return [rows[k] for k in order]


PROMPT = "{{ preamble }}\nQuestion: {{ q }}\nAnswer:"


def cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """``mlxbatch ARGS`` in a subprocess (``env``: the whole environment; default: this one's)."""
    return subprocess.Popen([sys.executable, "-m", "mlxbatch.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=os.environ if env is None else env)


def processes_mentioning(text: str) -> list[int]:
    """Pids of processes whose command line contains ``text`` (Linux /proc)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and text in (d / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err.decode()


def manifest_rows(out: Path) -> int:
    try:
        return sum(s["rows"] for s in json.loads((out / "manifest.json").read_text())["shards"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return 0


def wait_for(pred, proc: subprocess.Popen, timeout: float = 180) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    return None


def shard_records(out: Path) -> list[dict[str, Any]]:
    """Every record in the output's shards: key, id and the engine actor that ran it (``_worker``)."""
    recs = []
    for path in sorted((out / "shards").glob("shard-*.arrow")):
        t = read_shard(path)
        for rid, key, extra in zip(t.column("row_id").to_pylist(), t.column("key").to_pylist(),
                                   t.column("extra").to_pylist()):
            recs.append({"id": rid, "key": key, "worker": json.loads(extra).get("_worker") if extra else None})
    return recs


def outputs(out: Path, n: int) -> dict[str, tuple]:
    rows = pq.read_table(out / "results.parquet").to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == n, "every id exactly once"
    return {r["id"]: (r["key"], r["text"], r["generated_tokens"], r["finish_reason"], r["error"], r["error_kind"])
            for r in rows}


def exactly_once(out: Path) -> collections.Counter:
    """Records per key over every shard: each finished key must be there once (no row recorded twice)."""
    counts = collections.Counter(r["key"] for r in shard_records(out))
    assert counts and max(counts.values()) == 1, [k for k, c in counts.items() if c > 1][:5]
    return counts
