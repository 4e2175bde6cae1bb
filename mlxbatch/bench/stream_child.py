"""The streaming-memory child of the ``job`` section: one size of rows through the I/O layer, in its own process.

    python -m mlxbatch.bench.stream_child INPUT OUT_DIR [--every N] [--track-ids]

Streams ``INPUT`` (short JSONL rows) through ``open_reader``, builds a ``ResultRecord`` per row, appends a
checkpoint shard every ``N`` rows and ``finalize``s the Parquet against the expected rows (the input re-read,
keys recomputed, as ``JobRunner`` does); prints one JSON line: wall times and peak RSS. No model and no MLX: the
module-level imports are stdlib and ``memory`` only, so the RSS is the I/O layer's (pyarrow, numpy).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from mlxbatch.bench.jobdata import WORDS
from mlxbatch.bench.memory import peak_rss, ru_maxrss_bytes, status_kb


def _anon() -> int | None:
    """Anonymous RSS now (heap, no file pages) in bytes; None without /proc (macOS)."""
    kb = status_kb("RssAnon")
    return None if kb is None else kb * 1024


def stream_child(inp: str, out: str, every: int, track_ids: bool) -> dict[str, Any]:
    import mlxbatch.io as mio
    from mlxbatch.types import SamplingParams

    rss_imports = peak_rss()
    anon_peak = [_anon()]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            now = _anon()
            if now is not None:
                anon_peak[0] = max(anon_peak[0] or 0, now)

    threading.Thread(target=sample, daemon=True).start()
    params = mio.canonical_params(SamplingParams(temperature=0.0, max_tokens=16))
    identity = "0123456789abcdef"
    model = f"/models/bench@{identity}"
    spec = mio.InputSpec(inp, id_column="id")

    def key_of(row: Any) -> str:
        return mio.result_key(row.row_id, f"Summarise: {row.fields.get('text')}\n", identity, params, None)

    t0 = time.perf_counter()
    rows = 0
    with mio.CheckpointStore(out) as store:
        ids = mio.DuplicateIdTracker() if track_ids else None
        buf: list[Any] = []
        for row in mio.open_reader(spec):
            if ids is not None:
                ids.add(row.row_id)
            text = row.fields.get("text") or ""
            fake = " ".join(WORDS[(rows * 7 + k) % len(WORDS)] for k in range(10))
            buf.append(mio.ResultRecord(
                row_id=row.row_id, key=key_of(row), inputs={k: v for k, v in row.fields.items() if k != "id"},
                text=fake, finish_reason="length", prompt_tokens=len(text) // 4 + 3, generated_tokens=16,
                latency_s=0.25, ttft_s=0.05, model=model, params=params))
            rows += 1
            if len(buf) >= every:
                store.append(buf)
                buf = []
        if buf:
            store.append(buf)
        ids = None
        t1 = time.perf_counter()
        maxrss_stream = peak_rss()

        def expected() -> Iterator[Any]:
            seen = mio.DuplicateIdTracker() if track_ids else None
            for row in mio.open_reader(spec):
                if seen is not None:
                    seen.add(row.row_id)
                yield mio.ExpectedRow(row.row_id, key_of(row))

        final = mio.finalize(store, out, expected())
        t2 = time.perf_counter()
        shards = store.shards
    stop.set()
    now = _anon()
    if now is not None:
        anon_peak[0] = max(anon_peak[0] or 0, now)
    assert final.rows == rows and final.ok_rows == rows, (final, rows)
    rss_file = status_kb("RssFile")
    return {"rows": rows, "track_ids": track_ids, "wall_s": t2 - t0, "stream_s": t1 - t0, "finalize_s": t2 - t1,
            "shards": len(shards), "shard_bytes": sum(s.bytes for s in shards),
            "results_bytes": final.results_path.stat().st_size, "rss_imports": rss_imports,
            "maxrss_stream": maxrss_stream, "maxrss": peak_rss(), "anon_peak": anon_peak[0],
            "rss_file_end": None if rss_file is None else rss_file * 1024, "ru_maxrss": ru_maxrss_bytes()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="internal: the streaming-memory child of `mlxbatch bench job`")
    ap.add_argument("input")
    ap.add_argument("out_dir")
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--track-ids", action="store_true")
    args = ap.parse_args(argv)
    print(json.dumps(stream_child(args.input, args.out_dir, args.every, args.track_ids)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
