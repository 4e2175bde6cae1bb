"""Prompt rendering: row fields -> a prompt (text or chat messages), in a Jinja sandbox.

Owns the templates of one job. Templates cannot run code: a sandboxed, immutable environment with strict
undefined variables, so a row that lacks a field fails with a message naming it. ``fields()`` lists the
row fields the templates read, for validation before any work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlxbatch.errors import MlxbatchError
from mlxbatch.job.spec import PromptSection


class RenderError(MlxbatchError):
    """A row the templates cannot render (a missing field, a template error)."""


@dataclass(frozen=True)
class RenderedPrompt:
    prompt: str | list[dict[str, str]]  # what the engine gets: text, or chat messages
    identity: str  # a stable string of what was rendered: part of the row's result key


class PromptRenderer:
    def __init__(self, section: PromptSection, openai_batch: bool = False) -> None:
        self._env = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                                                  autoescape=False)
        self.section = section
        self.openai_batch = openai_batch
        try:
            self._template = self._env.from_string(section.template) if section.template is not None else None
            self._messages = [(m["role"], self._env.from_string(m["content"])) for m in section.messages or ()]
            self._system = self._env.from_string(section.system) if section.system is not None else None
        except jinja2.TemplateSyntaxError as exc:
            raise RenderError(f"prompt: template syntax error on line {exc.lineno}: {exc.message}") from exc

    def fields(self) -> set[str]:
        """Row fields the templates refer to."""
        sources = [self.section.template or "", self.section.system or ""]
        sources += [m["content"] for m in self.section.messages or ()]
        names: set[str] = set()
        for src in sources:
            names |= meta.find_undeclared_variables(self._env.parse(src))
        return names

    def render(self, fields: dict[str, Any], request: dict[str, Any] | None = None) -> RenderedPrompt:
        """Render one row; OpenAI-batch rows carry their own messages or prompt in ``request``."""
        try:
            if request is not None and (request.get("messages") or request.get("prompt")):
                return self._from_request(request)
            if self._template is not None and not self.section.messages:
                text = self._template.render(**fields)
                if self.section.system is not None:
                    msgs = [{"role": "system", "content": self._system.render(**fields)},  # type: ignore[union-attr]
                            {"role": "user", "content": text}]
                    return RenderedPrompt(msgs, json.dumps(msgs, ensure_ascii=False))
                return RenderedPrompt(text, text)
            msgs = []
            if self._system is not None:
                msgs.append({"role": "system", "content": self._system.render(**fields)})
            msgs += [{"role": role, "content": t.render(**fields)} for role, t in self._messages]
            if not self.section.chat_template:
                text = "\n\n".join(m["content"] for m in msgs)
                return RenderedPrompt(text, text)
            return RenderedPrompt(msgs, json.dumps(msgs, ensure_ascii=False))
        except jinja2.UndefinedError as exc:
            raise RenderError(f"template: {exc.message}") from exc
        except jinja2.TemplateError as exc:
            raise RenderError(f"template error: {exc}") from exc

    @staticmethod
    def _from_request(request: dict[str, Any]) -> RenderedPrompt:
        if request.get("messages"):
            msgs = request["messages"]
            if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                     for m in msgs):
                raise RenderError("body.messages: expected a list of {role, content} with text content")
            clean = [{"role": str(m.get("role", "user")), "content": m["content"]} for m in msgs]
            return RenderedPrompt(clean, json.dumps(clean, ensure_ascii=False))
        prompt = request["prompt"]
        if not isinstance(prompt, str):
            raise RenderError("body.prompt: expected a string")
        return RenderedPrompt(prompt, prompt)
