"""Prompt rendering: row fields -> a prompt (text or chat messages), in a bounded Jinja sandbox.

Owns the templates of one job. Templates cannot run code and cannot run away (``job.rows.sandbox``): a row that lacks
a field, holds a null the template prints, divides by zero, adds a number to a text, or asks for too much work
fails with a ``RenderError`` naming the problem; a prompt longer than ``max_chars`` characters raises
``PromptTooLong`` as soon as it passes that length (nothing that long is kept or tokenized). ``fields()`` lists the
row fields the templates read, for validation before any work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import meta, nodes

from mlxbatch.errors import MlxbatchError
from mlxbatch.job.rows.sandbox import BoundedSandbox, PromptTooLong, null
from mlxbatch.job.spec import PromptSection

DEFAULT_MAX_CHARS = 1 << 23  # 8 Mi characters, when the model's context is not known


class RenderError(MlxbatchError):
    """A row the templates cannot render (a missing or null field, a template error, a template limit)."""


class TemplateSyntaxError(RenderError):
    """A template that does not parse; ``key`` is the job key that holds it (``prompt.template``, ...)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class PromptTooLongError(RenderError):
    """A rendered prompt longer than the character bound: a ``request`` error of its row, not a template error."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        super().__init__(f"the prompt is longer than {max_chars:,} characters")


@dataclass(frozen=True)
class RenderedPrompt:
    prompt: str | list[dict[str, Any]]  # what the engine gets: text, or chat messages (content text or parts)
    identity: str  # a stable string of what was rendered: part of the row's result key


class PromptRenderer:
    def __init__(self, section: PromptSection, openai_batch: bool = False, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self._env = BoundedSandbox(max_chars)
        self.section = section
        self.openai_batch = openai_batch
        self.max_chars = max_chars
        # templates that are text only (no expression, no tag): the same text for every row, rendered once. By the
        # id of the compiled template, which this renderer holds for its life
        self._constant: dict[int, str] = {}
        # templates that print one field and nothing else (``{{ review }}``): a text field's value is what Jinja
        # prints, so a row whose field is a ``str`` skips the render (any other value renders: nulls, numbers, ...)
        self._field: dict[int, str] = {}
        self._template = self._compile("prompt.template", section.template)
        self._messages = [(m["role"], self._compile(f"prompt.messages[{i}].content", m["content"]))
                          for i, m in enumerate(section.messages or ())]
        self._system = self._compile("prompt.system", section.system)

    def _compile(self, key: str, source: str | None) -> Any:
        if source is None:
            return None
        try:
            template = self._env.from_string(source)
            text_only = all(isinstance(out, nodes.Output) and all(isinstance(n, nodes.TemplateData) for n in out.nodes)
                            for out in self._env.parse(source).body)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateSyntaxError(key, f"template syntax error on line {exc.lineno}: {exc.message}") from exc
        body = self._env.parse(source).body
        if (len(body) == 1 and isinstance(body[0], nodes.Output) and len(body[0].nodes) == 1
                and isinstance(body[0].nodes[0], nodes.Name)):
            self._field[id(template)] = body[0].nodes[0].name
        if text_only:
            try:
                self._constant[id(template)] = self._env.render_bounded(template, {})
            except PromptTooLong:  # longer than any prompt: each row says so
                pass
        return template

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
            return self._render_templates({k: null(k) if v is None else v for k, v in fields.items()})
        except PromptTooLong as exc:
            raise PromptTooLongError(exc.max_chars) from None
        except jinja2.UndefinedError as exc:
            raise RenderError(f"template: {exc.message}") from None
        except jinja2.TemplateError as exc:
            raise RenderError(f"template error: {exc}") from None
        except RenderError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template is user code: any failure is this row's error
            raise RenderError(f"template error: {type(exc).__name__}: {exc}") from None

    def _render_templates(self, values: dict[str, Any]) -> RenderedPrompt:
        env = self._env
        env.start_row()
        used = 0

        def render(template: jinja2.Template) -> str:
            nonlocal used
            text = self._constant.get(id(template))
            if text is None and (name := self._field.get(id(template))) is not None and type(values.get(name)) is str:
                text = values[name]
            if text is None:
                text = env.render_bounded(template, values, used)
            elif used + len(text) > self.max_chars:
                raise PromptTooLong(self.max_chars)
            used += len(text)
            return text

        if self._template is not None and not self.section.messages:
            if self.section.system is not None:
                system = render(self._system)  # type: ignore[arg-type]
                msgs = [{"role": "system", "content": system}, {"role": "user", "content": render(self._template)}]
                return RenderedPrompt(msgs, json.dumps(msgs, ensure_ascii=False))
            text = render(self._template)
            return RenderedPrompt(text, text)
        msgs = []
        if self._system is not None:
            msgs.append({"role": "system", "content": render(self._system)})
        msgs += [{"role": role, "content": render(t)} for role, t in self._messages]
        if not self.section.chat_template:
            text = "\n\n".join(m["content"] for m in msgs)
            return RenderedPrompt(text, text)
        return RenderedPrompt(msgs, json.dumps(msgs, ensure_ascii=False))

    def _from_request(self, request: dict[str, Any]) -> RenderedPrompt:
        if request.get("messages"):
            msgs = request["messages"]
            clean: list[dict[str, Any]] = []
            chars = 0
            for m in msgs if isinstance(msgs, list) else [None]:
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, list):  # text and image_url parts (io.jsonl checked them), in their order
                    content = [{"type": "text", "text": p["text"]} if p.get("type") == "text" else {"type": "image"}
                               for p in content]  # an image's place; its bytes are the row's images (job.rows.media)
                    chars += sum(len(p.get("text", "")) for p in content)
                elif isinstance(content, str):
                    chars += len(content)
                else:
                    raise RenderError("body.messages: expected a list of {role, content} with text content "
                                      "(or text and image_url parts)")
                clean.append({"role": str(m.get("role", "user")), "content": content})  # type: ignore[union-attr]
            if chars > self.max_chars:
                raise PromptTooLongError(self.max_chars)
            return RenderedPrompt(clean, json.dumps(clean, ensure_ascii=False))
        prompt = request["prompt"]
        if not isinstance(prompt, str):
            raise RenderError("body.prompt: expected a string")
        if len(prompt) > self.max_chars:
            raise PromptTooLongError(self.max_chars)
        return RenderedPrompt(prompt, prompt)

