"""Where a built module's bytes go, as data: each function body's bytes (its code section entry),
summed by quant type and by kernel, and the whole module raw and compressed as a page downloads it
(gzip level 9, brotli quality 11). `kernelgen build --sizes` prints the table; `kernelgen bench`
reports its totals as figures (`figures`), with the goals on them.

A function belongs to a quant type when its name (names.variant_name) ends in one: every instance
of a kernel generic over quant types, exports, pool jobs and internal kernels alike. Its kernel is
the name without the quant type, tune values and compile-time integers kept (`qtile__m2_n2_a2`):
one row per variant, summed over the quant types.
"""
from __future__ import annotations

import gzip
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import brotli

from ..names import parse_variant

if TYPE_CHECKING:  # the build imports this module to keep its byte budget
    from ..compiler.build import Built

QUANT_CODE, OTHER_CODE = "wasm code of quant-type kernels", "wasm code of the rest"
WASM, GZIP, BROTLI = "wasm size", "wasm size, gzip -9", "wasm size, brotli -q 11"


def quant_code(quant: str) -> str:
    """The figure of one quant type's function bodies."""
    return f"wasm code of {quant}"


def _leb(b: bytes, i: int) -> tuple[int, int]:
    """An unsigned LEB128 at b[i]: (value, index past it)."""
    value = shift = 0
    while True:
        x = b[i]
        value, shift, i = value | (x & 0x7F) << shift, shift + 7, i + 1
        if x < 0x80:
            return value, i


def code_sizes(built: Built) -> dict[str, int]:
    """Bytes of each defined function of `built`'s wasm (code section entries, their size prefix
    included), by the name the WAT gives it: the WAT lists functions in index order."""
    names = re.findall(r"^  \(func \$(\S+)", built.wat, re.M)
    wasm, i, sizes = built.wasm, 8, []
    while i < len(wasm):
        section, (size, j) = wasm[i], _leb(wasm, i + 1)
        if section == 10:  # the code section: a count, then each body's size and bytes
            count, k = _leb(wasm, j)
            for _ in range(count):
                body, at = _leb(wasm, k)
                sizes.append(at - k + body)
                k = at + body
        i = j + size
    if len(sizes) != len(names):
        raise ValueError(f"{built.target}: {len(sizes)} function bodies but {len(names)} functions in the WAT")
    return dict(zip(names, sizes))


def quant_of(function: str, quants: Iterable[str]) -> str | None:
    """The quant type a function's code belongs to (its base name ends in one), or None."""
    base = parse_variant(function).base
    return next((q for q in quants if base.endswith(f"_{q}")), None)


def by_quant(functions: dict[str, int], quants: tuple[str, ...]) -> dict[str | None, int]:
    """Function-body bytes (code_sizes) per quant type, None for the functions of none, in the
    order of `quants`: the byte budget's costs and the bench's figures."""
    out: dict[str | None, int] = {q: 0 for q in (*quants, None)}
    for name, size in functions.items():
        out[quant_of(name, quants)] += size
    return out


@dataclass(frozen=True)
class Sizes:
    """One target's module: its bytes raw and compressed, and each function body's bytes."""

    target: str
    wasm: int
    gzip: int
    brotli: int
    functions: dict[str, int]
    quants: tuple[str, ...]  # the manifest's quant types, in declaration order

    def split(self, name: str) -> tuple[str, str | None]:
        """(kernel, quant type or None) of a function: `qtile_q8_0__m2_n2_a2` -> (`qtile__m2_n2_a2`, `q8_0`)."""
        base = parse_variant(name).base
        quant = quant_of(name, self.quants)
        kernel = base.removesuffix(f"_{quant}") if quant else base
        params = name.partition("__")[2]
        return (f"{kernel}__{params}" if params else kernel), quant

    def by_quant(self) -> dict[str | None, int]:
        """Function-body bytes per quant type (None: the functions of no quant type), in declaration order."""
        return by_quant(self.functions, self.quants)

    def by_kernel(self) -> dict[str, int]:
        """Function-body bytes per kernel variant over all quant types, largest first."""
        out: dict[str, int] = {}
        for name, size in self.functions.items():
            kernel = self.split(name)[0]
            out[kernel] = out.get(kernel, 0) + size
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def figures(self) -> dict[str, int]:
        """The bench's figures of this module, by name."""
        q = self.by_quant()
        other = q.pop(None)
        return {WASM: self.wasm, GZIP: self.gzip, BROTLI: self.brotli, QUANT_CODE: sum(q.values()),
                OTHER_CODE: other, **{quant_code(name): size for name, size in q.items()}}


def sizes(built: Built) -> Sizes:
    return Sizes(built.target, len(built.wasm), len(gzip.compress(built.wasm, 9, mtime=0)),
                 len(brotli.compress(built.wasm, quality=11)), code_sizes(built), tuple(built.manifest["quants"]))


def format_sizes(s: Sizes, top: int = 12) -> str:
    """The table `kernelgen build --sizes` prints for one target: totals, each quant type, the
    `top` largest kernels."""
    f = s.figures()
    lines = [f"{s.target}: {s.wasm} bytes of wasm ({s.gzip} gzip -9, {s.brotli} brotli -q 11); function bodies:"
             f" {f[QUANT_CODE]} in quant-type kernels, {f[OTHER_CODE]} the rest",
             "  by quant type: " + ", ".join(f"{q} {n}" for q, n in s.by_quant().items() if q is not None),
             "  largest kernels (over all quant types): "
             + ", ".join(f"{k} {n}" for k, n in list(s.by_kernel().items())[:top])]
    return "\n".join(lines)
