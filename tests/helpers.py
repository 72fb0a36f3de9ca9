"""Helpers shared by the test files (kernels, JS runtime, MiniLM).

Imported as `from helpers import ...`: tests/ has no __init__.py, so pytest's default ("prepend")
import mode puts tests/ on sys.path for the test modules, as it does for conftest.py. pytest does not
rewrite the asserts of this module (it is not a test file), so every assert here carries its own message.
"""
from __future__ import annotations

import os
import shutil
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import pytest

from kernelgen.host.api import Act, Kernels

from conftest import Mode

ROW_TUNES = (1, 2, 4)  # qmatvec's `rows` tune domain
NODE = shutil.which("node")
CHROMIUM = Path("/usr/bin/chromium")  # Debian's (.ci/run installs it), never a downloaded browser
# Node 20 runs relaxed SIMD only behind a flag, and its baseline compiler (Liftoff) gets
# i32x4.relaxed_dot_i8x16_i7x16_add_s wrong (runtime/features.mjs probes it): compile with TurboFan.
NODE_FLAGS = ("--experimental-wasm-relaxed-simd", "--no-liftoff")

# A kernel the library does not have, added to it in a test's own DSL: its one `parallel`
# declaration is all it takes to run threaded from Python (test_pool.py) and Node (test_js.py).
# Items are pairs of values, so the item count is an expression the hosts evaluate, and its f32
# argument travels as a JOB_ARGS word.
SQUARE_ADD = """
# y = x * x + c over n values.
export kernel square_add(x: ptr, y: ptr, n: i32, c: f32) {
    parallel pairs p0..p1 in 0..(n + 1) / 2;
    for i in 2 * p0..min(2 * p1, n) {
        f32.store(y + i * 4, f32.load(x + i * 4) * f32.load(x + i * 4) + c);
    }
}
"""


def square_add_inputs(n: int = 1001) -> tuple[np.ndarray, float, np.ndarray]:
    """x, c and numpy's y = x * x + c in float32 (the kernel rounds as numpy does: no fused op)."""
    x = rng_for("square_add", n).standard_normal(n).astype(np.float32)
    c = float(np.float32(0.3))
    return x, c, x * x + np.float32(c)


def need(ok: object, reason: str) -> None:
    """Skip the test unless `ok`, except under CI (the CI variable set), where .ci/run installs every
    prerequisite and a skip would hide a failure."""
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI must have it: .ci/run installs it)")
        pytest.skip(reason)


def rng_for(*key: Any) -> np.random.Generator:
    """A generator with a fixed seed derived from `key` (stable across runs and processes)."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def consts(k: Kernels) -> tuple[int, int]:
    """The module's (ACT_ZERO, ACT_MAX) target constants."""
    c = k.manifest["constants"]
    return c["ACT_ZERO"], c["ACT_MAX"]


def act_dtype(k: Kernels) -> np.dtype:
    """The dtype of the module's stored activations: int16 on simd128 (int8 values widened once for
    its i16 dot, ACT_BYTES = 2), uint8 where stored with an offset (relaxed SIMD)."""
    c = k.manifest["constants"]
    return np.dtype({(0, 2): np.int16, (0, 1): np.int8, (64, 1): np.uint8}[c["ACT_ZERO"], c["ACT_BYTES"]])


def rows_tune(rows: int) -> dict:
    return {"qmatvec": {"rows": rows}}


def bits_of(a: np.ndarray) -> np.ndarray:
    """The raw bit patterns of a float16/32/64 array, as unsigned integers of the same width."""
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_bitwise_equal(a: Any, b: Any, what: str) -> None:
    """Bit-identical results: dtype and shape must match; floats compare bit patterns except that
    any NaN matches any NaN (payloads are unspecified, NaN positions must match); integer and bool
    arrays compare exactly; lists/tuples element by element; Act compares q, d and s."""
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{what}[{i}]")
        return
    if isinstance(a, Act):
        assert_bitwise_equal(a.q, b.q, f"{what}.q")
        assert_bitwise_equal(a.d, b.d, f"{what}.d")
        assert_bitwise_equal(a.s, b.s, f"{what}.s")
        return
    a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    if a.dtype.kind in "iub":
        np.testing.assert_array_equal(a, b, err_msg=what)
        return
    nan = np.isnan(a)
    np.testing.assert_array_equal(nan, np.isnan(b), err_msg=f"{what}: NaN positions differ")
    np.testing.assert_array_equal(bits_of(a[~nan]), bits_of(b[~nan]), err_msg=f"{what}: bits differ")


