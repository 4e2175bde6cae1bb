"""The plan's prefill prediction (``job.plan.reuse_model``) against the engine itself, at the reuse step of the CPU (1:
reuse to the token) and of CUDA's packed passes (a block), on the real tiny model: the same plan submitted to both."""

from __future__ import annotations

import random

import pytest

from mlxbatch import SamplingParams
from mlxbatch.engine import Engine, EngineConfig, plan, submission_order
from mlxbatch.job.plan.reuse_model import ReuseModel

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
    return {"alike": alike, "label": label, "fewshot": fewshot}


@pytest.mark.parametrize("step", [1, 16])
def test_the_prediction_follows_the_engine_at_its_reuse_step(tiny_loaded, step):
    for name, prompts in prompt_sets().items():
        eng = Engine(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=8))
        eng.core.scheduler.prefix.live_margin = step  # as ``EngineCore.reuse_step`` sets it where passes are packed
        subs = submission_order(plan(prompts, min_step_tokens=step))
        for s in subs:
            eng.core.add_request(prompts[s.index], GREEDY, cache_tokens=s.cache_tokens)
        eng.core.run_until_done()
        computed = eng.stats()["profile"]["prefill_tokens"]
        model = ReuseModel(8, forks=True, live_margin=step)
        model.start_window()
        predicted = sum(model.reuse(prompts[s.index], s.cache_tokens) for s in subs)
        # (a running row's copy, taken only a block past the cache at step 16, is where the two part: within 3%)
        assert abs(predicted - computed) <= 0.03 * computed, (name, step, predicted, computed)
