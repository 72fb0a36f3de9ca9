"""Checks on a parsed program before anything is emitted: names, declarations, quant types, tune
domains. Typing of kernel bodies happens as they are lowered for each target (lower.py applies
the per-target rules of ops.py), so `kernelgen check` runs both.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field, replace
from typing import Callable

from . import ast as A
from . import layout
from . import types as T
from ..errors import DslError, KernelgenError
from ..names import TUNE_NAME, variant_name
from .ops import TARGETS, Val, fold
from ..quantformat import QuantFormat
from .parse import parse_expr
from .quant import check_quant, table_values

_RESERVED = set(T.SCALARS) | set(T.VECTORS) | set(T.ALIASES) | set().union(*(t.ops for t in TARGETS.values()))
_TARGET_CONSTS = set().union(*(t.constants for t in TARGETS.values())) | set(layout.FIXED)
_DOC_PARAM = re.compile(r"#(\s+)(\w+):\s+(.*)")
# A pointer parameter's extent at the start of its doc: parts `TYPE[dims]` joined by " then ".
EXTENT_TYPES = {"f32": 4, "f64": 8, "i32": 4, "i16": 2, "i8": 1, "u8": 1}
_EXTENT_KIND = re.compile(r"(\w+)\[")
_EXTENT_START = re.compile(rf"(?:{'|'.join(EXTENT_TYPES)}|packed)\[")
_MULTIPLE = re.compile(r"\ba multiple of ((?:(?! \()[^,;])+)")  # to a ',', ';' or ' (' (a remark)
_MINIMUM = re.compile(r">= ((?:(?! \()[^,;])+)")


@dataclass(frozen=True)
class Extent:
    """The memory a pointer parameter of an export spans, from the start of its doc line
    (`#   x: f32[rows, k], row-major`): parts in order (`f32[n / 32] then i32[n / 32]`), each an
    element type and its dimensions, a dimension None where the doc writes `?` (known only from
    the data: nothing for a host to check). A packed matrix's is `packed[rows, k]`: its planes'
    bytes follow from its quant type. Dimensions are item-count arithmetic (_check_count), so both
    hosts evaluate them from a call's arguments and refuse memory too short for them."""

    parts: tuple[tuple[str, tuple[A.Expr | None, ...]], ...]
    loads: frozenset[str] = frozenset()  # the pointers whose i32s it reads (`starts[seqs]`)


@dataclass
class KernelInfo:
    ast: A.KernelDecl
    doc: list[str] = field(default_factory=list)  # the comment block above the kernel
    param_docs: dict[str, str] = field(default_factory=dict)  # from "#   name: meaning" lines in it
    extents: dict[str, Extent] = field(default_factory=dict)  # an export's pointer parameters' (Extent)
    multiples: dict[str, A.Expr] = field(default_factory=dict)  # its i32 parameters' "a multiple of N"
    minimums: dict[str, A.Expr] = field(default_factory=dict)  # and their ">= EXPR" (EXPR: item-count arithmetic)

    @property
    def name(self) -> str:
        return self.ast.name

    @property
    def inline(self) -> bool:
        return self.ast.mode == "inline"

    @property
    def job(self) -> str | None:
        """The name of the pool job generated from a `parallel` declaration, else None."""
        return f"{self.name}_job" if self.ast.parallel else None

    @property
    def job_params(self) -> tuple[A.Param, ...]:
        return job_params(self.ast)


def job_params(k: A.KernelDecl) -> tuple[A.Param, ...]:
    """The parameters a parallel kernel's job reads from JOB_ARGS words: those its body uses, in
    declaration order (one that only the item count uses, such as a row count, is left out)."""
    used = set(A.names_in(k.body))
    return tuple(p for p in k.params if p.name in used)


@dataclass
class Checked:
    program: A.Program
    consts: dict[str, Val]
    quants: dict[str, QuantFormat]
    kernels: dict[str, KernelInfo]
    jobs: dict[str, KernelInfo] = field(default_factory=dict)  # pool job name -> its parallel kernel

    @property
    def source(self) -> str:
        return self.program.source


def check(program: A.Program) -> Checked:
    """Validate declarations; raise DslError (with source) at the first mistake."""
    try:
        return _check(program)
    except DslError as e:
        raise e.with_source(program.source) from None


