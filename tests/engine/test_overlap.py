"""Overlapped steps (``EngineConfig.overlap_steps``): a step is launched before the step before it is read, and
nothing a request sees changes: the same tokens, logprobs, finish reasons and streamed text as steps run one at a
time, on a real tiny model (float32 on the CPU: rows do not depend on their batch).

The device queue's rule is tested here too: no evaluation is enqueued while a launch is in flight. On CUDA an
update enqueued while an earlier kernel still holds its buffer copies the whole buffer (the CPU runs each task when
the ones before it are done, so only the rule itself can be checked here)."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.types import SamplingParams

# each test with steps launched on the engine's thread and from a launch thread
pytestmark = pytest.mark.usefixtures("either_launch_thread")

SHARED = list(range(40, 88))  # a 48-token prefix several prompts share (three cache blocks)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tail = [rng.randrange(3, 1000) for _ in range(rng.randrange(4, 60))]
        out.append(SHARED + tail if i % 3 == 0 else tail)
    return out


def _params(n: int, stop_token: int) -> list[SamplingParams]:
    kinds = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(stop_token,)),  # stops on a drawn token
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=20, logprobs=2),
        SamplingParams(temperature=0, max_tokens=1),  # done as its prefill ends
        SamplingParams(temperature=0.7, seed=3, max_tokens=16, n=2),
        SamplingParams(temperature=0, max_tokens=12, logprobs=0),
    ]
    return [kinds[i % len(kinds)] for i in range(n)]


def _run(loaded, prompts, params, overlap: bool, **kw):
    with Engine(loaded, EngineConfig(warm_up=False, max_num_seqs=8, max_num_batched_tokens=256,
                                     prefill_chunk_size=64, overlap_steps=overlap, **kw)) as eng:
        outs = eng.generate(prompts, params)
        return outs, eng.core.runner.profile


def _view(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [(lp.token_id, round(lp.logprob, 5), lp.top) for lp in c.logprobs])
             for c in o.completions] for o in outs]


def test_overlapped_steps_give_what_steps_one_at_a_time_give(tiny_loaded):
    prompts = _prompts(30, seed=1)
    first, _ = _run(tiny_loaded, prompts[1:2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                    overlap=False)
    stop_token = first[0].completions[0].token_ids[5]  # a token row 1 draws greedily: it stops on it
    params = _params(30, stop_token)
    sync, prof_sync = _run(tiny_loaded, prompts, params, overlap=False)
    over, prof_over = _run(tiny_loaded, prompts, params, overlap=True)
    assert _view(over) == _view(sync)
    assert any(c.stop_reason == stop_token for o in sync for c in o.completions)  # the stop path ran
    # (rows leave the batch a step later when they stop on a token, so prefix reuse may differ by a few tokens)
    assert abs(prof_over.prefill_tokens - prof_sync.prefill_tokens) <= 0.02 * prof_sync.prefill_tokens
    # a row that drew its last token is not fed again; one that stopped on a token was fed once more at most
    stopped = sum(1 for o in sync for c in o.completions if c.finish_reason.value == "stop")
    assert prof_sync.decode_tokens <= prof_over.decode_tokens <= prof_sync.decode_tokens + stopped


def test_penalties_read_the_step_before_first(tiny_loaded):
    """Rows whose draw reads their own tokens (penalties, min_tokens) mixed with plain rows: the same outputs."""
    prompts = _prompts(12, seed=2)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3) if i % 4 == 0
              else SamplingParams(temperature=0.8, seed=i, max_tokens=18, min_tokens=6) if i % 4 == 1
              else SamplingParams(temperature=0, max_tokens=15 + i, ignore_eos=True) for i in range(12)]
    sync, _ = _run(tiny_loaded, prompts, params, overlap=False)
    over, _ = _run(tiny_loaded, prompts, params, overlap=True)
    assert _view(over) == _view(sync)


def test_streamed_text_is_the_same(tiny_loaded):
    prompts = _prompts(10, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=10 + i) for i in range(10)]

    def streamed(overlap: bool) -> dict[str, str]:
        text: dict[str, str] = {}
        with Engine(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=4, overlap_steps=overlap)) as eng:
            for d in eng.stream(prompts, params):
                text[d.request_id] = text.get(d.request_id, "") + d.text
        return text

    assert streamed(True) == streamed(False)


def test_a_step_is_launched_before_the_one_before_it_is_read(tiny_loaded):
    """The order of the runner's calls: launch k+1, then read k (its tokens feed k+1 on the device)."""
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=4, prefix_cache=False, overlap_steps=True))
    runner, events = eng.core.runner, []
    launch, collect = runner.launch, runner.collect

    def logged_launch(out):
        step = launch(out)
        events.append(("launch", step.launch))
        return step

    def logged_collect(step):
        events.append(("read", step.launch))
        return collect(step)

    runner.launch, runner.collect = logged_launch, logged_collect
    try:
        outs = eng.generate(_prompts(4, seed=4), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    finally:
        eng.close()
    assert all(len(o.completions[0].token_ids) == 6 for o in outs)
    launches = [n for kind, n in events if kind == "launch"]
    for kind, n in events:
        if kind == "read":  # step n is read after step n + 1 was launched (the last one: after the loop ends)
            assert events.index(("read", n)) > events.index(("launch", n)), events
            if n != launches[-1]:
                assert events.index(("read", n)) > events.index(("launch", launches[launches.index(n) + 1])), events


def test_nothing_is_enqueued_while_a_launch_is_in_flight(tiny_loaded, monkeypatch):
    """Every evaluation the engine asks for (``mx.eval``, ``mx.async_eval``), on its thread or the launch thread, comes
    after a synchronisation that followed the last launch: the rule that keeps CUDA's in-place KV writes in place
    (docs: ``engine.outputs``)."""
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=8, max_num_batched_tokens=128,
                                           prefill_chunk_size=32, overlap_steps=True))
    state = {"launched": False, "n": 0}
    real_eval, real_async, real_sync = mx.eval, mx.async_eval, mx.synchronize

    def checked(real, waits: bool):
        def call(*args, **kw):
            assert not state["launched"], "an evaluation was enqueued while a launch was in flight"
            state["n"] += 1
            out = real(*args, **kw)
            state["launched"] = not waits
            return out
        return call

    def synchronize(*args, **kw):
        out = real_sync(*args, **kw)
        state["launched"] = False
        return out

    monkeypatch.setattr(mx, "eval", checked(real_eval, waits=True))
    monkeypatch.setattr(mx, "async_eval", checked(real_async, waits=False))
    monkeypatch.setattr(mx, "synchronize", synchronize)
    try:
        outs = eng.generate(_prompts(24, seed=5), _params(24, stop_token=5))
    finally:
        monkeypatch.undo()
        eng.close()
    assert len(outs) == 24 and state["n"] > 24


