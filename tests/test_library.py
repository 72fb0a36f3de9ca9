"""The math and LLM-layer kernels of kernels.dsl against numpy: exp/softmax/SiLU/SwiGLU (f32), sin/cos/
exp/log (f64), RoPE tables and rotation, and the 4-bit quant types (q4_0, q4_1, q4_onnx) with their
references and quantized mat-vec kernels.

Every kernel test runs in the three modes of conftest.py (simd128; relaxed SIMD with wasmtime's
relaxed_simd_deterministic on and off). In the relaxed "off" mode each test reruns the same work on
the deterministic module and requires bit-identical outputs (NaN payloads aside).

Raw calls (Kernels.call on buffers we lay out ourselves) surround the data with canaries: float
patterns and NaN bit patterns (quiet, signalling, negative, with payloads) that must come back
bit for bit, so a write past the valid elements is caught even when it stores "the same" float
(arithmetic would quiet the signalling NaN). A bit-exact read-modify-write of a whole vector is
invisible to canaries: test_softmax_unpadded_rows_stay_inside_the_buffer puts the buffer at the
very end of memory instead, where touching the bytes after it traps.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kernelgen import reference
from kernelgen.host import formats
from kernelgen.host.api import Act, Kernels, padded_rows

from helpers import (ROW_TUNES, act_dtype, assert_bitwise_equal, assert_q_close, bits_of, consts, rng_for, rows_tune,
                     random_blocks, same_as_deterministic, unit_scale_qmatvec_and_qdots)

Q4_TYPES = ("q4_0", "q4_1", "q4_onnx")
FLT_MAX = float(np.finfo(np.float32).max)

# 12345.0, quiet NaN with a payload, signalling NaN, negative NaN with a payload, -0.0, the smallest
# subnormal, +inf, -12345.0: none of them may change, bit for bit.
CANARY = np.array([0x4640E400, 0x7FC01234, 0x7F800001, 0xFFBADBAD,
                   0x80000000, 0x00000001, 0x7F800000, 0xC640E400], np.uint32)
assert CANARY[0].view(np.float32) == 12345.0 and CANARY[7].view(np.float32) == -12345.0


# ---- helpers -----------------------------------------------------------------------------------


def canaries(n: int) -> np.ndarray:
    return np.resize(CANARY, n)


def f32_ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in float32 ulps (units in the last place) between float32 arrays, counting through
    zero across a sign change: bit patterns mapped to a monotone integer line (+0 and -0 both 0)."""
    def ordered(x: np.ndarray) -> np.ndarray:
        i = np.ascontiguousarray(x, np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    return np.abs(ordered(a) - ordered(b))


def f64_ulps(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """|got - ref| in units of np.spacing(ref) (the float64 ulp at the reference); inf where either
    is not finite unless both are the same inf or both NaN (then 0)."""
    with np.errstate(all="ignore"):
        u = np.abs(got - ref) / np.spacing(np.abs(ref))
    same = (got == ref) | (np.isnan(got) & np.isnan(ref))
    u = np.where(same, 0.0, u)
    return np.where(np.isfinite(u), u, np.inf)


def raw_elementwise(k: Kernels, kernel: str, inputs: list[np.ndarray], in_place: bool = False
                    ) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Call `kernel(in..., y, n)` on buffers laid out by hand: every input is followed by 8 canary
    words (the kernels read a partial last vector whole, so its dead lanes hold NaNs), and y (a fresh
    buffer of sentinels, or the first input when `in_place`) too. Returns y[:n] as float32, the 8
    words after y[n - 1], and every input buffer (n + 8 words) as it is after the call."""
    n = inputs[0].size
    m = k.module
    with m.scope():
        ptrs = [m.put(np.concatenate([a.view(np.uint32), canaries(8)])) for a in inputs]
        if in_place:
            py = ptrs[0]
        else:
            sentinel = np.full(n, np.float32(-777.0)).view(np.uint32)
            py = m.put(np.concatenate([sentinel, canaries(8)]))
        k.call(k.export_name(kernel), *ptrs, py, n)
        y = m.get(py, np.uint32, n + 8)
        after = [m.get(p, np.uint32, n + 8) for p in ptrs]
        return y[:n].view(np.float32), y[n:], after


# ---- exp_f32 (exp4) ----------------------------------------------------------------------------


def exp_ref(x: np.ndarray) -> np.ndarray:
    """exp in float64, rounded once to float32: the correctly rounded result (up to double rounding)."""
    with np.errstate(over="ignore"):
        return np.exp(x.astype(np.float64)).astype(np.float32)


def test_exp_f32_within_2_ulp(mode, kgen):
    # simd128 lowers madd to an unfused f32x4.mul + f32x4.add; relaxed SIMD to f32x4.relaxed_madd,
    # which is fused here (deterministic mode always fuses; non-deterministic mode uses the host's
    # FMA). Asserting the same 2-ulp bound in every mode covers both the fused and unfused polynomial.
    rng = rng_for("exp-ulp")
    x = np.concatenate([
        np.linspace(-87.3, 88.7, 500_001, dtype=np.float32),
        rng.uniform(-87.3, 88.7, 500_000).astype(np.float32),
        rng.uniform(-1, 1, 20_000).astype(np.float32),            # around k = 0 and k = +-1
        np.linspace(88.0, 88.72, 10_001, dtype=np.float32),       # the last binades before overflow
    ])

    def run(k: Kernels) -> np.ndarray:
        return k.exp_f32(x)

    got = run(kgen())
    ref = exp_ref(x)
    assert got.shape == x.shape and got.dtype == np.float32
    assert np.isfinite(ref).all() and (ref > 0).all()
    u = f32_ulps(got, ref)
    worst = int(u.argmax())
    assert u.max() <= 2, (f"exp_f32 [{mode.id}]: {int((u > 2).sum())} of {x.size} values off by more than 2 ulp;"
                          f" worst x={x[worst]!r}: got {got[worst]!r}, want {ref[worst]!r} ({u[worst]} ulp)")
    same_as_deterministic(mode, kgen, None, run, got)


def test_exp_f32_fused_and_unfused_lowerings_both_covered(any_module):
    """The 2-ulp test above really sees two different polynomials: simd128's unfused mul + add and
    relaxed SIMD's fused relaxed_madd (wasmtime's deterministic mode fuses) round differently on some
    inputs, and both stay within 2 ulp there."""
    x = np.linspace(-87.3, 88.7, 200_001, dtype=np.float32)
    unfused = any_module("simd128").exp_f32(x)
    fused = any_module("relaxed-simd", True).exp_f32(x)
    differ = unfused != fused
    assert differ.sum() > 100, "simd128 and relaxed SIMD exp agree everywhere: is madd fused at all?"
    ref = exp_ref(x[differ])
    assert f32_ulps(unfused[differ], ref).max() <= 2 and f32_ulps(fused[differ], ref).max() <= 2


def test_exp_f32_subnormal_results_within_2_ulp(mode, kgen):
    # Results below FLT_MIN (x < -87.34) down to the smallest subnormal (x ~ -103.28): 2^k is built in
    # two halves, so no special case; ulps of subnormals are 2^-149 in absolute terms.
    x = np.concatenate([np.linspace(-103.97, -87.3, 100_001, dtype=np.float32),
                        np.float32([-100.0, -96.0721817, -103.28, -103.3, -103.9])])

    def run(k: Kernels) -> np.ndarray:
        return k.exp_f32(x)

    got = run(kgen())
    ref = exp_ref(x)
    assert (ref < np.finfo(np.float32).tiny).sum() > 80_000  # the range really is subnormal
    u = f32_ulps(got, ref)
    worst = int(u.argmax())
    assert u.max() <= 2, f"x={x[worst]!r}: got {got[worst]!r}, want {ref[worst]!r} ({u[worst]} ulp)"
    assert got[x == np.float32(-100.0)][0] > 0  # e^-100 = 3.7e-44 is a subnormal, not 0
    same_as_deterministic(mode, kgen, None, run, got)


EXP_SPECIALS = [
    # (x, the exact f32 result)
    (np.nan, np.nan),
    (np.inf, np.inf),
    (-np.inf, 0.0),
    (88.73, np.inf),
    (88.8, np.inf),
    (1000.0, np.inf),
    (FLT_MAX, np.inf),
    (-104.0, 0.0),
    (-1000.0, 0.0),
    (-FLT_MAX, 0.0),
    (-0.0, 1.0),
    (0.0, 1.0),
]


def test_exp_f32_special_values(mode, kgen):
    x = np.array([v for v, _ in EXP_SPECIALS], np.float32)
    want = np.array([w for _, w in EXP_SPECIALS], np.float32)

    def run(k: Kernels) -> np.ndarray:
        return k.exp_f32(x)

    got = run(kgen())
    for xi, gi, wi in zip(x, got, want):
        if np.isnan(wi):
            assert np.isnan(gi), f"exp({xi}) = {gi}, want NaN"
        else:
            assert bits_of(np.float32([gi]))[0] == bits_of(np.float32([wi]))[0], f"exp({xi!r}) = {gi!r}, want {wi!r}"
    # ln(FLT_MAX) = 88.7228...: the largest x with a finite result, within 2 ulp of FLT_MAX
    edge = np.float32([88.72283, 88.7228, -87.33654, -103.27893])
    e = kgen().exp_f32(edge)
    assert np.isfinite(e).all() and (e > 0).all() and (f32_ulps(e, exp_ref(edge)) <= 2).all(), e
    same_as_deterministic(mode, kgen, None, run, got)


@pytest.mark.parametrize("n", (0, 1, 2, 3, 4, 5, 7, 8, 9), ids=lambda n: f"n{n}")
def test_exp_f32_partial_vector_writes_only_n(mode, kgen, n):
    """n not a multiple of 4: the last vector is read whole (its dead lanes are NaN canaries here)
    but only n values are written; the 8 words after y[n - 1] survive bit for bit, and so does x."""
    x = rng_for("exp-n", n).uniform(-20, 20, n).astype(np.float32)

    def run(k: Kernels) -> list[np.ndarray]:
        y, tail, (xa,) = raw_elementwise(k, "exp_f32", [x])
        yi, tail_i, _ = raw_elementwise(k, "exp_f32", [x], in_place=True)
        return [y, tail, xa, yi, tail_i]

    y, tail, xa, yi, tail_i = outs = run(kgen())
    assert (f32_ulps(y, exp_ref(x)) <= 2).all()
    np.testing.assert_array_equal(tail, canaries(8), err_msg="exp_f32 wrote past n")
    np.testing.assert_array_equal(xa, np.concatenate([x.view(np.uint32), canaries(8)]), err_msg="x changed")
    assert_bitwise_equal(yi, y, "in place (y = x) gives the same values")
    np.testing.assert_array_equal(tail_i, canaries(8), err_msg="exp_f32 in place wrote past n")
    assert_bitwise_equal(kgen().exp_f32(x), y, "API vs raw call")
    same_as_deterministic(mode, kgen, None, run, outs)


def test_elementwise_api_rejects_bad_arrays(kernels):
    x = np.ones(8, np.float32)
    mark = kernels.module.in_use()
    for bad, err in ((x.astype(np.float64), TypeError), ([1.0, 2.0], TypeError), (x.reshape(2, 4), ValueError)):
        for f in (kernels.exp_f32, kernels.silu_f32):
            with pytest.raises(err):
                f(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        kernels.swiglu_f32(x, np.ones(7, np.float32))
    with pytest.raises(TypeError):
        kernels.swiglu_f32(x, np.ones(8, np.float64))
    for f in (kernels.sin_f64, kernels.cos_f64, kernels.exp_f64, kernels.log_f64):
        with pytest.raises(TypeError):
            f(x)  # float32
        with pytest.raises(TypeError):
            f(np.ones((2, 2)))
    assert kernels.module.in_use() == mark
    assert kernels.exp_f32(np.zeros(0, np.float32)).shape == (0,)


# ---- softmax_f32 -------------------------------------------------------------------------------


def softmax64(x: np.ndarray) -> np.ndarray:
    """Row softmax in float64; a row of all -inf gives zeros (kernels.dsl's documented result)."""
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    m = np.where(m == -np.inf, 0.0, m)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(x - m)
        s = e.sum(axis=1, keepdims=True)
        return np.where(s > 0, e / np.where(s > 0, s, 1.0), 0.0)


def assert_softmax_close(got: np.ndarray, x: np.ndarray, what: str) -> None:
    ref = softmax64(x)
    g = got.astype(np.float64)
    err = np.abs(g - ref)
    # 1e-6 absolute and 1e-5 relative (1e-40 admits the rounding of subnormal results)
    bad = ~((err <= 1e-6) & (err <= 1e-5 * ref + 1e-40))
    assert not bad.any(), (f"{what}: at {np.argwhere(bad)[:4].tolist()} got {got[bad][:4]} want {ref[bad][:4]}")
    masked = x == -np.inf
    assert (got[masked] == 0).all(), f"{what}: masked (-inf) scores must give exactly 0"
    full = ~np.all(masked, axis=1)
    sums = g.sum(axis=1)
    assert np.all(np.abs(sums[full] - 1) <= 1e-5), f"{what}: row sums {sums}"


def softmax_raw(k: Kernels, rows: int, t: int, stride: int, data: np.ndarray) -> np.ndarray:
    """Put `data` (uint32 words, (rows + 1, stride)) in memory, run softmax_f32 on its first `rows`
    rows only, return the whole buffer as uint32 afterwards."""
    m = k.module
    with m.scope():
        p = m.put(data)
        k.call(k.export_name("softmax_f32"), p, rows, t, stride)
        return m.get(p, np.uint32, data.size).reshape(data.shape)


def softmax_case(t: int, rows: int = 3) -> tuple[np.ndarray, int, np.ndarray]:
    """Scores (rows, t), stride, and the buffer: rows of `stride` words with canaries in every row's
    padding and in a whole extra row after them."""
    rng = rng_for("softmax", t)
    stride = -(-t // 4) * 4
    x = (rng.standard_normal((rows, t)) * 4).astype(np.float32)
    if t >= 2:
        x[1, rng.choice(t, max(1, t // 3), replace=False)] = -np.inf  # attention mask, never the whole row
        x[1, rng.integers(t)] = 0.5
    x[2] *= 20  # wide spread: some results tiny or subnormal
    buf = canaries((rows + 1) * stride).reshape(rows + 1, stride)
    buf[:rows, :t] = x.view(np.uint32)
    return x, stride, buf


def test_softmax_padded_rows_leave_padding_and_next_row_untouched(mode, kgen):
    rows = 3
    cases = {t: softmax_case(t, rows) for t in range(1, 68)}

    def run(k: Kernels) -> list[np.ndarray]:
        return [softmax_raw(k, rows, t, stride, buf) for t, (_, stride, buf) in cases.items()]

    outs = run(kgen())
    for (t, (x, stride, buf)), out in zip(cases.items(), outs):
        got = out[:rows, :t].copy().view(np.float32)
        assert_softmax_close(got, x, f"softmax t={t} stride={stride}")
        np.testing.assert_array_equal(out[:rows, t:], buf[:rows, t:], err_msg=f"t={t}: padding changed")
        np.testing.assert_array_equal(out[rows], buf[rows], err_msg=f"t={t}: the next row changed")
    same_as_deterministic(mode, kgen, None, run, outs)


def test_softmax_special_rows(mode, kgen):
    t = 7
    ninf = -np.inf
    x = np.array([
        [ninf] * t,                                              # fully masked: all zeros
        [1.0, ninf, 2.0, ninf, 0.0, ninf, ninf],                 # masked entries are exactly 0
        [3e38, -3e38, 0.0, 1e30, -1e30, 2.9e38, 1.0],            # differences overflow f32: still fine
        [1e30] * t,                                              # all equal and huge: uniform
        [-1e30, -1e30, -1e30 * 0.5, -1e30, -1e30, -1e30, -1e30],  # huge and negative: one wins
        [1e30, 1e30 * (1 - 2 ** -23), 0, 0, 0, 0, 0],           # 1e30 apart on the f32 grid
        [ninf, ninf, ninf, ninf, ninf, ninf, 5.0],               # one survivor in the scalar tail
        [5.0, ninf, ninf, ninf, ninf, ninf, ninf],               # one survivor in the vector body
    ], np.float32)
    rows = x.shape[0]
    stride = 8
    buf = canaries((rows + 1) * stride).reshape(rows + 1, stride)
    buf[:rows, :t] = x.view(np.uint32)

    def run(k: Kernels) -> np.ndarray:
        return softmax_raw(k, rows, t, stride, buf)

    out = run(kgen())
    got = out[:rows, :t].copy().view(np.float32)
    assert_softmax_close(got, x, "special rows")
    assert (got[0] == 0).all() and not np.signbit(got[0]).any()
    np.testing.assert_array_equal(got[6], [0, 0, 0, 0, 0, 0, 1])
    np.testing.assert_array_equal(got[7], [1, 0, 0, 0, 0, 0, 0])
    np.testing.assert_allclose(got[3], 1 / t, rtol=1e-6)
    np.testing.assert_array_equal(out[:rows, t:], buf[:rows, t:])
    np.testing.assert_array_equal(out[rows], buf[rows])
    same_as_deterministic(mode, kgen, None, run, out)


def test_softmax_nan_row_is_nan_and_stays_in_its_row(mode, kgen):
    """A NaN makes its row NaN (documented), wherever it is, and does not leak into other rows."""
    t, stride = 10, 12
    rng = rng_for("softmax-nan")
    x = rng.standard_normal((5, t)).astype(np.float32)
    x[0, 0] = np.nan    # vector body
    x[2, 9] = np.nan    # scalar tail
    x[4, 5] = np.nan

    def run(k: Kernels) -> np.ndarray:
        return k.softmax_f32(padded_rows(x), t)

    out = run(kgen())
    assert out.shape == (5, stride)
    assert np.isnan(out[[0, 2, 4], :t]).all()
    assert_softmax_close(out[[1, 3], :t], x[[1, 3]], "rows next to NaN rows")
    assert (out[:, t:] == 0).all()
    same_as_deterministic(mode, kgen, None, run, out)


@pytest.mark.parametrize("t", (1, 3, 4, 5, 16, 33), ids=lambda t: f"t{t}")
def test_softmax_api_padded_rows(mode, kgen, t):
    rng = rng_for("softmax-api", t)
    x = (rng.standard_normal((4, t)) * 3).astype(np.float32)

    def run(k: Kernels) -> list[np.ndarray]:
        return [k.softmax_f32(padded_rows(x), t), k.softmax_f32(padded_rows(x, fill=12345.0), t)]

    a, b = outs = run(kgen())
    stride = -(-t // 4) * 4
    assert a.shape == (4, stride) and a.dtype == np.float32
    assert_softmax_close(a[:, :t], x, f"API t={t}")
    assert_bitwise_equal(a[:, :t], b[:, :t], "padding value does not matter")
    assert (a[:, t:] == 0).all() and (b[:, t:] == 12345.0).all()
    if t % 4 == 0:  # t defaults to the stride
        assert_bitwise_equal(kgen().softmax_f32(x), a, "t=None")
    same_as_deterministic(mode, kgen, None, run, outs)


def test_softmax_api_rejects_bad_shapes(kernels):
    mark = kernels.module.in_use()
    ok = np.zeros((2, 8), np.float32)
    for x, t in ((np.zeros((2, 5), np.float32), 5),    # stride not a multiple of 4
                 (np.zeros((2, 6), np.float32), None),
                 (ok, 0), (ok, 9), (ok, -1),           # t outside 1..stride
                 (np.zeros(8, np.float32), 8),         # 1-D
                 (np.zeros((1, 2, 8), np.float32), 8)):  # 3-D
        with pytest.raises(ValueError):
            kernels.softmax_f32(x, t)
    with pytest.raises(TypeError):
        kernels.softmax_f32(ok.astype(np.float64), 8)
    with pytest.raises(TypeError):
        kernels.softmax_f32(ok.tolist(), 8)  # type: ignore[arg-type]
    assert kernels.module.in_use() == mark
    assert padded_rows(np.zeros((3, 5), np.float32)).shape == (3, 8)
    assert padded_rows(np.zeros((3, 8), np.float32)).shape == (3, 8)


@pytest.mark.parametrize("t", (4, 8), ids=lambda t: f"t{t}")
def test_softmax_unpadded_rows_stay_inside_the_buffer(mode, kgen, t):
    k = kgen()
    m = k.module
    rows, stride = 2, t
    nbytes = rows * stride * 4
    p = m.memory.data_len() - nbytes  # the buffer ends exactly where memory ends (above the heap top)
    assert p >= m.in_use()
    x = rng_for("softmax-end", t).standard_normal((rows, t)).astype(np.float32)
    m.view(p, np.float32, rows * stride)[:] = x.reshape(-1)
    k.call(k.export_name("softmax_f32"), p, rows, t, stride)  # traps: reads 16 bytes past the end
    assert_softmax_close(m.get(p, np.float32, rows * stride).reshape(rows, stride), x, "end of memory")


# ---- SiLU and SwiGLU ---------------------------------------------------------------------------

# exp4 is within 2 ulp (<= 2^-22 relative); 1 + e adds one rounding (2^-24) and passes at most e's
# relative error on; the division and SwiGLU's multiply by g one rounding each (2^-24):
# |got - ref| <= (2^-22 + 3 * 2^-24) |ref| = 7 * 2^-24 |ref| ~ 4.2e-7 |ref|. The absolute floor 1e-44
# (7 subnormal ulps) admits SwiGLU products that round to subnormals.
SILU_RTOL = 7 * 2.0 ** -24
SILU_ATOL = 1e-44


def silu64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return x / (1 + np.exp(-x))


def assert_silu_close(got: np.ndarray, ref: np.ndarray, x: np.ndarray, what: str) -> None:
    with np.errstate(over="ignore", invalid="ignore"):
        ref32 = ref.astype(np.float32)  # overflow to inf in f32 is the right answer
    fin = np.isfinite(ref32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref32), err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(got[np.isinf(ref32)], ref32[np.isinf(ref32)], err_msg=f"{what}: infinities")
    err = np.abs(got[fin].astype(np.float64) - ref[fin])
    bad = ~(err <= SILU_RTOL * np.abs(ref[fin]) + SILU_ATOL)
    assert not bad.any(), (f"{what}: x={x[fin][bad][:4]} got {got[fin][bad][:4]} want {ref[fin][bad][:4]}"
                           f" (rel err {(err[bad] / np.abs(ref[fin][bad]))[:4]})")


def silu_inputs() -> np.ndarray:
    """Inputs down to -87, where exp(-|x|) (silu4 builds sigmoid from it; it never overflows) is
    still a normal float; below, see test_silu_far_below_zero_is_within_3e_37."""
    rng = rng_for("silu")
    return np.concatenate([
        (rng.standard_normal(100_000) * 5).astype(np.float32),
        rng.uniform(-88.7, 88.7, 100_000).astype(np.float32),
        np.linspace(-87, 100, 50_001, dtype=np.float32),
        np.float32([0.0, -0.0, 1e-30, -1e-30, 1e-45, -1e-45, 1.0, -1.0, 88.0, -88.0, 88.72, -88.72,
                    1e3, 1e10, 1e30, 3e38, FLT_MAX, np.inf, np.nan, -np.inf]),
    ])


def test_silu_matches_float64(mode, kgen):
    x = silu_inputs()

    def run(k: Kernels) -> np.ndarray:
        return k.silu_f32(x)

    got = run(kgen())
    assert_silu_close(got, silu64(x), x, "silu_f32")
    # exact cases: silu(0) = 0 with its sign, huge x passes through, NaN and -inf give NaN
    # (-inf / (1 + inf), as float64 numpy gives), +inf gives inf
    sp = dict(zip(x[-20:].tolist(), got[-20:]))
    assert bits_of(got[x.size - 20:x.size - 18]).tolist() == [0, 0x80000000]
    assert got[-6] == np.float32(1e30) and got[-5] == np.float32(3e38) and got[-4] == np.float32(FLT_MAX), sp
    assert got[-3] == np.inf and np.isnan(got[-2]) and np.isnan(got[-1]), sp
    same_as_deterministic(mode, kgen, None, run, got)


def test_swiglu_matches_float64(mode, kgen):
    x = silu_inputs()
    rng = rng_for("swiglu")
    g = (rng.standard_normal(x.size) * 3).astype(np.float32)
    g[:10] = [0.0, -0.0, np.nan, np.inf, -np.inf, 1e30, -1e30, 1e-40, FLT_MAX, 2.0]
    g[-20:] = 2.0  # the special x values times 2: 1e30 * 2, 3e38 * 2 -> inf, FLT_MAX * 2 -> inf

    def run(k: Kernels) -> np.ndarray:
        return k.swiglu_f32(x, g)

    got = run(kgen())
    with np.errstate(invalid="ignore", over="ignore"):
        ref = silu64(x) * g.astype(np.float64)
    assert_silu_close(got, ref, x, "swiglu_f32")
    assert got[-5] == np.inf and got[-4] == np.inf and np.isnan(got[2])
    same_as_deterministic(mode, kgen, None, run, got)


def test_silu_far_below_zero_is_within_3e_37(mode, kgen):
    """For x < -88.72 the true value is at most |x| e^x <= 2.7e-37 in magnitude (and decreasing);
    whatever the kernel rounds it to, the absolute error stays below 3e-37 and the sign is kept."""
    x = np.concatenate([np.linspace(-200, -87, 10_001, dtype=np.float32), np.float32([-1e30, -FLT_MAX])])

    def run(k: Kernels) -> list[np.ndarray]:
        return [k.silu_f32(x), k.swiglu_f32(x, np.ones_like(x))]

    outs = run(kgen())
    for got in outs:
        assert np.all(np.abs(got.astype(np.float64) - silu64(x)) <= 3e-37)
        assert np.all(got <= 0)
    same_as_deterministic(mode, kgen, None, run, outs)


def test_silu_keeps_normal_results_below_exp_overflow(mode, kgen):
    x = np.float32([-88.73, -88.75, -89.0])
    got = kgen().silu_f32(x)
    ref = silu64(x)
    assert (np.abs(ref) > np.finfo(np.float32).tiny).all()  # normal float32 results
    assert_silu_close(got, ref, x, "silu below exp overflow")


@pytest.mark.parametrize("n", (*range(1, 10), 1000), ids=lambda n: f"n{n}")
def test_silu_swiglu_lengths_write_only_n(mode, kgen, n):
    rng = rng_for("silu-n", n)
    x = (rng.standard_normal(n) * 6).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)

    def run(k: Kernels) -> list[Any]:
        return [k.silu_f32(x), k.swiglu_f32(x, g),
                raw_elementwise(k, "silu_f32", [x]), raw_elementwise(k, "swiglu_f32", [x, g]),
                raw_elementwise(k, "silu_f32", [x], in_place=True),
                raw_elementwise(k, "swiglu_f32", [x, g], in_place=True)]

    outs = run(kgen())
    silu_api, swiglu_api, *raws = outs
    assert_silu_close(silu_api, silu64(x), x, f"silu n={n}")
    assert_silu_close(swiglu_api, silu64(x) * g, x, f"swiglu n={n}")
    for (y, tail, after), want, ins, what in zip(
            raws, (silu_api, swiglu_api, silu_api, swiglu_api), ([x], [x, g], [x], [x, g]),
            ("silu", "swiglu", "silu in place", "swiglu in place (y = x)")):
        assert_bitwise_equal(y, want, f"{what} n={n}: raw vs API")
        np.testing.assert_array_equal(tail, canaries(8), err_msg=f"{what} n={n}: wrote past n")
        for i, (a, buf) in enumerate(zip(ins, after)):
            if "in place" in what and i == 0:
                continue
            np.testing.assert_array_equal(buf, np.concatenate([a.view(np.uint32), canaries(8)]),
                                          err_msg=f"{what} n={n}: input {i} changed")
    same_as_deterministic(mode, kgen, None, run, outs)


# ---- f64 sin, cos, exp, log --------------------------------------------------------------------

# Accepted: <= 2 float64 ulp (np.spacing at the reference) or <= 1e-15 relative.


def assert_f64_close(got: np.ndarray, ref: np.ndarray, x: np.ndarray, what: str) -> None:
    assert got.dtype == np.float64 and got.shape == ref.shape
    u = f64_ulps(got, ref)
    with np.errstate(all="ignore"):
        rel = np.abs(got - ref) / np.abs(ref)
    bad = ~((u <= 2) | (rel <= 1e-15))
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {x.size} off; x={x[bad][:4].tolist()} "
                           f"got {got[bad][:4].tolist()} want {ref[bad][:4].tolist()} ({u[bad][:4]} ulp)")


def rope_angles(rng: np.random.Generator) -> np.ndarray:
    """RoPE's angles p * theta^(-2i/d), p < 8192, d in {64, 128}, theta in {1e4, 1e6}: ~200k of them."""
    angles = []
    for d in (64, 128):
        for theta in (1e4, 1e6):
            freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
            angles.append(np.outer(np.arange(8192), freq).reshape(-1))
    a = np.concatenate(angles)
    return rng.choice(a, 200_000, replace=False)


@pytest.mark.parametrize("fn", ("sin", "cos"))
def test_f64_sin_cos(mode, kgen, fn):
    rng = rng_for("sincos")
    x = np.concatenate([rope_angles(rng), rng.uniform(-8192, 8192, 100_000), rng.uniform(-4, 4, 100_000),
                        np.arange(-5000, 5001) * (np.pi / 2),  # near the zeros of sin and cos
                        [0.0, 1e-300, -1e-300, 5e-324, np.pi, -np.pi, 8191.0, 8192.0, -8192.0, 1e5, 1.5e6]])

    def run(k: Kernels) -> np.ndarray:
        return getattr(k, f"{fn}_f64")(x)

    got = run(kgen())
    assert_f64_close(got, getattr(np, fn)(x), x, f"{fn}_f64")
    sp = np.array([np.nan, np.inf, -np.inf, 0.0])
    out = getattr(kgen(), f"{fn}_f64")(sp)
    assert np.isnan(out[:3]).all() and out[3] == (0.0 if fn == "sin" else 1.0)
    same_as_deterministic(mode, kgen, None, run, got)


def test_f64_sin_keeps_the_sign_of_zero(mode, kgen):
    got = kgen().sin_f64(np.array([-0.0, 0.0]))
    assert bits_of(got).tolist() == [0x8000000000000000, 0]


def test_f64_exp(mode, kgen):
    rng = rng_for("exp64")
    x = np.concatenate([np.linspace(-30, 0, 100_001), rng.uniform(-30, 0, 50_000),
                        np.linspace(-700, 700, 100_001), rng.uniform(-700, 700, 50_000),
                        np.linspace(-745, -700, 10_001),  # subnormal results
                        np.linspace(700, 709.78, 1_001),
                        [0.0, -0.0, 1.0, -1.0, 1e-300, -1e-300, 709.782712893384, -708.39641853226408,
                         -745.13321910194110, -745.2]])

    specials = np.array([np.inf, -np.inf, np.nan, 710.0, 1000.0, -746.0, -1000.0, 0.0, -0.0])

    def run(k: Kernels) -> list[np.ndarray]:
        return [k.exp_f64(x), k.exp_f64(specials)]

    got, out = run(kgen())
    assert_f64_close(got, np.exp(x), x, "exp_f64")
    assert out[0] == np.inf and out[1] == 0.0 and np.isnan(out[2]), out
    assert out[3] == np.inf and out[4] == np.inf and out[5] == 0.0 and out[6] == 0.0, out
    assert out[7] == 1.0 and out[8] == 1.0, out
    same_as_deterministic(mode, kgen, None, run, [got, out])


def test_f64_log(mode, kgen):
    rng = rng_for("log64")
    x = np.concatenate([10.0 ** rng.uniform(-300, 300, 200_000),
                        rng.uniform(0.5, 2, 50_000), 1 + rng.uniform(-1e-3, 1e-3, 50_000),
                        np.sqrt(0.5) * (1 + np.arange(-50, 51) * 2.0 ** -52),  # the mantissa split point
                        2.0 ** np.arange(-1074, 1024, dtype=np.float64),      # every power of two
                        [10000.0, 1e6, 1.0, 2.0, 0.5, 5e-324, 2.2250738585072014e-308, 2.225073858507201e-308,
                         np.finfo(np.float64).max, np.e, 10.0, 1e4 ** 0.5]])

    specials = np.array([0.0, -0.0, -1.0, -1e-300, -np.inf, np.inf, np.nan])

    def run(k: Kernels) -> list[np.ndarray]:
        return [k.log_f64(x), k.log_f64(specials)]

    got, out = run(kgen())
    assert_f64_close(got, np.log(x), x, "log_f64")
    assert got[np.flatnonzero(x == 1.0)].tolist() == [0.0] * int((x == 1.0).sum())
    assert abs(got[x == 5e-324][0] - np.log(5e-324)) <= np.spacing(744.5)
    with np.errstate(divide="ignore", invalid="ignore"):
        want = np.log(specials)
    assert out[0] == -np.inf and out[1] == -np.inf, out
    assert np.isnan(out[2:5]).all() and out[5] == np.inf and np.isnan(out[6]), out
    assert_bitwise_equal(np.isnan(out), np.isnan(want), "NaN positions as numpy")
    same_as_deterministic(mode, kgen, None, run, [got, out])


# ---- RoPE tables -------------------------------------------------------------------------------


def rope_table64(npos: int, dim: int, theta: float, pos0: int = 0) -> tuple[np.ndarray, np.ndarray]:
    freq = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    angles = np.outer(np.arange(pos0, pos0 + npos, dtype=np.float64), freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@pytest.mark.parametrize("dim", (64, 128), ids=lambda d: f"dim{d}")
@pytest.mark.parametrize("theta", (1e4, 1e6), ids=lambda t: f"theta{t:g}")
def test_rope_table_matches_float64(mode, kgen, theta, dim):
    npos = 8192

    def run(k: Kernels) -> tuple[np.ndarray, np.ndarray]:
        return k.rope_table(npos, dim, theta)

    cos, sin = got = run(kgen())
    rc, rs = rope_table64(npos, dim, theta)
    for name, g, r in (("cos", cos, rc), ("sin", sin, rs)):
        assert g.shape == (npos, dim // 2) and g.dtype == np.float32
        u = f32_ulps(g, r)
        differ = int((g != r).sum())
        worst = np.unravel_index(int(u.argmax()), u.shape)
        assert u.max() <= 1, (f"{name} theta={theta} dim={dim}: {differ} of {g.size} entries differ from"
                              f" float64 numpy, worst at (p, i)={worst}: {g[worst]!r} vs {r[worst]!r} ({u[worst]} ulp)")
        # most entries are exactly the rounded float64 value; the rest sit on a rounding boundary of
        # the angle's last bit (theta^(-2i/d) via exp(log) vs numpy's pow)
        assert differ <= g.size // 10000, f"{name}: {differ} of {g.size} entries not identical to float64 numpy"
    assert (cos[0] == 1).all() and (sin[0] == 0).all()
    same_as_deterministic(mode, kgen, None, run, list(got))


def test_rope_table_pos0_is_a_slice(mode, kgen):
    dim, theta = 128, 1e4

    def run(k: Kernels) -> list[np.ndarray]:
        out = list(k.rope_table(8192, dim, theta))
        for pos0, npos in ((1, 10), (4000, 100), (8092, 100), (8191, 1)):
            out += list(k.rope_table(npos, dim, theta, pos0=pos0))
        return out

    outs = run(kgen())
    cos, sin = outs[:2]
    for j, (pos0, npos) in enumerate(((1, 10), (4000, 100), (8092, 100), (8191, 1))):
        assert_bitwise_equal(outs[2 + 2 * j], cos[pos0:pos0 + npos], f"cos pos0={pos0}")
        assert_bitwise_equal(outs[3 + 2 * j], sin[pos0:pos0 + npos], f"sin pos0={pos0}")
    c, s = kgen().rope_table(0, dim, theta)
    assert c.shape == s.shape == (0, dim // 2)
    same_as_deterministic(mode, kgen, None, run, outs)


def test_rope_table_rejects_bad_arguments(kernels):
    mark = kernels.module.in_use()
    for kw in (dict(npos=4, dim=7), dict(npos=4, dim=129), dict(npos=4, dim=0), dict(npos=4, dim=-2),
               dict(npos=-1, dim=8), dict(npos=4, dim=8, pos0=-1), dict(npos=4, dim=8, theta=0.0),
               dict(npos=4, dim=8, theta=-1e4), dict(npos=4, dim=8, theta=float("nan"))):
        with pytest.raises(ValueError):
            kernels.rope_table(**kw)
    assert kernels.module.in_use() == mark


# ---- RoPE apply --------------------------------------------------------------------------------


def rope_numpy(x: np.ndarray, c: np.ndarray, s: np.ndarray, interleaved: bool) -> np.ndarray:
    """The rotation in float32 arithmetic, one rounding per mul and per add/sub (numpy never fuses)."""
    dim = x.shape[1]
    idx0 = np.arange(0, dim, 2) if interleaved else np.arange(dim // 2)
    idx1 = idx0 + 1 if interleaved else idx0 + dim // 2
    x0, x1 = x[:, idx0], x[:, idx1]
    out = np.empty_like(x)
    out[:, idx0] = x0 * c - x1 * s
    out[:, idx1] = x0 * s + x1 * c
    return out


@pytest.mark.parametrize("interleaved", (False, True), ids=("halves", "pairs"))
@pytest.mark.parametrize("dim", (8, 64, 128), ids=lambda d: f"dim{d}")
@pytest.mark.parametrize("heads", (1, 3), ids=lambda h: f"heads{h}")
def test_rope_apply_matches_numpy_f32(mode, kgen, heads, dim, interleaved):
    # The kernel computes x0*c - x1*s and x0*s + x1*c with separate f32 mul and sub/add (no madd, so
    # no fusing on relaxed SIMD either): numpy's float32 arithmetic gives bit-identical results.
    rng = rng_for("rope", heads, dim, interleaved)
    x = (rng.standard_normal((heads, dim)) * 3).astype(np.float32)
    x_before = x.copy()
    positions = (1, 137, 8191)

    def run(k: Kernels) -> list[np.ndarray]:
        cos, sin = k.rope_table(8192, dim, 1e4)
        outs = [k.rope(x, cos[p], sin[p], interleaved) for p in positions]
        ang = rng_for("rope-angles", dim).uniform(-np.pi, np.pi, dim // 2)
        c, s = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        return outs + [k.rope(x, c, s, interleaved), c, s, cos, sin]

    outs = run(kgen())
    *ys, yr, c, s, cos, sin = outs
    for p, y in zip(positions, ys):
        assert y.shape == x.shape and y.dtype == np.float32
        assert_bitwise_equal(y, rope_numpy(x, cos[p], sin[p], interleaved), f"position {p}")
    assert_bitwise_equal(yr, rope_numpy(x, c, s, interleaved), "random angles")
    # a rotation preserves each head's length (to f32 rounding)
    np.testing.assert_allclose(np.linalg.norm(yr, axis=1), np.linalg.norm(x, axis=1), rtol=1e-5)
    assert_bitwise_equal(x, x_before, "rope returns a copy: x is unchanged")
    same_as_deterministic(mode, kgen, None, run, outs)


@pytest.mark.parametrize("interleaved", (False, True), ids=("halves", "pairs"))
def test_rope_angle_zero_is_identity(mode, kgen, interleaved):
    rng = rng_for("rope-id", interleaved)
    x = (rng.standard_normal((3, 128)) * 10).astype(np.float32)
    x[0, :8] = [1e30, -1e30, 1e-40, -1e-40, FLT_MAX, -FLT_MAX, 0.5, -0.5]

    def run(k: Kernels) -> list[np.ndarray]:
        cos, sin = k.rope_table(1, 128, 1e4)
        return [k.rope(x, cos[0], sin[0], interleaved), cos, sin]

    outs = run(kgen())
    y, cos, sin = outs
    assert (cos == 1).all() and (sin == 0).all()
    assert_bitwise_equal(y, x, "rotation by angle 0")
    same_as_deterministic(mode, kgen, None, run, outs)


def test_rope_rejects_bad_shapes(kernels):
    mark = kernels.module.in_use()
    c4, s4 = np.ones(4, np.float32), np.zeros(4, np.float32)
    for x, c, s in ((np.zeros((1, 12), np.float32), np.ones(6, np.float32), np.zeros(6, np.float32)),
                    (np.zeros((1, 4), np.float32), np.ones(2, np.float32), np.zeros(2, np.float32)),
                    (np.zeros((2, 8), np.float32), np.ones(3, np.float32), s4),
                    (np.zeros((2, 8), np.float32), c4, np.zeros(8, np.float32)),
                    (np.zeros(8, np.float32), c4, s4)):
        for inter in (False, True):
            with pytest.raises(ValueError):
                kernels.rope(x, c, s, inter)
    with pytest.raises(TypeError):
        kernels.rope(np.zeros((1, 8)), c4, s4)
    with pytest.raises(TypeError):
        kernels.rope(np.zeros((1, 8), np.float32), c4.astype(np.float64), s4)
    assert kernels.module.in_use() == mark


# ---- 4-bit quant types: references -------------------------------------------------------------


@pytest.fixture(scope="module")
def quants(module_cache) -> dict:
    return module_cache.get("simd128").quants


def q4_data(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """Normal data with a per-row scale, plus an all-zero block, a constant block and blocks of mixed
    sign and offset (q4_1's minimum far from zero)."""
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.05, 5, (rows, 1))).astype(np.float32)
    x[0, :32] = 0.0
    if k >= 64:
        x[0, 32:64] = 0.7
    if k >= 96:
        x[0, 64:96] = np.float32(3.0) + rng.uniform(0, 1, 32).astype(np.float32)
    if rows > 1:
        x[1, :32] = -0.7
    return x


def test_q4_0_round_trip_within_half_a_step(quants):
    rng = rng_for("q4_0-rt")
    x = q4_data(rng, 9, 256)
    b = reference.quantize_q4_0(x)
    assert b.dtype == quants["q4_0"].dtype
    deq = reference.dequantize_q4(b)
    xb = x.reshape(9, -1, 32).astype(np.float64)
    err = np.abs(xb - deq.reshape(xb.shape))
    # llama.cpp's Q4_0: d = (value of largest magnitude) / -8 in f32, q = min(15, trunc(x/d + 8.5)),
    # then d stored as f16. Rounding x/d to the nearest step gives |err| <= |d|/2; storing d as f16
    # moves each of at most 8 steps by |d16 - d32|. The clamp at 15 (x/d > 7.5: the opposite
    # extreme, q - 8 can reach -8 but only +7) is the format's asymmetry: there |err| <= |d|.
    vmax = np.take_along_axis(xb, np.abs(xb).argmax(axis=-1)[..., None], axis=-1)
    d32 = (vmax / -8).astype(np.float32).astype(np.float64)
    d16 = b["d"].astype(np.float64)[..., None]
    drift = 8 * np.abs(d16 - d32)
    with np.errstate(divide="ignore", invalid="ignore"):
        clamped = np.where(d32 != 0, xb / d32, 0) > 7.5
    bound = np.where(clamped, np.abs(d32), np.abs(d32) / 2) * (1 + 1e-6) + drift + 1e-30
    assert (err <= bound).all(), f"max excess {(err - bound).max()}"
    # the all-zero block is exact, the constant block is its value up to the f16 scale
    assert (deq[0, :32] == 0).all()
    np.testing.assert_array_equal(deq[0, 32:64], -8 * b["d"][0, 1].astype(np.float32))  # every q = 0
    assert np.abs(deq[0, 32:64] - np.float32(0.7)).max() <= 8 * abs(float(b["d"][0, 1]) + float(np.float32(0.7)) / 8)
    np.testing.assert_array_equal(deq[1, :32], -deq[0, 32:64])  # -0.7: d > 0 now


def test_q4_0_clamp_side_error_is_one_step(quants):
    """Symmetric extremes: -1 takes d = 1/8 (q 0 -> -8 d = -1 exactly), +1 maps to x/d = 8 -> clamped
    to 15 -> 7 d = 0.875: the format's known asymmetry, an error of one step |d|, not d/2."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 1] = -1.0, 1.0
    b = reference.quantize_q4_0(x)
    deq = reference.dequantize_q4(b)
    assert float(b["d"][0, 0]) == 0.125
    assert deq[0, 0] == -1.0 and deq[0, 1] == 0.875
    np.testing.assert_array_equal(quants["q4_0"].dequantize_ref(b), deq)


def test_q4_1_round_trip_within_half_a_step(quants):
    rng = rng_for("q4_1-rt")
    x = q4_data(rng, 9, 256)
    b = reference.quantize_q4_1(x)
    assert b.dtype == quants["q4_1"].dtype
    deq = reference.dequantize_q4(b).reshape(9, -1, 32).astype(np.float64)
    xb = x.reshape(9, -1, 32).astype(np.float64)
    err = np.abs(xb - deq)
    lo, hi = xb.min(axis=-1, keepdims=True), xb.max(axis=-1, keepdims=True)
    d32 = ((hi - lo) / 15).astype(np.float32).astype(np.float64)
    d16 = b["d"].astype(np.float64)[..., None]
    m16 = b["m"].astype(np.float64)[..., None]
    assert (d16 >= 0).all()
    # |err| <= d/2 from rounding to the nearest of 16 steps above the minimum, plus the f16 storage
    # of d (up to 15 steps of |d16 - d32|) and of m (|m16 - min|)
    bound = d32 / 2 * (1 + 1e-6) + 15 * np.abs(d16 - d32) + np.abs(m16 - lo) + 1e-30
    assert (err <= bound).all(), f"max excess {(err - bound).max()}"
    assert (deq[0, 0] == 0).all()  # all-zero block: d = m = 0
    np.testing.assert_array_equal(deq[0, 1], np.float32(np.float16(0.7)))  # constant: d = 0, m = f16(c)
    assert b["d"][0, 1] == 0


@pytest.mark.parametrize("quant", ("q4_0", "q4_1"))
def test_q4_declared_dequant_equals_gguf_reference(quants, quant):
    q = quants[quant]
    rng = rng_for("q4-decl", quant)
    x = q4_data(rng, 5, 320)
    fq = reference.quantize_q4_0 if quant == "q4_0" else reference.quantize_q4_1
    blocks = [fq(x)]
    raw = rng.integers(0, 256, (7, 10 * q.stored_bytes), dtype=np.uint8).view(q.dtype).copy()
    raw["d"] = rng.uniform(-2, 2, raw.shape).astype(np.float16)  # both signs
    if quant == "q4_1":
        raw["m"] = rng.uniform(-3, 3, raw.shape).astype(np.float16)
    raw["qs"][0, 0] = 0x00  # every nibble 0
    raw["qs"][0, 1] = 0xFF  # every nibble 15
    raw["qs"][0, 2] = 0x0F  # low nibbles 15, high 0
    blocks.append(raw)
    for b in blocks:
        np.testing.assert_array_equal(q.dequantize_ref(b), reference.dequantize_q4(b))
        np.testing.assert_array_equal(q.dequantize_ref(b.view(np.uint8).reshape(b.shape[0], -1)),
                                      reference.dequantize_q4(b))  # raw bytes work too
    u = q.unpack_ref(raw)
    assert (u[0, 0] == (-8 if quant == "q4_0" else 0)).all() and (u[0, 1] == (7 if quant == "q4_0" else 15)).all()
    np.testing.assert_array_equal(u[0, 2, :16], 15 - (8 if quant == "q4_0" else 0))
    np.testing.assert_array_equal(u[0, 2, 16:], 0 - (8 if quant == "q4_0" else 0))


def onnx_weights(rng: np.random.Generator, k: int, n: int) -> np.ndarray:
    w = (rng.standard_normal((k, n)) * rng.uniform(0.05, 3, (1, n))).astype(np.float32)
    w[:32, 0] = 0.0                                              # all-zero block
    w[32:64, 1 % n] = np.abs(w[32:64, 1 % n]) + 1                # all positive: lo clamps to 0
    w[64:96, 2 % n] = -np.abs(w[64:96, 2 % n]) - 1               # all negative: hi clamps to 0
    w[40, 3 % n] = w[70, 4 % n] = 0.0                            # exact zeros inside blocks
    return w


def uint4(a: np.ndarray) -> np.ndarray:
    """Values 0..15 as onnx.numpy_helper.to_array returns a UINT4 tensor."""
    import ml_dtypes  # onnx's own dependency, in the test extra

    return a.astype(ml_dtypes.uint4)


@pytest.mark.parametrize("n", (1, 7, 10), ids=lambda n: f"n{n}")
def test_onnx_uint4_round_trip_and_blocks(quants, n):
    k = 96
    rng = rng_for("onnx", n)
    w = onnx_weights(rng, k, n)
    values, scale, zp = reference.quantize_onnx_uint4(w)
    assert values.shape == (k, n) and values.max() <= 15 and zp.shape == scale.shape
    assert scale.shape == (k // 32, n) and scale.dtype == np.float32 and (scale >= 0).all()
    deq = reference.dequantize_onnx_uint4(values, scale, zp)
    assert deq.shape == (k, n)
    # asymmetric UINT4 over [min(lo, 0), max(hi, 0)]: every value within half a step
    step = np.repeat(scale, 32, axis=0).astype(np.float64)
    err = np.abs(w.astype(np.float64) - deq)
    assert (err <= step / 2 * (1 + 1e-6) + 1e-30).all(), f"max err/step {(err / np.maximum(step, 1e-30)).max()}"
    # zero is in the range and exactly representable: exact zeros stay exact zeros
    assert (deq[w == 0] == 0).all()
    # blocks for q4_onnx, one row per output column, dequantize exactly as DequantizeLinear
    q = quants["q4_onnx"]
    blocks = formats.dequantize_linear_blocks(q, uint4(values), scale, uint4(zp), axis=0, block_size=32)
    assert blocks.dtype == q.dtype and blocks.shape == (n, k // 32)
    assert (blocks["z"] <= 15).all()
    np.testing.assert_array_equal(q.dequantize_ref(blocks), deq.T)


# ---- 4-bit quant types: kernels ----------------------------------------------------------------


def q4_blocks(quant: str, q: Any, rng: np.random.Generator, rows: int, k: int, kind: str) -> np.ndarray:
    """Weights of `quant` for a (rows, k) matrix: quantized from normal data, or random stored bytes."""
    if kind == "quantized":
        x = q4_data(rng, rows, k)
        if quant == "q4_0":
            return reference.quantize_q4_0(x)
        if quant == "q4_1":
            return reference.quantize_q4_1(x)
        values, scale, zp = reference.quantize_onnx_uint4(np.ascontiguousarray(x.T))
        return formats.dequantize_linear_blocks(q, uint4(values), scale, uint4(zp), axis=0, block_size=32)
    b = rng.integers(0, 256, (rows, k // 32 * q.stored_bytes), dtype=np.uint8).view(q.dtype).copy()
    if quant == "q4_onnx":
        b["d"] = rng.uniform(-0.05, 0.05, b.shape).astype(np.float32)
        b["z"] = rng.integers(0, 16, b.shape)
    else:
        b["d"] = rng.uniform(-0.05, 0.05, b.shape).astype(np.float16)
        if quant == "q4_1":
            b["m"] = rng.uniform(-0.4, 0.4, b.shape).astype(np.float16)
    return b


def q4_reference(k: Kernels, quant: str, blocks: np.ndarray, act: Act) -> tuple[np.ndarray, np.ndarray]:
    """reference.qmatvec's float64 result, and the scale of float rounding: the sum over blocks of
    |scale * d_a * int_dot| + |offset * d_a * sum(a)| (each term rounded separately by the kernel; see
    the xfail test below for why reference.qmatvec's own magnitude is not used)."""
    q = k.quants[quant]
    rows = blocks.shape[0]
    zero, _ = consts(k)
    w_int = q.unpack_ref(blocks).reshape(rows, -1)
    offset = q.offset_ref(blocks) if q.offset is not None else None
    per = q.block // q.subs  # values per scale: 32, or a sub-block of 16 (activation scales repeat)
    ad = np.repeat(act.d, 32 // per)
    ref, _ = reference.qmatvec(q.scale_ref(blocks), w_int, act.q, ad, zero, per, offset)
    ad = ad.astype(np.float64)
    t1 = q.scale_ref(blocks).astype(np.float64) * ad * reference.int_dots(w_int, act.q, zero, per)
    mag = np.abs(t1).sum(axis=1)
    if offset is not None:
        asum = (act.q.astype(np.int64) - zero).reshape(-1, per).sum(axis=1)
        mag = mag + np.abs(offset.astype(np.float64) * ad * asum).sum(axis=1)
    return ref, mag


def test_every_declared_quant_type_matches_its_declaration(mode, kgen):
    """Whatever kernels.dsl declares: qmatvec and qdot of every quant type, on blocks made from the
    declaration alone, match the reference derived from it."""
    k = kgen()
    rng = rng_for("every quant", mode.id)
    # 160: a tail past the four-block steps; super-blocks take whole ones (2 of 256)
    xs = {n: (rng.standard_normal(n) * 3).astype(np.float32) for n in (160, 512)}
    cases = {name: (k_len := 160 if q.block == 32 else 512, random_blocks(q, 9, k_len // q.block, rng))
             for name, q in k.quants.items()}

    def run(m: Kernels) -> list[Any]:
        acts = {n: m.quantize_act(x) for n, x in xs.items()}
        return [*acts.values()] + [out for name, (n, b) in cases.items() for out in
                                   (m.qmatvec(m.pack(name, b), acts[n]), np.float32(m.qdot(m.pack(name, b[:1]), acts[n])))]

    got = run(k)
    acts = dict(zip(xs, got))
    for i, (name, (n, b)) in enumerate(cases.items()):
        ref, mag = q4_reference(k, name, b, acts[n])
        assert_q_close(got[len(xs) + 2 * i], ref, mag, f"qmatvec {name}")
        assert_q_close(got[len(xs) + 1 + 2 * i][None], ref[:1], mag[:1], f"qdot {name}")
    same_as_deterministic(mode, kgen, None, run, got)


@pytest.mark.parametrize("quant", Q4_TYPES)
@pytest.mark.parametrize("rows_variant", ROW_TUNES, ids=lambda r: f"rows{r}")
def test_q4_qmatvec_and_qdot_match_reference(mode, kgen, rows_variant, quant):
    tune = rows_tune(rows_variant)
    km = kgen(tune)
    assert km.tune_of("qmatvec", quant)["rows"] == rows_variant
    q = km.quants[quant]
    cases = []
    for k in (32, 96, 4128):
        rng = rng_for("q4mv", quant, k)
        x = (rng.standard_normal(k) * np.repeat(rng.uniform(0.1, 10, k // 32), 32)).astype(np.float32)
        for rows in (1, 3, 8, 9):
            for kind in ("quantized", "raw"):
                cases.append((k, rows, kind, x, q4_blocks(quant, q, rng, rows, k, kind)))

    def run(m: Kernels) -> list[Any]:
        out = []
        for k, rows, kind, x, b in cases:
            act = m.quantize_act(x)
            out += [act, m.qmatvec(m.pack(quant, b), act), np.float32(m.qdot(m.pack(quant, b[:1]), act))]
        return out

    outs = run(km)
    for i, (k, rows, kind, x, b) in enumerate(cases):
        act, y, d = outs[3 * i:3 * i + 3]
        assert y.shape == (rows,) and y.dtype == np.float32
        ref, mag = q4_reference(km, quant, b, act)
        assert_q_close(y, ref, mag, f"{quant} qmatvec rows={rows} k={k} {kind}")
        assert_q_close(np.float32([d]), ref[:1], mag[:1], f"{quant} qdot k={k} {kind}")
    same_as_deterministic(mode, kgen, tune, run, outs)


def q4_extreme_blocks(quant: str, q: Any, k: int) -> tuple[np.ndarray, list[str]]:
    """Rows of nibble patterns (all 0, all 15, alternating, random) with scale 1 and, for q4_1, an
    integer minimum (0 or -8), for q4_onnx a zero point 0, 8 or 15: every value is an integer."""
    nb = k // 32
    rng = rng_for("q4-extreme", quant, k)
    patterns = {
        "all_0": np.zeros((nb, 16), np.uint8),
        "all_15": np.full((nb, 16), 0xFF, np.uint8),
        "lo15_hi0": np.full((nb, 16), 0x0F, np.uint8),
        "lo0_hi15": np.full((nb, 16), 0xF0, np.uint8),
        "random_0_15": rng.choice(np.array([0x00, 0x0F, 0xF0, 0xFF], np.uint8), (nb, 16)),
    }
    extra = {"q4_0": [None], "q4_1": [0.0, -8.0], "q4_onnx": [0, 8, 15]}[quant]
    rows, names = [], []
    for e in extra:
        for name, qs in patterns.items():
            b = np.zeros(nb, q.dtype)
            b["d"] = 1.0
            b["qs"] = qs
            if quant == "q4_1":
                b["m"] = e
            if quant == "q4_onnx":
                b["z"] = e
            rows.append(b)
            names.append(f"{name}" + (f" (extra {e})" if e is not None else ""))
    return np.stack(rows), names


def activation_extremes(target: str, k: int) -> dict[str, np.ndarray]:
    """Activation bytes at each target's extremes: int8 -128/-127/127 on simd128, the 7-bit operand's
    whole range 0/127 (q + 64) on relaxed SIMD."""
    rng = rng_for("q4-act", target, k)
    if target == "simd128":
        v = np.array([-128, -127, 127], np.int8)
        return {"all_-128": np.full(k, -128, np.int8), "all_-127": np.full(k, -127, np.int8),
                "all_127": np.full(k, 127, np.int8), "alt_-128_127": np.resize(v[[0, 2]], k),
                "random": rng.choice(v, k)}
    v = np.array([0, 127], np.uint8)
    return {"all_0": np.zeros(k, np.uint8), "all_127": np.full(k, 127, np.uint8),
            "alt_0_127": np.resize(v, k), "all_64_zero": np.full(k, 64, np.uint8), "random": rng.choice(v, k)}


@pytest.mark.parametrize("quant", Q4_TYPES)
@pytest.mark.parametrize("rows_variant", ROW_TUNES, ids=lambda r: f"rows{r}")
def test_q4_integer_accumulation_is_exact(mode, kgen, rows_variant, quant):
    tune = rows_tune(rows_variant)
    km = kgen(tune)
    q = km.quants[quant]
    zero, _ = consts(km)
    cases = []
    for k in (32, 160, 512):  # |result| <= 512 * (15 * 128 + 8 * 128) < 2^24: exact in f32
        blocks, names = q4_extreme_blocks(quant, q, k)
        cases.append((k, blocks, names, activation_extremes(mode.target, k)))

    def run(m: Kernels) -> list[np.ndarray]:
        out = []
        for _, blocks, _, acts in cases:
            out += unit_scale_qmatvec_and_qdots(m, quant, blocks, acts.values())
        return out

    outs = run(km)
    i = 0
    for k, blocks, names, acts in cases:
        w = q.unpack_ref(blocks).reshape(blocks.shape[0], -1).astype(np.int64)
        off = q.offset_ref(blocks).astype(np.int64)  # integer minima
        for aname, a in acts.items():
            av = a.astype(np.int64) - zero
            want = (w * av).sum(axis=1) + (off * av.reshape(-1, 32).sum(axis=1)).sum(axis=1)
            assert np.abs(want).max() < 2 ** 24
            for kernel in ("qmatvec", "qdot"):
                got = outs[i]
                i += 1
                wrong = got.astype(np.int64) != want
                assert (got == want).all(), (
                    f"{quant} {kernel} k={k} act {aname}: rows {[n for n, b in zip(names, wrong) if b]} "
                    f"got {got[wrong].tolist()} want {want[wrong].tolist()}")
    same_as_deterministic(mode, kgen, tune, run, outs)


def test_reference_qmatvec_magnitude_covers_offset_terms(mode, kgen):
    km = kgen()
    q = km.quants["q4_1"]
    zero, _ = consts(km)
    b = np.zeros((1, 1), q.dtype)
    b["d"], b["m"] = 0.1, -0.75
    vals = np.resize(np.array([7, 8], np.uint8), 32)
    b["qs"][0, 0] = vals[:16] | (vals[16:] << 4)
    assert q.unpack_ref(b).sum() == 240
    act = Act(q=np.full(32, zero + 1, act_dtype(km)), d=np.float32([0.1]))
    y = km.qmatvec(km.pack("q4_1", b), act)
    ref, mag = reference.qmatvec(q.scale_ref(b), q.unpack_ref(b).reshape(1, -1), act.q, act.d, zero, 32,
                                 q.offset_ref(b))
    _, true_mag = q4_reference(km, "q4_1", b, act)
    assert_q_close(y, ref, true_mag, "with the true magnitude")  # the kernel is fine
    assert_q_close(y, ref, mag, "with reference.qmatvec's magnitude")  # fails: mag is |ref| here


def test_q4_wrong_inputs(kernels):
    rng = rng_for("q4-wrong")
    q = kernels.quants["q4_1"]
    b = q4_blocks("q4_1", q, rng, 3, 64, "raw")
    w = kernels.pack("q4_1", b)
    assert (w.rows, w.k, w.quant) == (3, 64, "q4_1") and set(w.planes) == {"q", "scale", "offset", "sum"}
    w0 = kernels.pack("q4_0", q4_blocks("q4_0", kernels.quants["q4_0"], rng, 3, 64, "raw"))
    assert set(w0.planes) == {"q", "scale", "sum"}
    act = kernels.quantize_act(rng.standard_normal(64).astype(np.float32))
    with pytest.raises(ValueError):
        kernels.qmatvec(w, kernels.quantize_act(rng.standard_normal(32).astype(np.float32)))
    with pytest.raises(ValueError):
        kernels.qdot(w, act)  # three rows
    with pytest.raises(ValueError):
        kernels.pack("q4_1", np.zeros((2, 21), np.uint8))  # 20 bytes per block
    with pytest.raises(ValueError):
        kernels.pack("q4_onnx", np.zeros((2, 20), np.uint8))  # 21 bytes per block
    with pytest.raises(ValueError):
        kernels.pack("q4_0", np.zeros((2, 17), np.uint8))  # 18 bytes per block
    assert q.stored_bytes == 20 and kernels.quants["q4_0"].stored_bytes == 18
    assert kernels.quants["q4_onnx"].stored_bytes == 21


# ---- relaxed SIMD determinism, every kernel of this file at once --------------------------------


def test_relaxed_deterministic_flag_changes_no_result(any_module):
    """wasmtime's relaxed_simd_deterministic on and off: every kernel here gives bit-identical output."""
    rng = rng_for("det-all")
    x = rng.uniform(-104, 89, 4099).astype(np.float32)
    g = rng.standard_normal(4099).astype(np.float32)
    s = (rng.standard_normal((5, 37)) * 10).astype(np.float32)
    a64 = rng.uniform(-8192, 8192, 5000)
    l64 = 10.0 ** rng.uniform(-300, 300, 5000)
    xr = rng.standard_normal((3, 128)).astype(np.float32)
    xa = rng.standard_normal(4128).astype(np.float32)
    weights = {qn: q4_blocks(qn, any_module("relaxed-simd").quants[qn], rng, 9, 4128, "raw") for qn in Q4_TYPES}
    for r in ROW_TUNES:
        outs = []
        for det in (True, False):
            m = any_module("relaxed-simd", det, rows_tune(r))
            cos, sin = m.rope_table(512, 128, 1e6, pos0=7)
            act = m.quantize_act(xa)
            out = [m.exp_f32(x), m.silu_f32(x), m.swiglu_f32(x, g), m.softmax_f32(padded_rows(s), 37),
                   m.sin_f64(a64), m.cos_f64(a64), m.exp_f64(a64 / 10), m.log_f64(l64), cos, sin,
                   m.rope(xr, cos[100], sin[100], False), m.rope(xr, cos[100], sin[100], True), act]
            for qn, b in weights.items():
                out += [m.qmatvec(m.pack(qn, b), act), np.float32(m.qdot(m.pack(qn, b[:1]), act))]
            outs.append(out)
        assert_bitwise_equal(outs[0], outs[1], f"relaxed det vs nondet, rows={r}")


def test_pack_rejects_blocks_whose_values_do_not_fit_int8(mode, kgen):
    """q4_onnx's zero point is a UINT4: a byte of 200 would unpack to 0 - 200, outside the kernels'
    int8 weights; pack says so instead of computing garbage."""
    k = kgen()
    q = k.quants["q4_onnx"]
    blocks = np.zeros((1, 1), q.dtype)
    blocks["d"] = 1.0
    blocks["z"] = 200
    with pytest.raises(ValueError, match="outside int8"):
        k.pack("q4_onnx", blocks)
    blocks["z"] = 15
    k.pack("q4_onnx", blocks)  # the extreme of the format is fine
