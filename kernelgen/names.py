"""Variant names: an exported function's name says its kernel, quant type and tune values, and
parses back (XNNPACK's practice): `qmatvec_q8_0__rows4`, `dot_f32__unroll2`.

Shape before the double underscore, parameters after, each a lowercase name and its value.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

TUNE_NAME = re.compile(r"[a-z]+")
_PARAM = re.compile(r"([a-z]+)(-?\d+)")


@dataclass(frozen=True)
class Variant:
    base: str  # kernel name, with `_<quant>` for quant-generic kernels
    tune: dict[str, int]


def variant_name(kernel: str, quant: str | None, tune: dict[str, int]) -> str:
    base = f"{kernel}_{quant}" if quant else kernel
    if not tune:
        return base
    return base + "__" + "_".join(f"{k}{v}" for k, v in tune.items())


def parse_variant(name: str) -> Variant:
    """The inverse of variant_name (the base keeps kernel and quant joined)."""
    base, sep, params = name.partition("__")
    tune: dict[str, int] = {}
    if sep:
        for part in params.split("_"):
            m = _PARAM.fullmatch(part)
            if not m:
                raise ValueError(f"{name!r}: {part!r} is not a tune parameter (name then value)")
            tune[m.group(1)] = int(m.group(2))
    return Variant(base, tune)
