"""What a step returns and what the engine measures: ``RunnerOutput``, ``StepProfile`` and ``Traffic``.

``ModelRunner.execute`` returns a ``RunnerOutput`` (sampled tokens, scores, finished grammars): the engine core reads
results from it, never from runner attributes. ``StepProfile`` sums where step time goes; ``Traffic`` (one per
runner, shared with its KV layout and prefix store, which add to it) counts what the device is asked to move and to
wait for.
Compute is not counted here, only copies: a step's forward writes its own new KV in place and that is the work
itself. What is counted is every copy of KV that already exists (row moves, prefix copy-ins, cache stores, forks)
and buffer growth, so that tests can check that what a step moves scales with the rows and tokens it moves — not
with slot capacity, cache size or the rows already running (a copy that does costs seconds on a GPU and nothing
visible on a CPU). ``syncs`` counts the points where the host waits for the device (evaluations, reads of results).

``Traffic`` also keeps the device queue's one rule: work is *launched* (``mx.async_eval``) so the host builds the next
pass while the device runs this one, but at most one launch is in flight when more work is enqueued. KV is written in
place only when no pending kernel still holds the buffer (MLX donates a buffer to an update only when nothing else
references it, and a launched kernel's inputs stay referenced until it completes): enqueueing a pass while the last
one still reads its buffers would make every layer's update copy its whole buffer. So every launch and every
evaluation first waits for what is in flight (``settle``: one sync), and the host work between two launches is what
overlaps the device.

Every point where the host hands work to the device or waits for it goes through ``Traffic`` (launch, evaluate,
settle, and ``read`` of a launched draw): ``fault`` is the seam where tests make the device fail as Metal does (a
failed allocation reported at the next synchronisation or op, not where it was asked for); ``settled`` says which
launches a synchronisation has seen complete, so the runner knows which of its writes the device has confirmed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx

from mlxbatch.engine.decoding.sampling import Drawn, SampledToken
from mlxbatch.engine.launcher import Launcher, complete
from mlxbatch.types import TokenLogprob

LAUNCH_THREAD = "launch_thread"  # ``Traffic.waited``'s key for the engine's thread waiting for the launch thread


@dataclass
class Traffic:
    moved_bytes: int = 0  # existing KV copied to another place: row moves, copy-ins (running rows, cached blocks), forks
    row_moved_bytes: int = 0  # of ``moved_bytes``, those of row moves (arranging, promoting, retiring rows)
    stored_bytes: int = 0  # KV copied into the prefix cache
    grown_bytes: int = 0  # buffers copied when they grow or shrink (amortised: capacity doubles)
    resizes: int = 0  # buffer growths and shrinks
    resize_syncs: int = 0  # of ``syncs``, those of growths and shrinks (a sync per slice of ``kv.copies``)
    syncs: int = 0  # host waits for the device: evaluations and reads of results
    launches: int = 0  # evaluations enqueued without waiting for them (``launch``)
    prefix_gathers: int = 0  # cached prefixes gathered in a row's layout (``PrefixStore.gather_prefix``)
    hot_prefix_hits: int = 0  # ... and those taken from the gathered prefixes it keeps instead

    def __post_init__(self) -> None:  # the queue's state (not counters: ``asdict`` leaves it out)
        self._in_flight: str | None = None  # what the launch in flight runs ("prefill", "decode", ...), if any
        # the arrays of the launch in flight that this thread will read (its draw): whichever thread sees that launch
        # complete completes them (``launcher.complete``) before this one may read them (see ``engine.launcher``)
        self._reads: list[Any] = []
        self._settled = 0  # launches known to be complete
        self.waited: dict[str, float] = {}  # seconds the host waited for launches of each kind
        # seconds inside ``mx.async_eval`` by launch kind: MLX ordering the graph and encoding its kernels (on a
        # GPU, the host's part of a pass that is not Python building the graph)
        self.encoded: dict[str, float] = {}
        # called before each device call with what it is ("decode"/"prefill": a launch of that kind, "evaluate",
        # "synchronize", "read") and the arrays it hands over; tests set it to fail the device (None: nothing)
        self.fault: Callable[[str, Sequence[Any]], None] | None = None
        # the launch thread, where the engine has one (``engine.launcher``): launches are handed to it; and the launch
        # it waits for before its own (None: none, or seen complete)
        self.launcher: Launcher | None = None
        self._settling: tuple[int, str] | None = None

    def evaluate(self, *arrays: Any) -> None:
        """``mx.eval`` counted as one sync (after what is in flight: see the module's docstring)."""
        self.settle()
        self.syncs += 1
        if self.fault is not None:
            self.fault("evaluate", arrays)
        mx.eval(*arrays)

    def launch(self, kind: str, *arrays: Any, drawn: Drawn | None = None, beside: bool = False) -> int:
        """Enqueue the evaluation of ``arrays`` and ``drawn``'s (a draw this thread will ``read``) and return at once
        (after what is in flight); returns its number. ``beside``: the caller builds no graph until its next call
        here (a step's last launch), so with a launch thread the wait for what is in flight and the enqueueing
        happen there, beside the caller's work; a launch inside a step is enqueued on this thread (one thread at a
        time builds or evaluates graphs)."""
        reads = drawn.arrays() if drawn is not None else []
        arrays = (*reads, *arrays)
        if self.launcher is not None and beside:
            return self._hand_over(kind, arrays, reads)
        self.settle()
        if self.fault is not None:
            self.fault(kind, arrays)
        t0 = time.perf_counter()
        mx.async_eval(*arrays)
        self.encoded[kind] = self.encoded.get(kind, 0.0) + time.perf_counter() - t0
        self.launches += 1
        self._in_flight, self._reads = kind, reads
        return self.launches

    def _hand_over(self, kind: str, arrays: Sequence[Any], reads: list[Any]) -> int:
        assert self.launcher is not None
        self.join()
        if self._in_flight is not None and self.fault is not None:
            self.fault("synchronize", ())  # (the thread's wait for it: the same seam as ``settle``)
        if self.fault is not None:
            self.fault(kind, arrays)
        settle = None
        if self._in_flight is not None:
            self._settling, settle = (self.launches, self._in_flight), self._reads
        self.launcher.submit(arrays, settle)
        self.launches += 1
        self._in_flight, self._reads = kind, reads
        return self.launches

    def join(self) -> None:
        """Wait until the launch thread has launched what it was handed: its times counted, its failure raised (the
        launch before it counts as complete only if the thread saw it so)."""
        if self.launcher is None or not self.launcher.pending:
            return
        t0 = time.perf_counter()
        res = self.launcher.join()
        self.waited[LAUNCH_THREAD] = self.waited.get(LAUNCH_THREAD, 0.0) + time.perf_counter() - t0
        kind = self._in_flight or "prefill"
        self.encoded[kind] = self.encoded.get(kind, 0.0) + res.encoded_s
        if self._settling is not None:  # nothing waited for it on this thread: the thread's wait counts
            self._settled_by_thread(res.settled, res.waited_s)
        if res.error is not None:
            raise res.error

    def _settled_by_thread(self, ok: bool, waited_s: float) -> None:
        """The thread's wait for the launch before its own is over: one sync; that launch is complete if ``ok``."""
        assert self._settling is not None
        n, kind = self._settling
        self._settling = None
        self.syncs += 1
        self.waited[kind] = self.waited.get(kind, 0.0) + waited_s
        if ok:
            self._settled = max(self._settled, n)

    def drain(self) -> None:
        """With a launch thread: wait until it is idle and its stream has run everything, a failure dropped (after a
        failed step, or when the thread stops: nothing reads what it launched). The launches' books stay as they are:
        nothing more counts as complete."""
        if self.launcher is None:
            return
        if self.launcher.pending:
            self.launcher.join()
        self._settling, self._reads = None, []
        try:
            mx.synchronize(self.launcher.stream)
        except Exception:  # noqa: BLE001 (the failure of a step already given up)
            pass

    def settle(self) -> None:
        """Wait until every launch has completed and released its buffers (one sync, if anything is in flight)."""
        self.join()
        if self._in_flight is None:
            return
        t0 = time.perf_counter()
        if self.fault is not None:
            self.fault("synchronize", ())
        if self.launcher is not None:
            mx.synchronize(self.launcher.stream)
        else:
            mx.synchronize()
        if self.launcher is not None:  # (one thread alone reads what it launched: nothing to guard)
            complete(self._reads)
        self.syncs += 1
        self.waited[self._in_flight] = self.waited.get(self._in_flight, 0.0) + time.perf_counter() - t0
        self._in_flight, self._settled, self._reads = None, self.launches, []

    def wait_for(self, launch: int) -> None:
        """Wait for launch number ``launch`` (nothing to do if a later wait already covered it). The launch the
        thread waits for before its own is waited for with it: the rest of that launch is not."""
        if launch <= self._settled:
            return
        if self.launcher is not None and self._settling is not None and self._settling[0] == launch:
            t0 = time.perf_counter()
            if self.fault is not None:
                self.fault("synchronize", ())
            if self.launcher.wait_settled():
                self._settled_by_thread(True, time.perf_counter() - t0)
                return
        self.settle()  # (the thread's wait failed: its failure is raised here)

    @property
    def settled(self) -> int:
        """The last launch a synchronisation saw complete (a launch after it may still fail)."""
        return self._settled

    def read(self, drawn: Drawn) -> list[SampledToken]:
        """A launched draw's tokens on the host (``Drawn.read``: a sync if it is not evaluated yet)."""
        if self.fault is not None:
            self.fault("read", drawn.arrays())
        return drawn.read()

    @property
    def wait_s(self) -> float:
        return sum(self.waited.values())

    def snapshot(self) -> Traffic:
        return Traffic(**asdict(self))

    def since(self, before: Traffic) -> Traffic:
        """What was added after ``before`` (a snapshot)."""
        return Traffic(**{k: v - getattr(before, k) for k, v in asdict(self).items()})

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class StepProfile:
    """Where step time goes, summed over the engine's life (seconds), and what the steps moved (``traffic``).

    Passes are launched, not waited for, so a phase's time is the host's time building it plus the time the host
    later waited for it (``Traffic.waited``, by the kind of the launch waited for); host work done while the device
    ran a launch is host time (``host_s``), and it is the time overlapped."""

    prefill_build_s: float = 0.0  # building and launching prefill passes (copy-ins and row moves included)
    decode_build_s: float = 0.0  # building the decode pass
    sampling_s: float = 0.0  # building the draw
    total_s: float = 0.0
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    # steps whose decode rows ran in the packed pass (CUDA, ``runner``: one pass a step); building that pass counts
    # in ``prefill_build_s``, its launch (the step's one) in ``decode_build_s``
    one_pass_steps: int = 0
    grammar_mask_s: float = 0.0  # structured outputs: filling the allowed-token masks (host), inside sampling_s
    grammar_advance_s: float = 0.0  # ... advancing the matchers by the sampled tokens (host)
    traffic: Traffic = field(default_factory=Traffic)

    @property
    def prefill_s(self) -> float:
        return self.prefill_build_s + self.traffic.waited.get("prefill", 0.0)

    @property
    def decode_s(self) -> float:
        """Decode passes; in a decode-only step, its draw too (one evaluation for both)."""
        return self.decode_build_s + self.traffic.waited.get("decode", 0.0)

    @property
    def host_s(self) -> float:
        """Scheduling, bookkeeping, detokenization: step time not spent in the model or sampler, nor waiting for the
        launch thread to launch the step before (``waited_launch_thread_s``: where its encoding takes longer)."""
        return max(0.0, self.total_s - self.prefill_s - self.decode_s - self.sampling_s
                   - self.traffic.waited.get(LAUNCH_THREAD, 0.0))

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps, "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
            "sampling_s": round(self.sampling_s, 4), "host_s": round(self.host_s, 4),
            "total_s": round(self.total_s, 4), "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens, "one_pass_steps": self.one_pass_steps,
            "grammar_mask_s": round(self.grammar_mask_s, 5),
            "prefill_build_s": round(self.prefill_build_s, 4), "decode_build_s": round(self.decode_build_s, 4),
            **{f"waited_{k}_s": round(v, 4) for k, v in self.traffic.waited.items()},
            **{f"encoded_{k}_s": round(v, 4) for k, v in self.traffic.encoded.items()},
            "grammar_advance_s": round(self.grammar_advance_s, 5), **self.traffic.as_dict(),
        }


