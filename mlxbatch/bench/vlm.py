"""Vision-language benchmark (issue #6): 64 rows over 8 distinct images, in one process, one model object.

    .venv/bin/mlxbatch bench vlm [--rows 64 --images 8 --size 224 --max-tokens 32 --repeats 2 --json out.json]

Paths, each warmed up on two rows, then run ``--repeats`` times (interleaved) and the median reported:
  B0  mlx-vlm one row at a time: ``mlx_vlm.stream_generate`` (what a loop over rows does)
  B1  mlx-vlm ``batch_generate`` (one call for all rows; groups images by shape)
  E   mlxbatch engine: all rows submitted, continuous batching, vision cache + prefix cache on
  E0  the same with the vision cache off (``vision_cache_bytes=0``): every row runs the vision encoder
Greedy (temperature 0). The engine runs with ``ignore_eos`` so every row makes ``--max-tokens`` tokens; mlx-vlm
stops at EOS, so tok/s is reported beside rows/s. The model is the tiny random Qwen2-VL (speed does not depend on
the weights' values); images are generated pictures, ``--size`` pixels square (224: 64 image tokens each).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_vlm import batch_generate, stream_generate

from mlxbatch import _blas
from mlxbatch.engine import Engine, EngineConfig, ModelSpec, load_model
from mlxbatch.io.images import pixel_hash
from mlxbatch.models.random_vlm import build_random_vlm, synthetic_image
from mlxbatch.types import ImageInput, SamplingParams

QUESTIONS = ["What is in this picture?", "Which colours do you see?", "How many shapes are there?",
             "Describe the picture in one sentence.", "Is there a circle?", "What is the background colour?",
             "Where is the largest shape?", "Give the picture a title."]


def workload(rows: int, images: int, size: int) -> list[tuple[list[dict], ImageInput]]:
    pics = []
    for i in range(images):
        img = synthetic_image(100 + i, size, size)
        pics.append(ImageInput(img, pixel_hash(img), f"pic-{i}"))
    return [([{"role": "user", "content": QUESTIONS[(r // images) % len(QUESTIONS)]}], pics[r % images])
            for r in range(rows)]


def run_mlx_vlm_one_at_a_time(vlm, rows, max_tokens):
    t0 = time.perf_counter()
    tokens = 0
    for msgs, im in rows:
        last = None
        for last in stream_generate(vlm.model, vlm.processor, vlm.render(msgs, 1), image=[im.image],  # noqa: B007
                                    max_tokens=max_tokens, temperature=0.0):
            pass
        tokens += last.generation_tokens if last is not None else 0
    return time.perf_counter() - t0, tokens, {}


def run_mlx_vlm_batch(vlm, rows, max_tokens):
    t0 = time.perf_counter()
    # batch_generate applies the chat template (with one image placeholder) itself: give it the plain question
    res = batch_generate(vlm.model, vlm.processor, images=[im.image for _, im in rows],
                         prompts=[m[0]["content"] for m, _ in rows], max_tokens=max_tokens, verbose=False)
    return time.perf_counter() - t0, int(getattr(getattr(res, "stats", None), "generation_tokens", 0) or 0), {}


def run_engine(loaded, rows, max_tokens, vision_cache_bytes):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with Engine(loaded, EngineConfig(max_num_seqs=64, vision_cache_bytes=vision_cache_bytes)) as eng:
        core = eng.core
        t0 = time.perf_counter()  # from submission (encoding the rows included); the engine's warm-up is not
        ids = [core.add_request(m, params, images=[im]) for m, im in rows]
        outs = {o.request_id: o for o in core.run_until_done()}
        took = time.perf_counter() - t0
        st = eng.stats()
    return took, sum(outs[i].generated_tokens for i in ids), {"vision_cache": st["vision_cache"],
                                                              "prefix_cache": st["prefix_cache"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mlxbatch bench vlm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip", default="", help="comma-separated paths to skip (B0,B1,E,E0)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    path = build_random_vlm(Path.home() / ".cache" / "mlxbatch" / "bench" / "tiny-qwen2-vl")
    loaded = load_model(ModelSpec(str(path)))
    vlm = loaded.vlm
    rows = workload(args.rows, args.images, args.size)
    n_img_tokens = len(vlm.encode(rows[0][0], [rows[0][1]]).token_ids)
    paths = {
        "B0 mlx-vlm one at a time": ("B0", lambda r: run_mlx_vlm_one_at_a_time(vlm, r, args.max_tokens)),
        "B1 mlx-vlm batch_generate": ("B1", lambda r: run_mlx_vlm_batch(vlm, r, args.max_tokens)),
        "E  mlxbatch engine": ("E", lambda r: run_engine(loaded, r, args.max_tokens, 1 << 30)),
        "E0 mlxbatch engine, no vision cache": ("E0", lambda r: run_engine(loaded, r, args.max_tokens, 0)),
    }
    skip = set(filter(None, args.skip.split(",")))
    paths = {k: v for k, v in paths.items() if v[0] not in skip}
    for _, fn in paths.values():  # warm-up: compile shapes, load lazy modules
        fn(rows[:2])
    times: dict[str, list[float]] = {k: [] for k in paths}
    info: dict[str, tuple[int, dict]] = {}
    for _ in range(args.repeats):
        for name, (_, fn) in paths.items():
            mx.clear_cache()
            took, tokens, extra = fn(rows)
            info[name] = (tokens, extra)
            times[name].append(took)
    base = statistics.median(times[next(iter(paths))]) if paths else 1.0
    table = []
    for name in paths:
        t = statistics.median(times[name])
        tokens, extra = info[name]
        table.append({"path": name, "seconds": round(t, 3), "rows_per_s": round(args.rows / t, 2),
                      "tok_per_s": round(tokens / t, 1), "tokens": tokens, "speedup_vs_first": round(base / t, 2),
                      **extra})
    meta = {"date": dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "blas": _blas.loaded_path,
            "device": str(mx.default_device()), "rows": args.rows, "images": args.images, "size": args.size,
            "prompt_tokens_first_row": n_img_tokens, "max_tokens": args.max_tokens, "repeats": args.repeats}
    print(json.dumps(meta))
    print(f"{'path':40s} {'s':>8s} {'rows/s':>8s} {'tok/s':>8s} {'x':>6s}")
    for r in table:
        print(f"{r['path']:40s} {r['seconds']:8.2f} {r['rows_per_s']:8.2f} {r['tok_per_s']:8.1f} "
              f"{r['speedup_vs_first']:6.2f}")
        if r.get("vision_cache"):
            vc = r["vision_cache"]
            print(f"    vision cache: {vc['hits']} hits / {vc['misses']} misses, {vc['images_encoded']} images encoded, "
                  f"encoder {vc['encoder_s']:.3f} s, saved {vc['encoder_s_saved']:.3f} s")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "table": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
