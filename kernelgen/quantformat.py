"""A quant type as data: its stored block, its formulas as trees, and what both hosts derive from
them (numpy unpack/dequantize references, the pack step into the kernels' layout).

The compiler builds a QuantFormat from a checked declaration (kernelgen.compiler.quant); a host
rebuilds the same QuantFormat from the manifest's JSON (`QuantFormat.from_json`), so loading a built
library needs numpy and nothing of the compiler. runtime/pack.mjs reads the same JSON.

A formula is a tree of the node classes below. Every consumer walks it with `fold`, which calls
the consumer's `on_<kind>(node, *children)` bottom-up: checking and WAT lowering in the compiler,
numpy evaluation and text here. The JSON form is generic (`to_json`/`from_json`: a node's kind, its
attributes and `args`), so a new node is one class here plus one method per consumer
(docs/adding-a-quant-type.md lists them).

Packing turns a matrix of stored blocks into planes the kernels read (each contiguous, row-major):
  q       the fields `unpack` reads, per block, concatenated in declaration order (Q.bytes each),
          or for a `reencoded` type (super-blocks, bit masks) its integers per block of 32 in the
          narrowest cheap encoding (ENCODINGS)
  scale   S per block as f32 (f16 scales widened once here, not in the hot loop); for a
          super-block type whose S (and M) are F * I, an f16 field times a byte-sized integer of
          s, one record per super-block instead (QuantFormat.record): F as f32, I as bytes
  offset  M per block as f32, only for types with `+ M` (a super-block's record holds it)

A type packed with `group` GROUP_ROWS (QuantFormat.group: the grouped layout, Target.layout picks it
per target and type) holds the same planes with every GROUP_ROWS rows side by side: rows padded
with zero blocks to a multiple of GROUP_ROWS, each plane's per-row bytes of one block (one record of
a super-block) cut into granules and the group's rows interleaved granule by granule, group-major
then block-major. Granules are GRANULE bytes (a plane's f32s, the codes), one byte for a
record's integers (two for an offset's over sub-blocks of 16: Factored.per), or SUB_SCALE_GRANULE
bytes for integer sub-block scales, so that a 16-byte vector holds granule j of each of the four
rows (codes 4j .. 4j + 3 of a kernel block, or its f32 scale) and a kernel's i32 lane r is row r:
no lane folds per row. A scalar byte value field (q4_onnx's zero point) takes a whole granule,
its byte four times.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import numpy as np

# Storage types of block fields: bytes each, and the numpy type they are read as.
FIELD_BYTES = {"i8": 1, "u8": 1, "i16": 2, "u16": 2, "f16": 2, "i32": 4, "u32": 4, "f32": 4}
_NP = {"i8": "i1", "u8": "u1", "i16": "<i2", "u16": "<u2", "f16": "<f2", "i32": "<i4", "u32": "<u4", "f32": "<f4"}

# ---- formula nodes -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """A formula node. `children` names the attributes that are sub-formulas (in evaluation order);
    `span` is where the compiler read it (None when rebuilt from JSON)."""

    kind: ClassVar[str]
    children: ClassVar[tuple[str, ...]] = ()
    span: Any = field(default=None, kw_only=True, compare=False, repr=False)


@dataclass(frozen=True)
class Int(Node):
    """An integer constant."""

    kind = "int"
    value: int


@dataclass(frozen=True)
class Float(Node):
    """A float constant (scale and offset formulas)."""

    kind = "float"
    value: float


@dataclass(frozen=True)
class Field(Node):
    """A scalar field of the block: the same value for every element."""

    kind = "field"
    field: str


@dataclass(frozen=True)
class Elem(Node):
    """`i`: the element's index in the block."""

    kind = "i"


@dataclass(frozen=True)
class SubBlock(Node):
    """`s`: the sub-block's index in a super-block (scale and offset formulas)."""

    kind = "s"


@dataclass(frozen=True)
class Index(Node):
    """`f[at]`: element `at` of an array field (`f[i]` in flat blocks; any integer formula of i or
    s in super-blocks)."""

    kind = "index"
    children = ("at",)
    field: str
    at: Node


@dataclass(frozen=True)
class Select(Node):
    """`select(c, a, b)`: a where the integer c is nonzero, else b."""

    kind = "select"
    children = ("cond", "a", "b")
    cond: Node
    a: Node
    b: Node


@dataclass(frozen=True)
class Call(Node):
    """`nib(f, i)`: element i is the low nibble of byte i for the first half, the high nibble of
    byte i - n for the second (GGUF); `nibi(f, i)`: low nibble of byte i/2 for even i, high for odd
    (ONNX UINT4); `bit(f, i)`: bit i of the little-endian bit mask f; `crumb(f, i)` (plane q's 2-bit
    codes, ENCODINGS: no declaration writes it): bits 2 * (i / n) of byte i % n, n the field's
    bytes."""

    kind = "call"
    func: str
    field: str


@dataclass(frozen=True)
class Lookup(Node):
    """`kv[code]`: entry `code` (a 4-bit nibble) of a codebook of 16 integers (IQ4_NL, MXFP4)."""

    kind = "lookup"
    children = ("code",)
    values: tuple[int, ...]
    code: Node

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(self.values))  # JSON gives a list


@dataclass(frozen=True)
class Pow2(Node):
    """`pow2(x)`: 2 to the integer power x, exactly, as f32 (an e8m0 scale: MXFP4)."""

    kind = "pow2"
    children = ("arg",)
    arg: Node


@dataclass(frozen=True)
class Neg(Node):
    kind = "neg"
    children = ("arg",)
    arg: Node


@dataclass(frozen=True)
class Op(Node):
    """A binary operation: + - * / % | & << >> <. Integers stay integers (/ and % floor, < gives
    0 or 1) until they meet a float; then both sides are f32, as in C."""

    kind = "op"
    children = ("left", "right")
    op: str
    left: Node
    right: Node


NODES: dict[str, type[Node]] = {c.kind: c for c in (Int, Float, Elem, SubBlock, Field, Index, Call, Lookup, Pow2,
                                                      Select, Neg, Op)}
CALLS = ("nib", "nibi", "bit")  # the functions Call names

def fold(node: Node, v: Any) -> Any:
    """Walk `node` bottom-up: v.on_<kind>(node, *results of its children)."""
    return getattr(v, f"on_{node.kind}")(node, *(fold(getattr(node, c), v) for c in node.children))


def _attrs(node: Node) -> dict:
    return {f.name: getattr(node, f.name) for f in dataclasses.fields(node)
            if f.name != "span" and f.name not in node.children}


