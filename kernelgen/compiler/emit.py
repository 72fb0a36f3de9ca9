"""Emission: lowered functions -> the module's WAT text, through templates/module.wat.j2.

The template holds the module's frame (header, memory import); the functions come from the one
WAT writer (wat.py). Returns, with the text, the DSL span each line came from.
"""
from __future__ import annotations

from functools import cache

import jinja2

from .ast import Span
from .resources import template_dir
from .wat import Func, Writer

_MARK = "@@FUNCTIONS@@"


@cache
def _template() -> jinja2.Template:
    text = (template_dir() / "module.wat.j2").read_text(encoding="utf-8")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True, autoescape=False)
    return env.from_string(text)


def render_module(funcs: list[Func], cache: dict | None = None, **frame: object) -> tuple[str, list[Span | None]]:
    """The module's text and each line's span. `cache` (kept across the builds of one program, whose
    modules share most functions: lower's memo) holds each function's lines by identity."""
    w = Writer()
    for i, f in enumerate(funcs):
        if i:
            w.line(0, "")
        if cache is not None and id(f) in cache:
            _, lines, spans = cache[id(f)]
            w.lines += lines
            w.spans += spans
            continue
        start = len(w.lines)
        w.func(1, f)
        if cache is not None:  # (f kept with its lines: its id is not reused while the cache lives)
            cache[id(f)] = (f, w.lines[start:], w.spans[start:])
    head, _, tail = _template().render(**frame).partition(_MARK + "\n")
    lines = head.splitlines() + w.lines + tail.splitlines()
    spans = [None] * len(head.splitlines()) + w.spans + [None] * len(tail.splitlines())
    return "\n".join(lines) + "\n", spans
