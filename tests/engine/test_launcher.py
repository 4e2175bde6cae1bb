"""The launch thread (``engine.launcher``): with it, a step's ``mx.async_eval`` runs on a thread of the engine's own
while the engine's thread reads the step before and keeps its books; what requests get is what they get without it
(float32 on the CPU: the same tokens and logprobs), the engine's counts of launches and syncs are the same, and the
thread ends with the engine. The overlap and late out-of-memory suites run with it too
(``either_launch_thread``)."""

from __future__ import annotations

import sys
import threading

import mlx.core as mx
import pytest

from mlxbatch.engine import Engine, EngineConfig
from mlxbatch.engine.backend import Backend
from mlxbatch.engine.paths import overlaps_steps, uses_launch_thread
from mlxbatch.types import SamplingParams

CONFIG = dict(warm_up=False, max_num_seqs=8, max_num_batched_tokens=128, prefill_chunk_size=32, overlap_steps=True)
PROMPTS = [[3 + (11 * i + 7 * j) % 900 for j in range(5 + 4 * i)] for i in range(10)]
PARAMS = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True, logprobs=1) if i % 2
          else SamplingParams(temperature=0.8, seed=i, max_tokens=9) for i in range(10)]


def _launch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mlxbatch-launch"]


def _run(loaded, monkeypatch, on: bool):
    monkeypatch.setattr("mlxbatch.engine.core.uses_launch_thread", lambda backend, config, vision: on)
    threads: list[str] = []
    real = mx.async_eval

    def recorded(*arrays):
        # where each evaluation is enqueued: the thread, and whether a step's last launch asked for it (its draw)
        frames, f = [], sys._getframe(1)
        while f is not None:
            frames.append(f.f_code.co_name)
            f = f.f_back
        threads.append((threading.current_thread().name, "draw_commit" in frames))
        return real(*arrays)

    monkeypatch.setattr(mx, "async_eval", recorded)
    with Engine(loaded, EngineConfig(**CONFIG)) as eng:
        outs = eng.generate(PROMPTS, PARAMS)
        traffic = eng.core.runner.traffic
        counts = (traffic.launches, traffic.syncs)
        encoded = sum(traffic.encoded.values())
        prof = eng.core.runner.profile
        # the engine's thread's waits for the launch thread are their own figure, not the step's host work
        waited = prof.as_dict().get("waited_launch_thread_s")
        assert (waited is not None) == on and (waited or 0.0) < prof.total_s
        assert (eng.core._launcher is not None) == on
    monkeypatch.setattr(mx, "async_eval", real)
    view = [[(c.token_ids, None if c.logprobs is None else [(lp.token_id, lp.logprob) for lp in c.logprobs])
             for c in o.completions] for o in outs]
    return view, counts, threads, encoded


def test_steps_launched_from_the_launch_thread_give_the_same_outputs_and_counts(tiny_loaded, monkeypatch):
    want, counts, threads, _ = _run(tiny_loaded, monkeypatch, on=False)
    assert {name for name, _ in threads} == {"MainThread"}
    got, counts_lt, threads_lt, encoded = _run(tiny_loaded, monkeypatch, on=True)
    assert got == want
    assert counts_lt == counts  # the same launches, and a sync for each wait, wherever it waited
    # each step's last launch (its draw) went through the thread; launches inside a step stay on the engine's thread
    # (it goes on building the step's graph after them)
    last = sum(1 for _, drew in threads if drew)
    assert last > 0 and sum(1 for name, _ in threads_lt if name == "mlxbatch-launch") == last
    assert all(not drew for name, drew in threads_lt if name == "MainThread")
    assert encoded > 0  # the thread's time inside async_eval is counted
    assert not _launch_threads(), "the launch thread outlived its engine"


def test_the_warm_up_core_stops_its_launch_thread(tiny_loaded, monkeypatch):
    monkeypatch.setattr("mlxbatch.engine.core.uses_launch_thread", lambda backend, config, vision: True)
    with Engine(tiny_loaded, EngineConfig(**CONFIG)) as eng:
        eng.core.warm_up_paths()  # (a GPU engine does this as it starts; its throwaway core has a thread of its own)
        assert len(_launch_threads()) == 1
        out = eng.generate([PROMPTS[0]], PARAMS[1])
        assert len(out[0].completions[0].token_ids) == PARAMS[1].max_tokens
    assert not _launch_threads()


@pytest.mark.parametrize("kind, overlap, vision, invariant, want", [
    ("cuda", None, False, False, (True, True)),  # by device: overlapped, from the thread
    ("cuda", True, False, False, (True, True)),
    ("cuda", False, False, False, (False, False)),  # steps one at a time: nothing to run beside the encoding
    ("cuda", None, True, False, (False, False)),  # vision rows: fed embeddings made on the engine's thread
    ("cuda", None, False, True, (False, False)),  # fixed-shape forwards
    ("metal", None, False, False, (True, False)),  # overlapped from the engine's thread (a Mac's path on an H100)
    ("metal", None, True, False, (False, False)),  # vision rows: their tokens are read before the next step
    ("metal", None, False, True, (False, False)),
    ("metal", False, False, False, (False, False)),
    ("cpu", None, False, False, (False, False)),  # the CPU's encoding is cheap: the thread would only add a hand-over
    ("cpu", True, False, False, (True, False)),
])
def test_which_engines_overlap_steps_and_launch_from_a_thread(kind, overlap, vision, invariant, want):
    config = EngineConfig(overlap_steps=overlap, batch_invariant=invariant)
    assert (overlaps_steps(Backend(kind), config, vision), uses_launch_thread(Backend(kind), config, vision)) == want


def test_a_cpu_engine_resolves_overlap_by_device(tiny_loaded):
    with Engine(tiny_loaded, EngineConfig(warm_up=False)) as eng:
        assert eng.core.config.overlap_steps is False and eng.core._launcher is None


def test_a_draw_is_completed_before_the_engines_thread_reads_it(tiny_loaded, monkeypatch):
    """MLX changes an array when it is first read or taken into an evaluation (its event dropped): the next step's
    pass takes the step before's draw in while the engine's thread reads that draw. So whichever thread sees a launch
    complete completes its draw (``launcher.complete``) before the engine's thread may read it; without that, two
    threads dropped one event at once (a segmentation fault on an H100)."""
    import mlxbatch.engine.launcher as launcher_mod
    import mlxbatch.engine.outputs as outputs_mod
    from mlxbatch.engine.decoding.sampling import Drawn

    monkeypatch.setattr("mlxbatch.engine.core.uses_launch_thread", lambda backend, config, vision: True)
    completed: dict[int, str] = {}  # id of each array completed -> the thread that completed it
    unread: list[int] = []
    real_complete, real_read = launcher_mod.complete, Drawn.read

    def complete(arrays):
        for a in arrays:
            completed.setdefault(id(a), threading.current_thread().name)
        real_complete(arrays)

    def read(self):
        unread.extend(id(a) for a in self.arrays() if id(a) not in completed)
        return real_read(self)

    monkeypatch.setattr(launcher_mod, "complete", complete)
    monkeypatch.setattr(outputs_mod, "complete", complete)
    monkeypatch.setattr(Drawn, "read", read)
    with Engine(tiny_loaded, EngineConfig(**CONFIG)) as eng:
        outs = eng.generate(PROMPTS, PARAMS)
    assert all(o.finished for o in outs)
    assert not unread, f"{len(unread)} draw arrays read before any thread completed them"
    # most steps' draws are completed by the launch thread, beside the engine's thread's work
    assert list(completed.values()).count("mlxbatch-launch") > len(completed) // 2
