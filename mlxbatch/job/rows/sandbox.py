"""The Jinja environment prompts render in: no code, bounded work, and no null slipping into a prompt as "None".

Owns the limits of one job's templates. Templates run in jinja2's immutable sandbox (no access to Python
internals, no mutation of row values), with these additions:

- **Bounded work.** ``range`` draws from a budget of ``MAX_RANGE_ITEMS`` items per row (nested loops included);
  ``*``, ``**``, ``%``, ``+``, the width-taking string methods (``center``, ``ljust``, ``zfill``, ``format``,
  ``replace``, ...) and filters refuse a value over ``max_chars`` characters before building it; namespace
  values are checked when read back (so a doubling loop stops). The output itself stops at ``max_chars``
  (``PromptTooLong``). Every limit raises an exception, which the renderer turns into the row's error.
- **Nulls.** A null field (or a null reached through an attribute or an index) is a ``Null``: printing it or
  computing with it is an error naming the field, while ``{{ x or '' }}``, ``{% if x %}``, ``x is none`` and
  ``x|default(...)`` handle it. A null printed any other way (a list item in a loop) is an error too.
"""

from __future__ import annotations

import contextvars
import functools
import re
from collections.abc import Callable, Iterator
from typing import Any

import jinja2
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RANGE_ITEMS = 100_000  # range() items per row, all calls together
MAX_POWER_BITS = 100_000  # the size of an integer ``a ** b``
_BIG_WIDTH = re.compile(r"\d{7,}|\*")  # a width or precision of a million or more, or one taken from the args
_PERCENT_SPEC = re.compile(r"%[#0\- +]*[\d*]*(?:\.[\d*]+)?[a-zA-Z%]")
_BRACE_SPEC = re.compile(r"\{[^{}]*\}")
_NESTED_SPEC = re.compile(r"\{[^{}]*:[^{}]*\{")  # "{0:{1}}": a width taken from the arguments
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill"})

_range_left: contextvars.ContextVar[int] = contextvars.ContextVar("mlxbatch_range_left", default=MAX_RANGE_ITEMS)


class TemplateLimitError(jinja2.TemplateRuntimeError):
    """A template asked for more work or memory than a row may use."""


class PromptTooLong(Exception):
    """The rendered prompt passed ``max_chars`` characters (rendering stopped there)."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        super().__init__(f"the prompt is longer than {max_chars:,} characters")


class Null(jinja2.StrictUndefined):
    """A null row value: false in tests, ``none`` and ``default`` treat it as missing; printing it is an error."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        return other is None or isinstance(other, Null)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(None)


def null(name: str) -> Null:
    return Null(hint=f"{name!r} is null (write {{{{ {name} or '' }}}}, {name}|default('...') or "
                     f"{{% if {name} is none %}} to allow it)", name=name)


def _no_null(value: Any) -> Any:
    """The environment's ``finalize``: a null printed by ``{{ }}``, however it was reached, is an error."""
    if value is None:
        raise jinja2.UndefinedError("a null value is printed (use `or ''`, `default(...)` or `is none`)")
    return value


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple, bytes)) else 0


def _check_format(fmt: str, what: str) -> None:
    specs = _PERCENT_SPEC.findall(fmt) + _BRACE_SPEC.findall(fmt)
    if any(_BIG_WIDTH.search(s) for s in specs) or _NESTED_SPEC.search(fmt):
        raise TemplateLimitError(f"{what}: widths of a million or more (or taken from the arguments) are refused")


