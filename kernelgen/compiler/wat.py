"""WAT as data, and the one writer that prints it.

Lowering builds instructions as objects (folded S-expressions); only `write_func` turns them into
text, so indentation, line breaks and source comments are decided in one place. The writer also
records which DSL span each output line came from, so assembler errors map back to kernels.dsl.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .ast import Span

WIDTH = 100  # fold an instruction onto several lines past this many columns
INDENT = "  "


@dataclass(frozen=True)
class Instr:
    """One instruction with its immediates and its folded operands: `(op imm... arg...)`."""

    op: str
    imms: tuple[str, ...] = ()
    args: tuple[Instr, ...] = ()


def I(op: str, *rest: str | int | Instr) -> Instr:  # noqa: E743 - reads like the WAT it builds
    """Shorthand: strings and ints are immediates, Instr values are operands."""
    imms = tuple(str(r) for r in rest if not isinstance(r, Instr))
    args = tuple(r for r in rest if isinstance(r, Instr))
    return Instr(op, imms, args)


@dataclass
class Comment:
    """`;; text`, marking the DSL statement the following code comes from."""

    text: str
    span: Span | None = None


@dataclass
class Block:
    """`block` or `loop` with a label."""

    kind: str
    label: str
    body: list[Stmt] = field(default_factory=list)


@dataclass
class If:
    cond: Instr
    then: list[Stmt]
    orelse: list[Stmt] = field(default_factory=list)


Stmt = Instr | Comment | Block | If


@dataclass
class Func:
    name: str
    params: list[tuple[str, str]]
    result: str | None
    locals: list[tuple[str, str]]
    body: list[Stmt]
    export: str | None = None
    doc: list[str] = field(default_factory=list)
    span: Span | None = None


def _map_stmts(stmts: list[Stmt], f) -> list[Stmt]:
    """`stmts` with `f` applied to every instruction tree in them (inside blocks and ifs too)."""
    out: list[Stmt] = []
    for st in stmts:
        if isinstance(st, Instr):
            out.append(f(st))
        elif isinstance(st, Block):
            out.append(Block(st.kind, st.label, _map_stmts(st.body, f)))
        elif isinstance(st, If):
            out.append(If(f(st.cond), _map_stmts(st.then, f), _map_stmts(st.orelse, f)))
        else:
            out.append(st)
    return out


def share_vector_constants(body: list[Stmt], taken: set[str]) -> tuple[list[Stmt], list[tuple[str, str]]]:
    """`body` with each v128.const it uses more than once read from a local set at its start, and
    those locals: 2 bytes per use in place of 18 (a 4-row tile repeats its nibble mask eight times),
    the same values to an engine (a local set once is its constant). Names say the value
    (`$i8x16_15`; a few runs of lanes, `$i16x8_4x4_1x4`; else `$i16x8_const_2`), none of them in
    `taken`."""
    counts: dict[tuple[str, ...], int] = {}

    def count(x: Instr) -> Instr:
        if x.op == "v128.const":
            counts[x.imms] = counts.get(x.imms, 0) + 1
        for a in x.args:
            count(a)
        return x

    _map_stmts(body, count)
    names: dict[tuple[str, ...], str] = {}
    for imms, n in counts.items():
        if n > 1:
            shape, lanes = imms[0], imms[1:]
            runs = [(v, len(list(g))) for v, g in itertools.groupby(lanes)]
            base = (f"{shape}_{lanes[0]}" if len(runs) == 1 else f"{shape}_" + "_".join(f"{v}x{n}" for v, n in runs)
                    if len(runs) <= 3 else f"{shape}_const")
            base = base.replace("-", "m").replace(".", "_").replace("+", "")
            name, i = base, 1
            while name in taken or name in names.values():
                i += 1
                name = f"{base}_{i}"
            names[imms] = name
    if not names:
        return body, []

    def swap(x: Instr) -> Instr:
        if x.op == "v128.const" and x.imms in names:
            return I("local.get", f"${names[x.imms]}")
        return Instr(x.op, x.imms, tuple(swap(a) for a in x.args)) if x.args else x

    sets: list[Stmt] = [Comment("vector constants used more than once")]
    sets += [I("local.set", f"${name}", Instr("v128.const", imms)) for imms, name in names.items()]
    return sets + _map_stmts(body, swap), [(name, "v128") for name in names.values()]


def walk(code: Instr) -> Iterator[Instr]:
    """Every instruction of `code`'s tree, in no particular order (a stack, not nested generators:
    each statement is walked as it is emitted)."""
    todo = [code]
    while todo:
        x = todo.pop()
        yield x
        todo.extend(x.args)


def untee_unread(body: list[Stmt]) -> list[Stmt]:
    """`body` with each `local.tee` of a local nothing reads replaced by its value: what a load
    shared in case of a second use (Lowerer.load_once) becomes when it has none."""
    reads: set[str] = set()

    def note(x: Instr) -> Instr:
        reads.update(y.imms[0] for y in walk(x) if y.op == "local.get")
        return x

    _map_stmts(body, note)

    def untee(x: Instr) -> Instr:
        if x.op == "local.tee" and x.imms[0] not in reads:
            return untee(x.args[0])
        return Instr(x.op, x.imms, tuple(untee(a) for a in x.args)) if x.args else x

    return _map_stmts(body, untee)


_BRANCHES = frozenset({"br", "br_if", "br_table", "return", "unreachable"})
_LOCAL_OPS = frozenset({"local.get", "local.set", "local.tee"})
_PURE_VALUES = frozenset({"local.get", "i32.const", "i64.const", "f32.const", "f64.const", "v128.const"})


Uses = dict[int, tuple[Stmt, frozenset[str], bool]]  # _uses's memo: by id, the statement kept alive


def _uses(st: Stmt, memo: Uses) -> tuple[frozenset[str], bool]:
    """The locals `st` names (read or written, at any depth) and whether it can branch."""
    known = memo.get(id(st))
    if known is not None:
        return known[1], known[2]
    names: set[str] = set()
    branches = False
    if isinstance(st, Instr):
        if st.op in _LOCAL_OPS:
            names.add(st.imms[0])
        branches = st.op in _BRANCHES
        parts: list[Stmt] = list(st.args)
    elif isinstance(st, Block):
        parts = st.body
    elif isinstance(st, If):
        parts = [st.cond, *st.then, *st.orelse]
    else:
        parts = []
    for part in parts:
        n, b = _uses(part, memo)
        names |= n
        branches |= b
    memo[id(st)] = (st, frozenset(names), branches)
    return frozenset(names), branches


def _is_zero(x: Instr) -> bool:
    """A constant whose bits are all zero (not -0.0): the value a wasm local starts with."""
    if x.op == "v128.const":
        return all(v.lstrip("+") in ("0", "0.0", "0x0") for v in x.imms[1:])
    return x.op in ("i32.const", "i64.const", "f32.const", "f64.const") and x.imms[0] in ("0", "0.0")


def _set_of(st: Stmt) -> str | None:
    """The local a statement `(local.set $x value)` sets, if it is one."""
    return st.imms[0] if isinstance(st, Instr) and st.op == "local.set" else None


def _overwritten(stmts: list[Stmt], x: str, memo: Uses) -> bool:
    """Whether the first of `stmts` that names local x, before any that can branch, sets it from a
    value that does not read it: x's value before them is never read."""
    for st in stmts:
        names, branches = _uses(st, memo)
        if _set_of(st) == x and x not in _uses(st.args[0], memo)[0]:
            return True
        if x in names or branches:
            return False
    return False


