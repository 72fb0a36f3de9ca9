"""Parser: kernels.dsl text -> ast.Program. Lark (LALR) does the grammar; this module only builds
nodes with spans and turns lark's exceptions into `file:line:col` errors."""
from __future__ import annotations

import os
import sys
from functools import cache, lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import lark
from lark import Token, Transformer, v_args

from . import ast as A
from ..errors import DslError


@cache
def _parser() -> lark.Lark:
    """The LALR parser. Its tables are kept in lark's cache file, which lark checks against the
    grammar's hash (building them took 0.9-1 s of every `kernelgen build`, loading them 0.06 s), in
    the user's own cache directory: lark's default, the shared temp directory, would load a pickle
    any local user could have put there. Without a writable one, lark builds the tables each time."""
    grammar = resources.files("kernelgen.compiler").joinpath("grammar.lark").read_text(encoding="utf-8")
    return lark.Lark(grammar, parser="lalr", start=["program", "expr"], propagate_positions=True,
                     maybe_placeholders=True, cache=_cache_file())


def _cache_file() -> str | bool:
    """$XDG_CACHE_HOME/kernelgen (or ~/.cache/kernelgen)/grammar-lark<version>-py<version>, or False."""
    try:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kernelgen"
        root.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError):  # no home, a read-only file system
        return False
    return str(root / f"grammar-lark{lark.__version__}-py{sys.version_info[0]}{sys.version_info[1]}")


# Terminal names lark reports in "expected ..." lists, spelled as the user would type them.
_TERMINAL_TEXT = {
    "SEMICOLON": "';'", "COLON": "':'", "COMMA": "','", "DOT": "'.'", "LPAR": "'('", "RPAR": "')'",
    "LBRACE": "'{'", "RBRACE": "'}'", "LSQB": "'['", "RSQB": "']'", "EQUAL": "'='",
    "NAME": "a name", "INT": "an integer", "FLOAT": "a number", "_ARROW": "'->'", "_DOTDOT": "'..'",
    "CMP_OP": "a comparison", "ADD_OP": "'+' or '-'", "MUL_OP": "'*', '/' or '%'", "ASSIGN_OP": "'='",
    "UNARY_OP": "'-' or '~'", "SHIFT_OP": "'<<' or '>>'", "OR_OP": "'|'", "AND_OP": "'&'", "XOR_OP": "'^'",
    "$END": "end of file",
}


def _describe(expected: set[str]) -> str:
    words = sorted({_TERMINAL_TEXT.get(t, repr(t.lower()) if t.isupper() else t) for t in expected})
    if not words:  # after a whole expression (parse_expr): nothing may follow
        return "end of file"
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _end_of_previous(source: str, pos: int) -> tuple[int, int] | None:
    """(line, column) just after the last character of code before `pos` (comments skipped)."""
    lines = source[:pos].split("\n")
    for i in range(len(lines) - 1, -1, -1):
        code = lines[i].split("#", 1)[0].rstrip()
        if code:
            return i + 1, len(code) + 1
    return None

# Explicit limits, reported as located errors: beyond them the recursive passes (this module's
# transformer, check, lower) would run out of Python stack, or int() out of digits.
MAX_NESTING = 200  # parse-tree levels: an operator, a call or an `if` adds one or two (`1 + 1 + ...` one per `+`)
MAX_LITERAL_CHARS = 400  # characters in one number literal
MAX_INT_LITERAL = 2**64 - 1  # the widest integer type, i64, read as unsigned


def _check_nesting(tree: lark.Tree, filename: str, source: str) -> None:
    """Walk the parse tree without recursion; a DslError at the first node nested too deep."""
    todo = [(tree, 1)]
    while todo:
        node, depth = todo.pop()
        if depth > MAX_NESTING:
            meta = node.meta
            span = A.Span(filename, meta.line, meta.column) if not meta.empty else A.Span(filename, 1, 1)
            raise DslError(span, f"nested more than {MAX_NESTING} levels deep (expressions, calls, blocks); "
                                 "split it with let bindings or kernels", source)
        todo.extend((c, depth + 1) for c in node.children if isinstance(c, lark.Tree))


@lru_cache(maxsize=8)
def parse(source: str, filename: str = "kernels.dsl") -> A.Program:
    """Parse DSL source; raise DslError (with the source attached) on any syntax error. The tree is
    frozen, so a source parsed again is the same tree: the tuner builds one source per variant
    (0.2 s of parsing each, most of a small case's build)."""
    return _parse(source, filename, "program")


def parse_expr(source: str, text: str, line: int, col: int, filename: str = "kernels.dsl") -> A.Expr:
    """Parse `text`, an expression that sits at `line`:`col` of `source` (in a comment: a parameter's
    extent, check.py), with the spans and errors of the same text in code there."""
    try:
        return _parse("\n" * (line - 1) + " " * (col - 1) + text, filename, "expr")
    except DslError as e:
        raise DslError(e.span, e.message.replace("end of file", "end of the expression"), source) from None