def _check_replace(s: Any, old: Any, new: Any, cap: int) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        times = s.count(old) if old else len(s) + 1
        if len(s) + times * (len(new) - len(old)) > cap:
            raise TemplateLimitError(f"replace would build more than {cap:,} characters")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self, max_chars: int) -> None:
        super().__init__(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False,
                         finalize=_no_null)
        self.max_chars = max_chars
        self.globals["range"] = self._range
        self.globals["lipsum"] = self._lipsum
        self.tests["none"] = lambda value: value is None or isinstance(value, Null)
        for name, check in (("center", self._width_filter), ("indent", self._indent_filter),
                            ("format", self._format_filter), ("replace", self._replace_filter)):
            self.filters[name] = self._guarded(self.filters[name], check)
        for name in ("join", "wordwrap", "sum", "list", "string", "tojson", "pprint", "urlize", "batch", "map"):
            self.filters[name] = self._guarded(self.filters[name], None)

    # -- a row's budget ----------------------------------------------------------------------------------------
    @staticmethod
    def start_row() -> None:
        _range_left.set(MAX_RANGE_ITEMS)

    def _range(self, *args: int) -> range:
        r = range(*args)
        left = _range_left.get() - len(r)
        if left < 0:
            raise TemplateLimitError(f"range(): more than {MAX_RANGE_ITEMS:,} items in one row's templates")
        _range_left.set(left)
        return r

    def _lipsum(self, n: int = 5, *args: Any, **kwargs: Any) -> str:
        if not isinstance(n, int) or n > 100:
            raise TemplateLimitError("lipsum(): at most 100 paragraphs")
        return str(jinja2.utils.generate_lorem_ipsum(n, *args, **kwargs))

    def render_bounded(self, template: jinja2.Template, values: dict[str, Any], used: int = 0) -> str:
        """Render ``template``; raises PromptTooLong once ``used`` plus the output passes ``max_chars``."""
        parts: list[str] = []
        total = used
        pieces: Iterator[str] = template.generate(values)
        for piece in pieces:
            total += len(piece)
            if total > self.max_chars:
                raise PromptTooLong(self.max_chars)
            parts.append(piece)
        return "".join(parts)

    # -- sizes -------------------------------------------------------------------------------------------------
    def _sized(self, value: Any, what: str) -> Any:
        if _size(value) > self.max_chars:
            raise TemplateLimitError(f"{what} built a value of more than {self.max_chars:,} items")
        return value

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        cap = self.max_chars
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * abs(left).bit_length() > MAX_POWER_BITS:
                raise TemplateLimitError(f"{left} ** {right}: the result would be too large")
        elif operator == "*":
            seq, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(times, int) and _size(seq) * max(times, 0) > cap:
                raise TemplateLimitError(f"`*` would build more than {cap:,} items")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, "`%` formatting")
        return self._sized(super().call_binop(context, operator, left, right), f"`{operator}`")

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(owner, str):
            if name in _WIDTH_METHODS and args and isinstance(args[0], int) and args[0] > __self.max_chars:
                raise TemplateLimitError(f"str.{name}({args[0]}): wider than {__self.max_chars:,} characters")
            if name == "expandtabs" and owner.count("\t") * (args[0] if args else 8) > __self.max_chars:
                raise TemplateLimitError("str.expandtabs would build too long a string")
            if name == "replace" and len(args) >= 2:
                _check_replace(owner, args[0], args[1], __self.max_chars)
        result = super().call(__context, __obj, *args, **kwargs)
        return __self._sized(result, f"{name or 'a call'}()")

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        owner = getattr(value, "__self__", None)
        if isinstance(owner, str) and getattr(value, "__name__", "") in ("format", "format_map"):
            _check_format(owner, f"str.{value.__name__}")
        return super().wrap_str_format(value)

    def getattr(self, obj: Any, attribute: str) -> Any:
        return self._read(obj, attribute, super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        return self._read(obj, argument, super().getitem(obj, argument))

    def _read(self, obj: Any, name: Any, value: Any) -> Any:
        if value is None:
            return null(str(name))
        if isinstance(obj, jinja2.utils.Namespace):  # a namespace can accumulate across loop iterations
            return self._sized(value, f"namespace value {name!r}")
        return value

    # -- filters -----------------------------------------------------------------------------------------------
    def _guarded(self, fn: Callable[..., Any], check: Callable[[tuple[Any, ...]], None] | None) -> Callable[..., Any]:
        @functools.wraps(fn)  # keeps jinja's pass_context / pass_eval_context marks
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if check is not None:
                check(args[1:] if getattr(fn, "jinja_pass_arg", None) else args, **kwargs)
            return self._sized(fn(*args, **kwargs), f"filter {fn.__name__.removeprefix('do_')}")

        return guarded

    def _width_filter(self, args: tuple[Any, ...], width: int = 80, **_: Any) -> None:
        width = args[1] if len(args) > 1 else width
        if isinstance(width, int) and width > self.max_chars:
            raise TemplateLimitError(f"center({width}): wider than {self.max_chars:,} characters")

    def _indent_filter(self, args: tuple[Any, ...], width: int | str = 4, **_: Any) -> None:
        width = args[1] if len(args) > 1 else width
        per_line = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        lines = str(args[0]).count("\n") + 1 if args else 1
        if per_line * lines > self.max_chars:
            raise TemplateLimitError(f"indent would build more than {self.max_chars:,} characters")

    def _format_filter(self, args: tuple[Any, ...], **_: Any) -> None:
        if args and isinstance(args[0], str):
            _check_format(args[0], "filter format")

    def _replace_filter(self, args: tuple[Any, ...], **_: Any) -> None:
        if len(args) >= 3:
            _check_replace(args[0], args[1], args[2], self.max_chars)
