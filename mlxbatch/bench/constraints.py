"""Constrained decoding on this machine: llguidance vs outlines-core (``mlxbatch bench constraints``), and the
mask cost inside the engine (``--engine``: see ``constraints_engine``).

Library comparison (default): for each tokenizer, one fresh process per library
(``python -m mlxbatch.bench.constraints --worker LIB``) measures tokenizer / index setup, compile time of a
5-label choice, a regex and a 4-field JSON schema (until the first mask is ready), per-step mask time for 32 and
64 rows advancing through valid outputs, and RSS. The libraries and tokenizers are in ``constraint_libs``.

    .venv/bin/mlxbatch bench constraints                        # libraries, all tokenizers
    .venv/bin/mlxbatch bench constraints --engine --model tiny  # engine mask cost (tiny / 0.5b / smollm2)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from mlxbatch.bench.constraint_libs import LLG, Outlines, tokenizer_path, valid_outputs
from mlxbatch.bench.memory import current_rss, peak_rss
from mlxbatch.bench.procs import run_module

MB = 1 << 20


def rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MB (without /proc: both are ru_maxrss)."""
    return current_rss() / MB, peak_rss() / MB


def run_worker(lib: str, tok_name: str, batches: list[int], steps: int) -> dict:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizer_path(tok_name)))
    base_rss = rss_mb()[0]
    t0 = time.perf_counter()
    impl = LLG(hf) if lib == "llguidance" else Outlines(hf)
    impl.warm_up()  # one-time costs of the first grammar (llguidance builds its token trie views lazily)
    res: dict = {"lib": impl.name, "tokenizer": tok_name, "vocab": len(hf), "setup_s": time.perf_counter() - t0}
    compiled = {}
    for kind in ("choice", "regex", "json_schema"):
        t0 = time.perf_counter()
        compiled[kind] = impl.compile(kind)
        res[f"compile_{kind}_s"] = time.perf_counter() - t0
    eos = hf.eos_token_id
    for kind in ("choice", "regex", "json_schema", "mixed"):
        for b in batches:
            kinds = [("choice", "regex", "json_schema")[i % 3] if kind == "mixed" else kind for i in range(b)]
            texts = {k: valid_outputs(k, 64) for k in set(kinds)}
            toks = {k: [hf.encode(t, add_special_tokens=False) for t in v] for k, v in texts.items()}
            rows = [impl.rows(compiled[k], 1)[0] for k in kinds]
            pos, sample = [0] * b, list(range(b))
            mask = impl.alloc(b)
            fill_t, consume_t = [], []
            for _ in range(steps):
                t0 = time.perf_counter()
                impl.fill(rows, mask)
                t1 = time.perf_counter()
                for i, row in enumerate(rows):
                    seq = toks[kinds[i]][sample[i] % 64]
                    tok = seq[pos[i]]
                    word = mask[i, tok // 32]
                    assert (int(word) >> (tok % 32)) & 1, (impl.name, kinds[i], pos[i])
                    impl.consume(row, tok)
                    pos[i] += 1
                    if pos[i] == len(seq):  # complete: EOS must be allowed; start the next output
                        impl.fill([row], mask[i : i + 1])
                        assert (int(mask[i, eos // 32]) >> (eos % 32)) & 1
                        impl.reset(row)
                        pos[i], sample[i] = 0, sample[i] + b
                consume_t.append(time.perf_counter() - t1)
                fill_t.append(t1 - t0)
            warm = fill_t[steps // 4 :]
            res[f"mask_{kind}_{b}_ms"] = statistics.median(warm) * 1e3
            res[f"mask_{kind}_{b}_p90_ms"] = sorted(warm)[int(len(warm) * 0.9)] * 1e3
            res[f"consume_{kind}_{b}_ms"] = statistics.median(consume_t[steps // 4 :]) * 1e3
    cur, peak = rss_mb()
    res["rss_delta_mb"], res["rss_peak_mb"] = cur - base_rss, peak
    return res


def compare(args) -> None:
    results = []
    for tok in args.tokenizers.split(","):
        tokenizer_path(tok)  # build once, outside the timed workers
        for lib in args.libs.split(","):
            out = run_module("mlxbatch.bench.constraints", ["--worker", lib, "--tokenizers", tok,
                                                            "--batches", args.batches, "--steps", str(args.steps)])
            if out.returncode:
                print(out.stderr[-2000:], file=sys.stderr)
                results.append({"lib": lib, "tokenizer": tok, "error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]})
                continue
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    batches = [int(b) for b in args.batches.split(",")]
    head = ["tokenizer (vocab)", "library", "setup s", "choice ms", "regex ms", "json ms"]
    head += [f"{k} mask@{b} ms" for k in ("choice", "regex", "json_schema", "mixed") for b in batches]
    head += ["RSS +MB"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in results:
        if "error" in r:
            print(f"| {r['tokenizer']} | {r['lib']} | error: {r['error']} |")
            continue
        cells = [f"{r['tokenizer']} ({r['vocab']})", r["lib"], f"{r['setup_s']:.2f}"]
        cells += [f"{r[f'compile_{k}_s'] * 1e3:.1f}" for k in ("choice", "regex", "json_schema")]
        cells += [f"{r[f'mask_{k}_{b}_ms']:.2f}" for k in ("choice", "regex", "json_schema", "mixed") for b in batches]
        cells += [f"{r['rss_delta_mb']:.0f}"]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mlxbatch bench constraints", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--libs", default="llguidance,outlines")
    p.add_argument("--tokenizers", default="smollm2,tiny,bpe151k")
    p.add_argument("--batches", default="32,64")
    p.add_argument("--steps", type=int, help="steps measured (default: 80 for the libraries, 12 in the engine)")
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--engine", action="store_true", help="measure the mask cost inside the engine instead")
    p.add_argument("--repeats", type=int, default=2, help="engine section: runs of each kind, alternating")
    p.add_argument("--model", default="tiny", help="engine section: tiny or 0.5b (random weights), or smollm2")
    args = p.parse_args(argv)
    if args.worker or not args.engine:
        args.steps = args.steps or 80
    if args.worker:
        import mlxbatch.engine  # noqa: F401  (mlx and the engine's grammar code: import time is not compile time)

        res = run_worker(args.worker, args.tokenizers, [int(b) for b in args.batches.split(",")], args.steps)
        print(json.dumps(res))
    elif args.engine:
        from mlxbatch.bench.constraints_engine import engine_bench

        args.steps = args.steps or 12
        engine_bench(args)
    else:
        compare(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
