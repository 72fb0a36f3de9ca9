"""Pinned bits: qmatvec and qdot outputs of the library as they were before the mat-vec work of
issue 12 (activation layouts, row groups, packed layouts), as sha256 digests of the f32 results.
Relaxed SIMD re-pinned once by issue 13.3 (full int8 activations: its quantized activations and
integer dots are simd128's since; its float steps are relaxed madds). SIMD128 re-pinned once by
issue 12's split activations (idot without sign-extends): a leftover block's (qstep1) four i32
lanes, each converted to f32 on its own, now hold values 4j..4j+3 of each half (as the relaxed
dot's lanes do) instead of 2j, 2j+1, 2j+8, 2j+9; the four-block steps' whole-block dots are unchanged,
so a row of a multiple of 4 x accs blocks gives the same bits as before. Relaxed SIMD's i7 types
(Q4_0, Q4_1, q4_onnx here) re-pinned once more by issue 12's grouped layout: a row's float sum
takes its blocks in order (acc = madd(f32(dot), scale * d_a, acc), `accs` accumulators taking
turns), where the rows layout sums four lanes of block j mod 4 and folds them at the end.

The summation order per row is part of the contract (DESIGN: results bit-identical across
variants, layouts, threads and hosts); these digests catch any change of it, on both targets,
whatever wasmtime's relaxed_simd_deterministic says and whatever `rows` variant is built.
The inputs are arithmetic (no random generator whose stream could change between numpy versions).
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

ROWS, NB = 13, 17  # 13 rows: groups of 2 and 4 leave remainders; 17 blocks: 4-block steps leave one

# (target, quant) -> sha256 of qmatvec's y (13 f32) followed by qdot of row 0 (one f32).
PINNED = {
    ("simd128", "q8_0"): "861ddaae1c0202ac",
    ("simd128", "q4_0"): "7c5fbc8e7df173d0",
    ("simd128", "q4_1"): "78b5af0ff8328e3d",
    ("simd128", "q4_onnx"): "0ce9b185f3770476",
    ("relaxed-simd", "q8_0"): "22299afed8178435",
    ("relaxed-simd", "q4_0"): "538ba8b912f62c56",
    ("relaxed-simd", "q4_1"): "95471260c9b690fd",
    ("relaxed-simd", "q4_onnx"): "0a6b716ab3abb3b6",
}


def _stream(n: int, salt: int) -> np.ndarray:
    """n well-mixed bytes from a multiplicative hash of the index."""
    i = np.arange(n, dtype=np.uint64) + np.uint64(salt)
    return ((i * np.uint64(2654435761) + np.uint64(12345)) >> np.uint64(11)).astype(np.uint8)


def _blocks(k, quant: str) -> np.ndarray:
    q = k.quants[quant]
    blocks = _stream(ROWS * NB * q.stored_bytes, len(quant)).reshape(ROWS, -1).view(q.dtype).copy()
    for name in q.dtype.names:
        kind = q.dtype[name].base
        if kind.kind == "f":  # scales and minima: finite, mixed signs and magnitudes
            vals = (np.arange(blocks.size) % 23 - 11) * 0.0037 + 0.001
            blocks[name] = vals.reshape(blocks.shape).astype(kind)
        elif name == "z":  # zero points: 4-bit, as the format stores them
            blocks[name] = blocks[name] % 16
    return blocks


def _digest(k, quant: str) -> str:
    x = (np.sin(np.arange(NB * 32) * 0.37) * 3.0 + np.cos(np.arange(NB * 32) * 0.011)).astype(np.float32)
    act = k.quantize_act(x)
    w = k.pack(quant, _blocks(k, quant))
    y = k.qmatvec(w, act)
    d = k.qdot(k.pack(quant, _blocks(k, quant)[:1]), act)
    return hashlib.sha256(y.tobytes() + np.float32(d).tobytes()).hexdigest()[:16]


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("quant", ["q8_0", "q4_0", "q4_1", "q4_onnx"])
def test_qmatvec_bits_are_pinned(mode, kgen, quant, rows):
    k = kgen(tune={"qmatvec": {"rows": rows}})
    assert _digest(k, quant) == PINNED[(mode.target, quant)]
