"""``mlxbatch plan``: a dry run that prepares, tokenizes and plans a job's rows exactly as ``run`` will.

Owns the plan report and the prediction of the run's prefill tokens (what report.json counts as
``prefix_reuse.prefill_tokens_computed``):
- rows are cut into the job's windows (``plan.window``, after a ramp of smaller ones: ``window_sizes``) by input
  position, as the run's feed cuts them, and a window's text rows are planned along their token trie: each
  window's floor is its trie's node count, summed in ``distinct_tokens`` (the whole job's floor when it is one
  window; across windows the prefix cache carries shared prefixes, so a windowed run can compute less);
- the prefill is predicted by running the engine's own scheduling on the rows' tokens without a model
  (``engine.DryRun``: the real scheduler and prefix index, built from the job's engine config and this device's
  memory as a run builds them), the rows submitted in the run's order (the plan's submissions with their
  retention, or longest first with ``plan.enabled: false``; rows with images after their window's text rows) and
  paced as the local executor takes them (``take_room``). Each row draws its ``max_tokens`` (an output choice:
  its longest option's tokens); score rows are submitted with their candidates, as the run submits them;
- rows with images are keyed by their images' content, from their real token ids when the model is loaded (its
  processor expands each image to its placeholder tokens), else by their text tokens.
Rows are kept as compact ``array('i')`` token sequences (4 bytes a token); memory holds one window and the rows in
flight.
The ETA comes from ``job.plan.calibrate``: a short real run of the model on this machine (a FLOPs estimate without
weights).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxbatch.engine import DryModel, DryRun, PromptEncoder, device_info, is_vlm_folder, plan, submission_order
from mlxbatch.io import InputFormat, open_reader, resolve_inputs
from mlxbatch.job.check.model_fit import context_length
from mlxbatch.job.check.model_ref import local_model_dir
from mlxbatch.job.check.model_size import config_sizes, read_config
from mlxbatch.job.check.validate import input_spec
from mlxbatch.job.executors.base import engine_config, row_tokens_hint
from mlxbatch.job.executors.local import max_inflight, take_room
from mlxbatch.job.plan.calibrate import Eta, estimate, measured_eta
from mlxbatch.job.rows.feed import window_floor_saving
from mlxbatch.job.rows.prepare import PreparedRow, RowPreparer
from mlxbatch.job.spec import JobSpec
from mlxbatch.job.spec.sections import window_sizes
from mlxbatch.types import SamplingParams

__all__ = ["Eta", "PlanReport", "as_dict", "plan_job"]


@dataclass(frozen=True)
class PlanReport:
    rows: int
    planned_rows: int  # text rows planned along the trie
    skipped_rows: int  # rows that cannot run (input or render errors, prompts the tokenizer rejects)
    prompt_tokens: int  # every runnable row's prompt; score rows: their sequences' (context, candidates when run)
    distinct_tokens: int  # each window's trie node count, summed (report.json: prefix_reuse.window_floor_tokens)
    prefill_tokens: int  # what the run is predicted to compute (report.json: prefill_tokens_computed)
    saving: float  # 1 - prefill_tokens / prompt_tokens (report.json: prefix_reuse.saving, measured)
    peak_retained_tokens: int
    kv_bytes_per_token: int
    windowed: bool
    window: int
    seconds: float
    eta: Eta | None = None
    enabled: bool = True
    image_rows: int = 0  # not planned by the run: block-cache reuse only
    score_rows: int = 0
    notes: tuple[str, ...] = ()
    kv_dtype: str = "float32"  # the dtype the engine will keep KV in on this device
    windows: int = 1  # windows with planned rows

    @property
    def peak_retained_bytes(self) -> int:
        return self.peak_retained_tokens * self.kv_bytes_per_token

    @property
    def window_floor_saving(self) -> float:
        """The saving at the windows' trie floors (report.json: plan.window_floor_saving)."""
        return window_floor_saving(self.distinct_tokens, self.prompt_tokens)

    def _floor_line(self) -> str:
        if not self.planned_rows:  # (not "0, 100% below the prompt tokens")
            return ("distinct trie tokens (prefill floor): none, no row is planned (rows with images run in input "
                    "order; the prefix cache still reuses what they share)")
        at = f"{self.window_floor_saving:.1%} below the prompt tokens"
        if self.windows <= 1:
            return (f"distinct trie tokens (prefill floor): {self.distinct_tokens} ({at}: the least prefill of the "
                    f"planned rows in any order)")
        return (f"distinct trie tokens (prefill floor per window): {self.distinct_tokens}, summed over {self.windows} "
                f"windows ({at}); not a floor for the whole job: the prefix cache carries shared prefixes from one "
                f"window to the next, so the run can compute less (no whole-job trie is built: memory holds one window)")

    def summary(self) -> str:
        return "\n".join([
            f"rows: {self.rows} ({self.planned_rows} planned, {self.image_rows} with images, {self.score_rows} "
            f"scored, {self.skipped_rows} would be error rows)",
            f"prompt tokens: {self.prompt_tokens}",
            self._floor_line(),
            f"expected prefill saving: {self.saving:.1%} (predicted prefill: {self.prefill_tokens} of "
            f"{self.prompt_tokens} prompt tokens; report.json: prefix_reuse.prefill_tokens_computed and saving)",
            f"peak shared-prefix KV retained: {self.peak_retained_tokens} tokens "
            f"({self.peak_retained_bytes / 2**20:.1f} MiB at {self.kv_bytes_per_token} bytes/token, {self.kv_dtype})",
            f"planned {'in windows of ' + str(self.window) + ' rows' if self.windowed else 'whole'}"
            f"{'' if self.enabled else ' (plan.enabled: false: longest first, LRU prefix cache)'} "
            f"in {self.seconds:.1f} s",
        ] + ([self.eta.summary()] if self.eta is not None else []) + [f"note: {n}" for n in self.notes])


