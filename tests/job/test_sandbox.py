"""The prompt sandbox: template failures are row errors, work is bounded, and a null never becomes "None"."""

from __future__ import annotations

import time

import pytest

from mlxbatch.job.rows.prompts import PromptRenderer, PromptTooLongError, RenderError
from mlxbatch.job.spec import PromptSection


def render(template: str, max_chars: int = 1 << 20, **fields):
    return PromptRenderer(PromptSection(template=template), max_chars=max_chars).render(fields).prompt


@pytest.mark.parametrize("template, fields, words", [
    ("{{ x / y }}", {"x": 1, "y": 0}, "ZeroDivisionError"),
    ("{{ x // y }}", {"x": 1, "y": 0}, "ZeroDivisionError"),
    ("{{ a + b }}", {"a": 1, "b": "s"}, "TypeError"),
    ("{{ range(n) }}", {"n": 10**9}, "range()"),
    ("{{ range(n)|list }}", {"n": 10**6}, "range()"),
    ("{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}", {}, "range()"),
    ("{{ s * n }}", {"s": "ab", "n": 10**10}, "`*`"),
    ("{{ [1] * n }}", {"n": 10**10}, "`*`"),
    ("{{ 2 ** n }}", {"n": 10**9}, "too large"),
    ("{{ '%999999999d' % 1 }}", {}, "widths"),
    ("{{ '%*d' % (n, 1) }}", {"n": 10**9}, "widths"),
    ("{{ '{:>999999999}'.format(1) }}", {}, "widths"),
    ("{{ '{0:{1}}'.format(1, n) }}", {"n": 10**9}, "widths"),
    ("{{ '%s'|format(1) }}{{ '%999999999s'|format(1) }}", {}, "widths"),
    ("{{ s.center(n) }}", {"s": "x", "n": 10**10}, "wider"),
    ("{{ s.zfill(n) }}", {"s": "x", "n": 10**10}, "wider"),
    ("{{ s|center(n) }}", {"s": "x", "n": 10**10}, "wider"),
    ("{{ s|indent(n) }}", {"s": "a\nb", "n": 10**10}, "indent"),
    ("{{ s|replace('', t) }}", {"s": "a" * 10_000, "t": "z" * 1000}, "replace"),
    ("{{ s.replace('a', t) }}", {"s": "a" * 10_000, "t": "z" * 1000}, "replace"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     {}, "namespace"),
    ("{{ lipsum(n) }}", {"n": 10**8}, "lipsum"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", {}, "RecursionError"),
    ("{{ x.__class__.__mro__ }}", {"x": 1}, "unsafe"),
])
def test_template_failures_and_runaway_work_are_render_errors(template, fields, words):
    start = time.monotonic()
    with pytest.raises(RenderError, match=None) as info:
        render(template, **fields)
    assert words in str(info.value), str(info.value)
    assert time.monotonic() - start < 5, "a template limit must stop the work early"


def test_a_long_output_stops_at_the_bound_as_too_long():
    with pytest.raises(PromptTooLongError):
        render("{% for i in range(99999) %}{{ t }}{% endfor %}", max_chars=100_000, t="x" * 1000)
    with pytest.raises(PromptTooLongError):
        render("{{ t }}", max_chars=1000, t="y" * 1001)
    assert render("{{ t }}", max_chars=1000, t="y" * 1000) == "y" * 1000
    # the bound covers every message of a chat prompt together
    chat = PromptRenderer(PromptSection(system="{{ t }}", messages=({"role": "user", "content": "{{ t }}"},)),
                          max_chars=1500)
    with pytest.raises(PromptTooLongError):
        chat.render({"t": "z" * 800})


def test_a_null_printed_is_a_render_error_unless_the_template_handles_it():
    with pytest.raises(RenderError, match="'text' is null"):
        render("Echo exactly: [{{ text }}]", text=None)
    with pytest.raises(RenderError, match="'title' is null"):
        render("{{ meta.title }}", meta={"title": None})
    with pytest.raises(RenderError, match="null"):
        render("{% for x in xs %}{{ x }}{% endfor %}", xs=["a", None])
    with pytest.raises(RenderError, match="null"):
        render("{{ text ~ '!' }}", text=None)
    assert render("[{{ text or '' }}]", text=None) == "[]"
    assert render("{{ text|default('none given') }}", text=None) == "none given"
    assert render("{% if text is none %}N{% else %}{{ text }}{% endif %}", text=None) == "N"
    assert render("{% if text %}{{ text }}{% else %}empty{% endif %}", text=None) == "empty"
    assert render("{{ text == none }}", text=None) == "True"
    assert render("{{ meta.title or 'untitled' }}", meta={"title": None}) == "untitled"


def test_ordinary_templates_still_render():
    assert render("{{ '{a}-{b:>3}'.format(a=1, b=2) }}") == "1-  2"
    assert render("{{ '%-5s|%.2f' % ('a', 1.5) }}") == "a    |1.50"
    assert render("{% for i in range(3) %}{{ i }}{% endfor %}{{ 'ab' * 3 }}{{ 2 ** 10 }}") == "012ababab1024"
    assert render("{{ xs|join(', ') }} {{ s|center(7) }}|{{ s|indent(2, first=True) }}", xs=[1, 2], s="x") \
        == "1, 2    x   |  x"
    assert render("{{ 10 / d }}", d=4) == "2.5"


@pytest.mark.parametrize(("system", "text_only"), [
    ("Label this review.", True), ("Plain {# a comment #} text\n", True), ("{% raw %}{{x}}{% endraw %}", True),
    ("trailing\n\n", True), ("Hi {{ x }}", False), ("{% if x %}a{% endif %}", False), ('{{ "lit" }}', False)])
def test_a_text_only_template_is_rendered_once_to_what_each_row_would_render(system, text_only):
    section = PromptSection(messages=({"role": "system", "content": system}, {"role": "user", "content": "{{ x }}"}))
    once, every_row = PromptRenderer(section), PromptRenderer(section)
    every_row._constant.clear()
    assert len(once._constant) == text_only
    for x in ("v", "another value"):
        assert once.render({"x": x}) == every_row.render({"x": x})


@pytest.mark.parametrize("template", ["{{ x }}", "{{x}}", "{{ x }}\n", "{{ x|trim }}", "{{ y }}"])
@pytest.mark.parametrize("x", ["  a text  ", "", "{{ not a template }}", 7, 2.5, None, ["a"], True])
def test_a_template_printing_one_field_renders_what_jinja_renders(template, x):
    """``{{ x }}`` of a text field skips Jinja (its value is what Jinja prints); other values and other templates
    render, with the same errors (a null printed, a missing field)."""
    fast, jinja = PromptRenderer(PromptSection(template=template)), PromptRenderer(PromptSection(template=template))
    jinja._field.clear()
    assert len(fast._field) == (template in ("{{ x }}", "{{x}}", "{{ y }}"))

    def outcome(r):
        try:
            return r.render({"x": x}).prompt
        except RenderError as exc:
            return type(exc), str(exc)

    assert outcome(fast) == outcome(jinja)


def test_a_field_printed_alone_counts_toward_the_prompt_bound():
    r = PromptRenderer(PromptSection(system="{{ s }}", template="{{ x }}"), max_chars=5)
    assert r.render({"s": "ab", "x": "xyz"}).prompt[1]["content"] == "xyz"
    with pytest.raises(PromptTooLongError):
        r.render({"s": "ab", "x": "wxyz"})


def test_a_text_only_part_counts_toward_the_prompt_bound():
    r = PromptRenderer(PromptSection(system="abc", template="{{ x }}"), max_chars=5)
    assert r.render({"x": "xy"}).prompt[0]["content"] == "abc"
    with pytest.raises(PromptTooLongError):
        r.render({"x": "xyz"})
    with pytest.raises(PromptTooLongError):  # longer than the bound alone: not kept, each row refused
        PromptRenderer(PromptSection(template="abcdef"), max_chars=3).render({})
