"""The math and LLM-layer kernels of kernels.dsl against numpy: exp/softmax/SiLU/SwiGLU (f32), sin/cos/
exp/log (f64), RoPE tables and rotation.

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

from kernelgen.host.api import Kernels, padded_rows

from helpers import ROW_TUNES, assert_bitwise_equal, bits_of, rng_for, rows_tune, same_as_deterministic

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
    words (NaNs among them: a kernel reading a partial last vector whole would compute on them), and y (a fresh
    buffer of sentinels, or the first input when `in_place`) too; y is preceded by 8 more (a partial
    vector's lanes come from before it: load_last). Returns y[:n] as float32, the 16 words around
    y[0 .. n - 1] (before, then after), and every input buffer (n + 8 words) as it is after the call."""
    n = inputs[0].size
    m = k.module
    with m.scope():
        ptrs = [m.put(np.concatenate([canaries(8), a.view(np.uint32), canaries(8)])) + 32 for a in inputs]
        if in_place:
            py = ptrs[0]
        else:
            sentinel = np.full(n, np.float32(-777.0)).view(np.uint32)
            py = m.put(np.concatenate([canaries(8), sentinel, canaries(8)])) + 32
        k.call(k.export_name(kernel), *ptrs, py, n)
        y = m.get(py - 32, np.uint32, n + 16)
        after = [m.get(p, np.uint32, n + 8) for p in ptrs]
        return y[8:8 + n].view(np.float32), np.concatenate([y[:8], y[8 + n:]]), after


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
    np.testing.assert_array_equal(tail, canaries(16), err_msg="exp_f32 wrote outside y[0 .. n - 1]")
    np.testing.assert_array_equal(xa, np.concatenate([x.view(np.uint32), canaries(8)]), err_msg="x changed")
    assert_bitwise_equal(yi, y, "in place (y = x) gives the same values")
    np.testing.assert_array_equal(tail_i, canaries(16), err_msg="exp_f32 in place wrote outside x[0 .. n - 1]")
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


# (export, its inputs' count, the API method that gives the same values)
ELEMENTWISE = (("exp_f32", 1, "exp_f32"), ("silu_f32", 1, "silu_f32"), ("swiglu_f32", 2, "swiglu_f32"),
               ("erf_f32", 1, "erf_f32"))


@pytest.mark.parametrize("n", (1, 2, 3, 5, 7), ids=lambda n: f"n{n}")
@pytest.mark.parametrize("kernel, inputs, api", ELEMENTWISE, ids=[e[0] for e in ELEMENTWISE])
def test_elementwise_partial_vector_at_the_end_of_memory(mode, kgen, kernel, inputs, api, n):
    """Every buffer ends exactly where memory does, so a read or a write of the lanes of a partial
    last vector past n (a whole-vector load or read-modify-write) traps; the values equal the API's,
    in place (y = x) too."""
    k = kgen()
    m = k.module
    rng = rng_for(f"end-{kernel}", n)
    xs = [(rng.standard_normal(n) * 4).astype(np.float32) for _ in range(inputs)]
    want = getattr(k, api)(*xs)
    top = m.memory.data_len()
    for in_place in (False, True):
        # each buffer in its own last pages: the buffer i from the end ends where memory does when i = 0
        ptrs = [top - 4 * n - 4096 * i for i in range(inputs + (not in_place))]
        assert min(ptrs) >= m.in_use()
        for p, x in zip(ptrs, xs):
            m.view(p, np.float32, n)[:] = x
        y = ptrs[0] if in_place else ptrs[-1]
        k.call(k.export_name(kernel), *ptrs[:inputs], y, n)
        assert_bitwise_equal(m.get(y, np.float32, n), want, f"{kernel} n={n} at the end of memory (in place: {in_place})")


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
        np.testing.assert_array_equal(tail, canaries(16), err_msg=f"{what} n={n}: wrote outside y[0 .. n - 1]")
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


# ---- relaxed SIMD determinism, every kernel of this file at once --- --------------------------------


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
    for r in ROW_TUNES:
        outs = []
        for det in (True, False):
            m = any_module("relaxed-simd", det, rows_tune(r))
            cos, sin = m.rope_table(512, 128, 1e6, pos0=7)
            act = m.quantize_act(xa)
            out = [m.exp_f32(x), m.silu_f32(x), m.swiglu_f32(x, g), m.softmax_f32(padded_rows(s), 37),
                   m.sin_f64(a64), m.cos_f64(a64), m.exp_f64(a64 / 10), m.log_f64(l64), cos, sin,
                   m.rope(xr, cos[100], sin[100], False), m.rope(xr, cos[100], sin[100], True), act]
            outs.append(out)
        assert_bitwise_equal(outs[0], outs[1], f"relaxed det vs nondet, rows={r}")


