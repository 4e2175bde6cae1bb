"""The end of a runner step: the draw of the due rows' next tokens and the commit of the step's books.

``StepCommit`` (the runner holds one) draws every due row's next token at once (forked samples from their parent's
logits), commits the step's books once every pass is built (KV positions, finished prompts' blocks to the prefix
store, forks' copies of their parent's KV) and launches what is left of the step. It owns the last launched step until
its tokens are read (the next decode pass is fed its draw on the device: ``decode_tokens``) and the row moves the step
leaves: rows whose prefill ended join the decode rows, and freed rows leave, when the next step starts
(``settle_rows``: a row move waits for the device).
"""

from __future__ import annotations

import time

import mlx.core as mx

from mlxbatch.engine.decoding.sampling import SampleRow, draw, draw_greedy
from mlxbatch.engine.decoding.structured import SequenceGrammars
from mlxbatch.engine.kv import KVLayout, reuse
from mlxbatch.engine.kv.prefix_store import PrefixStore
from mlxbatch.engine.outputs import Launched, ScoredTokens, StepProfile
from mlxbatch.engine.request import Request
from mlxbatch.engine.sched.step import SchedulerOutput


class StepCommit:
    """A runner's draw and commit, on its KV layout, prefix store and matchers, counted in its step profile."""

    def __init__(self, batch: KVLayout, store: PrefixStore | None, grammars: SequenceGrammars,
                 profile: StepProfile) -> None:
        self.batch = batch
        self._store = store
        self._grammars = grammars
        self.profile = profile
        self.traffic = profile.traffic
        self.last: Launched | None = None  # the last launched step, until its tokens are read (``collected``)
        self._promote: list[str] = []  # rows whose prefill ended in the last step: they join the decode rows next
        self._free: list[str] = []  # rows to drop when the next step starts
        # the launch that evaluates the prefix store's last writes (None: written, not launched yet); until a
        # synchronisation sees it complete (``Traffic.settled``) a failure may have left the store undefined
        self._store_launch = 0

    def draw_commit(self, out: SchedulerOutput, due: list[Request], logits: list[mx.array],
                     scored: dict[str, ScoredTokens]) -> Launched:
        """Draw every due row's next token (forked samples from their parent's logits), commit the step's books, and
        launch what is left of the step."""
        prof = self.profile
        drawn = None
        if due:
            all_logits = mx.concatenate(logits, axis=0) if len(logits) > 1 else logits[0]
            if out.forks:  # each forked sample draws its first token from its parent's last logits
                pos = {r.request_id: i for i, r in enumerate(due)}
                all_logits = mx.concatenate([all_logits,
                                             all_logits[mx.array([pos[p.request_id] for p, _ in out.forks])]])
                due += [child for _, child in out.forks]
            t0 = time.perf_counter()
            if not len(self._grammars) and all(r.plain_greedy for r in due):  # nothing per row to build
                drawn = draw_greedy(all_logits)
            else:  # ``pending``: a token the step in flight drew counts among the row's tokens
                rows_s = [SampleRow(r.params, r.seed, len(r.output_token_ids) + r.pending, r.prompt_token_ids,
                                    r.output_token_ids, r.banned_ids) for r in due]
                t1 = time.perf_counter()
                constrained = self._grammars.constrain([r.request_id for r in due], all_logits)
                prof.grammar_mask_s += time.perf_counter() - t1
                drawn = draw(constrained, rows_s, all_logits if constrained is not all_logits else None)
            prof.sampling_s += time.perf_counter() - t0
        pending = self._commit(out)  # the prefix store's writes read this step's KV: evaluated with it
        t0, w0 = time.perf_counter(), self.traffic.wait_s
        if drawn is not None:
            n = self.traffic.launch("decode" if out.decodes else "prefill", *pending, drawn=drawn, beside=True)
        elif pending or out.decodes:
            n = self.traffic.launch("prefill", *pending, *self.batch.kv_arrays(), beside=True)
        else:
            n = self.traffic.launches
        build = time.perf_counter() - t0 - (self.traffic.wait_s - w0)
        if out.decodes:
            prof.decode_build_s += build
        else:
            prof.prefill_build_s += build
        if pending:
            self._store_launch = n
        step = Launched(tuple(r.request_id for r in due), drawn, n, scored)
        self.last = step if drawn is not None else None
        return step

    def collected(self, step: Launched) -> None:
        """``step``'s tokens were read: the next decode pass is fed from the host, not from its draw."""
        if step is self.last:
            self.last = None

    def decode_tokens(self, rows: list[Request]) -> list[list[int]] | mx.array:
        """The decode pass's inputs: each row's last token, from the last step's draw while it is still on the device
        (every decoding row was due in the step before), else from the host."""
        last = self.last
        if last is None or last.drawn is None:
            return [[r.last_token] for r in rows]
        pos = last.index
        assert all(r.request_id in pos for r in rows), "a decoding row was not drawn in the step before"
        at = [pos[r.request_id] for r in rows]
        if at == list(range(len(at))):  # the last draw's first rows, in order (most steps): a view, no gather
            return last.drawn.chosen[: len(at), None]
        return last.drawn.chosen[mx.array(at, dtype=mx.int32)][:, None]

    def _commit(self, out: SchedulerOutput) -> list[mx.array]:
        """The step's books: its KV positions count, finished prompts' blocks go to the prefix store (lazily: returns
        the store's buffers to evaluate with the step), forked samples get their parent's KV, and finished prefills
        join the decode rows when the next step starts (a row move waits for the device: not while this one runs).
        Called once every pass of the step is built; the pass reads lengths as they were."""
        if out.decodes:  # (the decode rows are the layout's first rows: every one runs every step)
            assert len(out.decodes) == self.batch.n_decode
            self.batch.advance_decodes()
        for c in out.prefills:
            self.batch.advance(c.request.request_id, c.end - c.start)
        pending: list[mx.array] = []
        if out.stores:
            assert self._store is not None
            self._store_launch = None
            pending = reuse.store_blocks(self.batch, self._store, out.stores)  # before any row moves again
        for parent, child in out.forks:  # n > 1: the prompt was prefilled once, each sample gets a copy
            self.batch.add(child.request_id, self.batch.extract(parent.request_id), parent.num_prompt_tokens)
        # in row order: a finished prefill row already at the head of the prefill region joins without moving
        done = {c.request.request_id for c in out.prefills if c.last} | {c.request_id for _, c in out.forks}
        self._promote = [rid for rid in self.batch.ids[self.batch.n_decode :] if rid in done]
        return pending

    @property
    def store_confirmed(self) -> bool:
        """Whether the device has completed the prefix store's every write (a synchronisation saw its launch end)."""
        return self._store_launch is not None and self._store_launch <= self.traffic.settled

    def reset(self) -> None:
        """A launched evaluation failed: nothing launched is read or fed again, and no row move is left to make (every
        row goes: the layout starts again; the prefix store's writes were confirmed or it starts empty)."""
        self.last = None
        self._promote, self._free = [], []
        self._store_launch = 0

    def free(self, request_ids: list[str]) -> None:
        """Drop these rows when the next step starts (the step in flight may still read them), or now when nothing
        is in flight."""
        self._free += request_ids
        if self.last is None:
            self.settle_rows()

    def settle_rows(self) -> None:
        """Row moves left by the last step (promotions, then frees), before this step touches the rows."""
        if self._promote:
            leaving = set(self._free)  # (a row done as its prefill ended is not promoted first)
            self.batch.promote_many([rid for rid in self._promote if rid not in leaving])
            self._promote = []
        if self._free:
            gone, self._free = self._free, []
            self.batch.remove_many(gone)
            self.batch.shrink_if_settled()
