"""The engine alone on the suite's workloads, each run twice in one process (diagnostic, for A/B runs on a GPU)

    python3 scripts/engine_runs.py --model 0.5b --tag main --runs label:2048,fewshot:2048,chat:1024
    python3 scripts/engine_runs.py --model 0.5b --tag after4 --prefill-after 4 --runs unique:1024,chat:1024
    python3 scripts/engine_runs.py --model 0.5b --tag t8k --config max_num_batched_tokens=8192 --runs label:2048:nocache

``--runs name:rows[:nocache]`` (``nocache``: the prefix cache off); ``--config k=v,...``: EngineConfig fields for
every run. Each workload: a first run (cuDNN builds a graph for every new attention shape) and the same run again
(the graphs are built). Prints wall, prefill seconds and tokens, decode seconds, the prefill passes and their distinct
(rows, tokens, keys) shapes, and MLX's peak memory over the run's start (the suite's working memory). For two
commits on one machine: copy each commit's ``mlxbatch`` to a folder and run this script once per folder with
``PYTHONPATH=<folder>``; compare the rows of one table, not machines.
"""

# ruff: isort: skip_file
from __future__ import annotations

import sys
from functools import partial

import mlxbatch  # noqa: F401  (first: it sets up MLX's BLAS on Linux CPUs)
from mlxbatch.bench.cli import parse_script_args
from mlxbatch.bench.harness import Bench, log
from mlxbatch.engine.kv.packed import PackedPass
from mlxbatch.engine.kv.slot_forward import ForwardPass
from mlxbatch.engine.kv.slots import SlotBatch


def count_passes() -> list[tuple[int, int, int]]:
    """Record the (rows, tokens, keys) of every prefill pass (wraps ``SlotBatch.forward`` and ``forward_packed``; this
    script only); a packed pass (CUDA) counts as its padded tokens over its rows, its widest group's keys."""
    seen: list[tuple[int, int, int]] = []
    forward, forward_packed = SlotBatch.forward, SlotBatch.forward_packed

    def recorded(self: SlotBatch, *a: object, **k: object) -> object:
        out = forward(self, *a, **k)
        fp = self._pass  # None after a compiled decode pass (``kv.compiled_decode``)
        if isinstance(fp, ForwardPass) and fp.width > 1:
            seen.append((fp.stop - fp.start, fp.width, fp.t_used))
        return out

    def recorded_packed(self: SlotBatch, *a: object, **k: object) -> object:
        out = forward_packed(self, *a, **k)
        fp = self._pass
        assert isinstance(fp, PackedPass)
        seen.append((fp.stop - fp.start, fp.padded, getattr(fp, "keys", 0) or max(g.keys for g in fp.groups)))
        return out

    SlotBatch.forward = recorded  # type: ignore[method-assign]
    SlotBatch.forward_packed = recorded_packed  # type: ignore[method-assign]
    return seen


def set_prefill_policy(after: str, max_scores: str) -> None:
    """Variants of the CUDA prefill-attention policy for this process (``kv.prefill_attention``): the passes a shape
    runs unfused before it runs fused (``--prefill-after``; 0: fused at once, as before ``b1bfb0e``) and the largest
    scores an unfused pass may materialise (``--prefill-max-scores``, elements). The defaults are the engine's."""
    from mlxbatch.engine.kv.prefill_attention import PrefillAttention

    init = PrefillAttention.__init__
    kw = {k: int(v) for k, v in (("after", after), ("max_scores", max_scores)) if v}

    def varied(self: PrefillAttention, *a: object, **k: object) -> None:
        init(self, *a, **{**k, **kw})  # type: ignore[arg-type]

    PrefillAttention.__init__ = varied  # type: ignore[method-assign]


def engine_config(spec: str) -> dict[str, object]:
    """``--config k=v,...``: EngineConfig fields for every run (integers, or true/false)."""
    out: dict[str, object] = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        out[key] = {"true": True, "false": False}.get(value.lower(), None)
        if out[key] is None:
            out[key] = int(value)
    return out


def main() -> None:
    mine, args = parse_script_args(sys.argv[1:], tag="", runs="label:2048,fewshot:2048,chat:1024",
                                   prefill_after="", prefill_max_scores="", config="")
    extra = engine_config(mine.config)
    set_prefill_policy(mine.prefill_after, mine.prefill_max_scores)
    b = Bench(args)
    C = b.concurrency
    seen = count_passes()
    warm = b.workload("label", 64)
    b.run_engine(warm, max_num_seqs=C)
    rows = []
    for item in mine.runs.split(","):
        name, n, *mode = item.split(":")
        if mode not in ([], ["nocache"]):
            raise SystemExit(f"--runs: {item!r}: the third field may only be 'nocache'")
        w = b.workload(name, int(n))
        cfg = {**extra, "max_num_seqs": C, **({"prefix_cache": False} if mode else {})}
        for again in ("first", "again"):
            seen.clear()
            run = b.measure({"engine": partial(b.run_engine, w, **cfg)}, 1)["engine"].median  # memory probed
            p = run.extra["profile"]
            rows.append((name + (" nocache" if mode else ""), again, run.wall_s, p["prefill_s"], p["prefill_tokens"], p["decode_s"], len(seen),
                         len(set(seen)), p.get("prefill_unfused_passes", "-"), (run.mlx_peak - run.mlx_base) / 2**30))
            log(f"{mine.tag} {rows[-1]}")
    print(f"\n{mine.tag}: concurrency {C}, mlxbatch from {mlxbatch.__file__}")
    print("| tag | workload | run | wall s | prefill s | prefill tok | decode s | passes | distinct shapes | unfused "
          "| peak GiB over start |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, again, wall, ps, pt, ds, np_, nd, nu, mem in rows:
        print(f"| {mine.tag} | {name} | {again} | {wall:.2f} | {ps:.2f} | {pt:,} | {ds:.2f} | {np_} | {nd} | {nu} "
              f"| {mem:.2f} |")


if __name__ == "__main__":
    main()