@dataclass
class _Tally:
    rows: int = 0
    skipped: int = 0
    planned: int = 0
    images: int = 0
    scored: int = 0
    windows: int = 0
    prompt: int = 0
    distinct: int = 0
    peak: int = 0
    sample: list[list[int]] = field(default_factory=list)  # the first rows' token ids, to calibrate the ETA
    sample_params: list[Any] = field(default_factory=list)  # their sampling as the run gives it (constraint too)


@dataclass(frozen=True)
class _Row:
    """A row as the run submits it to the engine."""

    ids: Sequence[int]
    params: SamplingParams
    cache_tokens: int | None = None
    candidates: tuple[str, ...] | None = None  # task score
    media: tuple[tuple[int, str], ...] = ()  # a row with images: its images' positions and content hashes


class _Planner:
    """Plans one window of prepared rows at a time, as the run's feed does, and submits them to a dry run of the
    engine paced as the local executor takes rows from the feed."""

    def __init__(self, spec: JobSpec, tok: Any, loaded: Any, model_dir: Path, vision: bool = False) -> None:
        self.spec, self.tok, self.loaded = spec, tok, loaded
        self.encoder = PromptEncoder(tok)
        self.dry_model = _dry_model(spec, model_dir, loaded, vision)
        self.engine = engine_config(spec.engine, spec.seed, row_tokens_hint(spec))
        self.device = device_info()  # (once: the ETA's probe sizing runs fresh dry runs on it)
        self.dry = DryRun(self.dry_model, self.engine, tok, self.device)
        # the engine's reuse step on this machine (a block on CUDA's text path): the feed plans with it
        self.step = self.dry.reuse_step
        self.max_inflight = max_inflight(self.dry.config.max_num_seqs)  # the local executor's, of the sized engine
        self.queue: collections.deque[_Row] = collections.deque()  # submitted in this order, as the run takes them
        self.pending: set[str] = set()
        self.ids = 0
        self._choices: dict[tuple[str, ...], int] = {}  # an output choice's options -> the longest one's tokens
        self.t = _Tally()
        self.sample_size = self.dry.config.max_num_seqs

    def window(self, preps: list[PreparedRow]) -> None:
        t, spec = self.t, self.spec
        text = [p for p in preps if not p.images]
        encoded = self.encoder.encode_many([p.prompt for p in text])  # type: ignore[misc]
        seqs: list[array[int]] = []
        rows: list[PreparedRow] = []
        more_prompt = 0  # score rows: every candidate's sequence is context + candidate
        for prep, ids in zip(text, encoded):
            if isinstance(ids, str):
                t.skipped += 1
                continue
            seqs.append(array("i", ids))
            rows.append(prep)
            if len(t.sample) < self.sample_size:
                t.sample.append(list(ids))
                t.sample_params.append(prep.params)
            if prep.candidates is not None:
                t.scored += 1
                lens = [len(self.tok.encode(c, add_special_tokens=False)) for c in prep.candidates]
                if any(n > 1 for n in lens):  # else one sequence: the context's last logits score every candidate
                    more_prompt += sum(lens) + len(ids) * (len(lens) - 1)
        if seqs:
            p = plan(seqs, min_step_tokens=self.step)
            t.windows += 1
            t.planned += len(seqs)
            t.prompt += p.total_tokens + more_prompt
            t.distinct += p.distinct_tokens
            t.peak = max(t.peak, p.peak_retained_tokens())
            # the run's order: the plan's submissions with their retention, else longest first (no retention)
            order = [(s.index, s.cache_tokens) for s in submission_order(p)] if spec.plan.enabled else \
                [(i, None) for i in sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))]
            self.queue.extend(_Row(seqs[i], self._params(rows[i]), keep, rows[i].candidates) for i, keep in order)
        for prep in (p for p in preps if p.images):  # after the window's text rows, without a plan
            t.images += 1
            ids, media, encoded_prompt = self._image_tokens(prep)
            t.prompt += len(ids) * prep.params.n  # each sample of an image row prefills on its own
            self.queue.append(_Row(ids, self._params(prep), None, None, tuple(media)))
            if encoded_prompt is not None and len(t.sample) < self.sample_size:
                t.sample.append(encoded_prompt)
                t.sample_params.append(prep.params)
        self._drive(last=False)

    def _params(self, prep: PreparedRow) -> SamplingParams:
        """The row's sampling with the tokens it is expected to draw as ``max_tokens``: a choice's longest option
        where the output is one (the row stops once its choice is complete), else ``max_tokens``."""
        p = prep.params
        c = p.constraint
        if c is None or c.kind != "choice" or not c.value:
            return p
        options = tuple(str(o) for o in c.value)
        longest = self._choices.get(options)
        if longest is None:  # (a job's rows mostly share their options: tokenized once)
            longest = self._choices[options] = max(len(self.tok.encode(o, add_special_tokens=False)) for o in options)
        return dataclasses.replace(p, max_tokens=max(1, min(p.max_tokens, longest)))

    def _drive(self, last: bool) -> None:
        """Run the dry run as the run loop runs the engine: take rows while there is room (``take_room``), then one
        step, until the rows queued so far are taken (``last``: and finished). A take that would read past the rows
        queued waits for the next window, as the run's feed hands it over."""
        dry = self.dry
        while True:
            room = take_room(len(self.pending), self.max_inflight)
            if room > len(self.queue) and not last:
                return
            for _ in range(min(room, len(self.queue))):
                self._submit(self.queue.popleft())
            if not self.pending:
                return
            self.pending.difference_update(dry.step())

    def _submit(self, row: _Row) -> None:
        rid = f"r{self.ids}"
        self.ids += 1
        self.pending.add(rid)
        if row.candidates is not None:
            self.dry.add_score_request(row.ids, row.candidates, rid, row.cache_tokens)
        else:
            self.dry.add_request(row.ids, row.params, rid, row.cache_tokens, row.media)

    def finish(self) -> int:
        """The prefill the dry run computed for every row (all of them run to the end)."""
        self._drive(last=True)
        return self.dry.counts.prefill_tokens

    def predict(self, prompts: list[Any]) -> int:
        """The prefill predicted for ``prompts`` (token ids or encoded image prompts) run alone on a fresh engine, in
        the plan's order with its retention, one token each (the ETA's probe)."""
        dry = DryRun(self.dry_model, self.engine, self.tok, self.device)
        text = [i for i, p in enumerate(prompts) if isinstance(p, list)]
        subs = submission_order(plan([prompts[i] for i in text], min_step_tokens=self.step)) if text else []
        one = SamplingParams(temperature=0, max_tokens=1)
        for k, s in enumerate(subs):
            dry.add_request(prompts[text[s.index]], one, f"t{k}", s.cache_tokens)
        for k, p in enumerate(p for p in prompts if not isinstance(p, list)):
            dry.add_request(p.token_ids, one, f"i{k}", None, p.mm.media)
        return dry.run_until_done().prefill_tokens

    def _image_tokens(self, prep: PreparedRow) -> tuple[list[int], tuple[tuple[int, str], ...], Any]:
        """An image row's token ids and image positions as the engine encodes it (placeholders expanded; needs the
        model's processor) with the encoded prompt, or its text tokens alone when the model is not loaded."""
        if self.loaded is not None and self.loaded.vlm is not None:
            from mlxbatch.io.images import load_image

            try:
                mm = self.loaded.vlm.encode(prep.prompt, [load_image(r) for r in prep.images])
                return list(mm.token_ids), mm.mm.media, mm
            except Exception:  # an image that does not decode: an error row in the run, counted by its text
                pass
        ids = self.encoder.encode_many([prep.prompt])[0]  # type: ignore[list-item]
        return ([] if isinstance(ids, str) else list(ids)), (), None