def _parse(source: str, filename: str, start: str) -> Any:
    try:
        tree = _parser().parse(source, start=start)
    except lark.UnexpectedCharacters as e:
        span = A.Span(filename, e.line, e.column)
        raise DslError(span, f"unexpected character {source[e.pos_in_stream]!r}", source) from None
    except lark.UnexpectedToken as e:
        tok = e.token
        if tok.type == "$END":
            lines = source.splitlines() or [""]
            span = A.Span(filename, len(lines), len(lines[-1]) + 1)
            raise DslError(span, f"unexpected end of file, expected {_describe(e.expected)}", source) from None
        end = _end_of_previous(source, tok.start_pos)
        if "SEMICOLON" in e.expected and end is not None and end[0] < tok.line:
            # The next statement (or a '}') on a later line: the statement before it lacks its ';'.
            raise DslError(A.Span(filename, *end), "missing ';' at the end of this statement", source) from None
        span = A.Span(filename, tok.line, tok.column)
        raise DslError(span, f"unexpected {tok.value!r}, expected {_describe(e.expected)}", source) from None
    except lark.UnexpectedEOF as e:
        lines = source.splitlines() or [""]
        span = A.Span(filename, len(lines), len(lines[-1]) + 1)
        raise DslError(span, f"unexpected end of file, expected {_describe(set(e.expected))}", source) from None
    _check_nesting(tree, filename, source)
    try:
        return _Build(filename, source).transform(tree)
    except lark.exceptions.VisitError as e:
        if isinstance(e.orig_exc, DslError):
            raise e.orig_exc.with_source(source) from None
        raise


def _no_parallel(stmts: tuple) -> None:
    for s in stmts:
        if isinstance(s, A.ParallelDecl):
            raise DslError(s.span, "'parallel' must be the kernel's first statement (after its tune and restrict lines)")


def _int(tok: Token, filename: str) -> int:
    text = str(tok)
    span = A.Span(filename, tok.line or 1, tok.column or 1)
    if len(text) > MAX_LITERAL_CHARS:
        raise DslError(span, f"a number literal of {len(text)} characters; at most {MAX_LITERAL_CHARS}")
    value = int(text, 16) if text[:2] in ("0x", "0X") else int(text, 10)  # 08 is eight, as written
    if value > MAX_INT_LITERAL:
        raise DslError(span, f"integer literal {text} is out of range: no integer type holds it (at most {MAX_INT_LITERAL})")
    return value


def _float(tok: Token, filename: str) -> float:
    text = str(tok)
    span = A.Span(filename, tok.line or 1, tok.column or 1)
    if len(text) > MAX_LITERAL_CHARS:
        raise DslError(span, f"a number literal of {len(text)} characters; at most {MAX_LITERAL_CHARS}")
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise DslError(span, f"float literal {text} is out of range: it overflows even f64")
    return value


