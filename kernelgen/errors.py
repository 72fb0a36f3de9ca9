"""User-facing errors. Every mistake in a kernel file is reported as `file:line:col: message`, the
source line and a caret, so an editor can jump to it; the CLI turns these into exit code 2."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # spans come from the compiler; the host raises these errors without it
    from .compiler.ast import Span


class KernelgenError(Exception):
    """An error the user can fix (bad input, not a bug in kernelgen); the CLI prints it and exits 2."""


class UnknownName(KeyError, ValueError):
    """A name this build does not have (an export, a kernel, a quant type, a pool job): API misuse,
    so a ValueError, and a failed lookup, so a KeyError. Its message reads as written (a KeyError's
    str is the repr of its argument)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DslError(KernelgenError):
    """A mistake at a place in the DSL source."""

    def __init__(self, span: Span | None, message: str, source: str = "") -> None:
        super().__init__(message)
        self.span = span
        self.message = message
        self.source = source

    def __reduce__(self) -> tuple:  # pickled whole (a parallel build's process raises it to the parent)
        return type(self), (self.span, self.message, self.source)

    def with_source(self, source: str) -> DslError:
        if not self.source:
            self.source = source
        return self

    def __str__(self) -> str:
        if self.span is None:
            return self.message
        text = f"{self.span}: {self.message}"
        lines = self.source.splitlines()
        if 1 <= self.span.line <= len(lines):
            line = lines[self.span.line - 1].rstrip()
            text += f"\n    {line}\n    {' ' * (self.span.col - 1)}^"
        return text