def locals_named(body: list[Stmt]) -> set[str]:
    """The locals `body` reads or writes (`$name`): a declared local outside it is left over from
    code the emitter did not keep, and is not declared."""
    memo: Uses = {}
    return set().union(*(_uses(st, memo)[0] for st in body))


def drop_dead_stores(body: list[Stmt], params: set[str]) -> list[Stmt]:
    """`body` (a function's) without the stores no one reads: a `local.set` of a constant or a local
    whose local is set again, later in the same statement list, before anything reads it or any
    branch; and, in the function's own list, a zero set before anything else names its local (locals
    start at zero; `params` do not). What a `var` declaration's initial value and an assignment
    right after it lower to: engines drop them as well, so the code runs the same, and the module
    is smaller and reads as it would be written by hand. A comment left with no code under it goes
    too."""
    memo: Uses = {}

    def one(stmts: list[Stmt], top: bool) -> list[Stmt]:
        stmts = _nested(stmts, lambda inner: one(inner, False))
        named: set[str] = set()  # locals the statements before this one name (the function's list)
        keep: list[Stmt] = []
        for i, st in enumerate(stmts):
            x = _set_of(st)
            dead = False
            if x is not None and st.args[0].op in _PURE_VALUES:
                if top and x not in named and x not in params and _is_zero(st.args[0]):
                    dead = True
                else:
                    dead = _overwritten(stmts[i + 1:], x, memo)
            if not dead:
                keep.append(st)
            if top:
                named |= _uses(st, memo)[0]
        return [s for i, s in enumerate(keep)
                if not isinstance(s, Comment) or (i + 1 < len(keep) and not isinstance(keep[i + 1], Comment))]

    return one(body, True)


