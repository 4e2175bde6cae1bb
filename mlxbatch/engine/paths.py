"""Which paths an engine takes on a backend, one definition each: the CUDA text path, the KV layout's options
(``layout_for``), overlapped steps and the launch thread. Pure decisions: nothing here builds or runs anything.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from mlxbatch.config import EngineConfig
from mlxbatch.engine.attention import AttentionKernels
from mlxbatch.engine.backend import Backend
from mlxbatch.engine.kv import LayoutOptions
from mlxbatch.engine.model.own_body import OwnBody
from mlxbatch.engine.model.split import SplitModel
from mlxbatch.engine.model.worker import KVGeometry


def cuda_text_path(backend: Backend, vision: bool, batch_invariant: bool) -> bool:
    """Whether a model runs the CUDA text path on ``backend``: prefill passes in recurring shapes, and packed where
    the model's body is ours (``OwnBody``: the common mlx-lm decoder layers)."""
    return not vision and not batch_invariant and backend.cuda


def overlaps_steps(backend: Backend, config: EngineConfig, vision: bool) -> bool:
    """Whether an engine overlaps its steps (``EngineConfig.overlap_steps``; None: by device). On a GPU's text rows:
    the host schedules and builds step N+1 while the device runs step N (as mlx-lm's own generation loop does with
    ``mx.async_eval``). A Mac's path run on an H100 (``mlxbatch bench runs --mac-decisions``: MLX's attention, row
    moves, no launch thread) took 17-18% less time on label and unique with it, 3% on decode alone
    (docs/benchmarks.md). Not on a CPU, whose MLX computes inside the evaluation call: nothing runs beside the
    host's work (a CPU user job measured no faster)."""
    if config.overlap_steps is not None:
        return config.overlap_steps
    return backend.gpu and not vision and not config.batch_invariant


def uses_launch_thread(backend: Backend, config: EngineConfig, vision: bool) -> bool:
    """Whether an engine launches its steps from a thread of its own (``engine.launcher``): where steps overlap (a
    step's books run while the device computes the step before) on the CUDA text path, whose encoding of a step's
    kernels is ~40% of its host time (docs/benchmarks.md). Metal encodes on the host too, but no Mac has measured it
    (nor MLX's Metal streams used from two threads): a Mac overlaps its steps from the engine's thread."""
    return overlaps_steps(backend, config, vision) and cuda_text_path(backend, vision, config.batch_invariant)


def layout_for(backend: Backend, split: SplitModel | None, geometry: KVGeometry, vision: bool,
               batch_invariant: bool) -> LayoutOptions:
    """The slot layout's options for a model on ``backend``: what follows from the device (``LayoutOptions.base``);
    on the CUDA text path prefill passes in recurring shapes (each new attention shape is a cuDNN graph build there),
    and where the model's body is ours (``OwnBody``) the engine's kernels and passes."""
    cuda = cuda_text_path(backend, vision, batch_invariant)
    base = dataclasses.replace(LayoutOptions.base(backend), shape_buckets=cuda)
    if split is None or not isinstance(split.body, OwnBody) or vision or batch_invariant:
        return base
    # CUDA decode steps: attention over each row's own keys, fused (MLX runs rows of different lengths unfused);
    # CUDA prefill: a new shape's attention unfused until the shape recurs (no cuDNN graph build for one pass), and
    # a packed pass's attention in one launch a layer where that kernel runs and agrees with MLX's
    kernels = AttentionKernels.create(backend, split.body.heads, geometry.kv_heads, geometry.head_dim,
                                      getattr(mx, geometry.dtype), prefill=cuda)
    if not cuda:
        return dataclasses.replace(base, attention=kernels)
    # one prefill pass a step (the host's work per pass binds there), whose rows are read and written by slot (rows
    # stay: promoting and retiring rows moves no KV), in recurring shapes; decode passes of a recurring shape from a
    # compiled graph (no graph build), and packed passes through the attention kernel too; q/k/v and gate/up as
    # one matmul each (fewer launches a layer)
    return dataclasses.replace(base, rows_stay=True, packed_prefill=True, compiled_decode=kernels.decode is not None,
                               compiled_prefill=kernels.packed is not None, fuse=True, attention=kernels)
