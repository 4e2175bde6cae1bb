"""Keep torch out of the processes that never use it.

Owns one thing: the process-wide choice not to import torch. transformers, which mlx-lm's tokenizer module imports,
imports torch wherever it is installed (``modeling_rope_utils``: ``if is_torch_available(): import torch``), and
mlxbatch's text path uses only its tokenizers, which never need it. A run paid that import before its first row: on
a 2-core CPU with torch 2.14 installed, a 200-row job's command took 3.8-4.0 s against 2.1 s, and on an H100's host a
feed worker's start took 15-21 s. Marked absent (``sys.modules["torch"] = None``, as on a machine without torch),
transformers takes its tokenizer-only path: the same token ids.

Only processes mlxbatch owns do it, for text models: the feed's workers and the engine's process (they render,
tokenize and run text rows), and the command line's ``run``, ``plan``, ``validate`` and ``generate`` of a text model
whose tokenizer runs no code of its own (``trust_remote_code`` off). A vision-language model keeps torch: transformers'
fast image processors use it. A notebook's process is never touched (the user's ``import torch`` must work).
This module must not import mlx or transformers.
"""

from __future__ import annotations

import sys


def hide_torch() -> bool:
    """Mark torch absent in this process unless something imported it, or transformers (which looked for it),
    already; returns whether torch is absent now."""
    if "torch" in sys.modules:
        return sys.modules["torch"] is None
    if "transformers" in sys.modules:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]
    return True
