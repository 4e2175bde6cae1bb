"""Inputs of the ``job`` section: short text rows as JSONL, generated from a seed (pure stdlib).

``token_rows`` makes rows whose text has a target token length (the overhead run); ``write_stream_inputs`` writes
the streaming-memory inputs (10k-1M rows of a few words each) in one pass.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

WORDS = ("the a of to and in is it that for on with as was at by an be this from or have not are but which one "
         "all were when we there can more if out so what up about into than them some could time only new may "
         "first also after any like our over such how where most get through back much before good well year "
         "work way even because people small large water number place word light house world river city "
         "summer winter market garden letter report table window school music paper story night answer").split()
TEMPLATE = "Summarise: {{ text }}\n"


def token_rows(n: int, tokenizer: Any, seed: int, lo: int = 20, hi: int = 60) -> list[dict[str, str]]:
    """``n`` rows whose text is lo..hi tokens long (uniform target, words added until it is reached)."""
    rng = random.Random(f"job-rows-{seed}")
    rows = []
    for i in range(n):
        target, words = rng.randint(lo, hi), []
        while len(tokenizer.encode(" ".join(words))) < target:
            words.append(rng.choice(WORDS))
        rows.append({"id": f"row-{i:06d}", "text": " ".join(words)})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def write_stream_inputs(dirpath: Path, sizes: list[int], seed: int) -> dict[int, Path]:
    """One JSONL file per size (short rows: an id and 4-9 words, ~70 bytes), written in one pass."""
    rng = random.Random(f"stream-{seed}")
    paths = {n: dirpath / f"rows-{n}.jsonl" for n in sizes}
    files = {n: open(p, "w", encoding="ascii") for n, p in paths.items()}  # noqa: SIM115
    try:
        for i in range(max(sizes)):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9)))
            line = f'{{"id": "row-{i:07d}", "text": "{text}"}}\n'
            for n, f in files.items():
                if i < n:
                    f.write(line)
    finally:
        for f in files.values():
            f.close()
    return paths
