"""Quant declarations: checking one into a QuantFormat (kernelgen.quantformat, which the hosts use
too) and lowering `Q.unpack(p, j)` to SIMD code.

A declaration says how a block is *stored* (the bytes users already have, e.g. GGUF's Q8_0),
`unpack`: an expression over the element index `i` giving each element's small integer, and
`dequant`: `S * q` or `S * q + M` with S and M formulas of the block's scalar fields. The AST of
each formula is read once, into formula nodes (`_formula`); everything after walks the nodes with
`quantformat.fold`.
"""
from __future__ import annotations

from typing import Callable

from . import ast as A
from ..errors import DslError
import numpy as np

from ..quantformat import (CALLS, FIELD_BYTES, FLOAT_OPS, INT_OPS, KERNEL_BLOCK, Call, Elem, Field, FieldInfo, Float, Index, Int, Lookup, Neg,
                           Node, Op, Pow2, QuantFormat, Select, SubBlock, NumpyEval, IntRange, IsFloat, fold, nodes)
from .wat import I, Instr

LANES = 16  # a block unpacks 16 int8 lanes at a time (one v128)

_UNPACK_ALLOWED = ("only field[i], nib(field, i), nibi(field, i), bit(field, i), table[nib(field, i)], byte fields, "
                   "integers, + - | & and << by a constant are allowed")
_SCALAR_ALLOWED = "only scalar fields, numbers, + - * / and pow2(x) are allowed"
_NOT_I = "'i' is not a byte-sized scalar field (use field[i], nib(field, i) or bit(field, i))"
TABLE_SIZE = 16  # a codebook is indexed by a nibble
MAX_PRIORITY = 100  # a quant type's `priority N;`: its speedups count N times in a build's code budget
DEFAULT_PRIORITY = 1  # a type that declares none


# ---- the declaration's formulas as nodes -------------------------------------------------------


def _formula(e: A.Expr, err: Callable[[A.Node, str], DslError], unsupported: str,
             tables: dict[str, tuple[int, ...]], lets: dict[str, Node]) -> Node:
    """The nodes of a formula's AST (a `let` name replaced by its formula); DslError for syntax no
    formula has."""
    def is_i(x: A.Expr) -> bool:
        return isinstance(x, A.Name) and x.id == "i"

    def sub(x: A.Expr) -> Node:
        return _formula(x, err, unsupported, tables, lets)

    if isinstance(e, A.Index) and isinstance(e.base, A.Name) and e.base.id in tables:
        if len(e.indices) != 1:
            raise err(e, f"index table {e.base.id} with one code: {e.base.id}[nib(field, i)]")
        return Lookup(tables[e.base.id], sub(e.indices[0]), span=e.span)
    if isinstance(e, A.Call) and isinstance(e.func, A.Name) and e.func.id == "pow2":
        if len(e.args) != 1:
            raise err(e, "write pow2(x)")
        return Pow2(sub(e.args[0]), span=e.span)
    if isinstance(e, A.Call) and isinstance(e.func, A.Name) and e.func.id == "select":
        if len(e.args) != 3:
            raise err(e, "write select(condition, a, b)")
        return Select(*map(sub, e.args), span=e.span)
    if isinstance(e, A.Name) and e.id in lets:
        return lets[e.id]
    if isinstance(e, A.Name) and e.id in ("i", "s"):
        return (Elem if e.id == "i" else SubBlock)(span=e.span)
    if isinstance(e, A.IntLit):
        if e.value > 2**31 - 1:  # (a negative one is a Neg of its magnitude)
            raise err(e, f"{e.value} is not an int32 (formulas compute in int32 and float32)")
        return Int(e.value, span=e.span)
    if isinstance(e, A.FloatLit):
        return Float(e.value, span=e.span)
    if isinstance(e, A.Name):
        return Field(e.id, span=e.span)
    if isinstance(e, A.Index):
        if len(e.indices) != 1:
            raise err(e, "index a field with one index: field[i]")
        if not isinstance(e.base, A.Name):
            raise err(e.base, "field[i] needs a field name")
        return Index(e.base.id, sub(e.indices[0]), span=e.span)
    if isinstance(e, A.Call) and isinstance(e.func, A.Name) and e.func.id in CALLS:
        name = e.func.id
        if len(e.args) != 2 or not is_i(e.args[1]):
            raise err(e, f"write {name}(field, i)")
        if not isinstance(e.args[0], A.Name):
            raise err(e.args[0], f"{name}(field, i) needs a field name")
        return Call(name, e.args[0].id, span=e.args[0].span)
    if isinstance(e, A.Unary) and e.op == "-":
        return Neg(sub(e.operand), span=e.span)
    if isinstance(e, A.Binary):
        return Op(e.op, sub(e.left), sub(e.right), span=e.span)
    raise err(e, unsupported)


