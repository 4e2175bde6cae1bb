"""An out-of-memory failure reported late, as Metal reports it: the step that asked for the memory runs with
undefined results, and the error comes at the next synchronisation or the next op (a later launch, the read of a
draw, a scoring evaluation), not where the allocation was asked for. Whatever the point, no exception escapes, the
batch shrinks, and every row's tokens and logprobs equal a run that never hit the limit (float32 on the CPU: exactly).

The device is failed at the runner's one seam for it (``Traffic.fault``, called before every launch, evaluation,
synchronisation and read): at the chosen launch the step's results become garbage as a failed command buffer leaves
them (its draw's token ids wrong, its logprobs, the slots' KV and the prefix store's blocks NaN), and the Metal error
is raised at the first ``report`` point after it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence

import mlx.core as mx
import pytest

from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.types import OutputConstraint, SamplingParams

# each test with steps launched on the engine's thread and from a launch thread
pytestmark = pytest.mark.usefixtures("either_launch_thread")

METAL_OOM = ("[metal::malloc] Attempting to allocate 21474836480 bytes which is greater than the maximum allowed "
             "buffer size of 17179869184 bytes.")

SHARED = list(range(40, 88))  # a 48-token prefix (three cache blocks)


class LateMetalOOM:
    """Fails the ``at``-th launch of ``kind`` (among those ``when`` accepts) as Metal does: its results are garbage,
    and ``METAL_OOM`` is raised at the first ``report`` event after it ("synchronize", "read", "evaluate", or a
    launch's kind); ``report="now"`` raises at the failing call itself."""

    def __init__(self, runner, kind: str, at: int, report: str,
                 when: Callable[[Sequence[mx.array]], bool] = lambda arrays: True) -> None:
        self.runner, self.kind, self.at, self.report, self.when = runner, kind, at, report, when
        self.seen = 0
        self.armed = False
        self.raised = 0
        runner.traffic.fault = self

    def __call__(self, event: str, arrays: Sequence[mx.array]) -> None:
        if self.armed and event == self.report:
            self._raise()
        if event != self.kind or self.raised or self.armed or not self.when(arrays):
            return
        self.seen += 1
        if self.seen != self.at:
            return
        for a in [*arrays, *self.runner.batch.kv_arrays()]:  # what the failed command buffer left
            if mx.issubdtype(a.dtype, mx.floating):
                a[...] = mx.nan
            elif a.dtype == mx.bool_:
                a[...] = mx.logical_not(a)
            else:
                a[...] = mx.where(a > 0, a - 1, a + 1)  # another token id, still in the vocabulary
        self.armed = True
        if self.report == "now":
            self._raise()

    def _raise(self) -> None:
        self.armed = False
        self.raised += 1
        raise RuntimeError(METAL_OOM)


def _view(outs):
    return [[(c.token_ids, c.finish_reason, None if c.logprobs is None else [(lp.token_id, lp.logprob, lp.top)
                                                                            for lp in c.logprobs])
             for c in o.completions] for o in outs]


def _until_done(core, ids: list[str], max_steps: int = 1000):
    """The outputs of ``ids``, stepping at most ``max_steps`` times (a lost request fails the test, not hangs it)."""
    done = {}
    for _ in range(max_steps):
        if not core.has_unfinished:
            break
        done.update((d.request_id, d.output) for d in core.step() if d.output is not None)
    assert not core.has_unfinished, "a request never finished"
    return [done[i] for i in ids]


def _generate(loaded, prompts, params, fault: dict | None = None, **config):
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    with Engine(loaded, EngineConfig(warm_up=False, **config)) as eng:
        failing = LateMetalOOM(eng.core.runner, **fault) if fault is not None else None
        outs = _until_done(eng.core, [eng.core.add_request(p, q) for p, q in zip(prompts, params)])
        stats = eng.stats()
    if failing is not None:
        assert failing.raised == 1, "the fault never fired: the test would prove nothing"
    return _view(outs), stats


PROMPTS = [[3 + (7 * i + 5 * j) % 900 for j in range(6 + 3 * i)] for i in range(6)]
PARAMS = [SamplingParams(temperature=0, max_tokens=10 + i, ignore_eos=True, logprobs=1) for i in range(6)]
OVERLAPPED = dict(max_num_seqs=8, max_num_batched_tokens=128, prefill_chunk_size=32, overlap_steps=True)


@pytest.mark.parametrize("at", [4, 9])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("report", ["synchronize", "read"])
def test_a_failing_decode_step_is_recomputed(tiny_loaded, report, overlap, at):
    """Overlapped steps: decode step N's failure is reported while step N+1 is launched (the sync before its first
    launch: before the fix, one wrong token per row was appended) or when a draw is read (before the fix: a
    traceback). Steps one at a time: it is reported when step N's own draw is waited for or read, outside the
    launch (before the fix: a traceback). At the 9th decode step the first row draws its last token: overlapped, it
    has left the running set when the failure comes, and runs again."""
    config = dict(OVERLAPPED, overlap_steps=overlap)
    want, _ = _generate(tiny_loaded, PROMPTS, PARAMS, **config)
    got, stats = _generate(tiny_loaded, PROMPTS, PARAMS, dict(kind="decode", at=at, report=report), **config)
    assert stats["preemptions"] == 1
    assert got == want


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_a_launch_that_fails_at_once_is_recomputed(tiny_loaded, kind):
    """The allocation fails as the work is handed over (inside the launch, with the step before still unread)."""
    want, _ = _generate(tiny_loaded, PROMPTS, PARAMS, **OVERLAPPED)
    got, stats = _generate(tiny_loaded, PROMPTS, PARAMS, dict(kind=kind, at=2, report="now"), **OVERLAPPED)
    assert stats["preemptions"] == 1
    assert got == want


SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 8},
                                           "score": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["title", "score"], "additionalProperties": False}