def to_json(node: Node) -> dict:
    """{"kind": k, <attributes>, "args": [children]}: the form the manifest carries."""
    out = {"kind": node.kind, **{k: list(v) if isinstance(v, tuple) else v for k, v in _attrs(node).items()}}
    if node.children:
        out["args"] = [to_json(getattr(node, c)) for c in node.children]
    return out


def from_json(tree: dict) -> Node:
    cls = NODES.get(tree.get("kind"))
    if cls is None:
        raise ValueError(f"formula: unknown node {tree!r}")
    attrs = {k: v for k, v in tree.items() if k not in ("kind", "args")}
    return cls(**attrs, **dict(zip(cls.children, map(from_json, tree.get("args", [])))))


class _AllNodes:
    """Every node of a formula, the root first."""

    def __getattr__(self, name: str) -> Callable[..., list[Node]]:
        return lambda n, *children: [n] + [x for c in children for x in c]


def nodes(n: Node) -> list[Node]:
    return fold(n, _AllNodes())


def _factors(n: Node) -> list[Node]:
    """The factors of a product a * b * ...."""
    return _factors(n.left) + _factors(n.right) if isinstance(n, Op) and n.op == "*" else [n]


def _float_field(n: Node, q: QuantFormat) -> bool:
    """Whether n is a float field of q's block or its negation (a record's F: QuantFormat.record)."""
    n = n.arg if isinstance(n, Neg) else n
    return isinstance(n, Field) and q.field(n.field).type in ("f16", "f32")


def _product(factors: list[Node]) -> Node:
    out = factors[0]
    for f in factors[1:]:
        out = Op("*", out, f)
    return out


class _Text:
    """Source-like text of a formula, for the manifest and `kernelgen list`."""

    def on_int(self, n: Int) -> str:
        return str(n.value)

    on_float = on_int

    def on_field(self, n: Field) -> str:
        return n.field

    def on_i(self, n: Elem) -> str:
        return "i"

    def on_s(self, n: SubBlock) -> str:
        return "s"

    def on_index(self, n: Index, at: str) -> str:
        return f"{n.field}[{at}]"

    def on_select(self, n: Select, c: str, a: str, b: str) -> str:
        return f"select({c}, {a}, {b})"

    def on_call(self, n: Call) -> str:
        return f"{n.func}({n.field}, i)"

    def on_lookup(self, n: Lookup, code: str) -> str:
        return f"{{{', '.join(map(str, n.values))}}}[{code}]"

    def on_pow2(self, n: Pow2, a: str) -> str:
        return f"pow2({a})"

    def on_neg(self, n: Neg, a: str) -> str:
        return f"-{a}"

    def on_op(self, n: Op, a: str, b: str) -> str:
        return f"({a} {n.op} {b})"


def text(node: Node) -> str:
    return fold(node, _Text())


# The operators of quant formulas, as numpy evaluates them (runtime/pack.mjs has the same two tables):
# the checker (compiler.quant) accepts exactly these.
FLOAT_OPS = {"+": np.add, "-": np.subtract, "*": np.multiply, "/": np.divide}
INT_OPS = {"+": np.add, "-": np.subtract, "*": np.multiply, "/": np.floor_divide, "%": np.mod, "|": np.bitwise_or,
            "&": np.bitwise_and, "<<": np.left_shift, ">>": np.right_shift,
            "<": lambda a, b: np.less(a, b).astype(np.int32)}


def _typed(v: np.ndarray) -> np.ndarray:
    """A field's values as the formulas compute with them: float32, or int32 (a u32 as int64: the
    checker lets one only into float arithmetic, where it counts unsigned, as in runtime/pack.mjs)."""
    return v.astype(np.float32 if v.dtype.kind == "f" else np.int64 if v.dtype == np.uint32 else np.int32)


