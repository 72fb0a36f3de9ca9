"""The f32 kernels (dot_f32, matvec_f32) and the module cache and manifests they are built into,
compiled for simd128 and relaxed SIMD and run under wasmtime, against float64 numpy.

Every kernel test runs in three modes (see conftest.py): simd128, relaxed SIMD with wasmtime's
relaxed_simd_deterministic on, and off. In the "off" mode each test also reruns the same work on
the deterministic module and requires bit-identical outputs.
"""
from __future__ import annotations

import numpy as np
import pytest

from kernelgen.host.api import Kernels

from conftest import TARGETS
from helpers import assert_bitwise_equal, rng_for, rows_tune, same_as_deterministic

UNROLLS = (1, 2, 4)
F32_N = (0, 1, 3, 4, 7, 8, 31, 32, 33, 100, 257)
F32_ROWS = (1, 2, 3, 5, 7)


# ---- helpers -----------------------------------------------------------------------------------


def f32_tune(unroll: int) -> dict:
    return {"dot_f32": {"unroll": unroll}, "matvec_f32": {"unroll": unroll}}


def dot64(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """float64 x . y and sum |x*y|."""
    with np.errstate(all="ignore"):
        p = x.astype(np.float64) * y.astype(np.float64)
        return float(p.sum()), float(np.abs(p).sum())


def assert_f32_close(got: float, ref: float, mag: float, what: str) -> None:
    # f32 accumulation error bound: for n <= 257 a result goes through at most ~70 f32 roundings
    # (products, n / 4 lane adds, hsum, scalar tail), each off by <= 2^-24 of a partial sum that is
    # itself <= sum |x*y|: |got - ref| <= 70 * 2^-24 * sum |x*y| < 1e-5 * sum |x*y|. The + 1e-30
    # only admits denormal noise when sum |x*y| == 0. inf/NaN must match float64 exactly.
    if np.isnan(ref):
        assert np.isnan(got), f"{what}: expected NaN, got {got}"
    elif np.isinf(ref):
        assert got == ref, f"{what}: expected {ref}, got {got}"
    else:
        assert abs(got - ref) <= 1e-5 * mag + 1e-30, f"{what}: got {got!r}, ref {ref!r} (sum|xy| {mag})"


# ---- modules and manifests ---------------------------------------------------------------------


def test_module_cache_compiles_each_key_once(module_cache):
    a = module_cache.get("simd128", False, rows_tune(2))
    assert module_cache.get("simd128", False, {"qmatvec": {"rows": 2}}) is a
    assert module_cache.get("simd128", False, None) is not a
    assert module_cache.get("relaxed-simd", False) is not module_cache.get("relaxed-simd", True)


@pytest.mark.parametrize("target", TARGETS)
def test_manifest_constants(module_cache, target):
    k = module_cache.get(target)
    assert k.target == target
    simd128 = target == "simd128"
    assert k.manifest["constants"] == {"ACT_ZERO": 0, "ACT_MAX": 127, "ACT_BYTES": 2 if simd128 else 1,
                                       "ACT_SPLIT": int(simd128), "DOT_SHIFT": 8 if simd128 else 0, "DOT_ADD": 0}
    assert k.manifest["activation"]["dtype"] == ("int16" if simd128 else "int8")
    assert k.manifest["activation"]["split"] is simd128
    assert k.manifest["activation"]["sums"] == "int32"
    assert "q8_0" in k.quants


@pytest.mark.parametrize("value", (1, 2, 4))
@pytest.mark.parametrize("target", TARGETS)
def test_tune_selects_exported_variant(module_cache, target, value):
    k = module_cache.get(target, True, f32_tune(value))
    assert k.export_name("dot_f32") == f"dot_f32__unroll{value}"
    assert k.export_name("matvec_f32") == f"matvec_f32__unroll{value}"
    k = module_cache.get(target, True, rows_tune(value))
    assert k.export_name("qmatvec", "q8_0") == f"qmatvec_q8_0__rows{value}_accs1"
    assert k.tune_of("qmatvec", "q8_0") == {"rows": value, "accs": 1}


# ---- f32 dot and mat-vec -----------------------------------------------------------------------


@pytest.mark.parametrize("n", F32_N, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("unroll", UNROLLS, ids=lambda u: f"unroll{u}")
def test_dot_f32_matches_float64(mode, kgen, unroll, n):
    tune = f32_tune(unroll)
    assert kgen(tune).tune_of("dot_f32") == {"unroll": unroll}
    rng = rng_for("dot", n)
    x = rng.standard_normal(n).astype(np.float32)
    y = (rng.standard_normal(n) * 10).astype(np.float32)

    def run(k: Kernels) -> float:
        return k.dot_f32(x, y)

    got = run(kgen(tune))
    ref, mag = dot64(x, y)
    assert_f32_close(got, ref, mag, f"dot_f32 n={n}")
    if n == 0:
        assert got == 0.0
    same_as_deterministic(mode, kgen, tune, run, got)


@pytest.mark.parametrize("n", F32_N, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("unroll", UNROLLS, ids=lambda u: f"unroll{u}")
def test_matvec_f32_matches_float64(mode, kgen, unroll, n):
    tune = f32_tune(unroll)
    assert kgen(tune).tune_of("matvec_f32") == {"unroll": unroll}
    rng = rng_for("matvec", n)
    cases = [(rng.standard_normal((rows, n)).astype(np.float32), rng.standard_normal(n).astype(np.float32))
             for rows in F32_ROWS]

    def run(k: Kernels) -> list[np.ndarray]:
        return [k.matvec_f32(w, x) for w, x in cases]

    outs = run(kgen(tune))
    for (w, x), y in zip(cases, outs):
        assert y.shape == (w.shape[0],) and y.dtype == np.float32
        for r in range(w.shape[0]):
            ref, mag = dot64(w[r], x)
            assert_f32_close(float(y[r]), ref, mag, f"matvec_f32 rows={w.shape[0]} k={n} row {r}")
    same_as_deterministic(mode, kgen, tune, run, outs)


N_SPECIAL = 37  # 32 in the vector body for every unroll, 5 in the scalar tail

F32_SPECIALS = {
    # name: list of (index, x value, y value)
    "nan_in_body": [(3, np.nan, 1.0)],
    "nan_in_tail": [(N_SPECIAL - 1, 1.0, np.nan)],
    "inf_in_body": [(5, np.inf, 2.0)],
    "neg_inf_in_tail": [(N_SPECIAL - 2, 1.5, -np.inf)],
    "inf_in_body_and_tail": [(0, np.inf, 1.0), (34, 2.0, np.inf)],
    "inf_times_zero": [(1, np.inf, 0.0)],
    "inf_minus_inf_across_lanes": [(0, np.inf, 1.0), (6, np.inf, -1.0)],
    "inf_minus_inf_body_tail": [(17, -np.inf, 1.0), (35, np.inf, 1.0)],
}


def special_vectors(name: str) -> tuple[np.ndarray, np.ndarray]:
    rng = rng_for("special", name)
    x = rng.standard_normal(N_SPECIAL).astype(np.float32)
    y = rng.standard_normal(N_SPECIAL).astype(np.float32)
    for i, a, b in F32_SPECIALS[name]:
        x[i], y[i] = a, b
    return x, y


@pytest.mark.parametrize("name", sorted(F32_SPECIALS))
@pytest.mark.parametrize("unroll", UNROLLS, ids=lambda u: f"unroll{u}")
def test_dot_f32_inf_and_nan_like_float64(mode, kgen, unroll, name):
    tune = f32_tune(unroll)
    x, y = special_vectors(name)
    ref, _ = dot64(x, y)
    assert not np.isfinite(ref)

    def run(k: Kernels) -> float:
        return k.dot_f32(x, y)

    got = run(kgen(tune))
    assert_f32_close(got, ref, np.inf, f"dot_f32 {name}")
    same_as_deterministic(mode, kgen, tune, run, got)


@pytest.mark.parametrize("unroll", UNROLLS, ids=lambda u: f"unroll{u}")
def test_matvec_f32_inf_and_nan_rows_stay_independent(mode, kgen, unroll):
    tune = f32_tune(unroll)
    rng = rng_for("matvec-special")
    x = rng.standard_normal(N_SPECIAL).astype(np.float32)
    x[0] = x[6] = 1.0
    x[10] = 0.0
    w = rng.standard_normal((9, N_SPECIAL)).astype(np.float32)
    w[1, 3] = np.nan                     # NaN in the vector body
    w[2, 36] = np.nan                    # NaN in the scalar tail
    w[3, 5] = np.inf                     # inf in the body
    w[4, 35] = -np.inf                   # -inf in the tail
    w[5, 10] = np.inf                    # inf * 0 -> NaN
    w[6, 0], w[6, 6] = np.inf, -np.inf   # inf - inf across lanes -> NaN
    w[7, 1], w[7, 33] = np.inf, np.inf   # same-sign infs in body and tail
    w[7, 1] *= np.sign(x[1])
    w[7, 33] *= np.sign(x[33])           # rows 0 and 8 stay finite
    x_inf = x.copy()
    x_inf[34] = np.inf                   # an inf in x: every row is inf or NaN as in float64

    def run(k: Kernels) -> list[np.ndarray]:
        return [k.matvec_f32(w, x), k.matvec_f32(w, x_inf)]

    outs = run(kgen(tune))
    for xv, got in zip((x, x_inf), outs):
        for r in range(w.shape[0]):
            ref, mag = dot64(w[r], xv)
            assert_f32_close(float(got[r]), ref, mag, f"matvec_f32 row {r}")
    assert np.isfinite(outs[0][[0, 8]]).all() and not np.isfinite(outs[0][1:8]).any()
    same_as_deterministic(mode, kgen, tune, run, outs)


def test_f32_kernels_deterministic_on_off_identical(any_module):
    rng = rng_for("f32-det")
    for unroll in UNROLLS:
        tune = f32_tune(unroll)
        on, off = any_module("relaxed-simd", True, tune), any_module("relaxed-simd", False, tune)
        for n in (7, 100, 257, 1000):
            x = rng.standard_normal(n).astype(np.float32)
            y = rng.standard_normal(n).astype(np.float32)
            w = rng.standard_normal((5, n)).astype(np.float32)
            assert_bitwise_equal(on.dot_f32(x, y), off.dot_f32(x, y), f"dot_f32 n={n} unroll={unroll}")
            assert_bitwise_equal(on.matvec_f32(w, x), off.matvec_f32(w, x), f"matvec_f32 n={n} unroll={unroll}")


def test_f32_wrong_inputs(kernels):
    x = np.ones(8, np.float32)
    with pytest.raises(TypeError):
        kernels.dot_f32(x.astype(np.float64), x)
    with pytest.raises(TypeError):
        kernels.dot_f32([1.0, 2.0], x)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        kernels.dot_f32(x, np.ones(9, np.float32))
    with pytest.raises(ValueError):
        kernels.dot_f32(x.reshape(2, 4), x.reshape(2, 4))
    with pytest.raises(ValueError):
        kernels.matvec_f32(np.ones((2, 7), np.float32), x)
    with pytest.raises(ValueError):
        kernels.matvec_f32(x, x)
    assert kernels.dot_f32(x, x) == 8.0


