"""Helpers shared by the kernel test files (test_kernels.py, test_library.py).

Imported as `from helpers import ...`: tests/ has no __init__.py, so pytest's default ("prepend")
import mode puts tests/ on sys.path for the test modules, as it does for conftest.py. pytest does not
rewrite the asserts of this module (it is not a test file), so every assert here carries its own message.
"""
from __future__ import annotations

import zlib
from typing import Any, Callable, Iterable

import numpy as np

from kernelgen.host.api import Act, Kernels

from conftest import Mode

ROW_TUNES = (1, 2, 4)  # qmatvec's `rows` tune domain


def rng_for(*key: Any) -> np.random.Generator:
    """A generator with a fixed seed derived from `key` (stable across runs and processes)."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def consts(k: Kernels) -> tuple[int, int]:
    """The module's (ACT_ZERO, ACT_MAX) target constants."""
    c = k.manifest["constants"]
    return c["ACT_ZERO"], c["ACT_MAX"]


def act_dtype(k: Kernels) -> type:
    """The dtype of the module's activation bytes: int8 (ACT_ZERO = 0) or uint8 (stored with an offset)."""
    return np.int8 if consts(k)[0] == 0 else np.uint8


def rows_tune(rows: int) -> dict:
    return {"qmatvec": {"rows": rows}}


def bits_of(a: np.ndarray) -> np.ndarray:
    """The raw bit patterns of a float16/32/64 array, as unsigned integers of the same width."""
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_bitwise_equal(a: Any, b: Any, what: str) -> None:
    """Bit-identical results: dtype and shape must match; floats compare bit patterns except that
    any NaN matches any NaN (payloads are unspecified, NaN positions must match); integer and bool
    arrays compare exactly; lists/tuples element by element; Act compares q and d."""
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{what}[{i}]")
        return
    if isinstance(a, Act):
        assert_bitwise_equal(a.q, b.q, f"{what}.q")
        assert_bitwise_equal(a.d, b.d, f"{what}.d")
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
        act = Act(q=a, d=np.ones(a.size // 32, np.float32))
        out.append(m.qmatvec(packed, act))
        out.append(np.array([m.qdot(p, act) for p in singles], np.float32))
    return out


def assert_q_close(y: np.ndarray, ref: np.ndarray, mag: np.ndarray, what: str) -> None:
    # f32 accumulation of per-block f32 terms: |y - ref| <= 1e-5 * (sum of |terms|) + 1e-30
    err = np.abs(y.astype(np.float64) - ref)
    bad = ~(err <= 1e-5 * mag + 1e-30)
    assert not bad.any(), f"{what}: rows {np.flatnonzero(bad)[:8]} got {y[bad][:4]} ref {ref[bad][:4]}"