@dataclass(frozen=True)
class ScoredTokens:
    """A scoring sequence's continuation tokens scored in one step, in token order."""

    logprobs: tuple[TokenLogprob, ...]
    greedy: tuple[bool, ...]  # whether each token is the model's greedy choice


@dataclass(frozen=True)
class RunnerOutput:
    sampled: dict[str, SampledToken] = field(default_factory=dict)  # every sequence whose next token became due
    scored: dict[str, ScoredTokens] = field(default_factory=dict)
    grammar_done: frozenset[str] = frozenset()  # constrained sequences whose grammar allows no more tokens


@dataclass(frozen=True)
class Launched:
    """A step the runner has enqueued: its scores (read already) and its draw, still on the device until
    ``ModelRunner.collect`` reads it (the next step can be built and launched first: the draw feeds it)."""

    due: tuple[str, ...]  # sequences whose next token ``drawn`` holds, in its row order
    drawn: Drawn | None
    launch: int  # the launch that evaluates it (``Traffic.launch``)
    scored: dict[str, ScoredTokens] = field(default_factory=dict)

    @property
    def index(self) -> dict[str, int]:
        return {rid: i for i, rid in enumerate(self.due)}


@dataclass(frozen=True)
class RunnerStats:
    profile: dict[str, float]
    kv_bytes: int  # the KV layout's buffers
    prefix_store_bytes: int  # the prefix cache's block tensors
    vision_cache: dict[str, Any] | None  # vision-language models only
