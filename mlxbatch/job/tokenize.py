"""Prompt tokenization in large batches, exactly as the engine tokenizes one prompt.

Owns the one rule both the planner and the run need: a text prompt gets the tokenizer's special tokens, a chat
prompt is rendered with the chat template (generation prompt added) and tokenized without adding specials again
(the template carries them). Batches go through the Hugging Face fast tokenizer in one Rust call (all cores).
Tests check the ids equal ``EngineCore.encode``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Prompt = str | list[dict[str, str]]


class PromptEncoder:
    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer  # mlx-lm's TokenizerWrapper
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)  # the fast tokenizer inside it

    def encode_many(self, prompts: Sequence[Prompt]) -> list[list[int] | str]:
        """Token ids per prompt, or a string saying why the prompt cannot be tokenized (a row error)."""
        out: list[list[int] | str] = [""] * len(prompts)
        texts: dict[bool, list[tuple[int, str]]] = {True: [], False: []}
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                texts[True].append((i, p))
                continue
            try:
                rendered = self._tok.apply_chat_template(list(p), add_generation_prompt=True, tokenize=False)
            except Exception as exc:  # no template, or the template rejects these messages
                out[i] = f"chat template failed: {exc}"
                continue
            texts[False].append((i, rendered))
        for special, items in texts.items():
            if items:
                ids = self._hf([t for _, t in items], add_special_tokens=special)["input_ids"]
                for (i, _), seq in zip(items, ids):
                    out[i] = list(seq)
        return out