def same_as_deterministic(mode: Mode, kgen: Callable[..., Kernels], tune: dict | None,
                          run: Callable[[Kernels], Any], got: Any) -> None:
    """In the relaxed non-deterministic mode, rerun on the deterministic module: bit-identical."""
    if mode.relaxed_nondet:
        assert_bitwise_equal(got, run(kgen(tune, deterministic=True)), "relaxed det vs nondet")


def unit_scale_qmatvec_and_qdots(m: Kernels, quant: str, blocks: np.ndarray, acts: Iterable[np.ndarray]
                                  ) -> list[np.ndarray]:
    """For each activation byte array in `acts` (all scales 1): qmatvec over all rows of `blocks`, then
    qdot of each row packed alone (as a float32 array), appended in that order."""
    packed = m.pack(quant, blocks)
    singles = [m.pack(quant, blocks[r:r + 1]) for r in range(blocks.shape[0])]
    out = []
    for a in acts:
        act = m.act_from_values(a, np.ones(a.size // 32, np.float32))
        out.append(m.qmatvec(packed, act))
        out.append(np.array([m.qdot(p, act) for p in singles], np.float32))
    return out


def assert_q_close(y: np.ndarray, ref: np.ndarray, mag: np.ndarray, what: str) -> None:
    # f32 accumulation of per-block f32 terms: |y - ref| <= 1e-5 * (sum of |terms|) + 1e-30
    err = np.abs(y.astype(np.float64) - ref)
    bad = ~(err <= 1e-5 * mag + 1e-30)
    assert not bad.any(), f"{what}: rows {np.flatnonzero(bad)[:8]} got {y[bad][:4]} ref {ref[bad][:4]}"


def random_blocks(q: Any, rows: int, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, n_blocks) blocks of any declared quant type `q` (a QuantFormat), made from its declaration
    alone: random stored bytes, every float field a finite value of either sign, and blocks whose
    values fall outside the kernels' int8 weights or whose zero point is past 127 (say a zero
    point past its format's range) or
    whose derived scale or offset exceeds 1 in magnitude (say an e8m0 exponent byte: products
    would overflow f32) drawn again. So a test covering every quant type needs no code per type."""
    def draw(count: int) -> np.ndarray:
        b = rng.integers(0, 256, (count, q.stored_bytes), dtype=np.uint8).view(q.dtype).reshape(count)
        for name in q.dtype.names:
            if q.dtype[name].kind == "f":
                b[name] = rng.uniform(-0.05, 0.05, b[name].shape).astype(q.dtype[name].base)
        return b

    blocks = draw(rows * n_blocks)
    for _ in range(64):
        v = q.unpack_ref(blocks.reshape(-1, 1)).reshape(blocks.size, -1)
        big = (np.abs(q.scale_ref(blocks)) > 1) | (np.abs(q.offset_ref(blocks)) > 1)  # per sub-block
        bad = (v < -128).any(axis=1) | (v > 127).any(axis=1) | big.reshape(blocks.size, -1).any(axis=1)
        if q.codes is not None and q.codes[1].kind == "field":  # a zero point pack refuses (QuantFormat.codes)
            bad |= blocks[q.codes[1].field].astype(np.int32) > 127
        bad = np.flatnonzero(bad)
        if not bad.size:
            return blocks.reshape(rows, n_blocks)
        blocks[bad] = draw(bad.size)
    raise AssertionError(f"{q.name}: random bytes almost never make a valid block; give the test its own data")
