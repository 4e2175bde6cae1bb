"""Constrained decoding on this machine: llguidance vs outlines-core, and the mask cost inside the engine.

Library comparison (default): for each tokenizer, one fresh process per library measures tokenizer / index
setup, compile time of a 5-label choice, a regex and a 4-field JSON schema (until the first mask is ready),
per-step mask time for 32 and 64 rows advancing through valid outputs, and RSS. Engine section
(``--engine``): decode-step time with every row constrained vs none at 32 and 64 rows, and the time in
``constrain_logits`` itself.

    .venv/bin/python scripts/bench_constraints.py                       # libraries, all tokenizers
    .venv/bin/python scripts/bench_constraints.py --engine --model tiny # engine mask cost (tiny / 0.5b)

Tokenizers: SmolLM2-135M-Instruct (49,152 ids), the tiny test model's byte-level BPE (1,024 ids) and a
151,646-id byte-level BPE trained here on local Python sources (Qwen2's vocabulary size; none with a real
151k vocabulary can be fetched offline). outlines-core needs a ``Vocabulary`` of token bytes: built here from
the byte-level BPE (``Vocabulary.from_pretrained`` would download from the hub).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CACHE = Path(os.environ.get("MLXBATCH_TEST_CACHE", Path.home() / ".cache" / "mlxbatch" / "test-models"))
LABELS = ["positive", "negative", "neutral", "mixed", "unknown"]
REGEX = r"\d{3}-\d{4}"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    },
    "required": ["name", "age", "sentiment", "tags"],
    "additionalProperties": False,
}
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "red", "green", "blue", "data", "model"]


def rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def big_bpe_path() -> Path:
    """A 151,646-id byte-level BPE (Qwen2's size) trained once on local Python sources; returns its folder."""
    out = CACHE / "bpe-151k-v1"
    if (out / "tokenizer.json").exists():
        return out
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            f.read_bytes().decode("utf-8")
            files.append(str(f))
        except (UnicodeDecodeError, OSError):
            pass
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train(files, trainers.BpeTrainer(vocab_size=151646, special_tokens=specials, show_progress=False,
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>").save_pretrained(
        str(out))
    return out


def tokenizer_path(name: str) -> Path:
    if name == "smollm2":
        from mlxbatch.engine.model.loader import resolve_path

        return Path(resolve_path("smollm2"))
    if name == "tiny":
        from mlxbatch.models.random_model import build_random_model

        return build_random_model(CACHE / "tiny-qwen2-v1", "tiny")
    if name == "bpe151k":
        return big_bpe_path()
    raise SystemExit(f"unknown tokenizer {name!r}")


def valid_outputs(kind: str, n: int) -> list[str]:
    """``n`` texts that match the constraint of ``kind`` (compact JSON in schema property order)."""
    import random

    rnd = random.Random(0)
    if kind == "choice":
        return [LABELS[i % len(LABELS)] for i in range(n)]
    if kind == "regex":
        return [f"{rnd.randrange(1000):03d}-{rnd.randrange(10000):04d}" for _ in range(n)]
    out = []
    for _ in range(n):
        obj = {"name": " ".join(rnd.sample(WORDS, 2)), "age": rnd.randrange(100),
               "sentiment": rnd.choice(["positive", "negative", "neutral"]),
               "tags": rnd.sample(WORDS, rnd.randrange(1, 4))}
        out.append(json.dumps(obj, separators=(",", ":")))
    return out


# -- one library, one tokenizer (run in a fresh process) -----------------------------------------------------
class LLG:
    name = "llguidance"

    def __init__(self, hf):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg, self.lln = llguidance, llguidance.numpy
        self.tok = llguidance.hf.from_tokenizer(hf)
        self.vocab = self.tok.vocab_size
        self.executor = llguidance.LLExecutor()

    def compile(self, kind):
        from mlxbatch.engine.decoding.structured import grammar_text  # imported (with mlx) in main(), not timed here
        from mlxbatch.types import OutputConstraint

        c = {"choice": OutputConstraint.choice(LABELS), "regex": OutputConstraint.regex(REGEX),
             "json_schema": OutputConstraint.json_schema(SCHEMA)}[kind]
        m = self.llg.LLMatcher(self.tok, grammar_text(c), log_level=0)
        assert not m.is_error(), m.get_error()
        self.fill([m.deep_copy()], self.alloc(1))  # the first mask, as for outlines-core
        return m

    def warm_up(self):
        m = self.llg.LLMatcher(self.tok, self.llg.LLMatcher.grammar_from_regex("[a-z]+"), log_level=0)
        self.fill([m], self.alloc(1))

    def rows(self, compiled, n):
        return [compiled.deep_copy() for _ in range(n)]

    def alloc(self, n):
        return self.lln.allocate_token_bitmask(n, self.vocab)

    def fill(self, rows, mask):
        self.lln.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(rows)], mask)

    def consume(self, row, tok):
        ok = row.consume_token(tok)
        assert ok, row.get_error()

    def reset(self, row):
        row.reset()