def _check(program: A.Program) -> Checked:
    seen: dict[str, A.Node] = {}

    def declare(name: str, node: A.Node, what: str) -> None:
        if name in _RESERVED or name in _TARGET_CONSTS:
            raise DslError(node.span, f"{what} name {name!r} is reserved (a type, an op or a target constant)")
        if name in seen:
            raise DslError(node.span, f"{name!r} is already declared at line {seen[name].span.line}")
        seen[name] = node

    consts: dict[str, Val] = {}
    for c in program.consts:
        declare(c.name, c, "const")
        t = T.resolve(c.type)
        if t is None or not T.is_scalar(t):
            raise DslError(c.span, f"const {c.name}: type must be a scalar type, not {c.type!r}")
        v = _const_value(c.value, consts)
        if not T.fits(v, t):
            raise DslError(c.value.span, f"const {c.name}: {t} cannot hold {v}")
        consts[c.name] = Val(None, t, float(v) if T.is_float(t) else v)

    tables: dict[str, tuple[int, ...]] = {}
    for t in program.tables:
        declare(t.name, t, "table")
        tables[t.name] = table_values(t)

    quants: dict[str, QuantFormat] = {}
    for q in program.quants:
        declare(q.name, q, "quant")
        quants[q.name] = check_quant(q, tables)

    kernels: dict[str, KernelInfo] = {}
    lines = program.source.splitlines()
    for k in program.kernels:
        declare(k.name, k, "kernel")
        _check_kernel(k, quants)
        kernels[k.name] = _with_docs(k, lines, program.source)
    if not any(k.exported for k in program.kernels):
        raise DslError(program.span, "no exported kernel: mark at least one 'export kernel'")
    jobs = {k.job: k for k in kernels.values() if k.job}
    for name, k in jobs.items():
        if name in seen:
            raise DslError(seen[name].span, f"{name!r} is the name of {k.name}'s pool job (its 'parallel' declaration)")
    return Checked(program, consts, quants, kernels, jobs)


def select_quants(checked: Checked, names: tuple[str, ...] | list[str]) -> Checked:
    """`checked` with only the quant types `names` (in declaration order): a build for a model that
    uses two types carries two types' code, and the byte budget spends itself on them alone. The
    declarations stay whole, so tunings (keyed per type, store.kernel_hash) still match."""
    if isinstance(names, str) or not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"quants: expected a list of quant type names, got {names!r}")
    if not names:
        raise KernelgenError("quants: name at least one quant type")
    if unknown := [n for n in names if n not in checked.quants]:
        raise KernelgenError(f"{checked.program.span.file}: no quant type {unknown[0]!r} is declared "
                             f"(declared: {', '.join(checked.quants)})")
    return replace(checked, quants={n: q for n, q in checked.quants.items() if n in names})


def _const_value(e: A.Expr, consts: dict[str, Val]) -> int | float:
    if isinstance(e, (A.IntLit, A.FloatLit)):
        return e.value
    if isinstance(e, A.Name):
        if e.id not in consts:
            raise DslError(e.span, f"unknown constant {e.id!r}")
        return consts[e.id].const
    if isinstance(e, A.Unary) and e.op == "-":
        return -_const_value(e.operand, consts)
    if isinstance(e, A.Binary):
        a, b = _const_value(e.left, consts), _const_value(e.right, consts)
        lit = lambda x: Val(None, T.FLOAT_LIT if isinstance(x, float) else T.INT_LIT, x)  # noqa: E731
        r = fold(e.op, lit(a), lit(b))
        if r is not None:
            return r.const
    raise DslError(e.span, "a const must be a compile-time number")