def _dry_model(spec: JobSpec, model_dir: Path, loaded: Any, vision: bool) -> DryModel:
    """The model as the dry run needs it, from its config.json (no weights read): KV bytes per token in the dtype the
    engine will use here, its context, and its weights' size on disk (what they take of the device's memory)."""
    sizes = config_sizes(model_dir, spec.model.dtype)
    context = loaded.context_length if loaded is not None else context_length(read_config(model_dir)[0]) or 4096
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors") if not f.name.startswith("."))
    return DryModel(sizes.kv_bytes_per_token, context, weights, vision)


def plan_job(spec: JobSpec, window: int | None = None, with_eta: bool = True, calibrate: bool = True) -> PlanReport:
    """Plan ``spec`` as ``run`` will (its plan.window unless ``window`` is given). ``calibrate`` loads the model and
    times a short real run for the ETA (and expands image rows' placeholders); off, or without weights, the ETA is
    a FLOPs estimate."""
    import itertools

    from mlx_lm.utils import load_tokenizer  # tokenizer files only: no weights are read

    t0 = time.perf_counter()
    window = window or spec.plan.window
    model_dir = local_model_dir(spec.model.path)
    loaded = _load(spec, model_dir) if calibrate and with_eta else None
    tok = loaded.tokenizer if loaded is not None else load_tokenizer(model_dir)
    ispec = input_spec(spec)
    openai = any(r.format is InputFormat.OPENAI_BATCH for r in resolve_inputs(ispec))
    # as the run prepares them: image paths opened only for a vision-language model, prompts bounded by the context
    preparer = RowPreparer(spec, "plan", openai, takes_images=is_vlm_folder(model_dir),
                           context_length=loaded.context_length if loaded is not None else None)
    planner = _Planner(spec, tok, loaded, model_dir, vision=is_vlm_folder(model_dir))
    rows = open_reader(ispec)
    if spec.input.limit is not None:
        rows = itertools.islice(rows, spec.input.limit)
    notes: list[str] = []
    t_prep = time.perf_counter()
    sizes = window_sizes(window, spec.plan.ramp)
    while True:
        chunk = list(itertools.islice(rows, next(sizes)))  # the run's windows: consecutive input rows, errors included
        if not chunk:
            break
        planner.t.rows += len(chunk)
        preps = [preparer.prepare(r) for r in chunk]
        runnable = [p for p in preps if p.error is None and p.prompt is not None]
        planner.t.skipped += len(preps) - len(runnable)
        planner.window(runnable)
    prefill = planner.finish()
    t = planner.t
    prep_s = time.perf_counter() - t_prep
    if t.images and (loaded is None or loaded.vlm is None):
        notes.append("image rows are counted by their text tokens: the model was not loaded (its processor expands "
                     "each image into placeholder tokens); plan with --calibrate and the model's weights")
    if planner.step > 1:
        notes.append(f"planned with the engine's {planner.step}-token reuse step (CUDA's packed prefill: a shared prefix "
                     "is kept only where it is that much longer than the one kept around it)")
    eta = None
    if with_eta:
        p = spec.sampling.params
        gen_rows = 0 if spec.task.kind == "score" else t.planned + t.images
        host_s = 2 * prep_s  # the run prepares and tokenizes every row, then prepares it again for the results
        eta = measured_eta(spec, loaded, t.sample, prefill, gen_rows, host_s, planner.predict, t.sample_params) \
            if loaded is not None else None
        if eta is None:
            eta = estimate(spec, model_dir, t.planned + t.images, prefill, gen_rows * p.max_tokens * p.n,
                           planner.dry.config.max_num_seqs)
    saving = 1 - prefill / t.prompt if t.prompt else 0.0
    sizes = config_sizes(model_dir, spec.model.dtype)
    return PlanReport(t.rows, t.planned, t.skipped, t.prompt, t.distinct, prefill, saving, t.peak,
                      sizes.kv_bytes_per_token, t.windows > 1, window, time.perf_counter() - t0, eta,
                      spec.plan.enabled, t.images, t.scored, tuple(notes), sizes.dtype, t.windows)


def _load(spec: JobSpec, model_dir: Path) -> Any:
    """The model through the engine's loader (None when its weights are not here: a tokenizer-only folder)."""
    from mlxbatch.engine import ModelSpec, load_model
    from mlxbatch.errors import MlxbatchError

    if not any(model_dir.glob("*.safetensors")):
        return None
    try:
        return load_model(ModelSpec(str(model_dir), spec.model.dtype, spec.model.adapter, spec.model.trust_remote_code))
    except MlxbatchError:
        return None


def as_dict(r: PlanReport) -> dict[str, Any]:
    out = {**{k: getattr(r, k) for k in r.__dataclass_fields__ if k != "eta"},
           "peak_retained_bytes": r.peak_retained_bytes, "window_floor_saving": r.window_floor_saving,
           "notes": list(r.notes)}
    if r.eta is not None:
        out["eta"] = r.eta.as_dict()
    return out
