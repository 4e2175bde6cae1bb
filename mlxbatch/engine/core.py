"""EngineCore: the step loop (schedule -> execute -> update), written once.

Owns the requests in flight and turns submissions into sequences (``n`` samples become ``n`` sequences
with derived seeds) after validating them. ``step()`` is the only place where the scheduler, the runner
and the requests meet. ``AsyncEngineCore`` drives the same loop from asyncio on one dedicated thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mlxbatch.config import EngineConfig
from mlxbatch.engine.decoding.detok import TextTracker
from mlxbatch.engine.decoding.sampling import derive_seed, uniform_for
from mlxbatch.engine.decoding.structured import GrammarCompiler, short_value
from mlxbatch.engine.inputs import Prompt, encode_prompt
from mlxbatch.engine.model.loader import LoadedModel
from mlxbatch.engine.model.memory import MemoryLimits, plan_memory
from mlxbatch.engine.model.worker import Worker
from mlxbatch.engine.outputs import Launched
from mlxbatch.engine.request import Request
from mlxbatch.engine.runner import ModelRunner
from mlxbatch.engine.sched.blocks import BLOCK_SIZE, stable_hash
from mlxbatch.engine.sched.prefix import PrefixIndex
from mlxbatch.engine.sched.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from mlxbatch.engine.vision.adapter import MultimodalPrompt
from mlxbatch.engine.warmup import WarmUpReport, exercise
from mlxbatch.errors import EngineClosedError, InvalidRequestError, OutOfMemoryError
from mlxbatch.types import ImageInput, RequestOutput, RequestTimings, SamplingParams, StreamDelta

log = logging.getLogger(__name__)

_SCORE_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)  # scoring generates nothing; greedy, no seed


@dataclass
class _Group:
    """A submitted request: its ``n`` sequences and what the caller asked to see."""

    request_id: str
    sequences: list[Request]
    stream: bool
    arrival: float = field(default_factory=time.perf_counter)

    @property
    def finished(self) -> bool:
        return all(s.status.finished for s in self.sequences)

    def output(self) -> RequestOutput:
        first = self.sequences[0]
        sched = [s.first_scheduled for s in self.sequences if s.first_scheduled is not None]
        toks = [s.first_token for s in self.sequences if s.first_token is not None]
        ends = [s.finished_at for s in self.sequences if s.finished_at is not None]
        timings = RequestTimings(self.arrival, min(sched, default=None), min(toks, default=None),
                                 max(ends) if self.finished and ends else None)
        # a score request's prompt is its context (each candidate sequence runs context + candidate)
        prompt = first.score_from if first.score_from is not None else first.num_prompt_tokens
        return RequestOutput(self.request_id, prompt, tuple(c for s in self.sequences for c in s.completions()),
                             timings, self.finished, cached_tokens=first.num_cached_tokens)


class EngineCore:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 worker: Worker | None = None) -> None:
        self.config = config or EngineConfig()
        self.loaded = loaded
        self.worker = worker or Worker(loaded)
        dev, geo = self.worker.device, self.worker.geometry
        block_bytes = geo.bytes_per_token * BLOCK_SIZE
        mem = plan_memory(self.config, dev.kind, dev.host_memory, self.worker.kv_budget_bytes, block_bytes,
                          loaded.vlm is not None)
        self.memory = mem
        self._limits = MemoryLimits(dev.kind)
        self._limits.apply(dev.total_memory, self.worker.weights_bytes + mem.total, mem.step_bytes)
        self.runner = ModelRunner(loaded.model, geo, mem.prefix_blocks, BLOCK_SIZE, vlm=loaded.vlm,
                                  vision_cache_bytes=mem.vision_cache_bytes,
                                  batch_invariant=self.config.batch_invariant)
        self.scheduler = Scheduler(
            SchedulerConfig(self.config.max_num_seqs, mem.step_tokens, self.config.prefill_chunk_size,
                            mem.slot_budget, self.runner.invariant_slice),
            self.runner.kv_cost,
            PrefixIndex(mem.prefix_blocks, BLOCK_SIZE, block_bytes) if mem.prefix_blocks else None)
        self._groups: dict[str, _Group] = {}
        self._aborted: set[str] = set()  # groups aborted since the last step
        self._seqs: dict[str, Request] = {}
        self._ids = itertools.count()
        self._closed = False
        tok = loaded.tokenizer
        self._eos = frozenset(int(t) for t in (tok.eos_token_ids or ()))
        self._vocab_size = len(tok._tokenizer)
        self._hidden_ids = frozenset(int(t) for t in (getattr(tok, "all_special_ids", None) or ()))
        self._compiler: GrammarCompiler | None = None
        self._pending: Launched | None = None  # the step launched last, until its tokens are read (``step``)
        if self.config.warm_up:
            self.worker.warm_up()
            if self.worker.device.kind != "cpu":  # GPU kernels compile on first use: not inside the first real steps
                self.warm_up_paths()

    def warm_up_paths(self) -> WarmUpReport:
        """Take every kind of step once on a throwaway core of the same model, small budget (engine.warmup)."""
        per_row = 256 * self.worker.geometry.bytes_per_token  # a row's KV at the slot layout's smallest length step
        # room for 8 short rows as the layout charges them (batch-invariant forwards charge their padding rows too:
        # with 16 plain rows' worth every warm-up request ran alone, a warning each)
        budget = max(16 * per_row, self.runner.kv_cost([256] * 8))
        cfg = dataclasses.replace(self.config, warm_up=False, max_num_seqs=8, max_num_batched_tokens=64,
                                  prefill_chunk_size=16, kv_budget_bytes=budget, prefix_cache=True,
                                  prefix_cache_bytes=4 * per_row)
        return exercise(EngineCore(self.loaded, cfg, self.worker))

    @property
    def compiler(self) -> GrammarCompiler:
        """Compiles output constraints for this model's tokenizer (built on first use, then cached)."""
        if self._compiler is None:
            width = self.loaded.config.get("vocab_size") or self._vocab_size
            try:
                self._compiler = GrammarCompiler(self.loaded.tokenizer, width, self._eos)
            except (ValueError, TypeError) as exc:  # e.g. a slow (non-Rust) tokenizer
                msg = f"this model's tokenizer does not support constrained decoding: {exc}"
                raise InvalidRequestError("constraint", "<any>", msg) from exc
        return self._compiler

    # -- submission ----------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: text, token ids, or chat messages (rendered with the chat template)."""
        return encode_prompt(self.loaded.tokenizer, prompt)

    def encode_images(self, prompt: Prompt, images: Sequence[ImageInput]) -> MultimodalPrompt:
        """Token ids and image inputs of a prompt with images; a text-only model refuses them (InvalidRequestError)."""
        if self.loaded.vlm is None:
            raise InvalidRequestError("images", ", ".join(im.source or "<image>" for im in images),
                                      f"model {self.loaded.spec.model!r} is text-only and cannot take images")
        if isinstance(prompt, MultimodalPrompt) or (not isinstance(prompt, str) and
                                                    not all(isinstance(m, dict) for m in prompt)):
            raise InvalidRequestError("prompt", type(prompt).__name__, "with images, give text or chat messages")
        return self.loaded.vlm.encode(prompt, images)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, stream: bool = False, cache_tokens: int | None = None,
                    images: Sequence[ImageInput] = ()) -> str:
        """Validate and queue one request; raises InvalidRequestError (the engine goes on) if it cannot run.

        ``cache_tokens`` is the plan's retention for this prompt: how many of its leading tokens later requests
        share (their KV is kept in the prefix cache, longer cached prefixes of it are dropped once it is
        admitted). None (no plan) caches every full block and evicts least recently used first.
        ``images`` go with a text or chat prompt (vision-language models); ``prompt`` may also be a
        ``MultimodalPrompt`` that ``encode_images`` made.
        """
        if self._closed:
            raise EngineClosedError("the engine has shut down")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params", type(params).__name__, "expected SamplingParams")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._groups:
            raise InvalidRequestError("request_id", request_id, "already in flight")
        mm = None
        if images:
            prompt = self.encode_images(prompt, images)
        if isinstance(prompt, MultimodalPrompt):
            ids, mm = prompt.token_ids, prompt.mm
        else:
            ids = self.encode(prompt)
        ctx = self.loaded.context_length
        self._check_ids(ids, "prompt", prompt)
        if params.constraint is not None and (reason := self.compiler.check(params.constraint)) is not None:
            raise InvalidRequestError("constraint", short_value(params.constraint), reason)
        seed = params.seed
        if seed is None:
            seed = (int(uniform_for(self.config.seed, stable_hash(request_id) & 0xFFFFFFFF) * (1 << 53))
                    if self.config.seed is not None else secrets.randbits(63))
        incremental = stream or bool(params.stop)
        # sample 0 prefills the prompt; samples 1..n-1 fork its KV when that prefill ends (prefill once)
        seqs = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}", group_id=request_id, index=i,
                prompt_token_ids=ids, params=params, seed=derive_seed(seed, i), eos_token_ids=self._eos,
                max_context=ctx, cache_tokens=cache_tokens, mm=mm,
                # samples 1..n-1 fork sample 0's KV (text rows; an image row's samples prefill on their own)
                fork_parent=f"{request_id}#0" if i and mm is None else None,
                text=TextTracker(self.loaded.tokenizer, params.stop, params.include_stop_str_in_output,
                                 incremental, self._hidden_ids, self._vocab_size),
            )
            for i in range(params.n)
        ]
        self._groups[request_id] = _Group(request_id, seqs, stream)
        for s in seqs:
            self._seqs[s.request_id] = s
            if params.constraint is not None:
                self.runner.set_constraint(s.request_id, self.compiler.matcher(params.constraint))
            self.scheduler.add(s)
        return request_id

    def _check_ids(self, ids: list[int], what: str, shown: Any, room: int = 1) -> None:
        ctx = self.loaded.context_length
        if not ids:
            raise InvalidRequestError(what, shown if isinstance(shown, str) else "[]", "is empty")
        if len(ids) > ctx - room:
            raise InvalidRequestError(what, f"<{len(ids)} tokens>", f"is longer than the model's context ({ctx} "
                                      f"tokens{', room for one more' if room else ''})")
        vocab = self.loaded.config.get("vocab_size") or self._vocab_size
        if max(ids) >= vocab or min(ids) < 0:
            raise InvalidRequestError(what, f"token id {max(ids)}", f"outside the vocabulary (size {vocab})")

    def add_score_request(self, context: Prompt, continuations: Sequence[str | Sequence[int]],
                          request_id: str | None = None, cache_tokens: int | None = None) -> str:
        """Queue the scoring of each continuation after ``context``: log-probability per token, their sum and
        whether each token is the greedy choice (the output's completions, in order; nothing is generated).

        Context and continuations are tokenized separately (a continuation's leading space stays its own), so
        every candidate is scored on the same context tokens. When every candidate is one token, they are one
        sequence: the context's last position scores each (the context computed once, no candidate token run).
        Otherwise each candidate is a sequence of its own; they share the context's KV through the prefix cache:
        the first computes it, the others wait for its blocks and reuse them. ``cache_tokens``: the
        plan's retention of the context (what the next row's context shares with it), as for ``add_request``.
        """
        if self._closed:
            raise EngineClosedError("the engine has shut down")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._groups:
            raise InvalidRequestError("request_id", request_id, "already in flight")
        ctx_ids = self.encode(context)
        self._check_ids(ctx_ids, "context", context, room=0)
        if isinstance(continuations, str) or not continuations:
            raise InvalidRequestError("candidates", continuations if isinstance(continuations, str) else "[]",
                                      "expected a non-empty list of continuations")
        tok = self.loaded.tokenizer
        cands = []
        for i, cont in enumerate(continuations):
            ids = list(tok.encode(cont, add_special_tokens=False)) if isinstance(cont, str) else [int(t) for t in cont]
            if not ids:
                raise InvalidRequestError(f"candidates[{i}]", cont, "is empty")
            self._check_ids(ctx_ids + ids, f"context + candidates[{i}]", cont, room=0)
            cands.append(ids)

        def sequence(i: int, ids: list[int], score_tokens: tuple[int, ...] = ()) -> Request:
            return Request(
                request_id=f"{request_id}#{i}", group_id=request_id, index=i, prompt_token_ids=ctx_ids + ids,
                params=_SCORE_PARAMS, seed=0, eos_token_ids=self._eos, max_context=self.loaded.context_length,
                text=TextTracker(tok, (), False, False, self._hidden_ids, self._vocab_size),
                score_from=len(ctx_ids), score_tokens=score_tokens, cache_tokens=cache_tokens)

        if all(len(ids) == 1 for ids in cands):  # one sequence: the context's last logits score every candidate
            seqs = [sequence(0, [], tuple(ids[0] for ids in cands))]
        else:
            seqs = [sequence(i, ids) for i, ids in enumerate(cands)]
        self._groups[request_id] = _Group(request_id, seqs, False)
        for s in seqs:
            self._seqs[s.request_id] = s
            self.scheduler.add(s)
        return request_id

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
        """One engine step; returns text deltas (streamed requests) and one final delta per finished request.

        Steps overlap (``EngineConfig.overlap_steps``): a step is launched on the device, then the host reads the step
        before it (its tokens were drawn while this one was built), schedules the next, and so on; the results of a
        step come out with the next one. A sequence that drew its last token is not fed again (``length_done``); one
        that stops on a token (EOS, stop strings) is fed once more, and that token is dropped. A step whose rows need
        their latest tokens on the host (penalties, ``min_tokens``, structured outputs, images) reads the step before
        it first."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        touched: list[Request] = []
        if out.empty:
            if self._pending is not None:
                touched = self._read(self._pending)
                self._pending = None
                self.runner.free([r.request_id for r in self.scheduler.reap()])
            return self._collect(touched)
        now = time.perf_counter()
        for req in [c.request for c in out.prefills] + [child for _, child in out.forks]:
            if req.first_scheduled is None:
                req.first_scheduled = now
        overlap = self.config.overlap_steps and self.runner.overlappable and not self._needs_history(out)
        if self._pending is not None and not overlap:
            touched += self._read(self._pending)
            self._pending = None
        try:
            with self._limits.step_bound():
                launched = self.runner.launch(out)
        except OutOfMemoryError as exc:
            log.warning("step failed for lack of memory (%s); shrinking the batch", exc)
            if self._pending is not None:  # drawn before the failed step: its tokens stand
                touched += self._read(self._pending)
                self._pending = None
            self.runner.free([r.request_id for r in self.scheduler.preempt_for_memory(out)])
            self.worker.shutdown()  # frees MLX's buffer cache
            return self._collect(touched)
        for rid, scored in launched.scored.items():
            self._seqs[rid].add_scores(list(scored.logprobs), list(scored.greedy))
        for chunk in out.prefills:
            if chunk.last and chunk.request.score_from is not None:
                chunk.request.finish_scored()
                touched.append(chunk.request)
        if overlap:
            if self._pending is not None:
                touched += self._read(self._pending)
            self._pending = launched
            for rid in launched.due:
                self._seqs[rid].pending = 1
        else:
            touched += self._read(launched)
        self.runner.free([r.request_id for r in self.scheduler.finish_step(out)])
        self.runner.end_step(time.perf_counter() - t0)
        return self._collect(touched)

    def _needs_history(self, out: SchedulerOutput) -> bool:
        """Whether a row drawn in this step reads its own earlier tokens on the host (``Request.needs_history``)."""
        return any(r.needs_history for r in out.decodes) or \
            any(c.last and c.request.needs_history for c in out.prefills) or any(c.needs_history for _, c in out.forks)

    def _read(self, launched: Launched) -> list[Request]:
        """Append a launched step's drawn tokens to their sequences (a sequence that finished since, e.g. on a stop
        token drawn the step before, or was aborted, drops its token)."""
        result = self.runner.collect(launched)
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
        for req in touched:
            group = self._groups[req.group_id]
            if group.stream:
                text = req.text.delta(final=req.status.finished)
                if text or req.status.finished:
                    deltas.append(StreamDelta(group.request_id, req.index, text, (req.output_token_ids[-1],),
                                              req.finish_reason))
        # only groups with a sequence touched this step (or aborted) can have finished: not a scan of every group
        candidates = dict.fromkeys([req.group_id for req in touched] + sorted(self._aborted))
        self._aborted.clear()
        for gid in [g for g in candidates if g in self._groups and self._groups[g].finished]:
            group = self._groups.pop(gid)
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
        self._closed = True
        self.worker.shutdown()
        self._limits.restore()

    def stats(self) -> dict[str, Any]:
        rs = self.runner.stats()
        prefix = None
        if self.scheduler.prefix is not None:
            prefix = {**self.scheduler.prefix.stats(), "bytes_allocated": rs.prefix_store_bytes}
        return {"profile": rs.profile, "kv_budget_bytes": self.scheduler.kv_budget_bytes, "kv_bytes": rs.kv_bytes,
                "preemptions": self.scheduler.num_preemptions, "prefix_cache": prefix,
                "vision_cache": rs.vision_cache, "device": self.worker.device.kind}
