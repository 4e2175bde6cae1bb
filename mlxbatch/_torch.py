"""Keep transformers from importing torch in the processes that never use it.

Owns one thing: the process-wide choice of transformers without torch. transformers, which mlx-lm's tokenizer module
imports, imports torch wherever it is installed (``modeling_rope_utils``: ``if is_torch_available(): import torch``),
and mlxbatch's text path uses only its tokenizers, which never need it. A run paid that import before its first row:
on a 2-core CPU with torch 2.14 installed, a 200-row job's command took 3.8-4.0 s against 2.1 s, and on an H100's
host a feed worker's start took 15-21 s.

``without_torch`` has transformers decide, with torch marked absent for that moment, that it is not available
(``is_torch_available`` keeps its first answer: every import of torch in transformers is behind it), then takes the
mark away: the tokenizers take their torch-free path, the same token ids as on a machine without torch, and a library
that imports torch itself (``datasets`` reading a folder of data files does) still can. A mark left in place broke
that: ``datasets`` imports torch whenever ``"torch" in sys.modules``.

Only processes mlxbatch owns do it, for text models: the feed's workers and the engine's process (they render,
tokenize and run text rows), the command line's ``run``, ``plan``, ``validate`` and ``generate``, and the worker
processes of a distributed run that connects to Ray itself (Ray's ``worker_process_setup_hook``), of a text model
whose tokenizer runs no code of its own (``trust_remote_code`` off: ``job.check.model_ref.tokenizers_only``). A vision-language model keeps torch: transformers'
fast image processors use it. A notebook's process is never touched.
This module must not import mlx.
"""

from __future__ import annotations

import os
import sys

ADVICE_VAR = "TRANSFORMERS_NO_ADVISORY_WARNINGS"  # transformers' switch for its advice (read when it gives it)


def without_torch() -> bool:
    """Have transformers decide that torch is not available, unless torch or transformers was imported already
    (then it stays as it is); returns whether transformers runs without torch."""
    if "torch" in sys.modules:
        return False
    if "transformers" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]  # (find_spec answers None: not installed)
        quiet = ADVICE_VAR not in os.environ  # its import's "PyTorch was not found ..." would be this module's doing
        if quiet:
            os.environ[ADVICE_VAR] = "1"
        try:
            import transformers

            transformers.is_torch_available()
        finally:
            del sys.modules["torch"]
            if quiet:
                del os.environ[ADVICE_VAR]
    import transformers

    return not transformers.is_torch_available()