class Outlines:
    name = "outlines-core"

    def __init__(self, hf):
        import numpy as np
        import outlines_core as oc

        self.oc, self.np = oc, np
        decode = {c: b for b, c in _bytes_to_unicode().items()}
        special = set(hf.all_special_ids) | {i for i in hf.added_tokens_decoder}
        tokens: dict[bytes, list[int]] = {}
        for text, i in hf.get_vocab().items():
            if i not in special:
                tokens.setdefault(bytes(decode[c] for c in text), []).append(i)
        self.vocab = len(hf)
        self.voc = oc.Vocabulary(hf.eos_token_id, tokens)

    def compile(self, kind):
        if kind == "choice":
            regex = "(" + "|".join(re.escape(x) for x in LABELS) + ")"
        elif kind == "regex":
            regex = REGEX
        else:
            regex = self.oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
        index = self.oc.Index(regex, self.voc)
        first = self.alloc(1)  # the first mask, as for llguidance
        self.fill([self.oc.Guide(index)], first)
        return index

    def warm_up(self):
        self.fill([self.oc.Guide(self.oc.Index("[a-z]+", self.voc))], self.alloc(1))

    def rows(self, index, n):
        return [self.oc.Guide(index) for _ in range(n)]

    def alloc(self, n):
        return self.np.full((n, (self.vocab + 31) // 32), -1, dtype=self.np.int32)

    def fill(self, rows, mask):
        words = mask.shape[1]
        base, stride = mask.ctypes.data, words * 4
        for i, g in enumerate(rows):
            g.write_mask_into(base + i * stride, words, 4)

    def consume(self, row, tok):
        row.advance(tok, return_tokens=False)

    def reset(self, row):
        row.reset()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE token text)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


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
            cmd = [sys.executable, __file__, "--worker", lib, "--tokenizers", tok, "--batches", args.batches,
                   "--steps", str(args.steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
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


# -- the engine: decode-step time with every row constrained vs none -------------------------------------------
ENGINE_SCHEMA = {  # long-lived: a list of at least 50 records, so no row completes inside the measured steps
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 50, "items": SCHEMA}},
    "required": ["records"],
}


def engine_model(name: str):
    from mlxbatch.engine.model.loader import ModelSpec, load_model, resolve_path
    from mlxbatch.models.random_model import build_random_model

    if name in ("tiny", "0.5b"):
        path = build_random_model(Path.home() / ".cache" / "mlxbatch" / "bench" / name, name)
    else:
        path = Path(resolve_path(name))
    return load_model(ModelSpec(str(path), dtype="float32"))


def engine_run(engine, rows: int, constrained: bool, warm: int, steps: int) -> dict:
    """Median decode-step time (all ``rows`` decoding) and, when constrained, the time in the mask and advance."""
    import mlx.core as mx

    from mlxbatch import SamplingParams
    from mlxbatch.types import OutputConstraint

    core = engine.core
    grammars = core.runner.grammars
    timing = {"mask": [], "advance": []}
    constrain, advance = grammars.constrain, grammars.advance

    def timed_constrain(ids, logits):
        t0 = time.perf_counter()
        out = constrain(ids, logits)
        mx.eval(out)  # the step's logits are evaluated already: this is the mask alone
        timing["mask"].append(time.perf_counter() - t0)
        return out

    def timed_advance(ids, toks):
        t0 = time.perf_counter()
        advance(ids, toks)
        timing["advance"].append(time.perf_counter() - t0)

    grammars.constrain, grammars.advance = timed_constrain, timed_advance
    constraint = OutputConstraint.json_schema(ENGINE_SCHEMA) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=warm + steps + 8, ignore_eos=True, constraint=constraint)
    ids = [core.add_request(f"Record {i}: write the records as JSON.", params) for i in range(rows)]
    step_s = []
    try:
        while len(step_s) < warm + steps and core.has_unfinished:
            before = core.runner.profile.prefill_tokens
            timing["mask"].clear()
            timing["advance"].clear()
            t0 = time.perf_counter()
            core.step()
            dt = time.perf_counter() - t0
            if core.runner.profile.prefill_tokens == before and core.runner.batch.n_decode == rows:
                step_s.append((dt, sum(timing["mask"]), sum(timing["advance"])))
    finally:
        for rid in ids:
            core.abort(rid)
        core.step()
        del grammars.constrain, grammars.advance
    meas = step_s[warm:]
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return {"step_ms": med([m[0] for m in meas]), "mask_ms": med([m[1] for m in meas]),
            "advance_ms": med([m[2] for m in meas]), "steps": len(meas)}