# ---- checking ----------------------------------------------------------------------------------


class _CheckUnpack:
    """unpack reads byte arrays element-wise and byte scalars, with + - | & and << by a constant.
    Records how each field is read in `used`."""

    def __init__(self, q: A.QuantDecl, fields: dict[str, FieldInfo]) -> None:
        self.q, self.fields = q, fields
        self.used: list[tuple[str, str]] = []

    def err(self, node: Node, msg: str) -> DslError:
        return DslError(node.span, f"quant {self.q.name}: unpack: {msg}")

    def _array(self, node: Node, name: str, want: int, how: str, kind: str) -> None:
        f = self.fields.get(name)
        if f is None:
            raise self.err(node, f"{how} needs a field name")
        allowed = ("i8", "u8") if kind == "index" else ("u8",)  # nibbles and bits are unsigned
        if f.type not in allowed or f.count is None:
            raise self.err(node, f"{how} reads a{'' if kind == 'index' else 'n unsigned'} byte array field "
                                 f"({' or '.join(allowed)}[n]); {f.name} is {f.type}{f'[{f.count}]' if f.count else ''}")
        if f.count != want:
            raise self.err(node, f"{how}: {f.name} must have {want} bytes for a block of {self.q.block}, has {f.count}")
        self.used.append((f.name, kind))

    def on_int(self, n: Int) -> None:
        pass

    def on_i(self, n: Elem) -> str:
        return "i"  # only as an index: f[i] (on_index); anywhere else on_op or check_quant rejects it

    def on_float(self, n: Node, *_: None) -> None:
        raise self.err(n, _UNPACK_ALLOWED)

    on_neg = on_pow2 = on_select = on_s = on_float

    def on_lookup(self, n: Lookup, _: None) -> None:
        if not isinstance(n.code, Call) or n.code.func not in ("nib", "nibi"):
            raise self.err(n, "a table is indexed by a nibble: table[nib(field, i)] or table[nibi(field, i)]")

    def on_field(self, n: Field) -> None:
        f = self.fields.get(n.field)
        if f is None or f.count is not None or f.type not in ("i8", "u8"):
            raise self.err(n, f"{n.field!r} is not a byte-sized scalar field (use field[i], nib(field, i) or bit(field, i))")
        self.used.append((f.name, "scalar"))

    def on_index(self, n: Index, at: str | None) -> None:
        if n.at != Elem():
            raise self.err(n, "index a field with the element index: field[i]")
        self._array(n, n.field, self.q.block, "field[i]", "index")

    def on_call(self, n: Call) -> None:
        block = self.q.block
        self._array(n, n.field, block // 8 if n.func == "bit" else block // 2, f"{n.func}(field, i)", n.func)
        if n.func != "bit" and (block // 2) % LANES:
            raise self.err(n, f"nib() needs a block of a multiple of {2 * LANES}")

    def on_op(self, n: Op, *args: str | None) -> None:
        if "i" in args:
            raise self.err(n, _NOT_I)
        shift = n.op == "<<" and isinstance(n.right, Int) and 0 <= n.right.value < 8
        if n.op not in ("+", "-", "|", "&") and not shift:
            raise self.err(n, _UNPACK_ALLOWED)


class _CheckScalar:
    """Scale and offset formulas: scalar fields, numbers and + - * /."""

    def __init__(self, q: A.QuantDecl, fields: dict[str, FieldInfo]) -> None:
        self.q, self.fields = q, fields

    def err(self, node: Node, msg: str) -> DslError:
        return DslError(node.span, f"quant {self.q.name}: dequant: {msg}")

    def on_int(self, n: Node, *_: None) -> None:
        pass

    on_float = on_neg = on_pow2 = on_int

    def on_field(self, n: Field) -> None:
        f = self.fields.get(n.field)
        if f is None or f.count is not None:
            raise self.err(n, f"{n.field!r} is not a scalar field of the block")

    def on_index(self, n: Node, *_: None) -> None:
        raise self.err(n, _SCALAR_ALLOWED)

    on_call = on_lookup = on_select = on_i = on_s = on_index

    def on_op(self, n: Op, *_: None) -> None:
        if n.op not in ("+", "-", "*", "/"):
            raise self.err(n, _SCALAR_ALLOWED)


class _MentionsQ:
    """Whether a dequant formula reads `q`, the unpacked integer."""

    def on_field(self, n: Field) -> bool:
        return n.field == "q"

    def on_int(self, n: Node, *args: bool) -> bool:
        return any(args)

    on_float = on_i = on_s = on_index = on_call = on_lookup = on_pow2 = on_select = on_neg = on_op = on_int


class _CheckSuper:
    """A super-block's formulas: unpack (over `i`, integers only) and scale/offset (over the
    sub-block `s`). Array fields are indexed by integer formulas of that index alone, checked to
    stay inside the field for every element or sub-block."""

    def __init__(self, q: A.QuantDecl, fields: dict[str, FieldInfo], what: str, var: str, count: int) -> None:
        self.q, self.fields, self.what, self.var = q, fields, what, var
        self.at = {var: np.arange(count)}  # the index's values
        self.used: list[tuple[str, str]] = []

    def err(self, node: Node, msg: str) -> DslError:
        return DslError(node.span, f"quant {self.q.name}: {self.what}: {msg}")

    def on_int(self, n: Node, *_: None) -> None:
        pass

    on_neg = on_select = on_int

    def on_float(self, n: Node, *_: None) -> None:
        if self.var == "i":
            raise self.err(n, "unpack is integer arithmetic")

    on_pow2 = on_float

    def _index(self, n: Node) -> None:
        if n.kind != self.var:
            raise self.err(n, f"{n.kind!r} is not defined here (the index is {self.var!r})")

    on_i = on_s = _index

    def on_field(self, n: Field) -> None:
        f = self.fields.get(n.field)
        if f is None or f.count is not None:
            raise self.err(n, f"{n.field!r} is not a scalar field of the block (index an array field)")
        if self.var == "i" and f.type[0] == "f":
            raise self.err(n, "unpack is integer arithmetic")

    def on_index(self, n: Index, _: None) -> None:
        f = self.fields.get(n.field)
        if f is None or f.count is None or f.type[0] == "f":
            raise self.err(n, f"{n.field!r} is not an integer array field")
        if any(x.kind not in ("int", "op", self.var) for x in nodes(n.at)) or any(
                x.op == "<" for x in nodes(n.at) if isinstance(x, Op)):
            raise self.err(n, f"index {n.field} with a formula of {self.var!r} and integers (+ - * / %)")
        at = np.broadcast_to(fold(n.at, NumpyEval(np.zeros(0), **self.at)), self.at[self.var].shape)
        if at.min() < 0 or at.max() >= f.count:
            k = int(np.flatnonzero((at < 0) | (at >= f.count))[0])
            raise self.err(n, f"{n.field}[...] reads element {at[k]} of {f.count} at {self.var} = {k}")
        self.used.append((f.name, "index"))

    def on_call(self, n: Node) -> None:
        raise self.err(n, "nib/nibi/bit read flat blocks; in a super-block index the bytes: (f[i / 64 * 32 + i % 32] >> ...) & 15")

    def on_lookup(self, n: Lookup, _: None) -> None:
        if self.var != "i":
            raise self.err(n, "a table is read by unpack")

    def on_op(self, n: Op, *_: None) -> None:  # (before an index that holds it is evaluated)
        if n.op not in INT_OPS:
            raise self.err(n, f"operator {n.op} is not one of a formula's ({' '.join(INT_OPS)})")





def check_quant(q: A.QuantDecl, shared: dict[str, tuple[int, ...]] | None = None) -> QuantFormat:
    """Validate a quant declaration and derive its format; DslError at the offending span."""
    if q.block is None:
        raise DslError(q.span, f"quant {q.name}: missing 'block N;'")
    if q.block <= 0 or q.block % LANES:
        raise DslError(q.span, f"quant {q.name}: block must be a positive multiple of {LANES}, got {q.block}")
    if not q.fields:
        raise DslError(q.span, f"quant {q.name}: a block needs at least one field")
    if q.unpack is None:
        raise DslError(q.span, f"quant {q.name}: missing 'unpack EXPR;'")
    if q.dequant is None:
        raise DslError(q.span, f"quant {q.name}: missing 'dequant EXPR;'")
    if q.priority is not None and not 1 <= q.priority <= MAX_PRIORITY:
        raise DslError(q.span, f"quant {q.name}: priority must be 1 to {MAX_PRIORITY}, got {q.priority}")
    fields: list[FieldInfo] = []
    offset = 0
    for f in q.fields:
        if f.type not in FIELD_BYTES:
            raise DslError(f.span, f"field {f.name}: unknown storage type {f.type!r}"
                                   f" (one of {', '.join(FIELD_BYTES)})")
        if any(g.name == f.name for g in fields):
            raise DslError(f.span, f"field {f.name} is declared twice")
        if f.name in ("i", "q") or f.name in CALLS:
            raise DslError(f.span, f"field name {f.name!r} is reserved")
        if shared and f.name in shared:
            raise DslError(f.span, f"field name {f.name!r} is taken: the file declares table {f.name}")
        if f.count is not None and f.count <= 0:
            raise DslError(f.span, f"field {f.name}: array length must be positive")
        fields.append(FieldInfo(f.name, f.type, f.count, offset))
        offset += fields[-1].nbytes
    byname = {f.name: f for f in fields}
    tables = _tables(q, byname, shared or {})

    def err_in(what: str) -> Callable[[A.Node, str], DslError]:
        return lambda node, msg: DslError(node.span, f"quant {q.name}: {what}: {msg}")

    lets: dict[str, Node] = {}
    for let in q.lets:
        if let.name in lets or let.name in byname or let.name in tables or let.name in ("i", "s", "q"):
            raise DslError(let.span, f"quant {q.name}: let {let.name}: the name is taken")
        lets[let.name] = _formula(let.value, err_in(f"let {let.name}"), _SCALAR_ALLOWED, tables, lets)
    if q.sub is not None and (q.sub not in (16, KERNEL_BLOCK) or q.block % KERNEL_BLOCK or q.block == q.sub):
        raise DslError(q.span, f"quant {q.name}: sub-blocks of 16 or {KERNEL_BLOCK} values in a larger block (a multiple"
                               f" of {KERNEL_BLOCK}, the kernels' block) are supported, got sub {q.sub} in block {q.block}")
    unpack = _formula(q.unpack, err_in("unpack"), _UNPACK_ALLOWED, tables, lets)
    checker = _CheckUnpack(q, byname) if q.sub is None else _CheckSuper(q, byname, "unpack", "i", q.block)
    if fold(unpack, checker) == "i":
        raise DslError(q.unpack.span, f"quant {q.name}: unpack: {_NOT_I}")
    for name in {f for f, _ in checker.used}:
        hows = {h for f, h in checker.used if f == name}
        if len(hows) > 1:
            raise DslError(q.unpack.span, f"quant {q.name}: unpack reads {name} in two ways ({', '.join(sorted(hows))})")
    scale, off = _split_dequant(q, _formula(q.dequant, err_in("dequant"), _SCALAR_ALLOWED, {}, lets))
    for formula in (scale, off):
        if formula is not None:
            fold(formula, _CheckScalar(q, byname) if q.sub is None else
                 _CheckSuper(q, byname, "dequant", "s", q.block // q.sub))
    used_names = {f for f, _ in checker.used}
    value_fields = tuple(f.name for f in fields if f.name in used_names)
    interleaved = tuple(dict.fromkeys(f for f, how in checker.used if how == "nibi"))
    qf = QuantFormat(q.name, q.block, tuple(fields), unpack, scale, off, value_fields, interleaved, q.sub)
    floats = IsFloat({f.name: f.type for f in fields})
    _check_arithmetic(unpack, err_in("unpack"), qf.ranges, floats)
    for formula in (scale, off):
        if formula is not None:
            _check_arithmetic(formula, err_in("dequant"), qf.ranges, floats)
    if q.sub is None:
        lo, hi = fold(unpack, qf.ranges)  # (bounded: _check_arithmetic)
        if hi < -128 or lo > 127:  # some blocks may still fall outside: pack refuses those
            raise DslError(q.unpack.span, f"quant {q.name}: unpack: its values ({lo}..{hi}) cannot fit int8: the"
                                          " kernels' weights are int8")
    if q.sub is not None:
        try:
            lo, hi = fold(unpack, qf.ranges)
        except ValueError as e:
            raise DslError(q.unpack.span, f"quant {q.name}: unpack: cannot bound its values ({e})") from None
        lookups = [n for n in nodes(unpack) if isinstance(n, Lookup)]
        if lookups and (lookups[0] is not unpack or len(lookups) > 1):
            raise DslError(lookups[0].span, f"quant {q.name}: unpack: in a super-block the table lookup is the whole unpack:"
                                            " table[code] (plane q holds the codes)")
        if lookups:
            clo, chi = fold(unpack.code, qf.ranges)
            if clo < 0 or chi >= TABLE_SIZE:
                raise DslError(lookups[0].span, f"quant {q.name}: unpack: the table's code spans {clo}..{chi}; it must lie in"
                                                f" 0..{TABLE_SIZE - 1} (a nibble): mask it, (... >> k) & 15")
        try:
            split = qf.sub_scales
        except ValueError as e:
            raise DslError(q.dequant.span, f"quant {q.name}: dequant: {e}") from None
        if split and off is not None:  # Q2_K's minimums: F * I(s), each I weighing a half's activation sum
            try:
                rec = qf.record
            except ValueError as e:
                raise DslError(q.dequant.span, f"quant {q.name}: dequant: {e}") from None
            if rec is None:
                raise DslError(q.dequant.span, f"quant {q.name}: dequant: with sub-blocks of {q.sub}, the scale and offset"
                                               " must be float fields times integers of s (d * scales[s] * q - dmin *"
                                               f" mins[s]) in a block of 128 * 2^k values")
            mlo, mhi = fold(rec.factors["offset"].i, qf.ranges)
            if mlo < 0 or mhi > 127:
                raise DslError(q.dequant.span, f"quant {q.name}: dequant: with sub-blocks of {q.sub}, the offset's integer"
                                               f" factor of s must lie in 0..127 (it spans {mlo}..{mhi}): the kernels"
                                               " multiply it by i16 activation sums")
        if split:
            try:
                ilo, ihi = fold(split[1], qf.ranges)
            except (ValueError, AttributeError):
                ilo, ihi = -1 << 40, 1 << 40
            if ilo < -128 or ihi > 127:
                raise DslError(q.dequant.span, f"quant {q.name}: dequant: the factors of s must be integers in int8"
                                               " (they multiply integer dots)")
        if lo < -128 or hi > 127:
            raise DslError(q.unpack.span, f"quant {q.name}: unpack: values may fall outside int8 ({lo}..{hi}): the"
                                          " kernels' weights are int8")
    return qf


def _check_arithmetic(formula: Node, err: Callable[[A.Node, str], DslError], ranges: IntRange, floats: IsFloat) -> None:
    """Every operation of `formula` is one both packers compute alike: floats take + - * /
    (FLOAT_OPS), integer operations stay within int32 (IntRange), where numpy and runtime/pack.mjs
    agree, and pow2 and a select's condition take integers."""
    for n in reversed(nodes(formula)):  # operands before what they make: the error at the innermost
        if isinstance(n, Op) and n.op not in FLOAT_OPS and fold(n, floats):
            raise err(n, f"operator {n.op} does not take a float (floats: {' '.join(FLOAT_OPS)})")
        if isinstance(n, Pow2) and fold(n.arg, floats):
            raise err(n, "pow2 takes an integer exponent")
        if isinstance(n, Select) and fold(n.cond, floats):
            raise err(n.cond, "a select's condition is an integer (a comparison with <)")
        if isinstance(n, (Op, Neg, Select)) and not fold(n, floats):
            try:
                fold(n, ranges)
            except ValueError as e:
                raise err(n, f"{e} (integer formulas compute in int32, alike in both packers only there)") from None


def table_values(t: A.TableDecl, where: str = "") -> tuple[int, ...]:
    """A codebook's entries: 16 int8 constants (the kernels' weights are int8). `where` prefixes
    errors: "quant NAME: " for a type's own table, nothing for a file-level one."""
    values = []
    for v in t.values:
        neg = isinstance(v, A.Unary) and v.op == "-"
        lit = v.operand if neg else v
        if not isinstance(lit, A.IntLit) or not -128 <= (-lit.value if neg else lit.value) <= 127:
            raise DslError(v.span, f"{where}table {t.name}: entries are int8 constants (-128..127)")
        values.append(-lit.value if neg else lit.value)
    if len(values) != TABLE_SIZE:
        raise DslError(t.span, f"{where}table {t.name} needs {TABLE_SIZE} entries (a nibble indexes it),"
                               f" has {len(values)}")
    return tuple(values)


def _tables(q: A.QuantDecl, fields: dict[str, FieldInfo],
            shared: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The codebooks the declaration can read: the file's (`shared`) and its own."""
    tables = dict(shared)
    for t in q.tables:
        if t.name in tables or t.name in fields or t.name in ("i", "q") or t.name in CALLS:
            raise DslError(t.span, f"quant {q.name}: table name {t.name!r} is taken")
        tables[t.name] = table_values(t, f"quant {q.name}: ")
    return tables


def _split_dequant(q: A.QuantDecl, e: Node) -> tuple[Node, Node | None]:
    """`S * q`, `q * S`, `S * q + M`, `S * q - M` -> (S, M)."""
    def mentions_q(n: Node) -> bool:
        return fold(n, _MentionsQ())

    offset: Node | None = None
    if isinstance(e, Op) and e.op in ("+", "-") and mentions_q(e.left) and not mentions_q(e.right):
        offset = e.right if e.op == "+" else Neg(e.right, span=e.right.span)
        e = e.left
    if isinstance(e, Op) and e.op == "*":
        if e.right == Field("q") and not mentions_q(e.left):
            return e.left, offset
        if e.left == Field("q") and not mentions_q(e.right):
            return e.right, offset
    raise DslError(q.dequant.span, f"quant {q.name}: dequant must read 'S * q' or 'S * q + M' with S and M"
                                   " formulas of the block's scalar fields")


# ---- SIMD lowering of unpack, for `Q.unpack(p, j)` in kernels ----------------------------------


def _splat8(value: int) -> Instr:
    return I("v128.const", "i8x16", *[str(value)] * LANES)


def _off(n: int) -> tuple[str, ...]:
    return (f"offset={n}",) if n else ()


Loader = Callable[[str, int, Instr], Instr]


def _plain_load(op: str, offset: int, addr: Instr) -> Instr:
    return I(op, *_off(offset), addr)


def _shr_u8(x: Instr, n: int) -> Instr:
    """i8x16.shr_u(x, n) as i16x8.shr_u and a mask of the bits that stay in their byte: the same
    lanes. x86 has no byte shift, so engines build i8x16.shr_u from a 16-bit shift and a mask, and V8
    (Node 20) builds that mask anew at every use (mov, movd, pshufd: 3 instructions per 16 values of
    a nibble type's high half); a v128.const is built once per function."""
    return I("v128.and", I("i16x8.shr_u", x, I("i32.const", n)), _splat8(0xFF >> n))


def _shl8(x: Instr, n: int) -> Instr:
    """i8x16.shl(x, n) as i16x8.shl and a mask: the same lanes (see _shr_u8)."""
    return I("v128.and", I("i16x8.shl", x, I("i32.const", n)), _splat8((0xFF << n) & 0xFF))


class _LowerUnpack:
    """i8x16 of lane group j of the block whose packed values (plane q) start at `base`: elements
    16j..16j+15 of a row's block, or in the grouped layout (qf.group rows) elements 4j..4j+3 of
    each of the group's rows (lanes 4r..4r+3: row r), the fields' offsets and sizes then counted in
    the group's interleaved bytes (qf.group times a row's). `relaxed`: the target has relaxed SIMD;
    `load(op, offset, addr)` emits the plane's vector loads (the compiler's load_once: V8 does not
    merge the equal loads of a block's two nibble halves)."""

    def __init__(self, qf: QuantFormat, base: Instr, j: int, relaxed: bool, load: Loader = _plain_load) -> None:
        self.qf, self.base, self.j, self.relaxed, self.load = qf, base, j, relaxed, load
        self.g = qf.group

    def on_int(self, n: Int) -> Instr:
        return _splat8(n.value)

    def on_field(self, n: Field) -> Instr:  # a per-block byte field: the same value in every lane of a row
        f = self.qf.field(n.field)
        if self.g > 1:  # a granule per row: its byte in each of the row's four lanes
            return self.load("v128.load", self.g * self.qf.value_offset(f.name), self.base)
        load = I(f"i32.load8_{'s' if f.type == 'i8' else 'u'}", *_off(self.qf.value_offset(f.name)), self.base)
        return I("i8x16.splat", load)

    def on_i(self, n: Elem) -> None:
        return None  # f[i] is the only use (on_index)

    def on_index(self, n: Index, _: None) -> Instr:
        return self.load("v128.load", self.g * self.qf.value_offset(n.field) + LANES * self.j, self.base)

    def on_call(self, n: Call) -> Instr:
        f = self.qf.field(n.field)
        if n.func in ("nib", "nibi"):  # plane q holds both in split order
            count = self.g * (f.count or 0)
            first = LANES * self.j
            load = self.load("v128.load", self.g * self.qf.value_offset(f.name) + first % count, self.base)
            if first // count == 0:
                return I("v128.and", load, _splat8(0x0F))
            return _shr_u8(load, 4)
        if n.func == "crumb":
            return self._crumbs(self.g * self.qf.value_offset(f.name))
        assert self.g == 1, "bit masks are re-encoded: no grouped type reads one"
        # bit: lanes 16j..16j+15 read bits of the two mask bytes 2j and 2j+1: put byte 2j in lanes
        # 0-7 and byte 2j+1 in lanes 8-15, keep each lane's own bit, then turn "bit set" into 1.
        both = I("v128.load16_splat", *_off(self.qf.value_offset(f.name) + 2 * self.j), self.base)
        spread = I("i8x16.swizzle", both, I("v128.const", "i8x16", *(["0"] * 8 + ["1"] * 8)))
        bitsel = I("v128.const", "i8x16", *[str(1 << (k % 8)) for k in range(LANES)])
        return I("v128.and", I("i8x16.eq", I("v128.and", spread, bitsel), bitsel), _splat8(1))

    def _crumbs(self, at: int) -> Instr:
        """Lane group j of 2-bit codes (quantformat._crumbs: byte b holds elements b, b + 8, b + 16,
        b + 24), as a 16-bit shift and an and (which drops the bits that cross a byte). Grouped: 16
        bytes hold bytes 4h..4h+3 of each row (h = j % 2), whose bit pair j / 2 is elements
        4j..4j+3: a load, a shift and an and, as a nibble's. Rows: lanes 0-7 want bit pair 2j of the
        block's 8 bytes and lanes 8-15 pair 2j + 1: the bytes in both halves, the low half's shifted
        up by a bit pair (a multiply by 4), then all right by 4j + 2 (one load: an unpack of two
        shifted copies needs the load twice)."""
        if self.g > 1:
            v, shift = self.load("v128.load", at + LANES * (self.j % 2), self.base), 2 * (self.j // 2)
        else:
            up = I("v128.const", "i16x8", *["4"] * 4 + ["1"] * 4)
            v, shift = I("i16x8.mul", self.load("v128.load64_splat", at, self.base), up), 4 * self.j + 2
        return I("v128.and", I("i16x8.shr_u", v, I("i32.const", shift)) if shift else v, _splat8(3))

    def on_lookup(self, n: Lookup, code: Instr) -> Instr:
        """A codebook lookup. Its indices are nibbles, below 16, where relaxed_swizzle is defined
        as swizzle on every engine: x86 then skips swizzle's saturating add that sends indices of
        16 and up to 0 (one operation per 16 values: IQ4_NL, MXFP4)."""
        op = "i8x16.relaxed_swizzle" if self.relaxed else "i8x16.swizzle"
        return I(op, I("v128.const", "i8x16", *map(str, n.values)), code)

    def on_op(self, n: Op, left: Instr, right: Instr) -> Instr:
        if n.op == "<<":
            assert isinstance(n.right, Int)
            return _shl8(left, n.right.value)
        return I({"+": "i8x16.add", "-": "i8x16.sub", "|": "v128.or", "&": "v128.and"}[n.op], left, right)


def unpack_lanes(qf: QuantFormat, base: Instr, j: int, error: Callable[[str], Exception],
                 what: str, relaxed: bool, load: Loader = _plain_load) -> Instr:
    """i8x16 of elements 16j..16j+15 of the block whose packed values start at `base`: the unpacked
    values, or (`what` "codes") the unsigned codes of QuantFormat.codes; `relaxed`: for a target
    with relaxed SIMD."""
    kb = qf.kernel
    if not 0 <= j < qf.group * kb.block // LANES:
        raise error(f"{qf.name}.{what}: lane group {j} is out of range 0..{qf.group * kb.block // LANES - 1}")
    if what == "unpack":
        return fold(kb.unpack, _LowerUnpack(kb, base, j, relaxed, load))
    if qf.codes is None:
        raise error(f"{qf.name} has no codes in [0, 127] (Q.codes7 is 0): use {qf.name}.unpack")
    return fold(qf.codes[0 if what == "codes" else 1], _LowerUnpack(kb, base, j, relaxed, load))


# ---- the per-block scale and offset, for `Q.scale4(w, blk)` and kin in kernels ---------------------


def lower_scales(qf: QuantFormat, planes: dict[str, Instr], blk: Instr, what: str, lanes: int,
                 reuse: Callable[[Instr], tuple[Instr, Instr]], form: str = "f32", at: Instr | None = None) -> Instr:
    """The f32 `what` ("scale" or "offset") of kernel block blk (lanes 1) or of blocks blk .. blk + 3
    (lanes 4, blk a multiple of 4) as an f32 or f32x4, or in the grouped layout (qf.group > 1, lanes
    4) of the group's rows for its block blk (blk counting blocks group by group: its rows' f32s
    side by side): `planes` reads each plane's pointer, `reuse` gives code for an i32 twice (code
    that evaluates it, then code that reads it again). A per-block plane is loaded as is; a
    super-block record (QuantFormat.record) gives F * I, F splat to the lanes (or each row's) and I a
    byte per block (per row) widened: the same f32 product pack's reference computes. Four blocks at a
    multiple of 4 lie in one record (a super-block holds 8). In the grouped layout `form` may take
    a record's factors apart: "f", F of the rows; "pairs", I of the rows as i16 lanes 2r and 2r + 1
    (pairsum's multipliers of row r's pair sums); "record", the address of the group's record (in
    either layout: of the row's record). An offset over sub-blocks (Factored.per > 1: Q2_K) gives F
    alone: its integers weigh activation sums in the kernels. `at`, if given, is the record's address
    ("record" of the same blk, formed once per super-block by the caller): "f" and "pairs" read from it
    (blk then picks the block within the record)."""
    rec, g = qf.record, qf.group
    if rec is None:
        op = "v128.load" if lanes == 4 else "f32.load"
        return I(op, I("i32.add", planes[what], I("i32.shl", blk, I("i32.const", str(2 + (g > 1) * 2)))))
    x = rec.factors[what]
    shift = rec.blocks.bit_length() - 1  # kernel blocks per record: a power of two (256 / 32)
    if at is not None:
        blk = (blk, blk)
    else:
        blk = reuse(blk) if x.i is not None else (blk, blk)
        at = I("i32.add", planes["scale"], I("i32.mul", I("i32.shr_u", blk[0], I("i32.const", str(shift))),
                                               I("i32.const", str(g * rec.bytes))))
    if form == "record":
        return at
    if g > 1:  # the rows' F side by side; their I of block blk side by side (QuantFormat._grouped)
        if x.i is None or form == "f" or x.per > 1:
            return I("v128.load", *_off(g * x.f_at), at)
        first, again = reuse(at) if form == "f32" else (at, None)
        sign = "s" if x.signed else "u"
        ints = I("i32.add", first, I("i32.shl", I("i32.and", blk[1], I("i32.const", str(rec.blocks - 1))), I("i32.const", str(g.bit_length() - 1))))
        raw = I("v128.load32_zero", *_off(g * x.i_at), ints)
        if form == "pairs":  # unsigned byte r (Q.int_scales: relaxed SIMD) to i16 lanes 2r, 2r + 1, high bytes
            # zero (a relaxed swizzle's index with the high bit set: ops._shuffle_relaxed)
            return I("i8x16.relaxed_swizzle", raw, I("v128.const", "i8x16", *(str(k) for r in range(4) for k in (r, 128, r, 128))))
        widened = I(f"i32x4.extend_low_i16x8_{sign}", I(f"i16x8.extend_low_i8x16_{sign}", raw))
        return I("f32x4.mul", I("f32x4.convert_i32x4_s", widened), I("v128.load", *_off(g * x.f_at), again))
    if x.i is None or form == "f" or x.per > 1:
        f = I("f32.load", *_off(x.f_at), at)
        return I("f32x4.splat", f) if lanes == 4 else f
    first, again = reuse(at)
    ints = I("i32.add", first, I("i32.and", blk[1], I("i32.const", str(rec.blocks - 1))))
    f = I("f32.load", *_off(x.f_at), again)
    sign = "s" if x.signed else "u"
    if lanes == 1:
        return I("f32.mul", I(f"f32.convert_i32_{sign}", I(f"i32.load8_{sign}", *_off(x.i_at), ints)), f)
    widened = I(f"i32x4.extend_low_i16x8_{sign}", I(f"i16x8.extend_low_i8x16_{sign}", I("v128.load32_zero", *_off(x.i_at), ints)))
    return I("f32x4.mul", I("f32x4.convert_i32x4_s", widened), I("f32x4.splat", f))