class NumpyEval:
    """Evaluate over structured blocks, per element (`i` given: unpack, shape blocks.shape +
    (block,)), per sub-block (`s` given: a super-block's scale/offset, blocks.shape + (subs,)) or
    per block (neither: a flat block's scale/offset)."""

    def __init__(self, blocks: np.ndarray, i: np.ndarray | None = None, s: np.ndarray | None = None) -> None:
        self.blocks, self.i, self.s = blocks, i, s
        self.per = i is not None or s is not None  # values carry a last axis

    def on_int(self, n: Int) -> np.generic:
        return np.int32(n.value)

    def on_float(self, n: Float) -> np.generic:
        return np.float32(n.value)

    def on_i(self, n: Elem) -> np.ndarray:
        return self.i.astype(np.int32)

    def on_s(self, n: SubBlock) -> np.ndarray:
        return self.s.astype(np.int32)

    def on_field(self, n: Field) -> np.ndarray:
        v = _typed(self.blocks[n.field])
        return v[..., None] if self.per else v

    def on_index(self, n: Index, at: np.ndarray) -> np.ndarray:
        v = _typed(self.blocks[n.field][..., at])
        return v[..., None] if self.per and np.ndim(at) == 0 else v  # a constant index: one value per block

    def on_select(self, n: Select, c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.where(c != 0, a, b)

    def on_call(self, n: Call) -> np.ndarray:
        f, i = self.blocks[n.field], self.i
        if n.func == "nib":
            count = f.shape[-1]
            byte = f[..., i % count].astype(np.int32)
            return np.where(i < count, byte & 0x0F, byte >> 4)
        if n.func == "nibi":
            byte = f[..., i // 2].astype(np.int32)
            return (byte >> (4 * (i % 2))) & 0x0F
        if n.func == "crumb":
            count = f.shape[-1]
            return (f[..., i % count].astype(np.int32) >> (2 * (i // count))) & 3
        bits = np.unpackbits(f.astype(np.uint8), axis=-1, bitorder="little")
        return bits[..., i].astype(np.int32)

    def on_lookup(self, n: Lookup, code: np.ndarray) -> np.ndarray:
        return np.array(n.values, np.int32)[code]

    def on_pow2(self, n: Pow2, a: np.ndarray) -> np.ndarray:
        return np.ldexp(np.float32(1), np.asarray(a).astype(np.int32)).astype(np.float32)

    def on_neg(self, n: Neg, a: np.ndarray) -> np.ndarray:
        return -a

    def on_op(self, n: Op, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):  # by 0: an integer 0, a float inf or NaN, as in JS
            if np.asarray(a).dtype.kind == "f" or np.asarray(b).dtype.kind == "f":
                return FLOAT_OPS[n.op](np.float32(a) if np.ndim(a) == 0 else np.asarray(a, np.float32),
                                        np.float32(b) if np.ndim(b) == 0 else np.asarray(b, np.float32))
            return INT_OPS[n.op](a, b)


def _int32(n: Node, r: tuple[int, int]) -> tuple[int, int]:
    if r[0] < -2**31 or r[1] > 2**31 - 1:
        raise ValueError(f"{text(n)} may leave int32 ({r[0]}..{r[1]})")
    return r


class IsFloat:
    """Whether a formula's value is a float (a float field or constant, pow2, or arithmetic with
    one): the packers compute it in float32, else in int32."""

    def __init__(self, fields: dict[str, str]) -> None:
        self.fields = fields

    def on_int(self, n: Node, *_: bool) -> bool:
        return False

    on_i = on_s = on_index = on_call = on_lookup = on_int

    def on_float(self, n: Node, *_: bool) -> bool:
        return True

    on_pow2 = on_float

    def on_field(self, n: Field) -> bool:
        return self.fields.get(n.field, "i")[0] == "f"

    def on_neg(self, n: Neg, a: bool) -> bool:
        return a

    def on_select(self, n: Select, c: bool, a: bool, b: bool) -> bool:
        return a or b

    def on_op(self, n: Op, a: bool, b: bool) -> bool:
        return a or b


class IntRange:
    """The interval [lo, hi] an integer formula's values lie in (for a block of `block` values, in
    `subs` sub-blocks where known; else s is bounded as i, sub-blocks being fewer than elements).
    ValueError where that is not within int32, the integers both packers compute in (numpy's int32
    and JavaScript's `| 0` agree only there), or where the formula is not integer arithmetic."""

    def __init__(self, block: int, fields: dict[str, str], subs: int | None = None) -> None:
        self.block, self.fields, self.subs = block, fields, subs or block

    def on_int(self, n: Int) -> tuple[int, int]:
        return n.value, n.value

    def on_i(self, n: Elem) -> tuple[int, int]:
        return 0, self.block - 1

    def on_s(self, n: SubBlock) -> tuple[int, int]:
        return 0, self.subs - 1

    def on_float(self, n: Node, *_: object) -> tuple[int, int]:
        raise ValueError(f"{text(n)} is not an integer")

    on_pow2 = on_float

    def _type(self, field: str) -> tuple[int, int]:
        t = self.fields[field]
        bits = 8 * FIELD_BYTES[t]
        if t[0] == "f" or t == "u32":
            raise ValueError(f"{field} ({t}) is not an integer of at most 31 bits (a u32 takes float arithmetic only)")
        return (-(1 << bits - 1), (1 << bits - 1) - 1) if t[0] == "i" else (0, (1 << bits) - 1)

    def on_field(self, n: Field) -> tuple[int, int]:
        return self._type(n.field)

    def on_index(self, n: Index, at: tuple[int, int]) -> tuple[int, int]:
        return self._type(n.field)

    def on_call(self, n: Call) -> tuple[int, int]:
        return (0, 1) if n.func == "bit" else (0, 3) if n.func == "crumb" else (0, 15)

    def on_lookup(self, n: Lookup, code: tuple[int, int]) -> tuple[int, int]:
        return min(n.values), max(n.values)

    def on_select(self, n: Select, c: tuple[int, int], a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
        return min(a[0], b[0]), max(a[1], b[1])

    def on_neg(self, n: Neg, a: tuple[int, int]) -> tuple[int, int]:
        return _int32(n, (-a[1], -a[0]))

    def on_op(self, n: Op, a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
        return _int32(n, self._op(n, a, b))

    def _op(self, n: Op, a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
        (a0, a1), (b0, b1) = a, b
        corners = lambda f, ys=b: (min(f(x, y) for x in a for y in ys), max(f(x, y) for x in a for y in ys))  # noqa: E731
        if n.op in ("+", "-", "*"):
            return corners({"+": int.__add__, "-": int.__sub__, "*": int.__mul__}[n.op])
        if n.op == "<":
            return 0, 1
        if n.op in ("<<", ">>"):  # monotone in each operand (>> floors, as int32's arithmetic shift)
            if b0 < 0 or b1 > 31:  # numpy's and JavaScript's shifts differ there
                raise ValueError(f"a shift amount lies in 0..31; {text(n.right)} spans {b0}..{b1}")
            return corners(int.__lshift__ if n.op == "<<" else int.__rshift__)
        if n.op == "/":  # floors (numpy's floor_divide, JavaScript's Math.floor); by 0: 0 in both
            divisors = [y for y in (b0, b1, -1, 1) if b0 <= y <= b1 and y != 0]
            return corners(int.__floordiv__, divisors) if divisors else (0, 0)
        if n.op == "%" and b0 > 0:
            return 0, min(a1, b1 - 1) if a0 >= 0 else b1 - 1
        if a0 >= 0 and b0 >= 0:
            if n.op == "&":
                return 0, min(a1, b1)
            if n.op == "|":
                return 0, (1 << max(a1, b1).bit_length()) - 1
        # & | of a negative value, % by a possibly negative one: within the widest operand's bits
        bits = max(abs(v).bit_length() for v in (a0, a1, b0, b1))
        return -(1 << bits), (1 << bits) - 1


# ---- the block format --------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldInfo:
    name: str
    type: str
    count: int | None  # None: one scalar per block
    offset: int  # byte offset in the stored block

    @property
    def nbytes(self) -> int:
        return FIELD_BYTES[self.type] * (self.count or 1)


KERNEL_BLOCK = 32  # values per block in the kernels (one activation block)
GROUP_ROWS = 4  # rows of one group in the grouped layout: one i32 lane of a vector each
GRANULE = 4  # bytes of a row that sit together in a group's vector (codes 4j .. 4j + 3, an f32)
SUB_SCALE_MAX = 1 << 13  # |integer sub-block scale|: 16 * 128 * 127 * 2^13 < 2^31 (sub_scales)
# Rows one by one, an integer sub-block scale s is stored as an i32 holding s in both of its i16
# halves: one 32-bit splat gives the i16 lanes of s (idot7zs; an i16 splat of a load ran Q6_K
# mat-vec at 0.58x in cranelift and a shuffle or narrow to i16 at 0.80-0.92x in V8), and i32 >> 16
# gives s. In the grouped layout, where a kernel multiplies each row's pair sums by its s in one i16
# vector (qgtile's pairsum), s is an int8 stored twice, SUB_SCALE_GRANULE bytes per row side by
# side: i16x8.load8x8 of one half's eight bytes is the group's scales in their rows' lane pairs,
# half the bytes of i32s (Q6_K: 37 bytes per 32 values, not 41). The language keeps every s in int8
# (check_quant).
SUB_SCALES = "isc"  # the kernel block's field of integer sub-block scales (sub-blocks of 16)
SUB_SCALE_GRANULE = 2
PACK_VALUES = 1 << 16  # values QuantFormat.pack evaluates at a time: its int32 temporaries stay in L2 (256 KB)


@dataclass(frozen=True)
class Factored:
    """A super-block type's scale or offset per kernel block as F * I (QuantFormat.record): F a
    float field of the super-block, maybe negated, stored as f32 at byte `f_at` of the record; I an
    integer formula of s stored as `per` bytes per kernel block from `i_at` (None: F alone, the kernel
    block's part of Q6_K's scale). The kernels multiply F * I in f32 as the reference does, so the
    products are the per-block f32 values bit for bit. An offset over sub-blocks of 16
    (QuantFormat.sub_offsets: Q2_K's minimums) has I of each sub-block, `per` 2: the kernels weigh
    each half's activation sum by its I in integers (exact), then multiply by F."""

    f: Node
    i: Node | None
    signed: bool
    f_at: int
    i_at: int
    per: int = 1


@dataclass(frozen=True)
class Record:
    """Plane scale of a super-block type: `bytes` per super-block of `blocks` kernel blocks."""

    factors: dict[str, Factored]  # "scale", and "offset" for types with `+ M`
    bytes: int
    blocks: int


@dataclass(frozen=True)
class Encoding:
    """How plane q holds one kernel block of a super-block type: the fields and the unpack formula
    kernels read, and the numpy encoder (integers minus the zero, shape (..., 32) -> bytes)."""

    fields: tuple[FieldInfo, ...]
    unpack: Node
    encode: Callable[[np.ndarray], np.ndarray]


def _nibbles(u: np.ndarray) -> np.ndarray:
    """Split order: byte j holds element j (low) and j + 16 (high), as GGUF's Q4_0."""
    return ((u[..., :16] & 15) | ((u[..., 16:] & 15) << 4)).astype(np.uint8)


def _crumbs(u: np.ndarray) -> np.ndarray:
    """Byte j holds elements j, j + 8, j + 16 and j + 24 in its bit pairs, low first: 16 values are
    one 8-byte load, shifts and an and (quant._LowerUnpack)."""
    return sum((u[..., 8 * k:8 * k + 8] & 3) << (2 * k) for k in range(4)).astype(np.uint8)


ENCODINGS = {
    "crumb": Encoding((FieldInfo("q2", "u8", 8, 0),), Call("crumb", "q2"), _crumbs),
    "nib": Encoding((FieldInfo("q4", "u8", 16, 0),), Call("nib", "q4"), _nibbles),
    "byte": Encoding((FieldInfo("q8", "i8", 32, 0),), Index("q8", Elem()), lambda u: u.astype(np.int8).view(np.uint8)),
}


@dataclass(frozen=True)
class QuantFormat:
    """A quant type: stored layout, formulas, and the packed layout the kernels read."""

    name: str
    block: int
    fields: tuple[FieldInfo, ...]
    unpack: Node
    scale: Node
    offset: Node | None
    value_fields: tuple[str, ...]  # fields `unpack` reads, stored in plane q in this order
    interleaved: tuple[str, ...]  # nibble fields read with nibi(): repacked to split order in plane q
    sub: int | None = None  # a super-block's sub-block size: scale and offset are formulas of s
    group: int = 1  # rows per group of the packed planes: 1, or GROUP_ROWS (the grouped layout)
    crumbs: bool = True  # 2-bit integers of a re-encoded type packed as crumbs (else nibbles: Target.layout)
    # byte-encoded integers under sub-block scales stored as themselves, not less their least value:
    # where a target's dots take the values (SIMD128: Target.layout)
    signed_bytes: bool = False

    # ---- the blocks kernels see (cached: each folds the formulas, and lowering reads them at every Q.<attr>)
    @functools.cached_property
    def reencoded(self) -> bool:
        """Whether plane q holds the unpacked integers re-encoded (ENCODINGS) rather than the stored
        value fields: every super-block, and a flat block of KERNEL_BLOCK values whose unpack reads
        a bit mask (Q5_0, Q5_1): the mask's unpack (splat, swizzle, and, compare, and, or per 16
        values) cost qmatvec Q5_1 0.35x Q4_0's rate, where bytes need no unpack at all."""
        return self.sub is not None or (self.block == KERNEL_BLOCK and any(
            isinstance(n, Call) and n.func == "bit" for n in nodes(self.unpack)))

    @functools.cached_property
    def kernel(self) -> QuantFormat:
        """The block kernels read. A flat type's stored value fields are that, unless `reencoded`
        (plane q holds them as stored). A re-encoded type is packed per block of KERNEL_BLOCK values
        (the activation block; a super-block's sub-blocks) from its unpacked integers, in 2 or 4
        bits when their range fits, else in bytes (ENCODINGS); `Q.block`, `Q.bytes` and
        `Q.unpack` in kernels are this block's."""
        if not self.reencoded:
            return self
        kind, zero = self.encoding
        enc = ENCODINGS[kind]
        unpack = Op("+", enc.unpack, Int(zero)) if zero else enc.unpack
        if self.codebook:  # the codes, looked up in the table as IQ4_NL's are (encoding: zero 0)
            unpack = Lookup(self.unpack.values, unpack)
        fields = enc.fields
        if self.sub_scales:  # the sub-blocks' integer scales follow the codes (SUB_SCALES)
            at, subs = sum(f.nbytes for f in fields), KERNEL_BLOCK // self.sub
            fields += (FieldInfo(SUB_SCALES, "i8", SUB_SCALE_GRANULE * subs, at) if self.group > 1
                       else FieldInfo(SUB_SCALES, "i32", subs, at),)
        return dataclasses.replace(self, block=KERNEL_BLOCK, fields=fields, unpack=unpack,
                                   value_fields=tuple(f.name for f in fields), interleaved=(), sub=None)

    @functools.cached_property
    def sub_scales(self) -> tuple[Node, Node] | None:
        """Sub-blocks smaller than the kernels' block (Q6_K's 16) scale as F * I: F a formula of the
        super-block's fields, the kernel block's f32 scale; I an integer formula of s, each
        sub-block's multiplier of its integer dot (stored after the kernel block's codes in plane
        q). None for other types; ValueError when the scale is not such a product."""
        if not self.sub or self.sub >= KERNEL_BLOCK:
            return None
        per_sub = [f for f in _factors(self.scale) if any(x.kind == "s" for x in nodes(f))]
        rest = [f for f in _factors(self.scale) if f not in per_sub]
        if not per_sub or not rest:
            raise ValueError(f"with sub-blocks of {self.sub}, write the scale as a product of factors of the super-block"
                             " and integer factors of s (d * scales[s])")
        lo, hi = fold(_product(per_sub), self.ranges)
        if max(-lo, hi) > SUB_SCALE_MAX:
            raise ValueError(f"the integer sub-block scale {text(_product(per_sub))} spans {lo}..{hi};"
                             f" the kernels take at most {SUB_SCALE_MAX} in magnitude (a 16-value dot times it stays"
                             " within i32 and it fits relaxed SIMD's i16 lanes: idot7zs)")
        return _product(rest), _product(per_sub)

    @property
    def sub_offsets(self) -> bool:
        """Whether the offset varies over sub-blocks smaller than the kernels' block (Q2_K's
        minimums per 16 values): the kernels then weigh each half's activation sum by its own
        integer (Factored.per) instead of taking the block's sum once."""
        return self.sub is not None and self.sub < KERNEL_BLOCK and self.offset is not None

    @functools.cached_property
    def ranges(self) -> IntRange:
        """Bounds of this block's integer formulas (i over the block, s over its sub-blocks)."""
        return IntRange(self.block, {f.name: f.type for f in self.fields}, self.block // self.sub if self.sub else None)

    @functools.cached_property
    def record(self) -> Record | None:
        """A super-block type's scales and offsets as one record per super-block in plane scale:
        F of each as f32, then I of each as a byte per kernel block, padded to a whole number of
        bytes per kernel block (Q4_K: d, -dmin, eight 6-bit scales and eight minimums, 24 bytes: 3
        per 32 values, where f32 scale and offset planes took 8, a third of Q4_K's bytes). None for
        flat types and for a super-block whose scale or offset is no such product (each kernel block
        then has its own f32s)."""
        blocks = self.block // KERNEL_BLOCK
        if not self.sub or blocks % 4 or blocks & (blocks - 1):  # the kernels read four blocks' scales at a
            return None  # multiple of 4 from one record, found by a shift (lower_scales)
        parts: dict[str, tuple[Node, Node | None]] = {}
        if self.sub_offsets and self._f_times_i(self.offset) is None:
            raise ValueError(f"with sub-blocks of {self.sub}, write the offset as a float field times an integer of s"
                             " (- dmin * mins[s])")
        if self.sub_scales:  # the integers of sub-blocks of 16 stay with the codes (plane q)
            parts["scale"] = (self.sub_scales[0], None)
        for name, formula in (("scale", self.scale), ("offset", self.offset)):
            if formula is not None and name not in parts:
                split = self._f_times_i(formula)
                if split is None:
                    return None
                parts[name] = split
        if not all(_float_field(f, self) for f, _ in parts.values()):
            return None
        ranges = self.ranges
        at = 4 * len(parts)
        factors = {}
        for name, (f, i) in parts.items():
            signed = i is not None and fold(i, ranges)[0] < 0
            per = KERNEL_BLOCK // self.sub if name == "offset" and self.sub_offsets else 1
            factors[name] = Factored(f, i, signed, 4 * len(factors), at if i is not None else -1, per)
            at += blocks * per if i is not None else 0
        unit = np.lcm(blocks, 4)  # whole bytes per kernel block, f32s aligned
        return Record(factors, int(-(-at // unit) * unit), blocks)

    def _f_times_i(self, formula: Node) -> tuple[Node, Node] | None:
        """formula as (F, I): F * I or -(F * I), F a float field, I an integer formula of s whose
        values fit a byte (IntRange); None when it is not such a product."""
        neg = isinstance(formula, Neg)
        core = formula.arg if neg else formula
        if not (isinstance(core, Op) and core.op == "*"):
            return None
        ranges = self.ranges
        for f, i in ((core.left, core.right), (core.right, core.left)):
            if not (isinstance(f, Field) and any(x.kind == "s" for x in nodes(i))):
                continue
            try:
                lo, hi = fold(i, ranges)
            except (ValueError, AttributeError):
                return None
            if -128 <= lo and hi <= 127 or 0 <= lo and hi <= 255:
                return (Neg(f) if neg else f), i
        return None

    @functools.cached_property
    def value_range(self) -> tuple[int, int]:
        """The least and largest value `unpack` can give (from the fields' types)."""
        return fold(self.unpack, self.ranges)

    @functools.cached_property
    def codebook(self) -> bool:
        """Whether this is a super-block of codebook values (IQ4_XS: unpack table[code]): plane q
        then holds the codes, not the values, and the kernels look them up."""
        return self.sub is not None and isinstance(self.unpack, Lookup)

    @functools.cached_property
    def encoded(self) -> Node:
        """The integers a re-encoded plane q holds: the unpacked values, or a codebook's codes."""
        return self.unpack.code if self.codebook else self.unpack

    @functools.cached_property
    def encoding(self) -> tuple[str, int]:
        """(ENCODINGS key, zero): the `encoded` integers minus `zero` fit the encoding's bits (a
        codebook's codes, 0..15, are nibbles as they are)."""
        if self.codebook:
            return "nib", 0
        lo, hi = self.value_range
        width = (hi - lo).bit_length()
        # (5-bit values take bytes: a bit plane's unpack costs 4-6x the nibbles' time, measured. In
        # the grouped layout, high bits sliced by lane group (one 16-bit shift, an and and an or per
        # 16 values, 0.625 and 0.75 bytes per value) ran relaxed Q5_K and Q6_K mat-vec at 0.67x and
        # 0.53x at 256x4096 and 1.07x and 0.83x from DRAM on one thread, 1.27x and 1.00x from DRAM
        # on two (Zen 4, wasmtime): bytes win while the cores, not DRAM, bound decoding. 2-bit codes
        # take crumbs: relaxed Q2_K mat-vec 1.3x nibbles' rate from DRAM at the same rate in L2, in
        # 0.66x the bytes per weight; Xeon. SIMD128 packs them as nibbles (`crumbs` False, from
        # Target.layout), which its idotns unpacks in four operations per 32: 1.2-1.36x crumbs' rate.)
        if width > 4 and self.signed_bytes and self.sub_scales and -128 <= lo and hi <= 127:
            return "byte", 0
        return ("crumb" if width <= 2 and self.crumbs else "nib" if width <= 4 else "byte"), lo

    @functools.cached_property
    def codes(self) -> tuple[Node, Node] | None:
        """(codes, zero): the kernel block's unpack as codes - zero, both integers in [0, 127] and
        zero the same for every element (a constant, or a scalar byte field that pack checks
        block by block: q4_onnx's UINT4 zero point), or None when the type has no such form
        (signed 8-bit values: Q8_0, IQ4_NL's codebook). Such codes fit the 7-bit operand of the
        relaxed dot with full int8 activations in the other (Target.dot_scheme)."""
        kb = self.kernel
        u = kb.unpack
        if self.reencoded and not self.codebook:  # encoded per kernel block as the integers minus the zero
            kind, zero = self.encoding
            lo, hi = self.value_range
            fits = 0 <= -zero <= 127 and 0 <= lo - zero and hi - zero <= 127  # not signed_bytes' values
            return (ENCODINGS[kind].unpack, Int(-zero)) if fits else None
        if isinstance(u, Lookup):
            codes, zero = Lookup(tuple(v - min(u.values) for v in u.values), u.code), Int(-min(u.values))
        elif isinstance(u, Op) and u.op == "-" and not any(x.kind == "i" for x in nodes(u.right)):
            codes, zero = u.left, u.right
        elif isinstance(u, Op) and u.op == "+" and isinstance(u.right, Int):
            codes, zero = u.left, Int(-u.right.value)
        else:
            codes, zero = u, Int(0)
        ranges = kb.ranges
        try:
            lo, hi = fold(codes, ranges)
            fits = 0 <= lo and hi <= 127 and (isinstance(zero, Field) or 0 <= min(fold(zero, ranges))
                                              and max(fold(zero, ranges)) <= 127)
        except ValueError:
            fits = False
        return (codes, zero) if fits else None

    @property
    def code_max(self) -> int | None:
        """The largest of `codes` (a reencoded type's: its integers' span), None without codes: the
        kernels' bound for sums of code products in i16 (Q.pair16)."""
        if self.codes is None:
            return None
        if self.reencoded and not self.codebook:
            lo, hi = self.value_range
            return hi - lo
        kb = self.kernel
        return fold(self.codes[0], kb.ranges)[1]

    # ---- layout
    @property
    def stored_bytes(self) -> int:
        return sum(f.nbytes for f in self.fields)

    @property
    def bytes(self) -> int:
        """Bytes per block and row in the packed value plane (Q.bytes in kernels, times the group)."""
        return sum(self.value_width(n) for n in self.value_fields)

    def field(self, name: str) -> FieldInfo:
        return next(f for f in self.fields if f.name == name)

    def value_width(self, name: str) -> int:
        """Bytes of value field `name` in a row's block of plane q: as stored, but a granule for a
        scalar byte field in the grouped layout (its byte repeated: the lanes of its row)."""
        f = self.field(name)
        return GRANULE if self.group > 1 and f.count is None else f.nbytes

    def value_offset(self, name: str) -> int:
        """Byte offset of value field `name` within a row's block of plane q."""
        off = 0
        for n in self.value_fields:
            if n == name:
                return off
            off += self.value_width(n)
        raise KeyError(name)

    def padded_rows(self, rows: int) -> int:
        """Rows the planes of a rows-row matrix hold: a whole number of groups."""
        return -(-rows // self.group) * self.group

    @property
    def planes(self) -> dict[str, tuple[str, int]]:
        """Plane name -> (numpy dtype, bytes per block), in the order kernels take them."""
        if self.record is not None:
            return {"q": ("u1", self.kernel.bytes), "scale": ("u1", self.record.bytes // self.record.blocks)}
        planes = {"q": ("u1", self.kernel.bytes), "scale": ("<f4", 4)}
        if self.offset is not None:
            planes["offset"] = ("<f4", 4)
        return planes

    def _planes_json(self) -> dict[str, dict]:
        """The manifest's planes: dtype and bytes per kernel block, and in the grouped layout the
        granules of a row's unit (a kernel block; a record) that sit beside the group's other rows."""
        out = {}
        for name, (dt, n) in self.planes.items():
            out[name] = {"dtype": np.dtype(dt).str, "bytes_per_block": n}
            if self.group > 1:
                unit = self.record.bytes if name == "scale" and self.record is not None else n
                out[name]["granules"] = [list(g) for g in self.granules(name, unit)]
        return out

    def packed_bytes(self, rows: int, cols: int) -> int:
        """Bytes of the planes of a packed rows x cols matrix (cols a multiple of the block)."""
        return sum(n for _, n in self.planes.values()) * self.padded_rows(rows) * (cols // self.kernel.block)

    @property
    def dtype(self) -> np.dtype:
        """The stored block as a packed numpy structured dtype (no padding, little-endian)."""
        return np.dtype([(f.name, _NP[f.type], (f.count,)) if f.count else (f.name, _NP[f.type])
                         for f in self.fields])

    # ---- the manifest's form
    def to_json(self) -> dict:
        return {
            "block": self.block,
            **({"sub": self.sub} if self.sub else {}),
            # rows per group of the planes (the grouped layout: the module docstring), 1 for rows
            "group": self.group,
            **({"kernel_block": KERNEL_BLOCK, "encoding": {**dict(zip(("kind", "zero"), self.encoding)),
                                                            # a codebook's codes: what plane q holds
                                                            **({"code": to_json(self.encoded)} if self.codebook else {})}}
               if self.reencoded else {}),
            # the scale's factors: plane scale (per super-block) and the i32 after each kernel block's codes
            **({"sub_scales": dict(zip(("block", "sub"), map(to_json, self.sub_scales)))} if self.sub_scales else {}),
            # plane scale's record per super-block: F at f_at (f32), I at i_at (`per` bytes per kernel block)
            **({"record": {"bytes": self.record.bytes, "blocks": self.record.blocks, "factors": {
                name: {"f": to_json(x.f), "f_at": x.f_at, "i": to_json(x.i) if x.i is not None else None,
                       "i_at": x.i_at, "signed": x.signed, "per": x.per} for name, x in self.record.factors.items()}}}
               if self.record else {}),
            "stored_bytes": self.stored_bytes,
            "fields": [{"name": f.name, "type": f.type, "count": f.count, "offset": f.offset} for f in self.fields],
            "unpack": text(self.unpack),
            "dequant": text(self.scale) + " * q" + (f" + {text(self.offset)}" if self.offset is not None else ""),
            "planes": self._planes_json(),
            "value_fields": list(self.value_fields),
            # unpack as codes - zero, both in [0, 127] (a field zero checked by pack), or null
            "codes": dict(zip(("codes", "zero"), map(to_json, self.codes))) if self.codes else None,
            "interleaved": list(self.interleaved),
            # The formulas as trees: what both hosts rebuild this type from.
            "formulas": {"unpack": to_json(self.unpack), "scale": to_json(self.scale),
                         "offset": to_json(self.offset) if self.offset is not None else None},
        }

    @classmethod
    def from_json(cls, name: str, d: dict) -> QuantFormat:
        """The type a manifest's `quants[name]` entry describes (written by to_json)."""
        try:
            f = d["formulas"]
            q = cls(name, d["block"], tuple(FieldInfo(x["name"], x["type"], x["count"], x["offset"]) for x in d["fields"]),
                    from_json(f["unpack"]), from_json(f["scale"]), from_json(f["offset"]) if f["offset"] else None,
                    tuple(d["value_fields"]), tuple(d["interleaved"]), d.get("sub"), d["group"])
            if q.group not in (1, GROUP_ROWS):
                raise ValueError(f"group {q.group}: this kernelgen packs rows one by one or in groups of {GROUP_ROWS}")
            if q.reencoded and q.encoding[0] == "crumb" and d["encoding"]["kind"] == "nib":
                q = dataclasses.replace(q, crumbs=False)
            if q.reencoded and q.encoding[0] == "byte" and q.encoding[1] != 0 and d["encoding"]["zero"] == 0:
                q = dataclasses.replace(q, signed_bytes=True)
            planes = d["planes"]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"manifest quant {name!r}: not a quant description ({type(e).__name__}: {e})") from None
        mine = q._planes_json()
        if planes != mine:  # the kernels were built for another packed layout: packing here would misread
            raise ValueError(f"manifest quant {name!r}: its kernels read planes {planes}, this kernelgen packs {mine};"
                             " rebuild the library with this version (kernelgen build)")
        return q

    # ---- numpy reference, derived from the formulas
    def as_blocks(self, raw: np.ndarray) -> np.ndarray:
        """View stored bytes (uint8, any shape ending in whole blocks) as structured blocks."""
        raw = np.ascontiguousarray(raw)
        if raw.dtype == self.dtype:
            return raw
        if raw.dtype != np.uint8 or raw.shape[-1] % self.stored_bytes:
            raise ValueError(f"{self.name} blocks: expected uint8 bytes in multiples of {self.stored_bytes}"
                             f" or dtype {self.dtype}, got {raw.dtype} shape {raw.shape}")
        return raw.view(self.dtype)

    def unpack_ref(self, blocks: np.ndarray) -> np.ndarray:
        """Each block's elements as int32, shape blocks.shape + (block,)."""
        blocks = self.as_blocks(blocks)
        v = fold(self.unpack, NumpyEval(blocks, np.arange(self.block)))
        return np.broadcast_to(v, blocks.shape + (self.block,)).astype(np.int32)

    @property
    def subs(self) -> int:
        """Scales per block: a super-block's sub-blocks, else 1."""
        return self.block // self.sub if self.sub else 1

    def _per_block(self, formula: Node | None, blocks: np.ndarray) -> np.ndarray:
        """A scale or offset formula per block (per sub-block of a super-block: blocks.shape[:-1] +
        (n_blocks * subs,), each kernel block's value in order)."""
        blocks = self.as_blocks(blocks)
        shape = blocks.shape + (self.subs,)
        if formula is None:
            v = np.zeros(shape, np.float32)
        else:
            s = np.arange(self.subs) if self.sub else None
            v = fold(formula, NumpyEval(blocks, s=s))
            v = np.broadcast_to(v if self.sub else np.asarray(v)[..., None], shape).astype(np.float32)
        return v.reshape(blocks.shape[:-1] + (-1,))

    def scale_ref(self, blocks: np.ndarray) -> np.ndarray:
        return self._per_block(self.scale, blocks)

    def offset_ref(self, blocks: np.ndarray) -> np.ndarray:
        return self._per_block(self.offset, blocks)

    def set_scale_bytes(self, blocks: np.ndarray, near: float) -> None:
        """Set every byte field of the scale formula (an e8m0 exponent: MXFP4) in `blocks` to the
        value whose scale is nearest `near`, in place: for timing and tuning data, where random
        exponent bytes make scales of 2^-128 .. 2^127 (subnormal and infinite products, which x86
        runs in microcode and float64 references do not reproduce)."""
        for name in dict.fromkeys(n.field for n in nodes(self.scale) if isinstance(n, Field)):
            if self.field(name).type in ("u8", "i8"):
                trial = np.repeat(blocks.reshape(-1)[:1], 256)
                trial[name] = np.arange(256).astype(np.uint8).view(trial[name].dtype)
                with np.errstate(over="ignore", divide="ignore"):
                    off = np.abs(np.log2(np.abs(self.scale_ref(trial[:, None])[:, 0])) - np.log2(near))
                blocks[name] = trial[name][np.argmin(np.where(np.isfinite(off), off, np.inf))]

    def dequantize_ref(self, blocks: np.ndarray) -> np.ndarray:
        """f32 values, shape blocks.shape[:-1] + (n_blocks * block,): the declared formula."""
        blocks = self.as_blocks(blocks)
        q = self.unpack_ref(blocks).astype(np.float32).reshape(blocks.shape[:-1] + (-1, self.block // self.subs))
        x = self.scale_ref(blocks)[..., None] * q
        if self.offset is not None:  # (no + 0: it would turn -0.0 into 0.0)
            x = x + self.offset_ref(blocks)[..., None]
        return x.reshape(blocks.shape[:-1] + (-1,))

    # ---- packing into the kernels' layout
    def pack(self, blocks: np.ndarray) -> dict[str, np.ndarray]:
        """Stored blocks (rows, n_blocks) -> the planes kernels read, each a flat array. Packed
        PACK_VALUES values (whole groups of rows) at a time, each plane's part for them contiguous:
        numpy's temporaries of a whole 14336x4096 matrix took 1.1 GB and 6x the time."""
        blocks = self.as_blocks(blocks)
        if blocks.ndim != 2:
            raise ValueError(f"{self.name}: pack takes blocks of shape (rows, n_blocks), got {blocks.shape}")
        step = max(1, PACK_VALUES // max(1, blocks.shape[1] * self.block * self.group)) * self.group
        parts = [self._pack_rows(blocks[r:r + step], r) for r in range(0, max(blocks.shape[0], 1), step)]
        return {name: parts[0][name] if len(parts) == 1 else np.concatenate([p[name] for p in parts]) for name in parts[0]}

    def _pack_rows(self, blocks: np.ndarray, row0: int) -> dict[str, np.ndarray]:
        """pack of rows row0.. of a matrix (for its errors), padded to whole groups."""
        values = self.unpack_ref(blocks)
        if values.size and (values.min() < -128 or values.max() > 127):
            bad = np.argwhere((values < -128) | (values > 127))[0]
            raise ValueError(f"{self.name}: block {(row0 + int(bad[0]), int(bad[1]))} unpacks to {values[tuple(bad)]} at element "
                             f"{bad[-1]}, outside int8: not a valid {self.name} block (the kernels' weights are int8)")
        if self.codes is not None and isinstance(self.codes[1], Field):
            zero = fold(self.codes[1], NumpyEval(blocks))
            if zero.size and (zero.min() < 0 or zero.max() > 127):
                bad = np.argwhere((zero < 0) | (zero > 127))[0]
                raise ValueError(f"{self.name}: block {(row0 + int(bad[0]), int(bad[1]))} has {text(self.codes[1])} = "
                                 f"{zero[tuple(bad)]}, outside 0..127: not a valid {self.name} block (the relaxed dot's"
                                 " 7-bit operand takes it)")
        if blocks.shape[0] % self.group:  # whole groups: zero blocks (scale 0) in the rows past the matrix
            pad = np.zeros((self.padded_rows(blocks.shape[0]) - blocks.shape[0], blocks.shape[1]), blocks.dtype)
            blocks = np.concatenate([blocks, pad])
            values = np.concatenate([values, self.unpack_ref(pad)])
        rows = blocks.shape[0]
        if self.codebook:
            values = np.broadcast_to(fold(self.encoded, NumpyEval(blocks, np.arange(self.block))), values.shape)
        per_kernel_block = values.reshape(rows, -1, KERNEL_BLOCK if self.reencoded else self.block)
        if self.reencoded:
            kind, zero = self.encoding
            q = ENCODINGS[kind].encode(per_kernel_block - zero)
            if self.sub_scales:
                mult = np.ascontiguousarray(np.broadcast_to(
                    fold(self.sub_scales[1], NumpyEval(blocks, s=np.arange(self.subs))), blocks.shape + (self.subs,)),
                    np.int32)
                if self.group > 1:  # each s an int8, SUB_SCALE_GRANULE times (SUB_SCALES)
                    isc = np.repeat(mult.astype(np.int8), SUB_SCALE_GRANULE, axis=-1).view(np.uint8)
                else:  # each s an i32 holding it in both i16 halves
                    isc = ((mult & 0xFFFF) * 0x10001).astype(np.uint32).view(np.uint8)
                q = np.concatenate([q, isc.reshape(rows, q.shape[1], -1)], axis=-1)
        else:
            raw = blocks.view(np.uint8).reshape(blocks.shape + (self.stored_bytes,))
            q = np.concatenate([np.repeat(part, self.value_width(f.name) // f.nbytes, axis=-1)
                                for f in (self.field(n) for n in self.value_fields)
                                for part in [self._packed_field(raw[..., f.offset:f.offset + f.nbytes], f.name)]], axis=-1)
        planes = {"q": q}
        if self.record is not None:
            planes["scale"] = self._records(blocks)
        else:
            planes["scale"] = self.scale_ref(blocks)
            if self.offset is not None:
                planes["offset"] = self.offset_ref(blocks)
            if self.sub_scales:
                planes["scale"] = np.repeat(np.broadcast_to(fold(self.sub_scales[0], NumpyEval(blocks)),
                                                            blocks.shape).astype(np.float32),
                                            self.block // KERNEL_BLOCK, axis=-1)
        return {name: self._grouped(name, np.ascontiguousarray(a)).reshape(-1).view(a.dtype) for name, a in planes.items()}

    def _grouped(self, plane: str, a: np.ndarray) -> np.ndarray:
        """A plane's per-row array (rows, units[, bytes]) in the layout of `group`: unchanged for
        rows one by one; else each group's rows side by side granule by granule (the module
        docstring), a record's integers (past its f32s) a byte at a time."""
        if self.group == 1:
            return a
        if a.dtype != np.uint8:  # one f32 per block and row: a granule
            a = a[..., None].view(np.uint8)
        rows, units, nbytes = a.shape
        parts = []
        for start, end, granule in self.granules(plane, nbytes):
            x = a[..., start:end].reshape(rows // self.group, self.group, units, -1, granule)
            parts.append(x.transpose(0, 2, 3, 1, 4).reshape(rows // self.group, units, -1))
        return np.concatenate(parts, axis=-1)

    def granules(self, plane: str, nbytes: int) -> list[tuple[int, int, int]]:
        """(start, end, granule) of the parts of a row's `nbytes` per unit of `plane` in the grouped
        layout: a record's f32s in GRANULE bytes and its integers a byte at a time, the codes in
        GRANULE bytes and integer sub-block scales in SUB_SCALE_GRANULE (the manifest's "granules",
        which the JS packer follows)."""
        if plane == "scale" and self.record is not None:  # (sub-block offsets: a row's pair of a block together)
            split = 4 * len(self.record.factors)
            per = max(x.per for x in self.record.factors.values())
            return [(0, split, GRANULE)] + ([(split, nbytes, per)] if nbytes > split else [])
        if plane == "q" and self.sub_scales and self.group > 1:
            split = self.kernel.value_offset(SUB_SCALES)
            return [(0, split, GRANULE), (split, nbytes, SUB_SCALE_GRANULE)]
        return [(0, nbytes, GRANULE)]

    def _records(self, blocks: np.ndarray) -> np.ndarray:
        """Plane scale of a `record` type: one record per stored block, shape blocks.shape + (bytes,)."""
        rec = self.record
        out = np.zeros(blocks.shape + (rec.bytes,), np.uint8)
        for x in rec.factors.values():
            f = np.broadcast_to(fold(x.f, NumpyEval(blocks)), blocks.shape).astype("<f4")
            out[..., x.f_at:x.f_at + 4] = f[..., None].view(np.uint8)
            if x.i is not None:  # each kernel block's first sub-block, or (per > 1) each of its sub-blocks
                subs = np.arange(rec.blocks * x.per) * KERNEL_BLOCK // (self.sub * x.per)
                i = np.broadcast_to(fold(x.i, NumpyEval(blocks, s=subs)), blocks.shape + (subs.size,))
                out[..., x.i_at:x.i_at + subs.size] = i.astype(np.int8 if x.signed else np.uint8).view(np.uint8)
        return out

    def _packed_field(self, part: np.ndarray, name: str) -> np.ndarray:
        """A value field's bytes as plane q holds them: interleaved nibbles (element 2i low, 2i+1
        high: ONNX's UINT4) become split nibbles (byte b holds elements b and b + n: GGUF's order),
        so both unpack with the same two SIMD instructions."""
        if name not in self.interleaved:
            return part
        n = part.shape[-1]
        elems = np.stack([part & 0x0F, part >> 4], axis=-1).reshape(part.shape[:-1] + (2 * n,))
        return (elems[..., :n] | (elems[..., n:] << 4)).astype(np.uint8)
