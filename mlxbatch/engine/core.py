"""EngineCore: the step loop (schedule -> execute -> update), written once.

Owns the requests in flight; submissions become sequences (``n`` samples become ``n`` sequences with derived seeds)
after validation in ``engine.intake`` (its ``RequestIntake``), then are queued here. ``step()`` is the only place where
the scheduler, the runner and the requests meet. ``AsyncEngineCore`` drives the same loop from asyncio on one
dedicated thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

from mlxbatch.config import EngineConfig
from mlxbatch.engine.decoding.structured import GrammarCompiler
from mlxbatch.engine.inputs import Prompt
from mlxbatch.engine.intake import RequestGroup, RequestIntake
from mlxbatch.engine.kv import LayoutOptions
from mlxbatch.engine.launcher import Launcher
from mlxbatch.engine.model.loader import LoadedModel
from mlxbatch.engine.model.memory import MemoryLimits, plan_memory
from mlxbatch.engine.model.worker import Worker
from mlxbatch.engine.outputs import Launched
from mlxbatch.engine.paths import overlaps_steps, uses_launch_thread
from mlxbatch.engine.request import Request
from mlxbatch.engine.runner import ModelRunner
from mlxbatch.engine.sched.blocks import BLOCK_SIZE
from mlxbatch.engine.sched.setup import build_scheduler
from mlxbatch.engine.sched.step import SchedulerOutput
from mlxbatch.engine.vision.adapter import MultimodalPrompt
from mlxbatch.engine.warmup import WarmUpReport, exercise
from mlxbatch.errors import EngineClosedError, InvalidRequestError, OutOfMemoryError
from mlxbatch.types import ImageInput, RequestOutput, SamplingParams, StreamDelta

__all__ = ["EngineCore", "Prompt"]  # Prompt: api and async_core import it from here

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 worker: Worker | None = None, *, layout: LayoutOptions | None = None,
                 launch_thread: bool | None = None) -> None:
        config = config or EngineConfig()
        self.loaded = loaded
        self.worker = worker or Worker(loaded)
        config = dataclasses.replace(config, overlap_steps=overlaps_steps(self.worker.backend, config,
                                                                         loaded.vlm is not None))
        dev, geo = self.worker.device, self.worker.geometry
        block_bytes = geo.bytes_per_token * BLOCK_SIZE
        free = self.worker.free_bytes()  # one reading for the KV budget and the step bound beside it
        mem = plan_memory(config, dev.kind, dev.host_memory, lambda f: self.worker.kv_budget_bytes(f, free),
                          block_bytes, loaded.vlm is not None, free)
        self.memory = mem
        self._limits = MemoryLimits(dev.kind)
        self._limits.apply(dev.total_memory, self.worker.weights_bytes + mem.total, mem.step_bytes)
        if launch_thread is None:
            launch_thread = uses_launch_thread(self.worker.backend, config, loaded.vlm is not None)
        # the launch thread (``engine.launcher``): the engine's arrays live on its stream, made and used inside ``_mlx``
        self._launcher = Launcher(self.worker.backend.gpu, self._limits.step_bound) if launch_thread else None
        with self._mlx():
            self.runner = ModelRunner(loaded.model, geo, self.worker.backend, mem.prefix_blocks, BLOCK_SIZE,
                                      vlm=loaded.vlm, vision_cache_bytes=mem.vision_cache_bytes,
                                      batch_invariant=config.batch_invariant, layout=layout)
        self.runner.traffic.launcher = self._launcher
        self._layout = layout  # (given: the warm-up's core takes it too)
        # the scheduler, the batch the config leaves unset (``self.config`` holds the values in effect) and the reuse
        # step, as ``sched.setup`` builds them (the dry run of ``mlxbatch plan`` builds them so too)
        built = build_scheduler(config, dev.sizing_facts, mem.slot_budget, mem.prefix_blocks, geo.bytes_per_token,
                                self.runner.kv_cost, self.runner.layout.packed_prefill, self.runner.invariant_slice,
                                self.runner.kv_cost_rows)
        self.scheduler, self.batch_size, self.config, self.reuse_step = \
            built.scheduler, built.batch_size, built.config, built.reuse_step
        if self.batch_size.chosen:  # a line only where something was chosen (the warm-up core sets both)
            log.info("engine batch: %s", self.batch_size.describe())
        self.intake = RequestIntake(loaded, self.config.seed)  # submissions -> validated sequences
        self._groups: dict[str, RequestGroup] = {}
        self._streamed: set[str] = set()  # the groups in flight that stream their text (most callers stream none)
        self._aborted: set[str] = set()  # groups aborted since the last step
        self._seqs: dict[str, Request] = {}
        self._closed = False
        self._pending: Launched | None = None  # the step launched last, until its tokens are read (``step``)
        if self.config.warm_up:
            self.warm_up()

    def warm_up(self) -> None:
        """The model's first evaluations, and on a GPU every kind of step once (its kernels compile on first use: not
        inside the first real steps). The constructor calls it when ``config.warm_up``; a caller that constructs with
        it off may call it later (a job warms its engine up while its feed prepares the first rows)."""
        self.worker.warm_up()
        if self.worker.backend.gpu:
            self.warm_up_paths()

    def warm_up_paths(self) -> WarmUpReport:
        """Take every kind of step once on a throwaway core of the same model, small budget (engine.warmup)."""
        per_row = 256 * self.worker.geometry.bytes_per_token  # a row's KV at the slot layout's smallest length step
        # room for 8 short rows as the layout charges them (batch-invariant forwards charge their padding rows too:
        # with 16 plain rows' worth every warm-up request ran alone, a warning each), and the prefix cache's 4 rows
        # inside the budget
        budget = max(16 * per_row, self.runner.kv_cost([256] * 8)) + 4 * per_row
        cfg = dataclasses.replace(self.config, warm_up=False, max_num_seqs=8, max_num_batched_tokens=64,
                                  prefill_chunk_size=16, kv_budget_bytes=budget, prefix_cache=True,
                                  prefix_cache_bytes=4 * per_row)
        core = EngineCore(self.loaded, cfg, self.worker, layout=self._layout,
                          launch_thread=self._launcher is not None)
        try:
            return exercise(core)
        finally:
            core.close_launch_thread()

    def _mlx(self) -> contextlib.AbstractContextManager[Any]:
        """Where the engine's arrays are made and evaluated: the launch thread's stream, if it has one."""
        return self._launcher.on_stream() if self._launcher is not None else contextlib.nullcontext()

    def close_launch_thread(self) -> None:
        """Stop the launch thread (what it launched completes first); steps after this launch on this thread."""
        if self._launcher is not None:
            self.runner.traffic.drain()
            self.runner.traffic.launcher = None
            self._launcher.close()
            self._launcher = None

    # -- submission ----------------------------------------------------------------------------
    @property
    def compiler(self) -> GrammarCompiler:
        """Compiles output constraints for this model's tokenizer (built on first use, then cached)."""
        return self.intake.compiler

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: text, token ids, or chat messages (rendered with the chat template)."""
        return self.intake.encode(prompt)

    def encode_images(self, prompt: Prompt, images: Sequence[ImageInput]) -> MultimodalPrompt:
        """Token ids and image inputs of a prompt with images; a text-only model refuses them (InvalidRequestError)."""
        return self.intake.encode_images(prompt, images)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, stream: bool = False, cache_tokens: int | None = None,
                    images: Sequence[ImageInput] = (), block_hashes: Sequence[int] | None = None) -> str:
        """Validate and queue one request (``RequestIntake.request``: ``cache_tokens`` is the plan's retention,
        ``images`` go with a text or chat prompt, ``block_hashes`` are the prompt's ``prompt_block_hashes`` computed
        off the step loop); raises InvalidRequestError (the engine goes on) if it cannot run."""
        if self._closed:
            raise EngineClosedError("the engine has shut down")
        return self._queue(self.intake.request(prompt, params, request_id, stream, cache_tokens, images,
                                               self._groups, block_hashes))

    def prepare_request(self, token_ids: Sequence[int], params: SamplingParams, request_id: str,
                        cache_tokens: int | None = None, block_hashes: Sequence[int] | None = None) -> RequestGroup:
        """``add_request``'s validation of a token-id prompt without queueing it (``queue_request`` does): made on a
        thread beside the step loop's, it reads only the intake (no images: their encoding evaluates; no output
        constraint: its compiler is the loop's). Raises InvalidRequestError as ``add_request`` does; an id in flight is
        refused when queued."""
        if params.constraint is not None:
            raise ValueError("a request with an output constraint is prepared by add_request, on the step loop")
        return self.intake.request(token_ids, params, request_id, False, cache_tokens, (), (), block_hashes)

    def queue_request(self, group: RequestGroup) -> str:
        """Queue a request ``prepare_request`` made (the step loop's thread); InvalidRequestError when its id is in
        flight."""
        if self._closed:
            raise EngineClosedError("the engine has shut down")
        if group.request_id in self._groups:
            raise InvalidRequestError("request_id", group.request_id, "already in flight")
        return self._queue(group)

    def add_score_request(self, context: Prompt, continuations: Sequence[str | Sequence[int]],
                          request_id: str | None = None, cache_tokens: int | None = None) -> str:
        """Queue the scoring of each continuation after ``context`` (``RequestIntake.score_request``)."""
        if self._closed:
            raise EngineClosedError("the engine has shut down")
        return self._queue(self.intake.score_request(context, continuations, request_id, cache_tokens, self._groups))

    def _queue(self, group: RequestGroup) -> str:
        """A validated request's sequences in flight: books, constraints (a matcher each), the scheduler's queue."""
        self._groups[group.request_id] = group
        if group.stream:
            self._streamed.add(group.request_id)
        for s in group.sequences:
            self._seqs[s.request_id] = s
            if s.params.constraint is not None:
                self.runner.set_constraint(s.request_id, self.compiler.matcher(s.params.constraint))
            self.scheduler.add(s)
        return group.request_id

    def abort(self, request_id: str) -> None:
        group = self._groups.get(request_id)
        if group is None:
            return
        gone = self.scheduler.abort([s.request_id for s in group.sequences])
        self.runner.free([s.request_id for s in gone])
        for s in group.sequences:  # one whose last token is still being drawn has left the scheduler already
            if not s.status.finished:
                s.abort()
        self._aborted.add(request_id)  # its final delta goes out with the next step's

    @property
    def has_unfinished(self) -> bool:
        return bool(self._groups)

    # -- the step loop -------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        with self._mlx():
            return self._step()

    def _step(self) -> list[StreamDelta]:
        """One engine step; returns text deltas (streamed requests) and one final delta per finished request.

        Steps overlap (``EngineConfig.overlap_steps``): a step is launched on the device, then the host reads the step
        before it (its tokens were drawn while this one was built), schedules the next, and so on; the results of a
        step come out with the next one. A sequence that drew its last token is not fed again (``length_done``); one
        that stops on a token (EOS, stop strings) is fed once more, and that token is dropped. A step whose rows need
        their latest tokens on the host (penalties, ``min_tokens``, structured outputs, images) reads the step before
        it first.

        A step's tokens (and scores) are taken only once the reads that wait for its evaluation succeeded: Metal
        reports a failed allocation at the next synchronisation or op, so an ``OutOfMemoryError`` raised anywhere
        here may come from any step not read yet (``_recover``)."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        touched: list[Request] = []  # sequences given tokens this step (read: they stand whatever fails later)
        if out.empty:
            if self._pending is not None:
                try:
                    touched += self._read(self._pending)
                except OutOfMemoryError as exc:
                    return self._recover(out, touched, exc)
                self.runner.free([r.request_id for r in self.scheduler.reap()])
            return self._collect(touched)
        now = time.perf_counter()
        for req in [c.request for c in out.prefills] + [child for _, child in out.forks]:
            if req.first_scheduled is None:
                req.first_scheduled = now
        overlap = self.config.overlap_steps and self.runner.overlappable and not self._needs_history(out)
        try:
            if self._pending is not None and not overlap:
                touched += self._read(self._pending)
            # (the launch thread bounds its launches itself: only one bound at a time sets MLX's limit)
            with self._limits.step_bound() if self._launcher is None else contextlib.nullcontext():
                launched = self.runner.launch(out)
            if self._pending is not None:
                touched += self._read(self._pending)
            if not overlap:
                touched += self._read(launched)
        except OutOfMemoryError as exc:
            return self._recover(out, touched, exc)
        for rid, scored in launched.scored.items():
            self._seqs[rid].add_scores(list(scored.logprobs), list(scored.greedy))
        for chunk in out.prefills:
            if chunk.last and chunk.request.score_from is not None:
                chunk.request.finish_scored()
                touched.append(chunk.request)
        if overlap:
            self._pending = launched
            for rid in launched.due:
                self._seqs[rid].pending = 1
        self.runner.free([r.request_id for r in self.scheduler.finish_step(out)])
        self.runner.end_step(time.perf_counter() - t0)
        return self._collect(touched)

    def _recover(self, failed: SchedulerOutput, touched: list[Request], exc: OutOfMemoryError) -> list[StreamDelta]:
        """An allocation failed in ``failed`` or in the step launched before it and not read yet: neither step's
        tokens are taken (their evaluation may be what failed), the batch shrinks, and every running row recomputes
        its KV from its tokens (prompt and outputs read so far), rows done but for a discarded last token included.
        The runner starts its KV layout afresh and drops the prefix cache's blocks if a failed step may have written
        them (``ModelRunner.recover``); the failed step's planned stores never happened."""
        log.warning("step failed for lack of memory (%s); shrinking the batch", exc)
        self.runner.traffic.drain()  # the launch thread's work ends (and fails) before the rows go
        unread: list[Request] = []
        if self._pending is not None:
            for rid in self._pending.due:
                req = self._seqs.get(rid)
                if req is not None:
                    req.pending = 0
                    unread.append(req)
            self._pending = None
        self.scheduler.reap()  # rows finished by the tokens read before the failure leave first: they stay finished
        self.scheduler.preempt_for_memory(failed, unread)
        if self.runner.recover() and self.scheduler.prefix is not None:
            self.scheduler.prefix.drop_cached()
        self.worker.shutdown()  # frees MLX's buffer cache
        return self._collect(touched)

    def _needs_history(self, out: SchedulerOutput) -> bool:
        """Whether a row drawn in this step reads its own earlier tokens on the host (``Request.needs_history``)."""
        return any(r.needs_history for r in out.decodes) or \
            any(c.last and c.request.needs_history for c in out.prefills) or any(c.needs_history for _, c in out.forks)

    def _read(self, launched: Launched) -> list[Request]:
        """Append a launched step's drawn tokens to their sequences (a sequence that finished since, e.g. on a stop
        token drawn the step before, or was aborted, drops its token). The step in flight is read: it is no longer
        ``_pending``; nothing is appended if the read fails."""
        result = self.runner.collect(launched)
        if launched is self._pending:
            self._pending = None
        touched = []
        for rid, tok in result.sampled.items():
            req = self._seqs.get(rid)
            if req is None or req.status.finished:
                continue
            req.pending = 0
            req.append(tok.token_id, tok.logprob, force_stop=rid in result.grammar_done)
            touched.append(req)
        return touched

    def _collect(self, touched: list[Request]) -> list[StreamDelta]:
        deltas: list[StreamDelta] = []
        for req in touched if self._streamed else ():
            group = self._groups[req.group_id]
            if group.stream:
                text = req.text.delta(final=req.status.finished)
                if text or req.status.finished:
                    deltas.append(StreamDelta(group.request_id, req.index, text, (req.output_token_ids[-1],),
                                              req.finish_reason))
        # only groups with a sequence finished this step (or aborted) can have finished: not a scan of every group,
        # nor of every group a step touched (each decoding row's, most of them still running)
        candidates = dict.fromkeys([req.group_id for req in touched if req.status.finished] + sorted(self._aborted))
        self._aborted.clear()
        for gid in [g for g in candidates if g in self._groups and self._groups[g].finished]:
            group = self._groups.pop(gid)
            self._streamed.discard(gid)
            for s in group.sequences:
                self._seqs.pop(s.request_id, None)
                self.runner.set_constraint(s.request_id, None)
            deltas.append(StreamDelta(gid, -1, "", (), group.sequences[0].finish_reason, group.output()))
        return deltas

    def run_until_done(self) -> list[RequestOutput]:
        outputs = []
        while self.has_unfinished:
            outputs += [d.output for d in self.step() if d.output is not None]
        return outputs

    def shutdown(self) -> None:
        for gid in list(self._groups):
            self.abort(gid)
        self._pending = None
        self._groups.clear()
        self._streamed.clear()
        self._closed = True
        self.close_launch_thread()
        self.worker.shutdown()
        self._limits.restore()

    def stats(self) -> dict[str, Any]:
        rs = self.runner.stats()
        prefix = None
        if self.scheduler.prefix is not None:
            prefix = {**self.scheduler.prefix.stats(), "bytes_allocated": rs.prefix_store_bytes}
        return {"profile": rs.profile, "batch": self.batch_size.as_dict(),
                "kv_budget_bytes": self.scheduler.kv_budget_bytes, "kv_bytes": rs.kv_bytes,
                "preemptions": self.scheduler.num_preemptions, "prefix_cache": prefix,
                "vision_cache": rs.vision_cache, "device": self.worker.device.kind,
                # MLX's peak memory in this process: weights, KV and the largest step's transient
                "peak_memory_bytes": self.worker.peak_memory()}
