"""The language's value types and how each maps to a wasm value type and instruction prefix."""
from __future__ import annotations

from dataclasses import dataclass

# `ptr` is a byte address into the one shared memory: an i32 with a name that says what it is for.
SCALARS = ("i32", "i64", "f32", "f64")
ALIASES = {"ptr": "i32"}


@dataclass(frozen=True)
class Vec:
    """A 128-bit vector type: lane type, lane count, and whether integer lanes read as unsigned."""

    lane: str
    lanes: int
    unsigned: bool = False

    @property
    def prefix(self) -> str:
        """The wasm instruction prefix, e.g. `i8x16` for both i8x16 and u8x16."""
        return f"{self.lane}x{self.lanes}"

    @property
    def is_float(self) -> bool:
        return self.lane.startswith("f")

    @property
    def sign(self) -> str:
        return "u" if self.unsigned else "s"


VECTORS: dict[str, Vec] = {
    "i8x16": Vec("i8", 16),
    "u8x16": Vec("i8", 16, unsigned=True),
    "i16x8": Vec("i16", 8),
    "i32x4": Vec("i32", 4),
    "f32x4": Vec("f32", 4),
    "f64x2": Vec("f64", 2),
}

# Compile-time literals before they meet a typed operand: an integer literal becomes whatever
# integer or float type it is combined with, a float literal any float type.
INT_LIT = "int"
FLOAT_LIT = "float"

# Storage-only types that may appear in quant block fields (never as values in kernels).
def resolve(name: str) -> str | None:
    """The canonical value type for a type name, or None when it is not a value type."""
    name = ALIASES.get(name, name)
    return name if name in SCALARS or name in VECTORS else None


def is_scalar(t: str) -> bool:
    return t in SCALARS


def is_vector(t: str) -> bool:
    return t in VECTORS


def is_int(t: str) -> bool:
    return t in ("i32", "i64", INT_LIT) or (t in VECTORS and not VECTORS[t].is_float)


def is_float(t: str) -> bool:
    return t in ("f32", "f64", FLOAT_LIT) or (t in VECTORS and VECTORS[t].is_float)


F32_MAX = float.fromhex("0x1.fffffep+127")  # the largest finite f32


def fits(value: int | float, t: str) -> bool:
    """Whether a compile-time value can be written as a constant of scalar type `t`: an integer in
    the signed or unsigned range of its width (wasm integers carry no sign), an f32 no larger than
    the largest finite f32 (infinities and NaNs are written as such)."""
    if is_int(t):
        bits = 64 if t == "i64" else 32
        return isinstance(value, int) and -(1 << (bits - 1)) <= value < (1 << bits)
    return t != "f32" or not abs(value) < float("inf") or abs(value) <= F32_MAX


def wasm_type(t: str) -> str:
    """The wasm value type that holds a value of type t."""
    return "v128" if t in VECTORS else t


def mask_type(t: str) -> str:
    """The type of a lane-wise comparison's result: an all-ones/all-zeros lane mask of the same width."""
    v = VECTORS[t]
    return {"i8": "i8x16", "i16": "i16x8", "i32": "i32x4", "f32": "i32x4"}.get(v.lane, t)
