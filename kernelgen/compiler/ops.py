"""Per-target lowering tables: what each operator and built-in becomes in WAT.

`SIMD128` is the baseline table; `RELAXED` is `{**SIMD128, ...}` with the few entries relaxed SIMD
does better. Where an op is lowered for a target is therefore one dict entry. An op missing from a
target's table, or given types its entry does not accept, is a checked error at the call's span.

Every entry is `fn(c, q, args) -> Val`: `c` gives access to the lowerer (errors, temporaries),
`q` is the type qualifier of a qualified call (`f32x4.load` -> "f32x4") or None, `args` are the
lowered operands.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, field
from typing import Callable, Protocol

from . import types as T
from ..quantformat import GROUP_ROWS, QuantFormat
from .wat import I, Instr, number


@dataclass(frozen=True)
class Val:
    """A lowered expression: its code, its type, and its value when known at compile time."""

    code: Instr | None
    type: str
    const: int | float | None = None


class Ctx(Protocol):
    def error(self, message: str) -> Exception: ...
    def materialize(self, v: Val, type_: str | None = None) -> Instr: ...
    def reuse(self, v: Val) -> tuple[Instr, Instr]: ...
    def load_once(self, op: str, offset: int, addr: Instr, shl: int = 0) -> Instr: ...


Op = Callable[[Ctx, "str | None", list[Val]], Val]

_INT = {"+": "add", "-": "sub", "*": "mul", "/": "div_s", "%": "rem_s", "&": "and", "|": "or",
        "^": "xor", "<<": "shl", ">>": "shr_s"}
_FLOAT = {"+": "add", "-": "sub", "*": "mul", "/": "div"}
_CMP_INT = {"==": "eq", "!=": "ne", "<": "lt_s", "<=": "le_s", ">": "gt_s", ">=": "ge_s"}
_CMP_FLOAT = {"==": "eq", "!=": "ne", "<": "lt", "<=": "le", ">": "gt", ">=": "ge"}
_VEC_INT = {"+": "add", "-": "sub", "*": "mul", "<<": "shl", ">>": "shr_s"}
_VEC_BITS = {"&": "and", "|": "or", "^": "xor"}
# Lane widths that lack an instruction wasm SIMD does not have (no i8x16.mul, no i8 division).
_VEC_MISSING = {("i8", "*")}


def _binary(op: str) -> Op:
    def lower(c: Ctx, q: str | None, args: list[Val]) -> Val:
        a, b = args
        t = a.type
        if T.is_scalar(t):
            table = {**_INT, **_CMP_INT} if T.is_int(t) else {**_FLOAT, **_CMP_FLOAT}
            if op not in table:
                raise c.error(f"operator '{op}' is not defined for {t}")
            rt = "i32" if op in _CMP_INT else t
            return Val(I(f"{t}.{table[op]}", c.materialize(a), c.materialize(b, t)), rt)
        v = T.VECTORS[t]
        if op in _VEC_BITS and not v.is_float:
            return Val(I(f"v128.{_VEC_BITS[op]}", c.materialize(a), c.materialize(b)), t)
        if op in _CMP_INT:
            name = _CMP_FLOAT[op] if v.is_float or op in ("==", "!=") else _CMP_INT[op][:-1] + v.sign
            return Val(I(f"{v.prefix}.{name}", c.materialize(a), c.materialize(b)), T.mask_type(t))
        table = _FLOAT if v.is_float else _VEC_INT
        if op == "*" and not v.is_float and _power_of_two(b) is not None:  # i32x4.mul is slow on x86: shift
            return Val(I(f"{v.prefix}.shl", c.materialize(a), I("i32.const", _power_of_two(b))), t)
        if op not in table or (v.lane, op) in _VEC_MISSING:
            raise c.error(f"operator '{op}' is not available for {t} (wasm SIMD has no such instruction)")
        name = table[op]
        if op == ">>" and v.unsigned:
            name = "shr_u"
        rhs = c.materialize(b, "i32" if op in ("<<", ">>") else t)
        return Val(I(f"{v.prefix}.{name}", c.materialize(a), rhs), t)

    return lower


def _power_of_two(v: Val) -> int | None:
    """log2 of a compile-time positive power of two, else None."""
    if isinstance(v.const, int) and v.const > 0 and v.const & (v.const - 1) == 0:
        return v.const.bit_length() - 1
    return None


def _unary_float_or_vec(name: str, ints: bool = False) -> Op:
    """abs, sqrt, nearest, floor, ...: one wasm instruction named after the op, on any float type
    (and integer vectors too when `ints`)."""

    def lower(c: Ctx, q: str | None, args: list[Val]) -> Val:
        (a,) = _arity(c, args, 1, name)
        t = a.type
        ok = T.is_float(t) or (ints and T.is_vector(t) and not T.VECTORS[t].unsigned)
        if not ok or t == T.FLOAT_LIT:
            raise c.error(f"{name}() takes a float {'or signed integer vector ' if ints else ''}value, not {t}")
        prefix = T.VECTORS[t].prefix if T.is_vector(t) else t
        return Val(I(f"{prefix}.{name}", c.materialize(a)), t)

    return lower


def _minmax(name: str) -> Op:
    def lower(c: Ctx, q: str | None, args: list[Val]) -> Val:
        a, b = _same(c, _arity(c, args, 2, name), name)
        t = _common_type(a, b)
        if T.is_float(t):
            prefix = T.VECTORS[t].prefix if T.is_vector(t) else t
            return Val(I(f"{prefix}.{name}", c.materialize(a, t), c.materialize(b, t)), t)
        if T.is_vector(t) and T.VECTORS[t].lane != "i64":
            v = T.VECTORS[t]
            return Val(I(f"{v.prefix}.{name}_{v.sign}", c.materialize(a, t), c.materialize(b, t)), t)
        if t in ("i32", "i64"):  # no scalar integer min/max in wasm: compare and select
            a1, a2 = c.reuse(Val(c.materialize(a, t), t))
            b1, b2 = c.reuse(Val(c.materialize(b, t), t))
            return Val(I("select", a1, b1, I(f"{t}.{'lt_s' if name == 'min' else 'gt_s'}", a2, b2)), t)
        raise c.error(f"{name}() is not available for {t}")

    return lower


def _pminmax(name: str) -> Op:
    """pmin(a, b) = b < a ? b : a and pmax(a, b) = a < b ? b : a on float vectors: one instruction on
    x86 (wasm's min/max must order NaN and -0 and take several); a NaN in `a` is kept."""

    def lower(c: Ctx, q: str | None, args: list[Val]) -> Val:
        a, b = _same(c, _arity(c, args, 2, name), name)
        t = _common_type(a, b)
        if t not in ("f32x4", "f64x2"):
            raise c.error(f"{name}() takes float vectors, not {t}")
        return Val(I(f"{t}.{name}", c.materialize(a, t), c.materialize(b, t)), t)

    return lower


def _horizontal(name: str, combine: str) -> Op:
    """hsum / hmax: fold the lanes of a 4-lane vector into a scalar, pairs first ((0,1),(2,3)).
    hsum(a, b, c, d) folds four at once into one vector (lane i: the ith's hsum, in the same order),
    six shuffles and three adds where four scalar folds take sixteen extracts and twelve adds."""

    def lower(c: Ctx, q: str | None, args: list[Val]) -> Val:
        if combine == "add":
            if len(args) not in (1, 4):
                raise c.error(f"hsum() takes one vector, or four, got {len(args)} arguments")
            if len(args) == 4:
                return _hsum4(c, _same(c, args, name))
        (a,) = _arity(c, args, 1, name)
        if a.type not in ("f32x4", "i32x4") or (a.type == "i32x4" and combine != "add"):
            raise c.error(f"{name}() takes an f32x4{' or i32x4' if combine == 'add' else ''}, not {a.type}")
        lane = T.VECTORS[a.type].lane
        first, again = c.reuse(a)
        ext = [I(f"{a.type}.extract_lane", k, first if k == 0 else again) for k in range(4)]
        op = f"{lane}.{combine}"
        return Val(I(op, I(op, ext[0], ext[1]), I(op, ext[2], ext[3])), lane)

    return lower


def _hsum4(c: Ctx, args: list[Val]) -> Val:
    """hsum(a, b, c, d): pairs within each vector ((0+1), (2+3)), then the pairs' sums."""
    t = args[0].type
    if t not in ("f32x4", "i32x4"):
        raise c.error(f"hsum() takes f32x4 or i32x4 vectors, not {t}")
    evens, odds = _lane_bytes([0, 2, 4, 6], 4), _lane_bytes([1, 3, 5, 7], 4)

    def pairs(x: Val, y: Val) -> Instr:  # lanes x0+x1, x2+x3, y0+y1, y2+y3
        (x1, x2), (y1, y2) = c.reuse(x), c.reuse(y)
        return I(f"{t}.add", I("i8x16.shuffle", *evens, x1, y1), I("i8x16.shuffle", *odds, x2, y2))

    ab, cd = Val(pairs(args[0], args[1]), t), Val(pairs(args[2], args[3]), t)
    return Val(pairs(ab, cd), t)


def _arity(c: Ctx, args: list[Val], n: int, name: str) -> list[Val]:
    if len(args) != n:
        raise c.error(f"{name}() takes {n} argument{'s' if n != 1 else ''}, got {len(args)}")
    return args


def _same(c: Ctx, args: list[Val], name: str) -> list[Val]:
    types = {a.type for a in args} - {T.INT_LIT, T.FLOAT_LIT}
    if len(types) > 1:
        raise c.error(f"{name}() needs operands of one type, got {', '.join(a.type for a in args)}")
    return args


def _common_type(*args: Val) -> str:
    """The type operands share: the first that is not a literal, else the literal's default."""
    typed = [a.type for a in args if a.type not in (T.INT_LIT, T.FLOAT_LIT)]
    if typed:
        return typed[0]
    return "f32" if any(a.type == T.FLOAT_LIT for a in args) else "i32"


def _need(c: Ctx, v: Val, want: str, what: str) -> None:
    if v.type != want:
        raise c.error(f"{what} must be {want}, not {v.type}")


def _qualified(c: Ctx, q: str | None, name: str) -> str:
    if q is None:
        raise c.error(f"{name}() needs a type, e.g. f32x4.{name}(...)")
    return q


def _const_int(c: Ctx, v: Val, what: str) -> int:
    if not isinstance(v.const, int):
        raise c.error(f"{what} must be a compile-time integer")
    return v.const


def _offset(c: Ctx, args: list[Val], n_before: int, name: str) -> int:
    if len(args) == n_before:
        return 0
    off = _const_int(c, args[n_before], f"the offset of {name}()")
    if off < 0:
        raise c.error(f"the offset of {name}() must not be negative, got {off}")
    return off


def _load(c: Ctx, q: str | None, args: list[Val]) -> Val:
    t = _qualified(c, q, "load")
    if len(args) not in (1, 2):
        raise c.error(f"{t}.load(ptr[, offset]) takes 1 or 2 arguments, got {len(args)}")
    off = _offset(c, args, 1, "load")
    if T.is_vector(t):  # an equal load before it (nothing written since) is read from its local
        return Val(c.load_once("v128.load", off, c.materialize(args[0], "i32")), t)
    imms = (f"offset={off}",) if off else ()
    return Val(Instr(f"{t}.load", imms, (c.materialize(args[0], "i32"),)), t)


def _load8x8(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """i16x8.load8x8(ptr[, offset]): eight int8 at ptr + offset, sign-extended to i16 lanes (one
    load; a byte per lane in memory where an i16x8.load takes two)."""
    t = _qualified(c, q, "load8x8")
    if t != "i16x8":
        raise c.error(f"load8x8 widens eight int8 to i16 lanes: i16x8.load8x8, not {t}.load8x8")
    if len(args) not in (1, 2):
        raise c.error(f"i16x8.load8x8(ptr[, offset]) takes 1 or 2 arguments, got {len(args)}")
    off = _offset(c, args, 1, "load8x8")
    return Val(Instr("v128.load8x8_s", (f"offset={off}",) if off else (), (c.materialize(args[0], "i32"),)), t)


def _store(c: Ctx, q: str | None, args: list[Val]) -> Val:
    t = _qualified(c, q, "store")
    if len(args) not in (2, 3):
        raise c.error(f"{t}.store(ptr[, offset], value) takes 2 or 3 arguments, got {len(args)}")
    off = _offset(c, args[:-1], 1, "store")
    value = args[-1]
    op = "v128.store" if T.is_vector(t) else f"{t}.store"
    imms = (f"offset={off}",) if off else ()
    return Val(Instr(op, imms, (c.materialize(args[0], "i32"), c.materialize(value, t))), "void")


def _splat(c: Ctx, q: str | None, args: list[Val]) -> Val:
    t = _qualified(c, q, "splat")
    if not T.is_vector(t):
        raise c.error(f"splat makes a vector; {t} is not a vector type")
    (a,) = _arity(c, args, 1, "splat")
    v = T.VECTORS[t]
    scalar = "i32" if v.lane in ("i8", "i16") else v.lane
    if a.const is not None:
        if not v.is_float and not isinstance(a.const, int):
            raise c.error(f"{t}.splat of a float constant; convert it explicitly")
        value = a.const if v.is_float else int(a.const)
        bits = {"i8": 8, "i16": 16, "i32": 32}.get(v.lane, 64)
        if not v.is_float and not -(1 << (bits - 1)) <= value < (1 << bits):
            raise c.error(f"{value} does not fit in a {v.lane} lane")
        return Val(I("v128.const", v.prefix, *([number(value)] * v.lanes)), t)
    return Val(I(f"{v.prefix}.splat", c.materialize(a, scalar)), t)


def _convert(c: Ctx, q: str | None, args: list[Val]) -> Val:
    t = _qualified(c, q, "convert")
    (a,) = _arity(c, args, 1, "convert")
    table = {("f32x4", "i32x4"): "f32x4.convert_i32x4_s", ("f64x2", "i32x4"): "f64x2.convert_low_i32x4_s"}
    if (t, a.type) not in table:
        raise c.error(f"{t}.convert() does not take {a.type}")
    return Val(I(table[(t, a.type)], c.materialize(a)), t)


def _trunc_sat(c: Ctx, q: str | None, args: list[Val]) -> Val:
    t = _qualified(c, q, "trunc_sat")
    (a,) = _arity(c, args, 1, "trunc_sat")
    if (t, a.type) != ("i32x4", "f32x4"):
        raise c.error(f"{t}.trunc_sat() does not take {a.type}")
    return Val(I("i32x4.trunc_sat_f32x4_s", c.materialize(a)), t)


def _narrow(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """Two vectors of wide lanes -> one of half-width lanes, saturating (signed or unsigned by q)."""
    t = _qualified(c, q, "narrow")
    a, b = _arity(c, args, 2, "narrow")
    wide = {"i16x8": "i32x4", "i8x16": "i16x8", "u8x16": "i16x8"}.get(t)
    if wide is None or a.type != wide or b.type != wide:
        raise c.error(f"{t}.narrow() takes two {wide or 'wider vectors'}, got {a.type}, {b.type}")
    v, w = T.VECTORS[t], T.VECTORS[wide]
    return Val(I(f"{v.prefix}.narrow_{w.prefix}_{v.sign}", c.materialize(a), c.materialize(b)), t)


def _extend(half: str) -> Op:
    def lower(c: Ctx, q: str | None, args: list[Val]) -> Val:
        t = _qualified(c, q, f"extend_{half}")
        (a,) = _arity(c, args, 1, f"extend_{half}")
        narrow = {"i16x8": ("i8x16", "u8x16"), "i32x4": ("i16x8",)}.get(t, ())
        if a.type not in narrow:
            raise c.error(f"{t}.extend_{half}() does not take {a.type}")
        src = T.VECTORS[a.type]
        return Val(I(f"{T.VECTORS[t].prefix}.extend_{half}_{src.prefix}_{src.sign}", c.materialize(a)), t)

    return lower


def _bits(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """Reinterpret: free between vector types; i32<->f32, i64<->f64 for scalars."""
    t = _qualified(c, q, "bits")
    (a,) = _arity(c, args, 1, "bits")
    if T.is_vector(t) and T.is_vector(a.type):
        return Val(c.materialize(a), t)
    pairs = {("i32", "f32"), ("f32", "i32"), ("i64", "f64"), ("f64", "i64")}
    if (t, a.type) not in pairs:
        raise c.error(f"{t}.bits() cannot reinterpret {a.type}")
    return Val(I(f"{t}.reinterpret_{a.type}", c.materialize(a)), t)


def _extract(c: Ctx, q: str | None, args: list[Val]) -> Val:
    v_, lane_ = _arity(c, args, 2, "extract")
    if not T.is_vector(v_.type):
        raise c.error(f"extract() takes a vector, not {v_.type}")
    v = T.VECTORS[v_.type]
    lane = _const_int(c, lane_, "the lane of extract()")
    if not 0 <= lane < v.lanes:
        raise c.error(f"lane {lane} is out of range for {v_.type} (0..{v.lanes - 1})")
    suffix = f"_{v.sign}" if v.lane in ("i8", "i16") else ""
    scalar = "i32" if v.lane in ("i8", "i16") else v.lane
    return Val(I(f"{v.prefix}.extract_lane{suffix}", lane, c.materialize(v_)), scalar)


def _iota(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """T.iota(): the lane indices 0, 1, ..., n-1 (for lane masks: `i32x4.iota() < i32x4.splat(k)`)."""
    t = _qualified(c, q, "iota")
    _arity(c, args, 0, "iota")
    if not T.is_vector(t):
        raise c.error(f"iota makes a vector; {t} is not a vector type")
    v = T.VECTORS[t]
    return Val(I("v128.const", v.prefix, *(number(float(k) if v.is_float else k) for k in range(v.lanes))), t)


def _shuffle(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """T.shuffle(a, b, l0, ..., l{n-1}): lane k of the result is lane l_k of a ++ b (0..2n-1),
    lowered to i8x16.shuffle with the byte indices of those lanes."""
    t = _qualified(c, q, "shuffle")
    if not T.is_vector(t):
        raise c.error(f"shuffle takes a vector type, not {t}")
    n = T.VECTORS[t].lanes
    if len(args) != 2 + n:
        raise c.error(f"{t}.shuffle(a, b, ...) takes two vectors and {n} lane indices, got {len(args)} arguments")
    a, b, *lanes = args
    for v in (a, b):
        _need(c, v, t, "a shuffle operand")
    idx = [_const_int(c, lane, "a shuffle lane") for lane in lanes]
    if any(not 0 <= i < 2 * n for i in idx):
        raise c.error(f"shuffle lanes of {t} must be in 0..{2 * n - 1}, got {idx}")
    return Val(I("i8x16.shuffle", *_lane_bytes(idx, n), c.materialize(a), c.materialize(b)), t)


def _shuffle_relaxed(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """shuffle; where one operand is a constant zero, a relaxed swizzle of the other with index 0x80
    in the zero lanes: zero on every engine (a relaxed_swizzle index with the high bit set), one
    pshufb on x86 where the shuffle is a table load and vpermi2b in cranelift (AVX-512 VBMI) or two
    pshufb and an or (V8). Q4_K's and Q5_K's byte-to-lane spreads (bytelanes, and the same swizzle in
    rowscale_pairs): their qmatvec at 256x4096 1.02x and 1.03x in wasmtime, 1.08x and 1.07x in Node 20,
    1.09x and 1.17x in Chromium 156 (Zen 4), bits unchanged."""
    v = _shuffle(c, q, args)
    a, b = v.code.args
    if is_zero_vector(args[0]) == is_zero_vector(args[1]):
        return v
    own = 16 if is_zero_vector(args[0]) else 0  # the byte indices that read the other operand start here
    idx = [int(x) - own if own <= int(x) < own + 16 else 128 for x in v.code.imms]
    return Val(I("i8x16.relaxed_swizzle", b if own else a, I("v128.const", "i8x16", *map(str, idx))), v.type)


def _lane_bytes(lanes: list[int], n: int) -> list[str]:
    """i8x16.shuffle's byte indices for picking `lanes` of two n-lane vectors."""
    width = 16 // n
    return [str(i * width + k) for i in lanes for k in range(width)]


def _select(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """select(cond, a, b): a where cond is set. Lane-wise (bitselect) for vector masks."""
    m, a, b = _arity(c, args, 3, "select")
    a, b = _same(c, [a, b], "select")
    t = _common_type(a, b)
    if T.is_vector(t):
        _need(c, m, T.mask_type(t), "the mask of select()")
        return Val(I("v128.bitselect", c.materialize(a, t), c.materialize(b, t), c.materialize(m)), t)
    _need(c, m, "i32", "the condition of select()")
    return Val(I("select", c.materialize(a, t), c.materialize(b, t), c.materialize(m)), t)


def _cast(to: str) -> Op:
    """`f32(x)`, `i32(x)`, ...: numeric conversion between scalars; float -> int saturates."""

    table = {
        ("f32", "i32"): "f32.convert_i32_s", ("f32", "i64"): "f32.convert_i64_s", ("f32", "f64"): "f32.demote_f64",
        ("f64", "i32"): "f64.convert_i32_s", ("f64", "i64"): "f64.convert_i64_s", ("f64", "f32"): "f64.promote_f32",
        ("i32", "f32"): "i32.trunc_sat_f32_s", ("i32", "f64"): "i32.trunc_sat_f64_s", ("i32", "i64"): "i32.wrap_i64",
        ("i64", "i32"): "i64.extend_i32_s", ("i64", "f32"): "i64.trunc_sat_f32_s", ("i64", "f64"): "i64.trunc_sat_f64_s",
    }

    def lower(c: Ctx, q: str | None, args: list[Val]) -> Val:
        (a,) = _arity(c, args, 1, to)
        if a.type == to:
            return a
        if a.const is not None and a.type in (T.INT_LIT, T.FLOAT_LIT):
            if to.startswith("i") and not math.isfinite(a.const):
                raise c.error(f"cannot convert {a.const} to {to}")
            value = float(a.const) if to.startswith("f") else int(a.const)
            return Val(None, to, value)
        if (to, a.type) not in table:
            raise c.error(f"cannot convert {a.type} to {to}")
        return Val(I(table[(to, a.type)], c.materialize(a)), to)

    return lower


def wrap(x: int | float, t: str) -> int | float:
    if isinstance(x, float) or t not in ("i32", "i64"):
        return x
    bits = 32 if t == "i32" else 64
    x &= (1 << bits) - 1
    return x - (1 << bits) if x >> (bits - 1) else x


def fold(op: str, a: Val, b: Val) -> Val | None:
    """Evaluate an operator on two compile-time values (C semantics for / and %), or None."""
    x, y = a.const, b.const
    t = a.type if a.type not in (T.INT_LIT, T.FLOAT_LIT) else b.type
    cmp = {"==": x == y, "!=": x != y, "<": x < y, "<=": x <= y, ">": x > y, ">=": x >= y}
    if isinstance(x, float) or isinstance(y, float):
        # Only untyped literals fold in Python; typed floats are left to wasm (f32 rounding).
        if t not in (T.INT_LIT, T.FLOAT_LIT):
            return None
        if op in cmp:
            return Val(None, "i32", int(cmp[op]))
        if op == "/" and y == 0:  # IEEE: +-inf, or NaN for 0/0 (`-1.0 / 0.0` spells -inf)
            r = float("nan") if x == 0 or x != x else math.copysign(float("inf"), x) * math.copysign(1.0, y)
            return Val(None, T.FLOAT_LIT, r)
        if op in ("+", "-", "*", "/"):
            return Val(None, T.FLOAT_LIT, float({"+": x + y, "-": x - y, "*": x * y, "/": x / (y or 1)}[op]))
        return None
    if op in ("/", "%") and y == 0:
        return None
    if op in cmp:
        return Val(None, "i32", int(cmp[op]))
    if op in ("<<", ">>") and not 0 <= y < 64:
        return None
    if op in ("/", "%"):
        q = abs(x) // abs(y) * (1 if (x >= 0) == (y >= 0) else -1)  # C: truncate toward zero
        r = q if op == "/" else x - q * y
    else:
        r = {"+": operator.add, "-": operator.sub, "*": operator.mul, "&": operator.and_, "|": operator.or_,
             "^": operator.xor, "<<": operator.lshift, ">>": operator.rshift}[op](x, y)
    return Val(None, t, wrap(r, t))



def _atomic(name: str, wasm: str, n_values: int, returns: bool) -> Op:
    """atomic_load(p), atomic_store(p, v), atomic_add/sub(p, v) -> old, atomic_cmpxchg(p, expected,
    new) -> old, on i32 words at 4-byte aligned addresses (sequentially consistent, as wasm's are)."""

    def lower(c: Ctx, q: str | None, args: list[Val]) -> Val:
        _arity(c, args, 1 + n_values, name)
        for a in args:
            if a.type not in ("i32", T.INT_LIT):
                raise c.error(f"{name}() works on i32 words: its arguments must be i32, got {a.type}")
        return Val(I(wasm, *(c.materialize(a, "i32") for a in args)), "i32" if returns else "void")

    return lower


def _wait32(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """wait32(p, expected, timeout_ns): sleep while the word at p equals expected (timeout < 0:
    forever); 0 woken, 1 not equal, 2 timed out."""
    p, expected, timeout = _arity(c, args, 3, "wait32")
    for v, what in ((p, "address"), (expected, "expected value")):
        if v.type not in ("i32", T.INT_LIT):
            raise c.error(f"wait32's {what} must be i32, not {v.type}")
    if timeout.type not in ("i64", T.INT_LIT):
        raise c.error(f"wait32's timeout must be i64 nanoseconds, not {timeout.type}")
    code = I("memory.atomic.wait32", c.materialize(p, "i32"), c.materialize(expected, "i32"),
             c.materialize(timeout, "i64"))
    return Val(code, "i32")


def _trap(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """trap(): stop with a trap (wasm's unreachable), for an input the kernel cannot honour that only
    it can see (a length read from memory): the host raises it, where going on would write past a
    buffer."""
    _arity(c, args, 0, "trap")
    return Val(I("unreachable"), "void")


def _notify(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """notify(p, count): wake up to count waiters on p (count -1: all); returns how many woke."""
    p, count = _arity(c, args, 2, "notify")
    return Val(I("memory.atomic.notify", c.materialize(p, "i32"), c.materialize(count, "i32")), "i32")


def _run_job(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """run_job(index, begin, end): call entry `index` of the job table on items [begin, end)."""
    idx, begin, end = _arity(c, args, 3, "run_job")
    code = I("call_indirect", "$jobs", "(type $job)", c.materialize(begin, "i32"), c.materialize(end, "i32"),
             c.materialize(idx, "i32"))
    return Val(code, "void")


# ---- ops whose lowering differs by target ------------------------------------------------------


def _pairs_to_i32(x: Instr) -> Instr:
    """i16 lanes summed in pairs into i32 lanes: an i16 dot with ones, what extadd_pairwise does,
    written so an engine can keep the ones in a register (V8 11 loads extadd's constant's address
    before every use)."""
    return I("i32x4.dot_i16x8_s", x, I("v128.const", "i16x8", *["1"] * 8))


def _idot_check(c: Ctx, args: list[Val]) -> tuple[Val, Val, Val, int | None]:
    """(acc, w, a, offset). `a` is an i8x16 of activations, or the address of activations stored in
    the target's layout (ACT_BYTES each) with a constant `offset` counted in activations."""
    if len(args) not in (3, 4):
        raise c.error(f"idot(acc, w, a) or idot(acc, w, ptr, offset) takes 3 or 4 arguments, got {len(args)}")
    acc, w, a = args[:3]
    _need(c, acc, "i32x4", "idot's accumulator")
    _need(c, w, "i8x16", "idot's weights")
    if a.type == "i32":
        return acc, w, a, _offset(c, args, 3, "idot")
    _need(c, a, "i8x16", "idot's activations")
    if len(args) == 4:
        raise c.error("idot's offset goes with an activation pointer, not an i8x16 value")
    return acc, w, a, None


def _act_load(c: Ctx, p: Instr, offset: int, op: str = "v128.load") -> Instr:
    """Stored activations at p + offset bytes (16 bytes, or 8 widened by a load8x8 `op`): loaded once
    for the dots in the statements that follow with the same activations (a GEMM tile's rows)."""
    return c.load_once(op, offset, p)


def _idot_i16(c: Ctx, args: list[Val], act: dict[str, int]) -> Val:
    """acc + w.a with lanes of 4 products each: i32x4.dot_i16x8_s, exact for any int8 w and a.
    Activations given by address are stored as the target's `act` constants say: as i16 in
    SIMD128's split layout (_idot_split) or as bytes in order (relaxed SIMD's: two sign-extending
    loads, against the sign-extended halves of w)."""
    acc, w, a, offset = _idot_check(c, args)
    if offset is not None and act["ACT_SPLIT"]:
        return _idot_split(c, acc, w, a, offset)
    w1, w2 = c.reuse(w)
    if offset is None:
        a1, a2 = c.reuse(a)
        a_lo, a_hi = I("i16x8.extend_low_i8x16_s", a1), I("i16x8.extend_high_i8x16_s", a2)
    else:
        p1, p2 = c.reuse(a)
        a_lo, a_hi = _act_load(c, p1, offset, "v128.load8x8_s"), _act_load(c, p2, offset + 8, "v128.load8x8_s")
    lo = I("i32x4.dot_i16x8_s", I("i16x8.extend_low_i8x16_s", w1), a_lo)
    hi = I("i32x4.dot_i16x8_s", I("i16x8.extend_high_i8x16_s", w2), a_hi)
    return _plus_acc(c, acc, I("i32x4.add", lo, hi))


def _plus_acc(c: Ctx, acc: Val, dots: Instr) -> Val:
    """acc + dots, or dots alone for a zero acc (a block's first dot: engines keep an add of zero)."""
    if is_zero_vector(acc):
        return Val(dots, "i32x4")
    return Val(I("i32x4.add", c.materialize(acc), dots), "i32x4")


def _idot_split(c: Ctx, acc: Val, w: Val, p: Val, offset: int) -> Val:
    """acc + 256 w.a (DOT_SHIFT 8) for 16 activations stored as i16 in SIMD128's split layout
    (ACT_SPLIT: the 8 at even positions, then the 8 at odd ones), without sign-extending w (the
    shuffle port's work, 3 of its operations per 16 weights): read as i16x8, w << 8 is its even
    bytes * 256 and w & 0xFF00 its odd bytes * 256, exactly (|256 w| <= 32768). Their i16 dots with
    the two planes sum to 256 w.a, each lane 4 products of at most 127 * 32768 in magnitude; the
    kernels shift the 256 out once per group of blocks (qexact in kernels.dsl), not per call."""
    w1, w2 = c.reuse(w)
    p1, p2 = c.reuse(p)
    even = I("i16x8.shl", w1, I("i32.const", "8"))
    odd = I("v128.and", w2, I("v128.const", "i16x8", *["0xff00"] * 8))
    dots = I("i32x4.add", I("i32x4.dot_i16x8_s", even, _act_load(c, p1, offset * 2)),
             I("i32x4.dot_i16x8_s", odd, _act_load(c, p2, offset * 2 + 16)))
    return _plus_acc(c, acc, dots)


def _idot_simd128(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """idot and idot7 on SIMD128: the i16 dot (activations stored as split i16, SIMD128_ACT)."""
    return _idot_i16(c, args, SIMD128_ACT)


def is_zero_vector(v: Val) -> bool:
    """A v128.const whose 128 bits are all zero (-0.0 has its sign bit)."""
    code = v.code
    return (code is not None and code.op == "v128.const" and not code.args
            and all(float(x) == 0 and not x.startswith("-") for x in code.imms[1:]))


def _idot_relaxed(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """idot on relaxed SIMD: exact for any int8 w (Q8_0's codes, codebook values), so the i16 dot
    of SIMD128 over byte activations; the relaxed dot cannot take a w of 8 significant bits."""
    return _idot_i16(c, args, RELAXED_ACT)


def _idots_relaxed(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """idots(acc, w, ptr, offset): acc + w.a for any int8 w and stored activations a in [-127, 127]
    (ACT_MAX), in lanes of four consecutive products (not idot's split: for sums whose lanes are
    added in integers). The activations' sign parts p = max(a, 0) and n = p - a = max(-a, 0), both
    in [0, 127], take the 7-bit operand of two relaxed i16 dots with w in the signed one: exact on
    every engine's semantics (pairs at most 2 * 128 * 127), subtracted in i16 (a pair of w * a is at
    most 2 * 128 * 127 too, so the wrapping subtraction is exact), then widened. Six operations
    and no sign-extend: idot's i16 dot of bytes takes four sign-extends, shuffle-port work that left
    relaxed Q8_0 mat-vec at 0.77x simd128. (p and n stored by quantize_act beside the values, one
    layout for all types, measured Q8_0 mat-vec 1.02x and GEMM 0.97x this, Q4_0 GEMM 0.89x: three
    times the activation bytes.)"""
    acc, w, a, offset = _idot_check(c, args)
    if offset is None:  # activations in a register: idot's form
        return _idot_i16(c, args, RELAXED_ACT)
    p, n = _sign_parts(c, a, offset)
    w1, w2 = c.reuse(w)
    dot_p = I("i16x8.relaxed_dot_i8x16_i7x16_s", w1, p)
    dot_n = I("i16x8.relaxed_dot_i8x16_i7x16_s", w2, n)
    return _plus_acc(c, acc, _pairs_to_i32(I("i16x8.sub", dot_p, dot_n)))


def _sign_parts(c: Ctx, a: Val, offset: int) -> tuple[Instr, Instr]:
    """p = max(a, 0) and n = p - a of the 16 stored activations at a + offset: both in [0, 127]."""
    a1, a2 = c.reuse(Val(_act_load(c, c.materialize(a, "i32"), offset), "i8x16"))
    p1, p2 = c.reuse(Val(I("i8x16.max_s", a1, I("v128.const", "i8x16", *["0"] * 16)), "i8x16"))
    return p1, I("i8x16.sub", p2, a2)


def _idots_fused(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """idots for engines whose relaxed i32 dot-add is one instruction (Chromium's vpdpbusd on
    AVX-VNNI; the "vnni" flavor): the same sign parts p and n, each through the dot-add, p's into
    acc and n's into zero, then subtracted. Exact as idots (a lane's four products of p or n at most
    4 * 128 * 127 each). Four instructions there against idots' five; six where the dot-add is
    pmaddubsw, pmaddwd and an add (wasmtime, Node 20), which measured 0.59x idots in Node."""
    acc, w, a, offset = _idot_check(c, args)
    if offset is None:
        return _idot_i16(c, args, RELAXED_ACT)
    p, n = _sign_parts(c, a, offset)
    w1, w2 = c.reuse(w)
    dot_p = I("i32x4.relaxed_dot_i8x16_i7x16_add_s", w1, p, c.materialize(acc))
    dot_n = I("i32x4.relaxed_dot_i8x16_i7x16_add_s", w2, n, I("v128.const", "i32x4", *["0"] * 4))
    return Val(I("i32x4.sub", dot_p, dot_n), "i32x4")


_IDOTS2 = (("acc", "i32x4", "accumulator"), ("w0", "i8x16", "first values"), ("w1", "i8x16", "second values"),
           ("ptr", "i32", "activation address"))


def _idots2(idots: Op) -> Op:
    def lower(c: Ctx, q: str | None, args: list[Val]) -> Val:
        """idots2(acc, w0, w1, ptr, offset): acc + w0.a[0:16] + w1.a[16:32], a block's two halves:
        the target's idots of each in turn (its lanes and order)."""
        acc, w0, w1, a, offset = _dot_args(c, args, "idots2", _IDOTS2)
        p1, p2 = c.reuse(a)
        first = idots(c, q, [acc, w0, Val(p1, "i32"), Val(None, T.INT_LIT, offset)])
        return idots(c, q, [first, w1, Val(p2, "i32"), Val(None, T.INT_LIT, offset + 16)])
    return lower


def _idots2_fused(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """idots2 where the relaxed i32 dot-add is one instruction (the vnni flavor): the sign parts'
    dot-adds of both halves in two chains, p's from acc and n's from zero, subtracted once: four
    dot-adds and a subtraction per block against idots twice's four, two subtractions and two
    zeroings. Exact as idots: each chain's lanes sum at most 8 products of 128 * 127."""
    acc, w0, w1, a, offset = _dot_args(c, args, "idots2", _IDOTS2)
    a1, a2 = c.reuse(a)
    p0, n0 = _sign_parts(c, Val(a1, "i32"), offset)
    p1, n1 = _sign_parts(c, Val(a2, "i32"), offset + 16)
    w0a, w0b = c.reuse(w0)
    w1a, w1b = c.reuse(w1)
    dot = "i32x4.relaxed_dot_i8x16_i7x16_add_s"
    pos = I(dot, w1a, p1, I(dot, w0a, p0, c.materialize(acc)))
    neg = I(dot, w1b, n1, I(dot, w0b, n0, I("v128.const", "i32x4", *["0"] * 4)))
    return Val(I("i32x4.sub", pos, neg), "i32x4")


def _idot7_relaxed(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """idot7(acc, u, a): acc + u.a for codes u in [0, 127], one relaxed dot with the int8
    activations in its signed operand and u in its 7-bit one. Exact on every engine's semantics:
    the 7-bit operand read as signed (ARM sdot, AVX-VNNI-INT8) or unsigned (AVX-VNNI vpdpbusd) is
    the same value in [0, 127]; x86's pmaddubsw adds pairs in saturating i16, and a pair is at most
    2 * 127 * 128 = 32512 in magnitude (|a| <= 128 for any int8), below 32767: no saturation."""
    acc, u, a, offset = _idot_check(c, args)
    act = c.materialize(a) if offset is None else _act_load(c, c.materialize(a, "i32"), offset)
    code = I("i32x4.relaxed_dot_i8x16_i7x16_add_s", act, c.materialize(u), c.materialize(acc))
    return Val(code, "i32x4")


def _dot_args(c: Ctx, args: list[Val], op: str, params: tuple[tuple[str, str, str], ...]) -> list:
    """The arguments of op(p1, .., pn, ptr, offset) checked against params ((name, type, role) of
    each before the offset, which is optional: 0), then the offset: what idot7p, idot7z and idot7zs
    take alike."""
    n = len(params)
    if len(args) not in (n, n + 1):
        names = ", ".join(name for name, _, _ in params)
        raise c.error(f"{op}({names}, offset) takes {n} or {n + 1} arguments, got {len(args)}")
    for v, (_, want, role) in zip(args, params):
        _need(c, v, want, f"{op}'s {role}")
    return [*args[:n], _offset(c, args, n, op)]


_IDOT7P = (("acc", "i32x4", "accumulator"), ("u0", "i8x16", "first codes"), ("u1", "i8x16", "second codes"),
           ("ptr", "i32", "activation address"))
_IDOT7Z = (("acc", "i32x4", "accumulator"), ("u", "i8x16", "codes"), ("z", "i8x16", "zeros"),
           ("ptr", "i32", "activation address"))
_IDOT7ZS = (*_IDOT7Z[:3], ("s", "i32", "scale address"), _IDOT7Z[3])


def _idot7p_simd128(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """idot7p on SIMD128: idot7 of each 16."""
    acc, u0, u1, a, offset = _dot_args(c, args, "idot7p", _IDOT7P)
    p1, p2 = c.reuse(a)
    first = _idot_simd128(c, q, [acc, u0, Val(p1, "i32"), Val(None, T.INT_LIT, offset)])
    return _idot_simd128(c, q, [first, u1, Val(p2, "i32"), Val(None, T.INT_LIT, offset + 16)])


def _idot7p_relaxed(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """idot7p(acc, u0, u1, a): acc + u0.a[0:16] + u1.a[16:32] in lanes of four products of each, for
    codes in [0, 64] (Q.pair16) and activations in [-127, 127] (ACT_MAX): a relaxed i16 dot of each
    16 (its pairs at most 2 * 64 * 127 in magnitude: exact on every engine, as idot7), the two added
    in i16 (at most 4 * 64 * 127 = 32512 < 32767: exact), then one widening add. Five operations
    (pmaddubsw twice, paddw, pmaddwd, paddd on x86) where idot7 twice takes six. Lane i holds the
    same products as idot7 twice, so the float order over lanes (qstep1) is unchanged."""
    acc, u0, u1, a, offset = _dot_args(c, args, "idot7p", _IDOT7P)
    p1, p2 = c.reuse(a)
    d0 = I("i16x8.relaxed_dot_i8x16_i7x16_s", _act_load(c, p1, offset), c.materialize(u0))
    d1 = I("i16x8.relaxed_dot_i8x16_i7x16_s", _act_load(c, p2, offset + 16), c.materialize(u1))
    return _plus_acc(c, acc, _pairs_to_i32(I("i16x8.add", d0, d1)))


def _idot7z_simd128(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """idot7z on SIMD128: the i16 dot of the values u - z."""
    acc, u, z, a, offset = _dot_args(c, args, "idot7z", _IDOT7Z)
    w = Val(I("i8x16.sub", c.materialize(u), c.materialize(z)), "i8x16")
    return _idot_i16(c, [acc, w, a, Val(None, T.INT_LIT, offset)], SIMD128_ACT)


def _idot7z_relaxed(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """idot7z(acc, u, z, a): acc + (u - z).a for codes u and zeros z in [0, 127], so values u - z in
    [-127, 127]: u.a - z.a per pair of lanes in i16 (two relaxed i16 dots, exact as in idot7: each
    pair at most 2 * 128 * 127 in magnitude), subtracted in i16 (the true pair sum of (u - z) * a is
    at most 2 * 128 * 127 too, so the wrapping subtraction is exact), then widened: five operations
    where idot7 twice and a subtraction take seven."""
    acc, u, z, a, offset = _dot_args(c, args, "idot7z", _IDOT7Z)
    p1, p2 = c.reuse(a)
    dot_u = I("i16x8.relaxed_dot_i8x16_i7x16_s", _act_load(c, p1, offset), c.materialize(u))
    dot_z = I("i16x8.relaxed_dot_i8x16_i7x16_s", _act_load(c, p2, offset), c.materialize(z))
    return _plus_acc(c, acc, _pairs_to_i32(I("i16x8.sub", dot_u, dot_z)))


def _idot7zs_simd128(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """idot7zs on SIMD128 (activations stored as split i16, SIMD128_ACT), where u - z may be any
    int8 (kernels.dsl passes Q6_K's values with a zero of 0): the values' even and odd bytes
    sign-extended to i16, times the activations' two planes, added in i16 (a pair at most 2 * 128 *
    127 in magnitude: exact), then s rides the widening i16 dot as on relaxed SIMD. Where the i16
    dot of the values, a shift out of DOT_SHIFT, a scalar scale and an i32 multiply took 14
    operations per 16 values, this takes 10 (one fewer with a zero of 0)."""
    acc, u, z, s, a, offset = _dot_args(c, args, "idot7zs", _IDOT7ZS)
    w = c.materialize(u) if is_zero_vector(z) else I("i8x16.sub", c.materialize(u), c.materialize(z))
    w1, w2 = c.reuse(Val(w, "i8x16"))
    p1, p2 = c.reuse(a)
    eight = I("i32.const", "8")
    even = I("i16x8.mul", I("i16x8.shr_s", I("i16x8.shl", w1, eight), eight), _act_load(c, p1, offset * 2))
    odd = I("i16x8.mul", I("i16x8.shr_s", w2, eight), _act_load(c, p2, offset * 2 + 16))
    scale = I("i32x4.splat", I("i32.load", c.materialize(s, "i32")))
    return _plus_acc(c, acc, I("i32x4.dot_i16x8_s", I("i16x8.add", even, odd), scale))


_IDOTSS = (("acc", "i32x4", "accumulator"), ("w0", "i8x16", "first values"), ("w1", "i8x16", "second values"),
           ("s", "i32", "scale address"), ("ptr", "i32", "activation address"))


def _idotss_simd128(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """idotss(acc, w0, w1, sp, a): acc + s0 * w0.a[0:16] + s1 * w1.a[16:32], the two halves of a
    block under their sub-block scales (at sp and sp + 4, each an i32 holding s in both i16 halves:
    SUB_SCALES), for values of at most 64 in magnitude (Q.sub16) and activations stored as split
    i16 (SIMD128_ACT). Each half's i16 dot (256 w.a, _idot_split) shifted exact has lanes of four
    products, at most 4 * 64 * 127 < 32767: both halves narrow into one i16x8 (exact), and one
    widening dot with the scales (s0 in the low four lanes, s1 in the high) applies both. Five
    vector multiplies per 32 values where a multiply per half after each dot took six: the bound of
    simd128 Q6_K. The lanes split the products otherwise than idot7zs twice: only for sums whose
    lanes are added in integers (S in kernels.dsl)."""
    acc, w0, w1, s, a, offset = _dot_args(c, args, "idotss", _IDOTSS)
    p1, p2 = c.reuse(a)
    zero = Val(I("v128.const", "i32x4", *["0"] * 4), "i32x4")
    halves = [c.materialize(_idot_split(c, zero, w, p, offset + 16 * h))
              for h, (w, p) in enumerate(((w0, Val(p1, "i32")), (w1, Val(p2, "i32"))))]
    return _scaled_halves(c, acc, *halves, s)


def _scaled_halves(c: Ctx, acc: Val, h0: Instr, h1: Instr, s: Val, z: Instr | None = None) -> Val:
    """acc + s0 h0 + s1 h1 for two halves' i16 dots (256 times each half's products, lanes of
    four at most 64 * 127 each) and their sub-block scales at s and s + 4 (SUB_SCALES): each half
    shifted exact, both narrowed into one i16x8 (exact), less `z` (idotnsz's zero, in the same
    lanes), and one widening dot with the scales (s0 in the low four lanes, s1 in the high)
    applies both (idotss, idotns, idotnsz)."""
    shift = I("i32.const", str(SIMD128_ACT["DOT_SHIFT"]))
    s1, s2 = c.reuse(Val(I("v128.load64_zero", c.materialize(s, "i32")), "i32x4"))
    scales = I("i8x16.shuffle", *_lane_bytes((0, 0, 1, 1), 4), s1, s2)
    halves = I("i16x8.narrow_i32x4_s", I("i32x4.shr_s", h0, shift), I("i32x4.shr_s", h1, shift))
    if z is not None:
        halves = I("i16x8.sub", halves, z)
    return _plus_acc(c, acc, I("i32x4.dot_i16x8_s", halves, scales))


_IDOTN = (("acc", "i32x4", "accumulator"), ("w", "i8x16", "packed nibbles"), ("ptr", "i32", "activation address"))
_IDOTNS = (*_IDOTN[:2], ("s", "i32", "scale address"), _IDOTN[2])
_IDOTNSZ = (*_IDOTN[:2], ("z", "i16x8", "zero's sums (nibzeros)"), *_IDOTNS[2:])


def _nibble_dots(c: Ctx, w: Val, a: Val, offset: int) -> list[Instr]:
    """idotn's four i16 dots, of codes 2m, 2m + 1 (a block's first half: activation planes 0, 1),
    then 2m + 16, 2m + 17 (its second half: planes 2, 3), for the 32 codes packed as nibbles in w
    (byte j holds c_j low and c_(j+16) high) and activations stored as split i16 (SIMD128_ACT).
    Read as i16x8, lane m of w holds c_2m, c_2m+16, c_2m+1 and c_2m+17 in its four nibbles, low
    first: an and each takes the first three as c, 16 c and 256 c, a shift the last as c, and each
    meets its activation plane times 256, 16, 1 and 256 (shifts of the loads, shared by a tile's
    rows: Lowerer.load_once), so every product is 256 c a, at most 15 * 32512 in magnitude."""
    first, again = c.reuse(w)
    p = c.materialize(a, "i32")  # local reads and constants (kernels.dsl's): each load's address
    dots = []
    for k, (mask, shl) in enumerate((("0x000f", 8), ("0x0f00", 0), ("0x00f0", 4), (None, 8))):
        lanes = first if k == 0 else again
        codes = (I("i16x8.shr_u", lanes, I("i32.const", "12")) if mask is None
                 else I("v128.and", lanes, I("v128.const", "i16x8", *[mask] * 8)))
        dots.append(I("i32x4.dot_i16x8_s", codes, c.load_once("v128.load", offset * 2 + 16 * k, p, shl)))
    return dots


def _idotn_simd128(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """idotn(acc, w, a): acc + 256 c.a (DOT_SHIFT 8) for the 32 codes c packed as nibbles in w
    (Q.nib16), the sum of _nibble_dots. Four operations unpack 32 codes where the nibbles' ands and
    shift then _idot_split's shift and and per 16 took seven. The lanes hold the products
    _idot_split's would, so the float order over lanes (qstep1) is unchanged."""
    acc, w, a, offset = _dot_args(c, args, "idotn", _IDOTN)
    d = _nibble_dots(c, w, a, offset)
    return _plus_acc(c, acc, I("i32x4.add", I("i32x4.add", d[0], d[1]), I("i32x4.add", d[2], d[3])))


def _idotns_simd128(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """idotns(acc, w, sp, a): idotss of the 32 codes packed as nibbles in w (Q.nibss: no zero, sub-
    block scales of 16 at sp): each half's two _nibble_dots summed apart, then _scaled_halves.
    Four operations unpack 32 codes where SIMD128's Q2_K took ten, two of them i16 multiplies (a
    crumb plane's multiply, shift and and per 16, then _idot_split's shift and and): simd128 Q2_K
    mat-vec 1.3-1.36x at 256x4096 and 4096x4096, 1.17-1.29x from DRAM on rows 2 and 4 in twice
    the code bytes (Xeon, wasmtime). Only for sums whose lanes are added in integers (S), as idotss."""
    acc, w, s, a, offset = _dot_args(c, args, "idotns", _IDOTNS)
    d = _nibble_dots(c, w, a, offset)
    return _scaled_halves(c, acc, I("i32x4.add", d[0], d[1]), I("i32x4.add", d[2], d[3]), s)


def _idotnsz_simd128(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """idotnsz(acc, w, z, sp, a): idotns of codes less a constant zero, s0 (c - zero)[:16].a[:16] +
    s1 (c - zero)[16:].a[16:], with z = nibzeros(a, zero): each half's narrowed lanes of c.a less
    z's, exact (both within 4 * 64 * 127 and so is their difference: Q.nibss bounds the codes and
    the zero), then the scales' widening dot. Per row one subtraction where unpacking c - zero
    into bytes for idotss took five operations more per 32 values: z is a token's, formed once
    for a tile's rows (SIMD128's Q3_K). Lanes as idotns's: only for sums added in integers (S)."""
    acc, w, z, s, a, offset = _dot_args(c, args, "idotnsz", _IDOTNSZ)
    d = _nibble_dots(c, w, a, offset)
    return _scaled_halves(c, acc, I("i32x4.add", d[0], d[1]), I("i32x4.add", d[2], d[3]), s, c.materialize(z))


def _nibzeros_simd128(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """nibzeros(ptr, zero): zero times the sums of the 32 stored activations at ptr (SIMD128's
    split i16) in idotns's narrowed lanes: lane j of the low four is zero * (a[4j] + .. + a[4j +
    3]), of the high four the same of a[16:]. Four i16 dots with the zero as a constant, exact (a
    lane at most 4 * 127 * zero; the zero within [0, 64]: Q.nibss), and a narrowing: what idotnsz
    takes off a row's dots, one token's for every row of a tile."""
    if len(args) not in (2, 3):
        raise c.error(f"nibzeros(ptr, zero, offset) takes 2 or 3 arguments, got {len(args)}")
    a, zero = args[:2]
    _need(c, a, "i32", "nibzeros' activation address")
    value, offset = _const_int(c, zero, "nibzeros' zero"), _offset(c, args, 2, "nibzeros")
    if not 0 <= value <= 64:
        raise c.error(f"nibzeros' zero must be in [0, 64], got {value}")
    p = c.materialize(a, "i32")
    z = I("v128.const", "i16x8", *[str(value)] * 8)
    d = [I("i32x4.dot_i16x8_s", c.load_once("v128.load", offset * 2 + 16 * k, p), z) for k in range(4)]
    return Val(I("i16x8.narrow_i32x4_s", I("i32x4.add", d[0], d[1]), I("i32x4.add", d[2], d[3])), "i16x8")


def _simd128_only(op: str, instead: str) -> Op:
    """An op of SIMD128's split i16 activations, refused on relaxed SIMD (its byte activations) with
    what does the work there."""
    def lower(c: Ctx, q: str | None, args: list[Val]) -> Val:
        raise c.error(f"{op} takes SIMD128's i16 activations; on relaxed SIMD {instead}")
    return lower


def _idot7zs_relaxed(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """idot7zs(acc, u, z, sp, a): acc + s * ((u - z).a) in lanes of four products, for codes u and
    zeros z in [0, 127] and an integer scale s within i16 (a sub-block's: QuantFormat.sub_scales
    checks its range), stored at sp as an i32 holding s in both i16 halves (SUB_SCALES), so its
    32-bit splat is s in every i16 lane. The pairs u.a - z.a in i16 as in idot7z (each exact: at
    most 2 * 128 * 127), then s rides the widening i16 dot in place of idot7z's ones: lane = s *
    (two pairs), at most 32768 * 2 * 32512 < 2^31 in magnitude, exact. An i32 multiply per 16
    values and idot7z's constant of ones go; a zero z (a constant 0) drops its relaxed dot."""
    acc, u, z, s, a, offset = _dot_args(c, args, "idot7zs", _IDOT7ZS)
    p1, p2 = c.reuse(a)
    pairs = I("i16x8.relaxed_dot_i8x16_i7x16_s", _act_load(c, p1, offset), c.materialize(u))
    if not is_zero_vector(z):
        pairs = I("i16x8.sub", pairs, I("i16x8.relaxed_dot_i8x16_i7x16_s", _act_load(c, p2, offset), c.materialize(z)))
    return _plus_acc(c, acc, I("i32x4.dot_i16x8_s", pairs, I("i32x4.splat", I("i32.load", c.materialize(s, "i32")))))


_HDOT7 = (("acc", "i16x8", "accumulator"), ("u", "i8x16", "codes"), ("a", "i8x16", "activations"))
_HDOT7Z = (*_HDOT7[:2], ("z", "i8x16", "zeros"), _HDOT7[2])


def _hdot_args(c: Ctx, args: list[Val], op: str, params: tuple[tuple[str, str, str], ...]) -> list[Val]:
    if len(args) != len(params):
        raise c.error(f"{op}({', '.join(n for n, _, _ in params)}) takes {len(params)} arguments, got {len(args)}")
    for v, (_, want, role) in zip(args, params):
        _need(c, v, want, f"{op}'s {role}")
    return args


def _plus16(c: Ctx, acc: Val, pairs: Instr) -> Val:
    """acc + pairs in i16 lanes, or pairs alone for a zero acc."""
    if is_zero_vector(acc):
        return Val(pairs, "i16x8")
    return Val(I("i16x8.add", c.materialize(acc), pairs), "i16x8")


def _pairs_relaxed(c: Ctx, u: Instr, a: Instr) -> Instr:
    """Lane i: u[2i] a[2i] + u[2i+1] a[2i+1], codes u in [0, 127] in the relaxed i16 dot's 7-bit
    operand: exact on every engine (a pair is at most 2 * 127 * 128 = 32512, below pmaddubsw's
    saturation)."""
    return I("i16x8.relaxed_dot_i8x16_i7x16_s", a, u)


def _pairs_simd128(c: Ctx, u: Instr, a: Instr) -> Instr:
    """_pairs_relaxed's lanes without relaxed SIMD: the bytes of each i16 lane split (a's sign-
    extended, u's zero-extended), two i16 multiplies and an add, exact for the same range."""
    a1, a2 = c.reuse(Val(a, "i8x16"))
    u1, u2 = c.reuse(Val(u, "i8x16"))
    even = I("i16x8.mul", I("i16x8.shr_s", I("i16x8.shl", a1, I("i32.const", "8")), I("i32.const", "8")),
             I("v128.and", u1, I("v128.const", "i16x8", *["255"] * 8)))
    odd = I("i16x8.mul", I("i16x8.shr_s", a2, I("i32.const", "8")), I("i16x8.shr_u", u2, I("i32.const", "8")))
    return I("i16x8.add", even, odd)


def _hdot7(pairs: Callable[[Ctx, Instr, Instr], Instr]) -> Op:
    def lower(c: Ctx, q: str | None, args: list[Val]) -> Val:
        """hdot7(acc, u, a): acc + pairs of u.a in i16 lanes (lane i: u[2i] a[2i] + u[2i+1]
        a[2i+1]) for codes u in [0, 127] and int8 a. Each pair is exact; the caller bounds how many
        it adds in one i16 lane (Q.u16 in kernels.dsl). The grouped layout's dot: a holds four
        activations four times (one per row) and lane pair (2r, 2r + 1) is row r's."""
        acc, u, a = _hdot_args(c, args, "hdot7", _HDOT7)
        return _plus16(c, acc, pairs(c, c.materialize(u), c.materialize(a)))
    return lower


def _hdot7z(pairs: Callable[[Ctx, Instr, Instr], Instr]) -> Op:
    def lower(c: Ctx, q: str | None, args: list[Val]) -> Val:
        """hdot7z(acc, u, z, a): acc + pairs of (u - z).a for codes and zeros in [0, 127]: u.a - z.a
        per pair, each exact, their difference the pair of (u - z).a (as exact, as idot7z)."""
        acc, u, z, a = _hdot_args(c, args, "hdot7z", _HDOT7Z)
        a1, a2 = c.reuse(a)
        return _plus16(c, acc, I("i16x8.sub", pairs(c, c.materialize(u), a1), pairs(c, c.materialize(z), a2)))
    return lower


def _pairsum(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """pairsum(s): i32 lane i = s[2i] + s[2i+1]; pairsum(s, m): s[2i] m[2i] + s[2i+1] m[2i+1] (a
    sub-block scale per row in both halves of its lane). One i32x4.dot_i16x8_s: exact."""
    if len(args) not in (1, 2):
        raise c.error(f"pairsum(s) or pairsum(s, m) takes 1 or 2 arguments, got {len(args)}")
    for v, what in zip(args, ("pairsum's sums", "pairsum's multipliers")):
        _need(c, v, "i16x8", what)
    if len(args) == 1:
        return Val(_pairs_to_i32(c.materialize(args[0])), "i32x4")
    return Val(I("i32x4.dot_i16x8_s", c.materialize(args[0]), c.materialize(args[1])), "i32x4")


def _madd_check(c: Ctx, args: list[Val]) -> list[Val]:
    return _same(c, _arity(c, args, 3, "madd"), "madd")


def _madd_simd128(c: Ctx, q: str | None, args: list[Val]) -> Val:
    a, b, acc = _madd_check(c, args)
    t = _common_type(a, b, acc)
    mul = _binary("*")(c, None, [Val(c.materialize(a, t), t), Val(c.materialize(b, t), t)])
    return _binary("+")(c, None, [mul, Val(c.materialize(acc, t), t)])


def _madd_relaxed(c: Ctx, q: str | None, args: list[Val]) -> Val:
    """a*b + acc as one relaxed madd on float vectors (fused or not, as the engine chooses: kernels
    using it are verified with a tolerance, and both of wasmtime's modes are tested)."""
    a, b, acc = _madd_check(c, args)
    t = _common_type(a, b, acc)
    if t not in ("f32x4", "f64x2"):
        return _madd_simd128(c, q, args)
    return Val(I(f"{t}.relaxed_madd", c.materialize(a, t), c.materialize(b, t), c.materialize(acc, t)), t)


SIMD128: dict[str, Op] = {
    **{op: _binary(op) for op in [*_INT, *_CMP_INT]},
    "abs": _unary_float_or_vec("abs", ints=True),
    "neg": _unary_float_or_vec("neg", ints=True),
    "sqrt": _unary_float_or_vec("sqrt"),
    "nearest": _unary_float_or_vec("nearest"),
    "floor": _unary_float_or_vec("floor"),
    "ceil": _unary_float_or_vec("ceil"),
    "trunc": _unary_float_or_vec("trunc"),
    "min": _minmax("min"),
    "max": _minmax("max"),
    "pmin": _pminmax("pmin"),
    "pmax": _pminmax("pmax"),
    "hsum": _horizontal("hsum", "add"),
    "hmax": _horizontal("hmax", "max"),
    "load": _load,
    "load8x8": _load8x8,
    "store": _store,
    "splat": _splat,
    "convert": _convert,
    "trunc_sat": _trunc_sat,
    "narrow": _narrow,
    "extend_low": _extend("low"),
    "extend_high": _extend("high"),
    "bits": _bits,
    "extract": _extract,
    "shuffle": _shuffle,
    "iota": _iota,
    "select": _select,
    **{t: _cast(t) for t in T.SCALARS},
    "atomic_load": _atomic("atomic_load", "i32.atomic.load", 0, True),
    "atomic_store": _atomic("atomic_store", "i32.atomic.store", 1, False),
    "atomic_add": _atomic("atomic_add", "i32.atomic.rmw.add", 1, True),
    "atomic_sub": _atomic("atomic_sub", "i32.atomic.rmw.sub", 1, True),
    "atomic_cmpxchg": _atomic("atomic_cmpxchg", "i32.atomic.rmw.cmpxchg", 2, True),
    "wait32": _wait32,
    "notify": _notify,
    "trap": _trap,
    "run_job": _run_job,
    "idot": _idot_simd128,
    "idots": _idot_simd128,
    "idots2": _idots2(_idot_simd128),
    "idot7": _idot_simd128,
    "idot7p": _idot7p_simd128,
    "idot7z": _idot7z_simd128,
    "idot7zs": _idot7zs_simd128,
    "idotss": _idotss_simd128,
    "idotn": _idotn_simd128,
    "idotns": _idotns_simd128,
    "idotnsz": _idotnsz_simd128,
    "nibzeros": _nibzeros_simd128,
    "hdot7": _hdot7(_pairs_simd128),
    "hdot7z": _hdot7z(_pairs_simd128),
    "pairsum": _pairsum,
    "madd": _madd_simd128,
}

RELAXED: dict[str, Op] = {
    **SIMD128,
    "idot": _idot_relaxed,
    "idots": _idots_relaxed,
    "idots2": _idots2(_idots_relaxed),
    "idot7": _idot7_relaxed,
    "idot7p": _idot7p_relaxed,
    "idot7z": _idot7z_relaxed,
    "idot7zs": _idot7zs_relaxed,
    "idotss": _simd128_only("idotss", "sub-block scales go through idot7zs"),
    "idotns": _simd128_only("idotns", "sub-block scales go through idot7zs"),
    "idotnsz": _simd128_only("idotnsz", "sub-block scales go through idot7zs"),
    "nibzeros": _simd128_only("nibzeros", "a zero goes through idot7zs"),
    "idotn": _simd128_only("idotn", "nibble codes go through idot7p"),
    "hdot7": _hdot7(_pairs_relaxed),
    "hdot7z": _hdot7z(_pairs_relaxed),
    "madd": _madd_relaxed,
    "shuffle": _shuffle_relaxed,
}


@dataclass(frozen=True)
class Flavor:
    """Another build of a target for engines that lower some of its ops differently: the same
    kernels, exports, layouts and results, bit for bit (each op exact on every engine's semantics),
    other forms of `ops` that are faster there. Hosts load it where their probe of the relaxed dot
    (runtime/features.mjs, kernelgen.host.api) finds every field of `when`."""

    name: str
    ops: dict[str, Op]  # over the target's table
    constants: dict[str, int]  # over the target's: kernels may take another form in a flavor
    when: dict[str, object]
    why: str


@dataclass(frozen=True)
class Target:
    """A compilation target: its lowering table, the constants kernels read to adapt to it, and
    the wasm features its module uses (wat2wasm flags follow from them)."""

    name: str
    ops: dict[str, Op]
    constants: dict[str, int]
    features: tuple[str, ...]
    wat2wasm_flags: tuple[str, ...] = field(default=())
    dot7: bool = False  # idot7 is a relaxed dot, faster than idot's i16 dot
    flavors: tuple[Flavor, ...] = ()
    flavor: str | None = None  # which of the base target's flavors this is (flavored)

    @property
    def key(self) -> str:
        """The name with the flavor, as the WAT's header names the build."""
        return self.name if self.flavor is None else f"{self.name}/{self.flavor}"

    def flavored(self, name: str) -> Target:
        """This target with flavor `name`'s ops and constants."""
        f = next((f for f in self.flavors if f.name == name), None)
        if f is None:
            have = ", ".join(x.name for x in self.flavors) or "none"
            raise ValueError(f"{self.name} has no flavor {name!r} (flavors: {have})")
        return dataclasses.replace(self, ops={**self.ops, **f.ops}, constants={**self.constants, **f.constants},
                                   flavors=(), flavor=name)

    def dot_scheme(self, codes7: bool) -> str:
        """How a quant type's integer dots run here (the manifest's per-type "dot"): "i7", the
        type's unsigned codes (unpack + zero, in [0, 127]) through idot7 and the zero removed with
        the activations' sums; else "i16", its signed values through idot."""
        return "i7" if self.dot7 and codes7 else "i16"

    def layout(self, q: QuantFormat) -> QuantFormat:
        """q as this target packs it: in groups of GROUP_ROWS rows (quantformat's grouped layout)
        for the i7 scheme, whose codes a relaxed i16 dot multiplies by a splat of four activations
        into one i32 lane per row, a block's sums kept in i16 (hdot7); rows one by one otherwise.
        Measured against the rows layout (4 rows x 4-byte granules, AMD EPYC Zen 4): relaxed Q4_0
        mat-vec 1.2-1.6x in wasmtime, 1.1-1.2x in Node 20, 1.5-2.1x in Chromium 156, its GEMM
        1.4-2.3x on all three; the i16 scheme (Q8_0: 8 operations per 16 products either way) and
        SIMD128 gained nothing (0.8-1.0x), so they keep rows. SIMD128 packs 2-bit integers as
        nibbles, not crumbs (QuantFormat.crumbs): Q2_K then takes idotns."""
        if self.dot_scheme(q.codes is not None) == "i7":
            return dataclasses.replace(q, group=GROUP_ROWS)
        if self.constants["ACT_SPLIT"] and q.reencoded and q.encoding[0] == "crumb":
            return dataclasses.replace(q, crumbs=False)  # SIMD128 reads nibbles faster (idotns)
        if self.constants["ACT_SPLIT"] and q.reencoded and q.encoding[0] == "byte" and q.sub_scales:
            return dataclasses.replace(q, signed_bytes=True)  # its dots take the values: no zero to add back
        return q


# How activations are quantized and stored for the integer dot on each target (kernels read these
# as constants; quantize_act writes this layout and idot's pointer form reads it):
#   ACT_ZERO, ACT_MAX  int8 in [-127, 127], stored as is, on both targets: the same x quantizes to
#                      the same activations on SIMD128 and relaxed SIMD (the relaxed dot's 7-bit
#                      operand takes the weight codes instead: idot7, Target.dot_scheme).
#   ACT_BYTES          bytes per stored activation: SIMD128's dot is i16 x i16, so activations are
#                      stored widened to i16 once per call; relaxed SIMD's dot reads bytes.
#   ACT_SPLIT          1: each 16 activations stored as the 8 at even positions, then the 8 at odd
#                      ones (SIMD128: idot reads the weights' even and odd bytes without a
#                      sign-extend, _idot_split); 0: in order.
#   DOT_SHIFT          idot of stored activations adds the dot << DOT_SHIFT (SIMD128's split dot is
#                      256 x the dot); kernels shift it out once per group of blocks (qexact).
# and, not about activations, DOT_ADD: 0 in the base builds, 1 in the vnni flavor (kernels.dsl).
SIMD128_ACT = {"ACT_ZERO": 0, "ACT_MAX": 127, "ACT_BYTES": 2, "ACT_SPLIT": 1, "DOT_SHIFT": 8}
RELAXED_ACT = {"ACT_ZERO": 0, "ACT_MAX": 127, "ACT_BYTES": 1, "ACT_SPLIT": 0, "DOT_SHIFT": 0}
# Relaxed SIMD where its dot-add is x86's vpdpbusd: runtime/features.mjs's probe finds the 7-bit
# operand read unsigned and no pmaddubsw saturation (Chromium 156 on AVX-VNNI; wasmtime 50 and Node
# 20 lower the dot-add to pmaddubsw, pmaddwd and an add, and saturate).
VNNI = Flavor("vnni", {"idots": _idots_fused, "idots2": _idots2_fused}, {"DOT_ADD": 1},
              {"sevenBit": "unsigned", "saturates": False},
              "the relaxed i32 dot-add is one unsaturated instruction (x86 AVX-VNNI vpdpbusd, as Chromium "
              "lowers it): the dots through it, not through i16 pairs")
TARGETS: dict[str, Target] = {
    "simd128": Target("simd128", SIMD128, {**SIMD128_ACT, "DOT_ADD": 0},
                      ("simd", "threads"), ("--enable-threads", "--disable-relaxed-simd")),
    "relaxed-simd": Target("relaxed-simd", RELAXED, {**RELAXED_ACT, "DOT_ADD": 0},
                           ("simd", "relaxed-simd", "threads"), ("--enable-threads",), dot7=True,
                           flavors=(VNNI,)),
}
