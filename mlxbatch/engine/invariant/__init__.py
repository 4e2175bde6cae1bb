"""Batch-invariant mode (``EngineConfig(batch_invariant=True)``): a row's tokens and logprobs a function of the row
alone, through forwards whose every shape is fixed by that row. One face for the runner.

- ``shapes.py``: the shape rules (``Shapes``: key widths, slices, row counts per device) and the start-up check;
- ``slots.py``: ``InvariantSlots``, the slot layout that runs fixed-shape forwards and keeps decode rows grouped;
- ``forwards.py``: ``FixedForwards``, one step's decodes and prefill chunks as fixed-shape passes (``start``).

The scheduler's side is ``SchedulerConfig.invariant_slice`` (chunks and reuse in whole slices). See
docs/architecture.md, "Batch invariance".
"""

from mlxbatch.engine.invariant.forwards import FixedForwards, FixedStep, start
from mlxbatch.engine.invariant.shapes import Shapes
from mlxbatch.engine.invariant.slots import InvariantSlots

__all__ = ["FixedForwards", "FixedStep", "InvariantSlots", "Shapes", "start"]