def _nested(stmts: list[Stmt], f: Callable[[list[Stmt]], list[Stmt]]) -> list[Stmt]:
    """`stmts` with `f` applied to the statement lists of its blocks and ifs."""
    return [Block(s.kind, s.label, f(s.body)) if isinstance(s, Block)
            else If(s.cond, f(s.then), f(s.orelse)) if isinstance(s, If) else s for s in stmts]


def _lists(stmts: list[Stmt]) -> Iterator[list[Stmt]]:
    """`stmts` and every statement list inside it."""
    yield stmts
    for s in stmts:
        if isinstance(s, Block):
            yield from _lists(s.body)
        elif isinstance(s, If):
            yield from _lists(s.then)
            yield from _lists(s.orelse)


def _forwards(stmts: list[Stmt]) -> list[tuple[int, int]]:
    """(i, j): statement i sets a local, and the next statement that is not a comment, j, copies it
    into another."""
    code = [i for i, st in enumerate(stmts) if not isinstance(st, Comment)]
    pairs = []
    for i, j in zip(code, code[1:]):
        a, b = _set_of(stmts[i]), _set_of(stmts[j])
        if a is not None and b is not None and b != a and stmts[j].args[0] == Instr("local.get", (a,)):
            pairs.append((i, j))
    return pairs


def forward_copies(body: list[Stmt], params: set[str]) -> list[Stmt]:
    """`body` (a function's) with `(local.set $a E) (local.set $b (local.get $a))` as `(local.set $b E)`
    where the copy is the only read of that value of $a: every read of $a in the function is such a
    copy right after one of its sets, or the next statement after the copy that names $a (before
    any branch) sets it anew from a value that does not read it. What an inline kernel's `return`
    into a `let` lowers to (`$ret`, then the caller's name): the value reaches $b as before, with a
    store and a read fewer."""
    while True:
        gets: dict[str, int] = {}
        tees: set[str] = set()

        def count(x: Instr) -> Instr:
            if x.op == "local.get":
                gets[x.imms[0]] = gets.get(x.imms[0], 0) + 1
            elif x.op == "local.tee":
                tees.add(x.imms[0])
            for a in x.args:
                count(a)
            return x

        _map_stmts(body, count)
        copies: dict[str, int] = {}
        for stmts in _lists(body):
            for i, _ in _forwards(stmts):
                copies[_set_of(stmts[i])] = copies.get(_set_of(stmts[i]), 0) + 1
        through = {a for a, n in copies.items() if gets.get(a) == n and a not in tees and a not in params}
        memo: Uses = {}
        before = body

        def rewrite(stmts: list[Stmt]) -> list[Stmt]:
            out = list(stmts)
            drop = set()
            for i, j in _forwards(stmts):
                a = _set_of(stmts[i])
                if a in through or _overwritten(stmts[j + 1:], a, memo):  # out[i]: a chain's earlier copy already holds its value
                    out[j] = Instr("local.set", stmts[j].imms, out[i].args)
                    drop.add(i)
            return _nested([st for k, st in enumerate(out) if k not in drop], rewrite)

        body = rewrite(body)
        if body == before:
            return body


