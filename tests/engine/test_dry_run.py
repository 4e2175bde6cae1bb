"""The dry run of the engine's scheduling (``engine.DryRun``: what ``mlxbatch plan`` predicts with) against the engine
itself on the real tiny model: the same rows submitted to both, at the reuse step of the CPU (1: reuse to the token)
and of CUDA's packed passes (a block), compute the same prefill tokens, reuse the same tokens and take the same steps."""

from __future__ import annotations

import random

import pytest

from mlxbatch import SamplingParams
from mlxbatch.engine import DryModel, DryRun, Engine, EngineConfig, plan, submission_order

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def prompt_sets() -> dict[str, list[list[int]]]:
    rng = random.Random(5)
    inst = [rng.randrange(10, 1000) for _ in range(150)]
    starts = [rng.randrange(10, 40) for _ in range(6)]  # texts that start alike: 1-2 tokens past the instruction
    alike = [inst + [rng.choice(starts), rng.choice(starts[:3])] + [rng.randrange(10, 1000)
                                                                    for _ in range(rng.randint(5, 30))]
             for _ in range(48)]
    label = [inst + [rng.randrange(10, 1000) for _ in range(rng.randint(5, 40))] for _ in range(48)]
    heads = [[rng.randrange(10, 1000) for _ in range(rng.randint(40, 90))] for _ in range(4)]
    fewshot = [heads[i % 4] + [rng.randrange(10, 1000) for _ in range(rng.randint(3, 20))] for i in range(48)]
    twins = [label[i % 12] for i in range(36)]  # rows identical to another: they fork it
    return {"alike": alike, "label": label, "fewshot": fewshot, "twins": twins}


def dry_for(loaded, eng: Engine, step: int) -> DryRun:
    core = eng.core
    model = DryModel(core.worker.geometry.bytes_per_token, loaded.context_length)
    # the engine's memory as its worker measured it (the device's free memory changes as tests run)
    cfg = EngineConfig(warm_up=False, max_num_seqs=8, kv_budget_bytes=core.memory.total)
    return DryRun(model, cfg, loaded.tokenizer, packed_prefill=step > 1)


def counted(eng: Engine) -> tuple[int, int]:
    st = eng.stats()
    return st["profile"]["prefill_tokens"], st["prefix_cache"]["tokens_reused"]


@pytest.mark.parametrize("step", [1, 16])
def test_the_dry_run_computes_what_the_engine_computes(tiny_loaded, step):
    for name, prompts in prompt_sets().items():
        eng = Engine(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=8))
        eng.core.scheduler.prefix.live_margin = step  # as ``EngineCore.reuse_step`` sets it where passes are packed
        dry = dry_for(tiny_loaded, eng, step)
        assert dry.reuse_step == step and dry.config.max_num_seqs == 8
        subs = submission_order(plan(prompts, min_step_tokens=step))
        for k, s in enumerate(subs):
            eng.core.add_request(prompts[s.index], GREEDY, request_id=f"r{k}", cache_tokens=s.cache_tokens)
            dry.add_request(prompts[s.index], GREEDY, f"r{k}", s.cache_tokens)
        steps = 0
        while eng.core.has_unfinished:
            eng.core.step()
            steps += 1
        counts = dry.run_until_done()
        computed, reused = counted(eng)
        assert (counts.prefill_tokens, counts.reused_tokens) == (computed, reused), (name, step)
        assert counts.steps <= steps <= counts.steps + 1, (name, step)  # the engine's last step may only reap
        eng.close()


def test_samples_and_multi_token_candidates_as_the_engine_runs_them(tiny_loaded):
    """``n`` samples fork sample 0; each multi-token candidate of a score row is a sequence of its own, the later ones
    waiting for the context's blocks (the plan under-predicted these by a third before it ran the scheduler)."""
    rng = random.Random(3)
    head = [rng.randrange(10, 1000) for _ in range(61)]
    contexts = [head + [rng.randrange(10, 1000) for _ in range(rng.randint(4, 20))] for _ in range(24)]
    cands = [[[rng.randrange(10, 1000) for _ in range(rng.randint(1, 4))] for _ in range(4)] for _ in contexts]
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=8))
    dry = dry_for(tiny_loaded, eng, 1)
    subs = submission_order(plan(contexts))
    sampled = SamplingParams(temperature=0.7, max_tokens=3, n=3, ignore_eos=True, seed=1)
    for k, s in enumerate(subs):
        eng.core.add_score_request(contexts[s.index], cands[s.index], request_id=f"s{k}", cache_tokens=s.cache_tokens)
        dry.add_score_request(contexts[s.index], cands[s.index], f"s{k}", s.cache_tokens)
    for k, ctx in enumerate(contexts[:6]):
        eng.core.add_request(ctx, sampled, request_id=f"g{k}")
        dry.add_request(ctx, sampled, f"g{k}")
    eng.core.run_until_done()
    counts = dry.run_until_done()
    assert (counts.prefill_tokens, counts.reused_tokens) == counted(eng)
    assert counts.forked_tokens > 0  # samples 1 and 2 forked sample 0 (where it was still prefilling)
    eng.close()
