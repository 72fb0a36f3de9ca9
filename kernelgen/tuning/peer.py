"""The bench's peer: a seed-style hand-written Q8_0 mat-vec (seed_qmatvec.wat), run on a kernel
module's own shared memory so that it reads the very planes kernelgen packed.

It is verified against numpy before it is timed (a peer that computes something else would make
every ratio against it meaningless).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import wasmtime

from ..host.api import Kernels, Packed
from ..reference import quantize_act

WAT = Path(__file__).with_name("seed_qmatvec.wat")


def wasm() -> bytes:
    """The peer assembled (wasmtime's own WAT parser: it is plain SIMD128)."""
    return wasmtime.wat2wasm(WAT.read_text(encoding="utf-8"))


@dataclass
class SeedPeer:
    """The peer instantiated on `k`'s memory; `prepare` lays out one mat-vec's inputs."""

    k: Kernels
    exports: dict

    @classmethod
    def on(cls, k: Kernels) -> SeedPeer:
        module = wasmtime.Module(k.module.engine, wasm())
        instance = wasmtime.Instance(k.module.store, module, [k.module.memory])
        return cls(k, dict(instance.exports(k.module.store)))

    def prepare(self, w: Packed, x: np.ndarray) -> tuple[list[int], np.ndarray]:
        """Arguments (wq, ws, aq, ad, xw, y, n, k) for q8_0 weights `w` and activations x, and the
        numpy reference of y: the peer quantizes as simd128's quantize_act does (int8, +-127)."""
        if w.quant != "q8_0":
            raise ValueError(f"the seed-style peer runs q8_0 only, got {w.quant}")
        q, d = quantize_act(x, 127, 0)
        m = self.k.module
        args = [w.planes["q"], w.planes["scale"], m.put(q.astype(np.int8)), m.put(d), m.alloc(2 * w.k),
                m.alloc(4 * w.rows), w.rows, w.k]
        wq = m.view(w.planes["q"], np.int8, w.rows * w.k).reshape(w.rows, -1, 32).astype(np.int64)
        ws = m.view(w.planes["scale"], np.float32, w.rows * w.k // 32).reshape(w.rows, -1)
        dots = (wq * q.astype(np.int64).reshape(1, -1, 32)).sum(axis=-1)
        return args, (dots * ws.astype(np.float64) * d.astype(np.float64)).sum(axis=-1)

    def check(self, args: list[int], ref: np.ndarray) -> None:
        """One call checked against the float64 reference (f32 accumulation: 1e-5 of the largest)."""
        self.exports["seed_qmatvec"](self.k.module.store, *args)
        y = self.k.module.get(args[5], np.float32, args[6])
        err = np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30)
        if not err < 1e-5:
            raise AssertionError(f"seed-style peer differs from numpy: max relative error {err:.2e}")

    def repeat(self, args: list[int]) -> Callable[[int], None]:
        """`reps -> None` running the peer reps times inside wasm, for timing.measure."""
        return lambda reps: self.exports["seed_qmatvec_repeat"](self.k.module.store, reps, *args)