def number(x: int | float) -> str:
    """A numeric immediate as WAT reads it: decimal where that round-trips, nan/inf spelled out."""
    if isinstance(x, int):
        return str(x)
    if x != x:
        return "nan"
    if x in (float("inf"), float("-inf")):
        return "inf" if x > 0 else "-inf"
    return repr(float(x))


def _flat(ins: Instr, memo: dict[int, str]) -> str:
    """`ins` on one line; memo (by id: the tree is alive while it is written) holds each subtree's
    text, so an instruction broken over lines does not flatten its operands again at every level
    (0.3 s of a target's build)."""
    text = memo.get(id(ins))
    if text is None:
        text = memo[id(ins)] = "(" + " ".join([ins.op, *ins.imms, *(_flat(a, memo) for a in ins.args)]) + ")"
    return text


class Writer:
    """Accumulates lines and, for each, the DSL span it was emitted under."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.spans: list[Span | None] = []
        self._span: Span | None = None

    def line(self, depth: int, text: str) -> None:
        self.lines.append(INDENT * depth + text)
        self.spans.append(self._span)

    def instr(self, depth: int, ins: Instr, close: str = "", memo: dict[int, str] | None = None) -> None:
        memo = {} if memo is None else memo
        flat = _flat(ins, memo)
        if len(INDENT * depth) + len(flat) + len(close) <= WIDTH or not ins.args:
            self.line(depth, flat + close)
            return
        self.line(depth, "(" + " ".join([ins.op, *ins.imms]))
        for i, arg in enumerate(ins.args):
            self.instr(depth + 1, arg, ")" + close if i == len(ins.args) - 1 else "", memo)

    def stmts(self, depth: int, body: list[Stmt]) -> None:
        for s in body:
            if isinstance(s, Comment):
                self._span = s.span or self._span
                self.line(depth, f";; {s.text}")
            elif isinstance(s, Instr):
                self.instr(depth, s)
            elif isinstance(s, Block):
                self.line(depth, f"({s.kind} ${s.label}")
                self.stmts(depth + 1, s.body)
                self.lines[-1] += ")"
            elif isinstance(s, If):
                self.instr(depth, Instr("if", (), (s.cond,)), "")
                self.lines[-1] = self.lines[-1][:-1]  # reopen "(if (cond)" to add its arms
                self.line(depth + 1, "(then")
                self.stmts(depth + 2, s.then or [Instr("nop")])
                self.lines[-1] += ")"
                if s.orelse:
                    self.line(depth + 1, "(else")
                    self.stmts(depth + 2, s.orelse)
                    self.lines[-1] += ")"
                self.lines[-1] += ")"

    def func(self, depth: int, f: Func) -> None:
        self._span = f.span
        for d in f.doc:
            self.line(depth, f";; {d}".rstrip())
        head = f"(func ${f.name}"
        if f.export:
            head += f' (export "{f.export}")'
        self.line(depth, head)
        for i in range(0, len(f.params), 6):
            self.line(depth + 1, " ".join(f"(param ${n} {t})" for n, t in f.params[i:i + 6]))
        if f.result:
            self.line(depth + 1, f"(result {f.result})")
        for i in range(0, len(f.locals), 6):
            self.line(depth + 1, " ".join(f"(local ${n} {t})" for n, t in f.locals[i:i + 6]))
        self.stmts(depth + 1, f.body)
        self.lines[-1] += ")"