def _check_kernel(k: A.KernelDecl, quants: dict[str, QuantFormat]) -> None:
    names: dict[str, A.Node] = {}

    def local(name: str, node: A.Node) -> None:
        if name in names:
            raise DslError(node.span, f"{k.name}: {name!r} is declared twice")
        if name in _RESERVED:
            raise DslError(node.span, f"{k.name}: {name!r} is reserved (a type or an op)")
        names[name] = node

    generic_kinds = {}
    for g in k.generics:
        local(g.name, g)
        if g.kind != "quant" and g.kind != "i32":
            raise DslError(g.span, f"{k.name}: a compile-time parameter is 'quant' or 'i32', not {g.kind!r}")
        if g.kind == "i32" and not TUNE_NAME.fullmatch(g.name.lower().replace("_", "")):
            raise DslError(g.span, f"{k.name}: compile-time parameter {g.name!r}: use letters and '_' only (its value"
                                   " is part of the function's name)")
        generic_kinds[g.name] = g.kind
    if k.exported and (len(k.generics) > 1 or any(g.kind != "quant" for g in k.generics)):
        raise DslError(k.span, f"exported kernel {k.name}: only one [Q: quant] parameter is allowed; "
                               "it is built for every quant type")
    if k.exported and k.generics and not quants:
        raise DslError(k.span, f"exported kernel {k.name} is generic over quant types, but none is declared")
    for p in k.params:
        local(p.name, p)
        if p.packed:
            if generic_kinds.get(p.type) != "quant":
                raise DslError(p.span, f"{k.name}: 'packed {p.type}' needs {p.type} to be a [{p.type}: quant] parameter")
        elif T.resolve(p.type) is None:
            raise DslError(p.span, f"{k.name}: unknown parameter type {p.type!r}")
        elif T.is_vector(T.resolve(p.type)) and k.exported:
            raise DslError(p.span, f"{k.name}: exported kernels take scalars and pointers, not {p.type}")
    if k.ret is not None and T.resolve(k.ret) is None:
        raise DslError(k.span, f"{k.name}: unknown return type {k.ret!r}")
    for t in k.tunes:
        if not k.exported:
            raise DslError(t.span, f"{k.name}: tune parameters belong on exported kernels (pass values down in"
                                   " [...]; a job uses its kernel's, e.g. qmatvec.rows)")
        local(t.name, t)
        if not TUNE_NAME.fullmatch(t.name):
            raise DslError(t.span, f"tune parameter {t.name!r}: use lowercase letters only (it becomes part of export names)")
        if t.type != "i32":
            raise DslError(t.span, f"tune parameter {t.name}: type must be i32")
        if not all(T.fits(v, "i32") for v in t.domain):
            raise DslError(t.span, f"tune parameter {t.name}: a value does not fit in i32")
        if len(set(t.domain)) != len(t.domain):
            raise DslError(t.span, f"tune parameter {t.name}: a value is listed twice")
        if t.default not in t.domain:
            raise DslError(t.span, f"tune parameter {t.name}: default {t.default} is not in its domain {set(t.domain)}")
    for r in k.restricts:
        if not k.tunes:
            raise DslError(r.span, f"{k.name}: 'restrict' constrains tune parameters; this kernel has none")
        _check_restrict_names(k, r.cond, {t.name for t in k.tunes})
        defaults = {t.name: Val(None, "i32", t.default) for t in k.tunes}
        if not _const_value(r.cond, defaults):
            raise DslError(r.span, f"{k.name}: the declared defaults "
                                   f"({', '.join(f'{t.name}={t.default}' for t in k.tunes)}) break this restriction")
    if k.mode == "inline":
        _check_inline_returns(k, k.body, top=True)
    if k.parallel:
        _check_parallel(k, quants, local)


def _check_restrict_names(k: A.KernelDecl, e: A.Expr, tunes: set[str]) -> None:
    if isinstance(e, A.Name) and e.id not in tunes:
        raise DslError(e.span, f"{k.name}: a restriction may use only tune parameters and numbers, not {e.id!r}")
    for child in (getattr(e, "left", None), getattr(e, "right", None), getattr(e, "operand", None)):
        if child is not None:
            _check_restrict_names(k, child, tunes)


