"""Job inputs of the bench, as JSONL generated from a seed (pure stdlib).

``token_rows`` makes rows whose text has a target token length (the ``job`` section's overhead run);
``write_stream_inputs`` writes the streaming-memory inputs (10k-1M rows of a few words each) in one pass;
``write_reviews`` the user-job benchmark's labeling input (``userjob``, ``ray``): one shared instruction
(``INSTRUCTION``) and a review of 8-40 words a row; ``write_tasks`` rows of 8 long task preambles shared in Zipf-like
proportions (``ray``).
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
REVIEW_WORDS = ("great terrible okay fine broke works love hate cheap expensive quality delivery late fast slow "
                "battery screen sound price support refund size colour fits comfortable noisy quiet sturdy flimsy "
                "recommend return again never always easy hard setup manual box arrived damaged perfect "
                "disappointed happy excellent unfortunately replacement instructions packaging performance "
                "headphones customer service warranty definitely absolutely charger keyboard blender "
                "it the and was but not very").split()
INSTRUCTION = "Label the sentiment of this customer review: positive, negative or mixed."


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


def write_reviews(path: Path, rows: int, seed: int) -> Path:
    """The labeling job's input: ``rows`` rows ``{"id", "review"}``, a review of 8-40 words each."""
    rng = random.Random(f"reviews-{seed}")
    with open(path, "w", encoding="ascii") as f:
        for i in range(rows):
            review = " ".join(rng.choice(REVIEW_WORDS) for _ in range(rng.randint(8, 40)))
            f.write(f'{{"id": "r{i:07d}", "review": "{review}"}}\n')
    return path


def write_tasks(path: Path, rows: int, seed: int, tasks: int = 8) -> Path:
    """Rows ``{"id", "task", "text"}``: ``tasks`` preambles of 60-240 words shared by their rows in Zipf-like
    proportions, and a short text of 6-20 words each."""
    rng = random.Random(f"tasks-{seed}")
    preambles = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 240))) for _ in range(tasks)]
    weights = [1 / (k + 1) for k in range(tasks)]
    with open(path, "w", encoding="ascii") as f:
        for i in range(rows):
            t = rng.choices(range(tasks), weights)[0]
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 20)))
            f.write(json.dumps({"id": f"r{i:06d}", "task": f"Task {t}: {preambles[t]}", "text": text}) + "\n")
    return path