def test_abort_while_the_last_token_is_drawn(tiny_loaded):
    """An abort between a step's launch and its read: the request ends aborted, the others run to the end."""
    eng = Engine(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=4, prefix_cache=False, overlap_steps=True))
    core = eng.core
    for i, p in enumerate(_prompts(4, seed=6)):
        core.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), request_id=f"r{i}")
    finals = {}
    steps = 0
    while core.has_unfinished:
        for d in core.step():
            if d.output is not None:
                finals[d.request_id] = d.output
        steps += 1
        if steps == 3:
            assert core._pending is not None  # a launched step is waiting to be read
            core.abort("r1")
    eng.close()
    assert finals["r1"].completions[0].finish_reason.value == "abort"
    assert all(len(finals[f"r{i}"].completions[0].token_ids) == 8 for i in (0, 2, 3))


@pytest.mark.parametrize("fail_at", [3, 6])
def test_an_out_of_memory_step_with_a_step_in_flight(tiny_loaded, fail_at, fail_launch_at):
    """A launch fails for lack of memory while the step before it is still unread: that step's tokens are not taken
    (its evaluation may be what failed: tests/engine/test_late_oom.py), every row is preempted and recomputed, and
    the outputs are what steps one at a time give with the same failure."""
    prompts = _prompts(12, seed=7)
    params = [SamplingParams(temperature=0, max_tokens=10 + i % 5, ignore_eos=True) for i in range(12)]

    def run(overlap: bool):
        eng = Engine(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=6, max_num_batched_tokens=128,
                                               prefill_chunk_size=32, overlap_steps=overlap))
        fail_launch_at(eng.core.runner, fail_at)
        try:
            return _view(eng.generate(prompts, params)), eng.core.scheduler.num_preemptions
        finally:
            eng.close()

    (over, n_over), (sync, n_sync) = run(True), run(False)
    assert n_over == n_sync == 1
    assert over == sync
    assert [len(o[0][0]) for o in over] == [p.max_tokens for p in params]