@v_args(meta=True, inline=True)
class _Build(Transformer):
    """Thin tree -> dataclass transformer; semantic checks live in check.py."""

    def __init__(self, filename: str, source: str) -> None:
        super().__init__()
        self.filename = filename
        self.source = source

    def _span(self, meta: Any) -> A.Span:
        if getattr(meta, "empty", True):
            return A.Span(self.filename, 1, 1)
        return A.Span(self.filename, meta.line, meta.column, meta.end_line, meta.end_column)

    # ---- expressions
    def int_lit(self, meta, tok):
        return A.IntLit(self._span(meta), _int(tok, self.filename))

    def float_lit(self, meta, tok):
        return A.FloatLit(self._span(meta), _float(tok, self.filename))

    def name(self, meta, tok):
        return A.Name(self._span(meta), str(tok))

    def binary(self, meta, left, op, right):
        return A.Binary(self._span(meta), str(op), left, right)

    def unary(self, meta, op, operand):
        return A.Unary(self._span(meta), str(op), operand)

    def attr(self, meta, base, name):
        return A.Attr(self._span(meta), base, str(name))

    def index(self, meta, base, *indices):
        return A.Index(self._span(meta), base, tuple(indices))

    def call(self, meta, func, *args):
        return A.Call(self._span(meta), func, tuple(a for a in args if a is not None))

    # ---- statements
    def block(self, meta, *stmts):
        _no_parallel(stmts)
        return tuple(stmts)

    def let_stmt(self, meta, name, type_, value):
        return A.LetStmt(self._span(meta), str(name), str(type_) if type_ is not None else None, value)

    def array_size(self, meta, expr):
        return expr

    def var_stmt(self, meta, name, size, type_, value):
        return A.VarStmt(self._span(meta), str(name), size, str(type_), value)

    def assign_stmt(self, meta, target, op, value):
        return A.AssignStmt(self._span(meta), target, str(op), value)

    def for_stmt(self, meta, var, start, stop, step, body):
        return A.ForStmt(self._span(meta), str(var), start, stop, step, body)

    def while_stmt(self, meta, cond, body):
        return A.WhileStmt(self._span(meta), cond, body)

    def unroll_stmt(self, meta, var, start, stop, body):
        return A.UnrollStmt(self._span(meta), str(var), start, stop, body)

    def if_stmt(self, meta, static, cond, then, orelse):
        if isinstance(orelse, A.IfStmt):
            if orelse.static != bool(static):
                raise DslError(orelse.span, "an 'else if' is static exactly when its 'if' is: write 'else static if'"
                                            if static else "a 'static if' cannot be the 'else' of a runtime 'if'")
            orelse = (orelse,)
        return A.IfStmt(self._span(meta), cond, then, orelse or (), bool(static))

    def return_stmt(self, meta, value):
        return A.ReturnStmt(self._span(meta), value)

    def expr_stmt(self, meta, expr):
        return A.ExprStmt(self._span(meta), expr)

    # ---- declarations
    def const_decl(self, meta, name, type_, value):
        return A.ConstDecl(self._span(meta), str(name), str(type_), value)

    def block_decl(self, meta, size):
        return ("block", _int(size, self.filename), self._span(meta))

    def array_len(self, meta, n):
        return _int(n, self.filename)

    def field_decl(self, meta, name, type_, count):
        return ("field", A.FieldDecl(self._span(meta), str(name), str(type_), count), self._span(meta))

    def sub_decl(self, meta, size):
        return ("sub", _int(size, self.filename), self._span(meta))

    def priority_decl(self, meta, weight):
        return ("priority", _int(weight, self.filename), self._span(meta))

    def let_decl(self, meta, name, value):
        return ("let", A.LetStmt(self._span(meta), str(name), None, value), self._span(meta))

    def table_decl(self, meta, name, *values):
        return ("table", A.TableDecl(self._span(meta), str(name), tuple(values)), self._span(meta))

    def unpack_decl(self, meta, expr):
        return ("unpack", expr, self._span(meta))

    def dequant_decl(self, meta, expr):
        return ("dequant", expr, self._span(meta))

    def quant_decl(self, meta, name, *items):
        parts: dict[str, Any] = {"block": None, "sub": None, "priority": None, "unpack": None, "dequant": None}
        lists: dict[str, list] = {"field": [], "table": [], "let": []}
        for kind, value, span in items:
            if kind in lists:
                lists[kind].append(value)
            elif parts[kind] is not None:
                raise DslError(span, f"quant {name}: '{kind}' given twice")
            else:
                parts[kind] = value
        return A.QuantDecl(self._span(meta), str(name), parts["block"], tuple(lists["field"]), parts["unpack"],
                       parts["dequant"], tuple(lists["table"]), parts["sub"], tuple(lists["let"]),
                       parts["priority"])

    def mode(self, meta, tok):
        return str(tok)

    def packed(self, meta):
        return True

    def generics(self, meta, *gs):
        return tuple(gs)

    def generic(self, meta, name, kind):
        return A.Generic(self._span(meta), str(name), str(kind))

    def param(self, meta, name, packed, type_):
        return A.Param(self._span(meta), str(name), str(type_), bool(packed))

    def ret(self, meta, type_):
        return str(type_)

    def tune_decl(self, meta, name, type_, *values):
        *domain, default = (_int(v, self.filename) for v in values)
        return A.TuneDecl(self._span(meta), str(name), str(type_), tuple(domain), default)

    def restrict_decl(self, meta, expr):
        return A.RestrictDecl(self._span(meta), expr)

    def parallel_decl(self, meta, items, begin, end, start, count):
        return A.ParallelDecl(self._span(meta), str(items), str(begin), str(end), start, count)

    def kernel_decl(self, meta, mode, name, generics, *rest):
        params = tuple(r for r in rest if isinstance(r, A.Param))
        first = next((r for r in rest if isinstance(r, A.Node)
                      and not isinstance(r, (A.Param, A.Generic, A.TuneDecl, A.RestrictDecl))), None)
        parallel = first if isinstance(first, A.ParallelDecl) else None
        restricts = tuple(r for r in rest if isinstance(r, A.RestrictDecl))
        ret = next((r for r in rest if isinstance(r, str)), None)
        tunes = tuple(r for r in rest if isinstance(r, A.TuneDecl))
        body = tuple(r for r in rest if isinstance(r, A.Node)
                     and not isinstance(r, (A.Param, A.TuneDecl, A.RestrictDecl)) and r is not parallel)
        _no_parallel(body)
        return A.KernelDecl(self._span(meta), str(name), mode or "", generics or (), params, ret, tunes, body, restricts,
                        parallel)

    def program(self, meta, *items):
        return A.Program(
            self._span(meta),
            consts=tuple(i for i in items if isinstance(i, A.ConstDecl)),
            quants=tuple(i for i in items if isinstance(i, A.QuantDecl)),
            kernels=tuple(i for i in items if isinstance(i, A.KernelDecl)),
            tables=tuple(i[1] for i in items if isinstance(i, tuple) and i[0] == "table"),
            source=self.source,
        )
