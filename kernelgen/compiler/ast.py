"""The kernel language's syntax tree: one frozen dataclass per grammar rule, each with its source span.

Nodes are plain data; meaning (types, constants, lowering) is given to them by check.py and lower.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator


@dataclass(frozen=True)
class Span:
    """Where a node stands in the DSL source: 1-based line and column of its first character."""

    file: str
    line: int
    col: int
    end_line: int = 0
    end_col: int = 0

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Node:
    span: Span = field(compare=False, repr=False)


# ---- expressions -------------------------------------------------------------------------------


@dataclass(frozen=True)
class IntLit(Node):
    value: int


@dataclass(frozen=True)
class FloatLit(Node):
    value: float


@dataclass(frozen=True)
class Name(Node):
    id: str


@dataclass(frozen=True)
class Binary(Node):
    op: str
    left: Expr
    right: Expr


@dataclass(frozen=True)
class Unary(Node):
    op: str
    operand: Expr


@dataclass(frozen=True)
class Attr(Node):
    """`base.name`: a quant property (`Q.block`), a packed plane (`w.scale`) or a typed op (`f32x4.load`)."""

    base: Expr
    name: str


@dataclass(frozen=True)
class Index(Node):
    """`base[i]` (a register array) or `base[A, B]` (a generic kernel's compile-time arguments)."""

    base: Expr
    indices: tuple[Expr, ...]


@dataclass(frozen=True)
class Call(Node):
    func: Expr
    args: tuple[Expr, ...]


Expr = IntLit | FloatLit | Name | Binary | Unary | Attr | Index | Call


# ---- statements --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LetStmt(Node):
    name: str
    type: str | None
    value: Expr


@dataclass(frozen=True)
class VarStmt(Node):
    """A mutable local, or with `size` a register array of compile-time length."""

    name: str
    size: Expr | None
    type: str
    value: Expr


@dataclass(frozen=True)
class AssignStmt(Node):
    target: Expr
    op: str  # "=", "+=", "-=", "*="
    value: Expr


@dataclass(frozen=True)
class ForStmt(Node):
    var: str
    start: Expr
    stop: Expr
    step: Expr | None
    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class WhileStmt(Node):
    cond: Expr
    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class UnrollStmt(Node):
    """A loop run by the compiler: the body is emitted once per value, `var` a constant in each copy."""

    var: str
    start: Expr
    stop: Expr
    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class IfStmt(Node):
    """`if`, or with `static` a compile-time choice whose taken arm shares the enclosing scope."""

    cond: Expr
    then: tuple[Stmt, ...]
    orelse: tuple[Stmt, ...]
    static: bool = False


@dataclass(frozen=True)
class ReturnStmt(Node):
    value: Expr | None


@dataclass(frozen=True)
class ExprStmt(Node):
    expr: Expr


Stmt = LetStmt | VarStmt | AssignStmt | ForStmt | WhileStmt | UnrollStmt | IfStmt | ReturnStmt | ExprStmt


# ---- declarations ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConstDecl(Node):
    name: str
    type: str
    value: Expr


@dataclass(frozen=True)
class FieldDecl(Node):
    """One field of a stored quant block, in storage order: `d: f16`, `qs: i8[32]`."""

    name: str
    type: str
    count: int | None


@dataclass(frozen=True)
class TableDecl(Node):
    """A codebook: `table kv = {-127, -104, ...};`, in a quant type or at file level (any type's)."""

    name: str
    values: tuple[Expr, ...]


@dataclass(frozen=True)
class QuantDecl(Node):
    name: str
    block: int | None
    fields: tuple[FieldDecl, ...]
    unpack: Expr | None
    dequant: Expr | None
    tables: tuple[TableDecl, ...] = ()
    sub: int | None = None
    lets: tuple[LetStmt, ...] = ()
    priority: int | None = None  # the weight of its speedups in a build's code budget (budget.spend); None: quant.DEFAULT_PRIORITY


@dataclass(frozen=True)
class Generic(Node):
    name: str
    kind: str  # "quant" or an integer type


@dataclass(frozen=True)
class Param(Node):
    name: str
    type: str
    packed: bool  # `w: packed Q`: the planes of a packed quantized matrix


@dataclass(frozen=True)
class TuneDecl(Node):
    name: str
    type: str
    domain: tuple[int, ...]
    default: int


@dataclass(frozen=True)
class RestrictDecl(Node):
    """`restrict EXPR;`: a condition on the kernel's tune values that every variant meets."""

    cond: Expr


@dataclass(frozen=True)
class ParallelDecl(Node):
    """`parallel ITEMS BEGIN..END in 0..COUNT;`: the kernel's work splits into COUNT items (rows,
    blocks, vector groups, heads), done in chunks [BEGIN, END) on the thread pool's threads."""

    items: str
    begin: str
    end: str
    start: Expr
    count: Expr


@dataclass(frozen=True)
class KernelDecl(Node):
    name: str
    mode: str  # "export", "inline" or "" (internal)
    generics: tuple[Generic, ...]
    params: tuple[Param, ...]
    ret: str | None
    tunes: tuple[TuneDecl, ...]
    body: tuple[Stmt, ...]
    restricts: tuple[RestrictDecl, ...] = ()
    parallel: ParallelDecl | None = None

    @property
    def exported(self) -> bool:
        return self.mode == "export"


@dataclass(frozen=True)
class Program(Node):
    consts: tuple[ConstDecl, ...]
    quants: tuple[QuantDecl, ...]
    kernels: tuple[KernelDecl, ...]
    tables: tuple[TableDecl, ...] = ()  # file-level codebooks, read by any quant type
    source: str = field(compare=False, repr=False, default="")


def names_in(node: object) -> Iterator[str]:
    """Every name a node (or a tuple of nodes) reads, in source order, with repeats."""
    if isinstance(node, Name):
        yield node.id
    if isinstance(node, tuple):
        for item in node:
            yield from names_in(item)
    elif isinstance(node, Node):
        for f in node.__dataclass_fields__:
            if f != "span":
                yield from names_in(getattr(node, f))