def _check_parallel(k: A.KernelDecl, quants: dict[str, QuantFormat], local: Callable[[str, A.Node], None]) -> None:
    """A parallel kernel: its body runs on items [begin, end); its job reads the parameters the
    body uses from JOB_ARGS words, and hosts compute the item count from the call's arguments."""
    par = k.parallel
    if not k.exported:
        raise DslError(par.span, f"{k.name}: 'parallel' belongs on exported kernels (their pool job is made from it)")
    if k.ret is not None:
        raise DslError(par.span, f"{k.name}: a parallel kernel returns nothing (each thread writes its own items)")
    local(par.begin, par)
    local(par.end, par)
    if not (isinstance(par.start, A.IntLit) and par.start.value == 0):
        raise DslError(par.start.span, f"{k.name}: the items of a parallel kernel are numbered from 0 ('in 0..COUNT')")
    params = {p.name: p for p in k.params}
    _check_count(k, par.count, params, {g.name for g in k.generics})
    words = 0
    for p in job_params(k):
        if p.packed:
            words += max((len(q.planes) for q in quants.values()), default=0)
        elif T.resolve(p.type) not in ("i32", "f32"):
            raise DslError(p.span, f"{k.name}: its job reads {p.name} from one JOB_ARGS word: it must be i32, ptr or f32")
        else:
            words += 1
    if words > layout.JOB_ARG_WORDS:
        raise DslError(par.span, f"{k.name}: its job needs {words} argument words; JOB_ARGS holds {layout.JOB_ARG_WORDS}")


def _check_count(k: A.KernelDecl, e: A.Expr, params: dict[str, A.Param], generics: set[str],
                 what: str = "the item count", loads: set[str] | None = None) -> None:
    """The item count (or an extent's dimension) is arithmetic (+ - * / %) on numbers, consts, tune
    values, Q.block and the kernel's i32 parameters: what both hosts can evaluate from a call's
    arguments (manifest "parallel".count, a parameter's "extent"). An extent may also read `p[i]`,
    the i32 at index i of pointer p (its own extent i32[...]; i without reads), which `loads`
    collects: attention's rows are starts[seqs]."""
    if isinstance(e, A.Binary) and e.op in "+-*/%":
        _check_count(k, e.left, params, generics, what, loads)
        _check_count(k, e.right, params, generics, what, loads)
    elif (loads is not None and isinstance(e, A.Index) and isinstance(e.base, A.Name) and len(e.indices) == 1
          and e.base.id in params and params[e.base.id].type == "ptr"):
        _check_count(k, e.indices[0], params, generics, what)
        loads.add(e.base.id)
    elif isinstance(e, A.Name) and e.id in params:
        if params[e.id].packed or T.resolve(params[e.id].type) != "i32" or params[e.id].type == "ptr":
            raise DslError(e.span, f"{k.name}: {what} may use i32 parameters, not {e.id}: {params[e.id].type}")
    elif isinstance(e, A.Attr) and isinstance(e.base, A.Name) and e.base.id in generics:
        pass
    elif not isinstance(e, (A.IntLit, A.Name)):
        raise DslError(e.span, f"{k.name}: {what} is arithmetic (+ - * / %) on numbers, consts, tune values,"
                               " Q.block and i32 parameters")


def _check_inline_returns(k: A.KernelDecl, body: tuple[A.Stmt, ...], top: bool) -> None:
    """An inline kernel's value is its last statement's `return`, or that of the last statement of
    each arm of a final `static if` (the arm taken is known where it is expanded)."""
    for i, s in enumerate(body):
        last = top and i == len(body) - 1
        if isinstance(s, A.ReturnStmt) and not last:
            raise DslError(s.span, f"inline kernel {k.name}: 'return' may only be its last statement")
        arms_last = last and isinstance(s, A.IfStmt) and s.static
        for sub in (getattr(s, "body", ()), getattr(s, "then", ()), getattr(s, "orelse", ())):
            _check_inline_returns(k, sub, top=arms_last)


