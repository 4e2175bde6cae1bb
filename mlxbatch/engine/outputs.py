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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx

from mlxbatch.engine.decoding.sampling import SampledToken
from mlxbatch.types import TokenLogprob


@dataclass
class Traffic:
    moved_bytes: int = 0  # existing KV copied to another place: row moves, copy-ins (running rows, cached blocks), forks
    stored_bytes: int = 0  # KV copied into the prefix cache
    grown_bytes: int = 0  # buffers copied when they grow or shrink (amortised: capacity doubles)
    resizes: int = 0  # buffer growths and shrinks
    resize_syncs: int = 0  # of ``syncs``, those of growths and shrinks (a sync per slice of ``kv.copies``)
    syncs: int = 0  # host waits for the device: evaluations and reads of results

    def evaluate(self, *arrays: Any) -> None:
        """``mx.eval`` counted as one sync."""
        self.syncs += 1
        mx.eval(*arrays)

    def snapshot(self) -> Traffic:
        return Traffic(**asdict(self))

    def since(self, before: Traffic) -> Traffic:
        """What was added after ``before`` (a snapshot)."""
        return Traffic(**{k: v - getattr(before, k) for k, v in asdict(self).items()})

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class StepProfile:
    """Where step time goes, summed over the engine's life (seconds), and what the steps moved (``traffic``)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0  # decode forwards; in a decode-only step, its sampling too (one evaluation for both)
    sampling_s: float = 0.0  # sampling in steps that prefill (their forwards were evaluated before it)
    total_s: float = 0.0
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    grammar_mask_s: float = 0.0  # structured outputs: filling the allowed-token masks (host), inside sampling_s
    grammar_advance_s: float = 0.0  # ... advancing the matchers by the sampled tokens (host)
    traffic: Traffic = field(default_factory=Traffic)

    @property
    def host_s(self) -> float:
        """Scheduling, bookkeeping, detokenization: step time not spent in the model or sampler."""
        return max(0.0, self.total_s - self.prefill_s - self.decode_s - self.sampling_s)

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps, "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
            "sampling_s": round(self.sampling_s, 4), "host_s": round(self.host_s, 4),
            "total_s": round(self.total_s, 4), "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens, "grammar_mask_s": round(self.grammar_mask_s, 5),
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
class RunnerStats:
    profile: dict[str, float]
    kv_bytes: int  # the KV layout's buffers
    prefix_store_bytes: int  # the prefix cache's block tensors
    vision_cache: dict[str, Any] | None  # vision-language models only