def engine_bench(args) -> None:
    from mlxbatch.engine import Engine, EngineConfig

    loaded = engine_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    engine = Engine(loaded, EngineConfig(max_num_seqs=max(batches), max_num_batched_tokens=4096))
    engine.core.compiler.check  # noqa: B018  (build the grammar tokenizer outside the timed steps)
    print(f"model {args.model}: logits width {engine.core.compiler.vocab_size}, "
          f"tokenizer {engine.core.compiler.tokenizer_vocab} ids; JSON schema rows (greedy), median of {args.steps} "
          "decode steps")
    print("| rows | step ms, none | step ms, all constrained | mask ms (fill + apply; range over runs) | advance ms | "
          "overhead | mask / unconstrained step |")
    print("|---|---|---|---|---|---|---|")
    for b in batches:
        runs = [engine_run(engine, b, kind, 3, args.steps) for kind in (False, True) * args.repeats]
        # the machine is shared: of each kind's runs, the one with the fastest median step
        none = min(runs[0::2], key=lambda r: r["step_ms"])
        con = min(runs[1::2], key=lambda r: r["step_ms"])
        over = (con["step_ms"] - none["step_ms"]) / none["step_ms"] * 100
        masks = sorted(r["mask_ms"] for r in runs[1::2])
        mask = statistics.median(masks)
        spread = f" ({masks[0]:.1f}-{masks[-1]:.1f})" if len(masks) > 1 else ""
        print(f"| {b} | {none['step_ms']:.1f} | {con['step_ms']:.1f} | {mask:.2f}{spread} | "
              f"{con['advance_ms']:.2f} | {over:+.1f}% | {mask / none['step_ms'] * 100:.1f}% |")
    engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--libs", default="llguidance,outlines")
    p.add_argument("--tokenizers", default="smollm2,tiny,bpe151k")
    p.add_argument("--batches", default="32,64")
    p.add_argument("--steps", type=int, help="steps measured (default: 80 for the libraries, 12 in the engine)")
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--engine", action="store_true", help="measure the mask cost inside the engine instead")
    p.add_argument("--repeats", type=int, default=2, help="engine section: runs of each kind, alternating")
    p.add_argument("--model", default="tiny", help="engine section: tiny or 0.5b (random weights), or smollm2")
    args = p.parse_args()
    if args.worker or not args.engine:
        args.steps = args.steps or 80
    if args.worker:
        import mlxbatch.engine.decoding.structured  # noqa: F401  (import time is not compile time)

        res = run_worker(args.worker, args.tokenizers, [int(b) for b in args.batches.split(",")], args.steps)
        print(json.dumps(res))
    elif args.engine:
        args.steps = args.steps or 12
        engine_bench(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