def _with_docs(k: A.KernelDecl, lines: list[str], source: str) -> KernelInfo:
    """The comment block above `k`: its text, and its parameter lines `#   name: meaning` (a line
    indented deeper than one continues it), which for an export give its pointers' extents and its
    i32 parameters' "a multiple of N" and ">= EXPR" (_parameter_contract)."""
    doc: list[int] = []  # line indices
    n = k.span.line - 2
    while n >= 0 and lines[n].lstrip().startswith("#"):
        doc.insert(0, n)
        n -= 1
    params: dict[str, str] = {}
    at: dict[str, tuple[int, int]] = {}  # parameter -> (line, column) of its meaning
    text: list[str] = []
    last: tuple[str, int] | None = None  # the parameter a deeper-indented line continues, its indent
    for i in doc:
        d = lines[i].strip()
        if (m := _DOC_PARAM.fullmatch(d)) is not None:
            params[m.group(2)] = m.group(3).strip()
            at[m.group(2)] = (i + 1, len(lines[i]) - len(lines[i].lstrip()) + m.start(3) + 1)
            last = (m.group(2), len(m.group(1)))
        elif last is not None and len(d) - len(d[1:].lstrip()) - 1 > last[1]:
            params[last[0]] += " " + d.lstrip("#").strip()
        else:
            last = None
            if d.lstrip("#").strip():
                text.append(d.lstrip("#").strip())
    info = KernelInfo(k, text, params)
    if k.exported:
        for p in k.params:
            if p.name in params:
                _parameter_contract(k, p, params[p.name], *at[p.name], source, info)
        for name, e in info.extents.items():  # an extent reads i32s only where the pointer's own says so
            for read in e.loads:
                own = info.extents.get(read)
                if own is None or [kind for kind, _ in own.parts] != ["i32"] or own.loads:
                    raise DslError(A.Span(k.span.file, *at[name]), f"{k.name}: {name}'s extent reads {read}[...]: "
                                   f"{read}'s own extent must be i32[...], reading nothing", source)
    return info


def _bracketed(text: str, start: int) -> list[str] | None:
    """The comma-separated items from `start` to the `]` that closes the `[` before it (brackets
    inside nest: `starts[seqs]`), or None if none closes it."""
    items, depth, begin = [], 0, start
    for i in range(start, len(text)):
        c = text[i]
        if c == "[":
            depth += 1
        elif c == "]" and depth:
            depth -= 1
        elif c in ",]" and depth == 0:
            items.append(text[begin:i])
            begin = i + 1
            if c == "]":
                return items
    return None


def _parameter_contract(k: A.KernelDecl, p: A.Param, meaning: str, line: int, col: int, source: str,
                        info: KernelInfo) -> None:
    """Record an exported kernel's parameter `p`'s Extent (a pointer whose doc starts with one) or
    its "a multiple of N" and ">= EXPR" (an i32), from its doc `meaning` at `line`:`col` of `source`."""
    params = {q.name: q for q in k.params}
    generics = {g.name for g in k.generics}

    def expr(text: str, at: int, what: str, loads: set[str] | None = None) -> A.Expr:
        e = parse_expr(source, text, line, col + at, k.span.file)
        try:
            _check_count(k, e, params, generics, what, loads)
        except DslError as err:
            raise err.with_source(source) from None
        return e

    pointer = p.packed or p.type == "ptr"
    if pointer and _EXTENT_START.match(meaning):
        parts, pos, loads = [], 0, set()
        while (m := _EXTENT_KIND.match(meaning, pos)) is not None and (dims_text := _bracketed(meaning, m.end())):
            kind = m.group(1)
            if kind not in EXTENT_TYPES and not (kind == "packed" and p.packed and not parts):
                want = "packed[rows, k]" if p.packed else f"one of {', '.join(EXTENT_TYPES)}"
                raise DslError(A.Span(k.span.file, line, col + pos), f"{k.name}: {p.name}'s extent: {kind}[...] is"
                               f" not an element type here (want {want})", source)
            dims, at = [], m.end()
            for d in dims_text:
                lead = len(d) - len(d.lstrip())
                dims.append(None if d.strip() == "?" else expr(d.strip(), at + lead, f"{p.name}'s extent", loads))
                at += len(d) + 1
            parts.append((kind, tuple(dims)))
            pos = at
            if not meaning.startswith(" then ", pos) or kind == "packed":
                break
            pos += len(" then ")
        rest = meaning[pos:]
        if not parts:
            raise DslError(A.Span(k.span.file, line, col + pos), f"{k.name}: {p.name}'s extent: no ']' closes its "
                           f"'[' in {meaning!r}", source)
        if rest and not rest.startswith(","):
            raise DslError(A.Span(k.span.file, line, col + pos), f"{k.name}: {p.name}'s extent: expected ','"
                           f" or ' then TYPE[...]' after {meaning[:pos]!r}", source)
        if p.packed != (parts[0][0] == "packed") or (p.packed and len(parts[0][1]) != 2):
            raise DslError(A.Span(k.span.file, line, col), f"{k.name}: {p.name} is "
                           f"{'a packed matrix: its extent is packed[rows, k]' if p.packed else 'a pointer'}", source)
        info.extents[p.name] = Extent(tuple(parts), frozenset(loads))
    elif not pointer and T.resolve(p.type) == "i32":
        if (m := _MULTIPLE.search(meaning)) is not None:
            info.multiples[p.name] = expr(m.group(1).strip(), m.start(1), f"{p.name}'s multiple")
        if (m := _MINIMUM.search(meaning)) is not None:
            info.minimums[p.name] = expr(m.group(1).strip(), m.start(1), f"{p.name}'s minimum")


