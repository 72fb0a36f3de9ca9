"""The 4-bit quant types (q4_0, q4_1, q4_onnx): their declarations against the gguf references, the
reference quantizers, and their quantized dot and mat-vec kernels.

Every kernel test runs in the three modes of conftest.py (simd128; relaxed SIMD with wasmtime's
relaxed_simd_deterministic on and off). In the relaxed "off" mode each test reruns the same work on
the deterministic module and requires bit-identical outputs (NaN payloads aside).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kernelgen import reference
from kernelgen.host import formats
from kernelgen.host.api import Act, Kernels

from helpers import (ROW_TUNES, assert_bitwise_equal, assert_q_close, consts, rng_for, rows_tune,
                     random_blocks, same_as_deterministic, unit_scale_qmatvec_and_qdots)

Q4_TYPES = ("q4_0", "q4_1", "q4_onnx")


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
    a = k.act_values(act)
    ref, _ = reference.qmatvec(q.scale_ref(blocks), w_int, a, ad, zero, per, offset)
    ad = ad.astype(np.float64)
    t1 = q.scale_ref(blocks).astype(np.float64) * ad * reference.int_dots(w_int, a, zero, per)
    mag = np.abs(t1).sum(axis=1)
    if offset is not None:
        asum = (a.astype(np.int64) - zero).reshape(-1, per).sum(axis=1)
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
    """Activation values at the extremes of quantize_act's range, the same int8 on both targets:
    -127, 127 and 0 (-128 is refused: relaxed SIMD's idots takes |a| in 7 bits)."""
    rng = rng_for("q4-act", target, k)
    v = np.array([-127, 0, 127], np.int8)
    return {"all_-127": np.full(k, -127, np.int8), "all_127": np.full(k, 127, np.int8),
            "alt_-127_127": np.resize(v[[0, 2]], k), "pairs_127_-127": np.resize(v[[2, 2, 0, 0]], k),
            "random": rng.choice(v, k)}


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
    act = km.act_from_values(np.full(32, zero + 1), np.float32([0.1]))
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
    assert (w.rows, w.k, w.quant) == (3, 64, "q4_1") and set(w.planes) == {"q", "scale", "offset"}
    w0 = kernels.pack("q4_0", q4_blocks("q4_0", kernels.quants["q4_0"], rng, 3, 64, "raw"))
    assert set(w0.planes) == {"q", "scale"}
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
    """wasmtime's relaxed_simd_deterministic on and off: every 4-bit kernel gives bit-identical output."""
    rng = rng_for("det-all-q4")
    xa = rng.standard_normal(4128).astype(np.float32)
    weights = {qn: q4_blocks(qn, any_module("relaxed-simd").quants[qn], rng, 9, 4128, "raw") for qn in Q4_TYPES}
    for r in ROW_TUNES:
        outs = []
        for det in (True, False):
            m = any_module("relaxed-simd", det, rows_tune(r))
            act = m.quantize_act(xa)
            out = [act]
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
    blocks["z"], blocks["qs"] = 130, 0xFF  # values fit int8, but the zero point is no UINT4
    with pytest.raises(ValueError, match="z = 130, outside 0..127"):
        k.pack("q4_onnx", blocks)
