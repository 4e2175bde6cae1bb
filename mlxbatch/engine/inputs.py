"""Prompt encoding: a prompt -> token ids, the one rule the engine, the planner and the job layer share.

A text prompt gets the tokenizer's special tokens; chat messages are rendered with the chat template (generation
prompt added) and tokenized without adding specials again (the template carries them), which is what
``apply_chat_template(tokenize=True)`` does; a list of token ids is taken as it is. ``PromptEncoder`` does the same
for many prompts at once through the Hugging Face fast tokenizer (one Rust call, all cores), for planning jobs.
Pure Python (the tokenizer is the only dependency).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlxbatch.errors import InvalidRequestError

Prompt = Any  # str | Sequence[int] | Sequence[dict] (chat messages) | vision.adapter.MultimodalPrompt
TextPrompt = str | list[dict[str, str]]


class PromptEncoder:
    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer  # mlx-lm's TokenizerWrapper
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)  # the fast tokenizer inside it

    def encode_many(self, prompts: Sequence[TextPrompt]) -> list[list[int] | str]:
        """Token ids per prompt, or a string saying why the prompt cannot be tokenized (a row error)."""
        out: list[list[int] | str] = [""] * len(prompts)
        texts: dict[bool, list[tuple[int, str]]] = {True: [], False: []}
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                texts[True].append((i, p))
                continue
            if getattr(self._tok, "chat_template", None) is None:
                out[i] = "the model's tokenizer has no chat template"
                continue
            try:
                rendered = self._tok.apply_chat_template(list(p), add_generation_prompt=True, tokenize=False)
            except Exception as exc:  # the template rejects these messages
                out[i] = f"chat template failed: {exc}"
                continue
            texts[False].append((i, rendered))
        for special, items in texts.items():
            if items:
                ids = self._hf([t for _, t in items], add_special_tokens=special)["input_ids"]
                for (i, _), seq in zip(items, ids):
                    out[i] = list(seq)
        return out


def encode_prompt(tok: Any, prompt: Prompt) -> list[int]:
    """Token ids of one prompt: text, token ids, or chat messages; InvalidRequestError if it cannot be encoded."""
    if not isinstance(prompt, str):
        items = list(prompt)
        if set(map(type, items)) <= {int}:  # plain ints (not bools), checked at C speed: jobs pass ids of 1k+ tokens
            return items  # (a new list: the caller's is never aliased; an empty prompt is refused by the caller)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in items):  # int subclasses (IntEnum); numpy ints are not ints: refused
            return [int(t) for t in items]
        if not all(isinstance(m, dict) for m in items):
            raise InvalidRequestError("prompt", type(prompt).__name__,
                                      "expected a string, a list of token ids or a list of chat messages")
        prompt = items
    ids = PromptEncoder(tok).encode_many([prompt])[0]
    if isinstance(ids, str):
        raise InvalidRequestError("prompt", "<messages>", ids)
    return ids
