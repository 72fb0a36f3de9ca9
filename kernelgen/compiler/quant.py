"""Quantization types: one declaration in kernels.dsl gives the stored block format, its numpy
unpack/dequantize reference, the pack step into the kernels' layout, and the SIMD unpack code.

A declaration says how a block is *stored* (the bytes users already have, e.g. GGUF's Q8_0),
`unpack`: an expression over the element index `i` giving each element's small integer, and
`dequant`: `S * q` or `S * q + M` with S and M formulas of the block's scalar fields.

Packing turns a matrix of stored blocks into planes the kernels read (each contiguous, row-major):
  q       the fields `unpack` reads, per block, concatenated in declaration order (Q.bytes each)
  scale   S per block as f32 (f16 scales widened once here, not in the hot loop)
  offset  M per block as f32, only for types with `+ M`
  sum     the sum of the block's unpacked integers, i32: removes the 7-bit activation offset of
          the relaxed dot exactly (sum(w*(a+64)) - 64*sum(w) = sum(w*a))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import ast as A
from ..errors import DslError
from .types import FIELD_TYPES
from .wat import I, Instr

_NP = {"i8": "i1", "u8": "u1", "i16": "<i2", "u16": "<u2", "f16": "<f2", "i32": "<i4", "u32": "<u4", "f32": "<f4"}
LANES = 16  # a block unpacks 16 int8 lanes at a time (one v128)


@dataclass(frozen=True)
class FieldInfo:
    name: str
    type: str
    count: int | None  # None: one scalar per block
    offset: int  # byte offset in the stored block

    @property
    def nbytes(self) -> int:
        return FIELD_TYPES[self.type] * (self.count or 1)


@dataclass(frozen=True)
class QuantInfo:
    """A checked quant declaration and everything derived from it."""

    name: str
    block: int
    fields: tuple[FieldInfo, ...]
    unpack: A.Expr
    scale: A.Expr
    offset: A.Expr | None
    value_fields: tuple[str, ...]  # fields `unpack` reads, stored in plane q in this order
    interleaved: tuple[str, ...]  # nibble fields read with nibi(): repacked to split order in plane q
    span: A.Span

    # ---- layout
    @property
    def stored_bytes(self) -> int:
        return sum(f.nbytes for f in self.fields)

    @property
    def bytes(self) -> int:
        """Bytes per block in the packed value plane (Q.bytes in kernels)."""
        return sum(self.field(n).nbytes for n in self.value_fields)

    def field(self, name: str) -> FieldInfo:
        return next(f for f in self.fields if f.name == name)

    def value_offset(self, name: str) -> int:
        """Byte offset of value field `name` within a block of plane q."""
        off = 0
        for n in self.value_fields:
            if n == name:
                return off
            off += self.field(n).nbytes
        raise KeyError(name)

    @property
    def planes(self) -> dict[str, tuple[str, int]]:
        """Plane name -> (numpy dtype, bytes per block), in the order kernels take them."""
        planes = {"q": ("u1", self.bytes), "scale": ("<f4", 4)}
        if self.offset is not None:
            planes["offset"] = ("<f4", 4)
        planes["sum"] = ("<i4", 4)
        return planes

    @property
    def dtype(self) -> np.dtype:
        """The stored block as a packed numpy structured dtype (no padding, little-endian)."""
        return np.dtype([(f.name, _NP[f.type], (f.count,)) if f.count else (f.name, _NP[f.type])
                         for f in self.fields])

    def describe(self) -> dict:
        return {
            "block": self.block,
            "stored_bytes": self.stored_bytes,
            "fields": [{"name": f.name, "type": f.type, "count": f.count, "offset": f.offset} for f in self.fields],
            "unpack": _text(self.unpack),
            "dequant": _text(self.scale) + " * q" + (f" + {_text(self.offset)}" if self.offset is not None else ""),
            "planes": {name: {"dtype": np.dtype(dt).str, "bytes_per_block": n} for name, (dt, n) in self.planes.items()},
            "value_fields": list(self.value_fields),
            "interleaved": list(self.interleaved),
            # The formulas as trees, for hosts that pack blocks themselves (runtime/kernelgen.mjs).
            "formulas": {"unpack": _tree(self.unpack), "scale": _tree(self.scale),
                         "offset": _tree(self.offset) if self.offset is not None else None},
        }

    # ---- numpy reference, derived from the declaration
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
        i = np.arange(self.block)
        return np.broadcast_to(_eval_np(self.unpack, blocks, i, None), blocks.shape + (self.block,)).astype(np.int32)

    def scale_ref(self, blocks: np.ndarray) -> np.ndarray:
        blocks = self.as_blocks(blocks)
        return np.broadcast_to(_eval_np(self.scale, blocks, None, None), blocks.shape).astype(np.float32)

    def offset_ref(self, blocks: np.ndarray) -> np.ndarray:
        blocks = self.as_blocks(blocks)
        if self.offset is None:
            return np.zeros(blocks.shape, np.float32)
        return np.broadcast_to(_eval_np(self.offset, blocks, None, None), blocks.shape).astype(np.float32)

    def dequantize_ref(self, blocks: np.ndarray) -> np.ndarray:
        """f32 values, shape blocks.shape[:-1] + (n_blocks * block,): the declared formula."""
        blocks = self.as_blocks(blocks)
        q = self.unpack_ref(blocks).astype(np.float32)
        x = self.scale_ref(blocks)[..., None] * q + self.offset_ref(blocks)[..., None]
        return x.reshape(blocks.shape[:-1] + (-1,))

    # ---- packing into the kernels' layout
    def pack(self, blocks: np.ndarray) -> dict[str, np.ndarray]:
        """Stored blocks (rows, n_blocks) -> the planes kernels read, each a flat array."""
        blocks = self.as_blocks(blocks)
        if blocks.ndim != 2:
            raise ValueError(f"{self.name}: pack takes blocks of shape (rows, n_blocks), got {blocks.shape}")
        raw = blocks.view(np.uint8).reshape(blocks.shape + (self.stored_bytes,))
        parts = [self._packed_field(raw[..., f.offset:f.offset + f.nbytes], f.name)
                 for f in (self.field(n) for n in self.value_fields)]
        planes = {"q": np.ascontiguousarray(np.concatenate(parts, axis=-1)).reshape(-1),
                  "scale": self.scale_ref(blocks).reshape(-1)}
        if self.offset is not None:
            planes["offset"] = self.offset_ref(blocks).reshape(-1)
        values = self.unpack_ref(blocks)
        if values.size and (values.min() < -128 or values.max() > 127):
            bad = np.argwhere((values < -128) | (values > 127))[0]
            raise ValueError(f"{self.name}: block {tuple(bad[:-1])} unpacks to {values[tuple(bad)]} at element "
                             f"{bad[-1]}, outside int8: not a valid {self.name} block (the kernels' weights are int8)")
        planes["sum"] = values.sum(axis=-1, dtype=np.int32).reshape(-1)
        return planes

    def _packed_field(self, part: np.ndarray, name: str) -> np.ndarray:
        """A value field's bytes as plane q holds them: interleaved nibbles (element 2i low, 2i+1
        high: ONNX's UINT4) become split nibbles (byte b holds elements b and b + n: GGUF's order),
        so both unpack with the same two SIMD instructions."""
        if name not in self.interleaved:
            return part
        n = part.shape[-1]
        elems = np.stack([part & 0x0F, part >> 4], axis=-1).reshape(part.shape[:-1] + (2 * n,))
        return (elems[..., :n] | (elems[..., n:] << 4)).astype(np.uint8)

    # ---- SIMD unpack, for `Q.unpack(p, j)` in kernels
    def unpack_lanes(self, base: Instr, j: int, error: Callable[[str], Exception]) -> Instr:
        """i8x16 of elements 16j..16j+15 of the block whose packed values start at `base`."""
        if not 0 <= j < self.block // LANES:
            raise error(f"{self.name}.unpack: lane group {j} is out of range 0..{self.block // LANES - 1}")
        return _lower_unpack(self, self.unpack, base, j)


# ---- checking a declaration --------------------------------------------------------------------

# nib(f, i): element i is the low nibble of byte i for the first half, the high nibble of byte
# i - n for the second (GGUF); nibi(f, i): low nibble of byte i/2 for even i, high for odd (ONNX
# UINT4); bit(f, i): bit i of the little-endian bit mask f.
_UNPACK_FUNCS = {"nib": 2, "nibi": 2, "bit": 2}


def check_quant(q: A.Quant) -> QuantInfo:
    """Validate a quant declaration and derive its info; DslError at the offending span."""
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
    fields: list[FieldInfo] = []
    offset = 0
    for f in q.fields:
        if f.type not in FIELD_TYPES:
            raise DslError(f.span, f"field {f.name}: unknown storage type {f.type!r}"
                                   f" (one of {', '.join(FIELD_TYPES)})")
        if any(g.name == f.name for g in fields):
            raise DslError(f.span, f"field {f.name} is declared twice")
        if f.name in ("i", "q") or f.name in _UNPACK_FUNCS:
            raise DslError(f.span, f"field name {f.name!r} is reserved")
        if f.count is not None and f.count <= 0:
            raise DslError(f.span, f"field {f.name}: array length must be positive")
        fields.append(FieldInfo(f.name, f.type, f.count, offset))
        offset += fields[-1].nbytes
    byname = {f.name: f for f in fields}
    used: list[tuple[str, str]] = []  # (field, how it is read)
    _check_unpack(q, q.unpack, byname, used)
    for name in {f for f, _ in used}:
        hows = {h for f, h in used if f == name}
        if len(hows) > 1:
            raise DslError(q.unpack.span, f"quant {q.name}: unpack reads {name} in two ways ({', '.join(sorted(hows))})")
    scale, off = _split_dequant(q)
    for expr in (scale, off):
        if expr is not None:
            _check_scalar_formula(q, expr, byname)
    used_names = {f for f, _ in used}
    value_fields = tuple(f.name for f in fields if f.name in used_names)
    interleaved = tuple(dict.fromkeys(f for f, how in used if how == "nibi"))
    return QuantInfo(q.name, q.block, tuple(fields), q.unpack, scale, off, value_fields, interleaved, q.span)


def _check_unpack(q: A.Quant, e: A.Expr, fields: dict[str, FieldInfo], used: list[tuple[str, str]]) -> None:
    def err(node: A.Node, msg: str) -> DslError:
        return DslError(node.span, f"quant {q.name}: unpack: {msg}")

    def array_field(node: A.Expr, want: int, how: str, kind: str) -> FieldInfo:
        if not isinstance(node, A.Name) or node.id not in fields:
            raise err(node, f"{how} needs a field name")
        f = fields[node.id]
        allowed = ("i8", "u8") if kind == "index" else ("u8",)  # nibbles and bits are unsigned
        if f.type not in allowed or f.count is None:
            raise err(node, f"{how} reads a{'' if kind == 'index' else 'n unsigned'} byte array field "
                            f"({' or '.join(allowed)}[n]); {f.name} is {f.type}{f'[{f.count}]' if f.count else ''}")
        if f.count != want:
            raise err(node, f"{how}: {f.name} must have {want} bytes for a block of {q.block}, has {f.count}")
        used.append((f.name, kind))
        return f

    def is_i(node: A.Expr) -> bool:
        return isinstance(node, A.Name) and node.id == "i"

    if isinstance(e, A.IntLit):
        return
    if isinstance(e, A.Index):
        if len(e.indices) != 1 or not is_i(e.indices[0]):
            raise err(e, "index a field with the element index: field[i]")
        array_field(e.base, q.block, "field[i]", "index")
        return
    if isinstance(e, A.Call) and isinstance(e.func, A.Name) and e.func.id in _UNPACK_FUNCS:
        name = e.func.id
        if len(e.args) != 2 or not is_i(e.args[1]):
            raise err(e, f"write {name}(field, i)")
        array_field(e.args[0], q.block // 8 if name == "bit" else q.block // 2, f"{name}(field, i)", name)
        if name != "bit" and (q.block // 2) % LANES:
            raise err(e, f"nib() needs a block of a multiple of {2 * LANES}")
        return
    if isinstance(e, A.Name):
        f = fields.get(e.id)
        if f is None or f.count is not None or f.type not in ("i8", "u8"):
            raise err(e, f"{e.id!r} is not a byte-sized scalar field (use field[i], nib(field, i) or bit(field, i))")
        used.append((f.name, "scalar"))
        return
    if isinstance(e, A.Binary) and e.op in ("+", "-", "|", "&"):
        _check_unpack(q, e.left, fields, used)
        _check_unpack(q, e.right, fields, used)
        return
    if isinstance(e, A.Binary) and e.op == "<<" and isinstance(e.right, A.IntLit) and 0 <= e.right.value < 8:
        _check_unpack(q, e.left, fields, used)
        return
    raise err(e, "only field[i], nib(field, i), nibi(field, i), bit(field, i), byte fields, integers, + - | & "
                 "and << by a constant are allowed")


def _split_dequant(q: A.Quant) -> tuple[A.Expr, A.Expr | None]:
    """`S * q`, `q * S`, `S * q + M`, `S * q - M` -> (S, M)."""
    e = q.dequant
    offset: A.Expr | None = None
    if isinstance(e, A.Binary) and e.op in ("+", "-") and _mentions_q(e.left) and not _mentions_q(e.right):
        offset = e.right if e.op == "+" else A.Unary(e.right.span, "-", e.right)
        e = e.left
    if isinstance(e, A.Binary) and e.op == "*":
        if isinstance(e.right, A.Name) and e.right.id == "q" and not _mentions_q(e.left):
            return e.left, offset
        if isinstance(e.left, A.Name) and e.left.id == "q" and not _mentions_q(e.right):
            return e.right, offset
    raise DslError(q.dequant.span, f"quant {q.name}: dequant must read 'S * q' or 'S * q + M' with S and M"
                                   " formulas of the block's scalar fields")


def _mentions_q(e: A.Expr) -> bool:
    if isinstance(e, A.Name):
        return e.id == "q"
    if isinstance(e, A.Binary):
        return _mentions_q(e.left) or _mentions_q(e.right)
    if isinstance(e, A.Unary):
        return _mentions_q(e.operand)
    return False


def _check_scalar_formula(q: A.Quant, e: A.Expr, fields: dict[str, FieldInfo]) -> None:
    if isinstance(e, (A.IntLit, A.FloatLit)):
        return
    if isinstance(e, A.Name):
        f = fields.get(e.id)
        if f is None or f.count is not None:
            raise DslError(e.span, f"quant {q.name}: dequant: {e.id!r} is not a scalar field of the block")
        return
    if isinstance(e, A.Unary) and e.op == "-":
        return _check_scalar_formula(q, e.operand, fields)
    if isinstance(e, A.Binary) and e.op in ("+", "-", "*", "/"):
        _check_scalar_formula(q, e.left, fields)
        _check_scalar_formula(q, e.right, fields)
        return
    raise DslError(e.span, f"quant {q.name}: dequant: only scalar fields, numbers and + - * / are allowed")


# ---- numpy evaluation --------------------------------------------------------------------------


def _eval_np(e: A.Expr, blocks: np.ndarray, i: np.ndarray | None, q: np.ndarray | None) -> np.ndarray:
    """Evaluate an unpack (i given: integers per element) or scale/offset formula (f32 per block)."""
    if isinstance(e, A.IntLit):
        return np.int32(e.value) if i is not None else np.float32(e.value)
    if isinstance(e, A.FloatLit):
        return np.float32(e.value)
    if isinstance(e, A.Name):
        v = blocks[e.id]
        return v.astype(np.int32)[..., None] if i is not None else v.astype(np.float32)
    if isinstance(e, A.Index):
        return blocks[e.base.id][..., i].astype(np.int32)
    if isinstance(e, A.Call):
        f = blocks[e.args[0].id]
        if e.func.id == "nib":
            n = f.shape[-1]
            byte = f[..., i % n].astype(np.int32)
            return np.where(i < n, byte & 0x0F, byte >> 4)
        if e.func.id == "nibi":
            byte = f[..., i // 2].astype(np.int32)
            return (byte >> (4 * (i % 2))) & 0x0F
        bits = np.unpackbits(f.astype(np.uint8), axis=-1, bitorder="little")
        return bits[..., i].astype(np.int32)
    if isinstance(e, A.Unary):
        return -_eval_np(e.operand, blocks, i, q)
    a, b = _eval_np(e.left, blocks, i, q), _eval_np(e.right, blocks, i, q)
    ops = {"+": np.add, "-": np.subtract, "*": np.multiply, "/": np.divide, "|": np.bitwise_or,
           "&": np.bitwise_and, "<<": np.left_shift}
    return ops[e.op](a, b)


# ---- SIMD lowering of unpack -------------------------------------------------------------------


def _splat8(value: int) -> Instr:
    return I("v128.const", "i8x16", *[str(value)] * LANES)


def _lower_unpack(qi: QuantInfo, e: A.Expr, base: Instr, j: int) -> Instr:
    if isinstance(e, A.IntLit):
        return _splat8(e.value)
    if isinstance(e, A.Name):  # a per-block byte field: the same value in every lane
        f = qi.field(e.id)
        load = I(f"i32.load8_{'s' if f.type == 'i8' else 'u'}", *_off(qi.value_offset(f.name)), base)
        return I("i8x16.splat", load)
    if isinstance(e, A.Index):
        return I("v128.load", *_off(qi.value_offset(e.base.id) + LANES * j), base)
    if isinstance(e, A.Call) and e.func.id in ("nib", "nibi"):  # plane q holds both in split order
        f = qi.field(e.args[0].id)
        n = f.count or 0
        first = LANES * j
        load = I("v128.load", *_off(qi.value_offset(f.name) + first % n), base)
        if first // n == 0:
            return I("v128.and", load, _splat8(0x0F))
        return I("i8x16.shr_u", load, I("i32.const", 4))
    if isinstance(e, A.Call) and e.func.id == "bit":
        # Lanes 16j..16j+15 read bits of the two mask bytes 2j and 2j+1: put byte 2j in lanes 0-7 and
        # byte 2j+1 in lanes 8-15, keep each lane's own bit, then turn "bit set" into 1.
        f = qi.field(e.args[0].id)
        both = I("v128.load16_splat", *_off(qi.value_offset(f.name) + 2 * j), base)
        spread = I("i8x16.swizzle", both, I("v128.const", "i8x16", *(["0"] * 8 + ["1"] * 8)))
        bitsel = I("v128.const", "i8x16", *[str(1 << (k % 8)) for k in range(LANES)])
        return I("v128.and", I("i8x16.eq", I("v128.and", spread, bitsel), bitsel), _splat8(1))
    assert isinstance(e, A.Binary)
    left = _lower_unpack(qi, e.left, base, j)
    if e.op == "<<":
        return I("i8x16.shl", left, I("i32.const", e.right.value))
    right = _lower_unpack(qi, e.right, base, j)
    op = {"+": "i8x16.add", "-": "i8x16.sub", "|": "v128.or", "&": "v128.and"}[e.op]
    return I(op, left, right)


def _off(n: int) -> tuple[str, ...]:
    return (f"offset={n}",) if n else ()


def _tree(e: A.Expr) -> dict:
    """A formula as JSON: {"int": n} {"float": x} {"i": true} {"field": f} {"index": f} for f[i],
    {"call": "nib"|"nibi"|"bit", "field": f}, {"neg": t}, {"op": "+", "args": [a, b]}."""
    if isinstance(e, A.IntLit):
        return {"int": e.value}
    if isinstance(e, A.FloatLit):
        return {"float": e.value}
    if isinstance(e, A.Name):
        return {"i": True} if e.id == "i" else {"field": e.id}
    if isinstance(e, A.Index):
        return {"index": e.base.id}
    if isinstance(e, A.Call):
        return {"call": e.func.id, "field": e.args[0].id}
    if isinstance(e, A.Unary):
        return {"neg": _tree(e.operand)}
    assert isinstance(e, A.Binary)
    return {"op": e.op, "args": [_tree(e.left), _tree(e.right)]}


def _text(e: A.Expr) -> str:
    """Source-like text of a formula, for the manifest."""
    if isinstance(e, (A.IntLit, A.FloatLit)):
        return str(e.value)
    if isinstance(e, A.Name):
        return e.id
    if isinstance(e, A.Index):
        return f"{_text(e.base)}[{', '.join(_text(x) for x in e.indices)}]"
    if isinstance(e, A.Call):
        return f"{_text(e.func)}({', '.join(_text(x) for x in e.args)})"
    if isinstance(e, A.Unary):
        return f"-{_text(e.operand)}"
    if isinstance(e, A.Binary):
        return f"({_text(e.left)} {e.op} {_text(e.right)})"
    return "?"