@pytest.mark.parametrize("report", ["synchronize", "read"])
def test_a_structured_step_failing_at_its_read_is_recomputed(tiny_loaded, report):
    """Structured outputs run steps one at a time: the failure is reported when the step's own draw is waited for
    or read, outside the launch (before the fix: a traceback that stopped the job)."""
    prompts = ["Review as JSON:", "Label:", "Another review as JSON:", "x = 1"]
    params = [SamplingParams(temperature=0, max_tokens=24, logprobs=1, constraint=OutputConstraint.json_schema(SCHEMA)),
              SamplingParams(temperature=0, max_tokens=6, logprobs=1,
                             constraint=OutputConstraint.choice(["positive", "negative", "neutral"])),
              SamplingParams(temperature=0, max_tokens=24, logprobs=1, constraint=OutputConstraint.json_schema(SCHEMA)),
              SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)]
    want, _ = _generate(tiny_loaded, prompts, params, max_num_seqs=4)
    got, stats = _generate(tiny_loaded, prompts, params, dict(kind="decode", at=3, report=report), max_num_seqs=4)
    assert stats["preemptions"] == 1
    assert got == want
    for out in got[:1] + got[2:3]:
        json.loads(tiny_loaded.tokenizer.decode(list(out[0][0])))


def test_a_failed_step_that_stored_prefix_blocks_leaves_none_behind(tiny_loaded):
    """The failed step wrote prompt blocks into the prefix cache: those blocks are results of the failed graph, and
    the rows admitted after the recovery must not read them."""
    prompts = [SHARED + [100 + i, 200 + i, 300 + i] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    config = dict(max_num_seqs=2, max_num_batched_tokens=128, prefill_chunk_size=64, overlap_steps=True)
    want, _ = _generate(tiny_loaded, prompts, params, **config)
    # the first launch that hands the store's buffers over with the draw (more arrays than the draw's 4: ids,
    # logprobs, top ids and values): the step where the first prompt ends
    stores = dict(kind="prefill", at=1, report="synchronize", when=lambda arrays: len(arrays) > 4)
    got, stats = _generate(tiny_loaded, prompts, params, stores, **config)
    assert stats["preemptions"] == 1 and stats["prefix_cache"]["tokens_reused"] > 0  # reused after the recovery
    assert got == want


def test_a_scoring_evaluation_failing_keeps_each_score_once(tiny_loaded):
    """A scoring row's continuation spans several prefill chunks; the second chunk's scoring evaluation fails. The
    row is recomputed and every continuation token is scored once, as in a run without the failure."""
    items = [("Once upon a time", [" there lived a king who had three daughters and a very large castle"]),
             ("The capital of France is", [" Paris, a city of museums, cafes and long walks by the river"])]
    config = dict(max_num_seqs=4, prefill_chunk_size=8, max_num_batched_tokens=16)

    def run(fault):
        with Engine(tiny_loaded, EngineConfig(warm_up=False, **config)) as eng:
            failing = LateMetalOOM(eng.core.runner, **fault) if fault else None
            outs = eng.score(items)
            stats = eng.stats()
        assert failing is None or failing.raised == 1
        return _view(outs), stats

    want, _ = run(None)
    got, stats = run(dict(kind="evaluate", at=2, report="now"))
    assert stats["preemptions"] == 1
    assert got == want


def test_a_row_finished_by_a_token_read_before_the_failure_stays_finished(tiny_loaded):
    """Overlapped: row A's stop token is in the step in flight when a row that reads its own history (a repetition
    penalty) joins, so the next step reads the step in flight first (A finishes on its stop token) and then its
    launch fails. A stays finished, with the output a run without the failure gives."""
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    with Engine(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=4)) as eng:
        free_run = eng.generate([PROMPTS[0]], plain)[0].completions[0].token_ids
    stop = free_run[4]  # A's fifth token (greedy): it stops there
    assert stop not in free_run[:4]
    params = [dataclasses.replace(plain, ignore_eos=False, stop_token_ids=(stop,)), plain]
    late = SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3, logprobs=1)
    config = EngineConfig(warm_up=False, max_num_seqs=4, overlap_steps=True)

    def run(fail: bool):
        with Engine(tiny_loaded, config) as eng:
            core = eng.core
            ids = [core.add_request(p, q) for p, q in zip(PROMPTS[:2], params)]
            a = core._seqs[ids[0]]  # (n = 1: the sequence has the request's id)
            done = {}
            while not (len(a.output_token_ids) == 4 and a.pending == 1):  # A's stop token is in flight
                done.update((d.request_id, d.output) for d in core.step() if d.output is not None)
            failing = LateMetalOOM(core.runner, kind="prefill", at=1, report="now") if fail else None
            ids.append(core.add_request(PROMPTS[2], late))
            rest = [i for i in ids if i not in done]
            done.update(zip(rest, _until_done(core, rest)))
            outs = [done[i] for i in ids]
            stats = eng.stats()
        assert failing is None or failing.raised == 1
        return _view(outs), stats

    want, _ = run(False)
    got, stats = run(True)
    assert stats["preemptions"] == 1
    assert want[0][0][0][-1] == stop and got == want