def tune_key(kernel: str, quant: str | None) -> str:
    """The key of a kernel's tune values for one quant type in a build's table (`qmatvec_q8_0`, the
    base of its export names); a kernel's own name holds its values for every type without one."""
    return variant_name(kernel, quant, {})


def tune_for(tune: dict[str, dict[str, int]], kernel: str, quant: str | None) -> dict[str, int]:
    """`kernel`'s tune values for `quant` in a build's table (see tune_key)."""
    return tune.get(tune_key(kernel, quant), tune.get(kernel, {})) if quant else tune.get(kernel, {})


def resolve_tune(checked: Checked, overrides: dict[str, dict[str, int]] | None = None,
                 where: str = "--tune") -> dict[str, dict[str, int]]:
    """Each exported kernel's tune values: declared defaults, replaced by `overrides`; every
    value in its domain and every `restrict` met. An override keyed by tune_key (`qmatvec_q8_0`)
    sets one quant type's values (the rest from the kernel's); the result holds it under that key."""
    overrides = overrides or {}
    per_quant = {tune_key(k.name, q): k for k in checked.kernels.values() if k.ast.exported and k.ast.generics
                 for q in checked.quants}
    for name, values in overrides.items():
        k = checked.kernels.get(name) or per_quant.get(name)
        if k is None and (left_out := next((q.name for q in checked.program.quants if q.name not in checked.quants
                                            and name.endswith("_" + q.name)), None)):
            raise DslError(None, f"{where}: {name!r} tunes quant type {left_out}, which this build leaves out "
                                 f"(it builds {', '.join(checked.quants)})")
        if k is None or not k.ast.exported:
            raise DslError(None, f"{where}: no exported kernel {name!r}")
        declared = {t.name: t for t in k.ast.tunes}
        for p, v in values.items():
            if p not in declared:
                raise DslError(None, f"{where}: kernel {k.name} has no tune parameter {p!r}"
                                     f" (it has: {', '.join(declared) or 'none'})")
            if v not in declared[p].domain:
                raise DslError(declared[p].span, f"{where}: {name}.{p}={v} is outside its domain {list(declared[p].domain)}",
                               checked.source)
    result: dict[str, dict[str, int]] = {}
    for k in checked.kernels.values():
        if k.ast.exported:
            result[k.name] = {t.name: overrides.get(k.name, {}).get(t.name, t.default) for t in k.ast.tunes}
    for name, values in overrides.items():
        if name in per_quant:
            k = per_quant[name]
            result[name] = {p: values.get(p, v) for p, v in result[k.name].items()}
    for name, values in result.items():
        k = checked.kernels.get(name) or per_quant[name]
        broken = _broken_restrict(checked, k, values)
        if broken is not None:
            shown = ", ".join(f"{n}={v}" for n, v in values.items())
            raise DslError(broken.span, f"{where}: {name} with {shown} breaks this restriction", checked.source)
    return result


def _broken_restrict(checked: Checked, k: KernelInfo, values: dict[str, int]) -> A.RestrictDecl | None:
    env = {**checked.consts, **{n: Val(None, "i32", v) for n, v in values.items()}}
    for r in k.ast.restricts:
        if not _const_value(r.cond, env):
            return r
    return None


def variants(checked: Checked, kernel: str) -> list[dict[str, int]]:
    """Every assignment of `kernel`'s tune parameters that meets its restrictions, defaults first."""
    k = checked.kernels[kernel]
    tunes = k.ast.tunes
    default = {t.name: t.default for t in tunes}
    out = [default]
    for combo in itertools.product(*(t.domain for t in tunes)):
        values = dict(zip((t.name for t in tunes), combo))
        if values != default and _broken_restrict(checked, k, values) is None:
            out.append(values)
    return out
