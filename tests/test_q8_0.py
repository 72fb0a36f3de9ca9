"""Activation quantization (quantize_act) and GGUF Q8_0: the declaration against the gguf reference,
qdot and qmatvec against kernelgen.reference, exact integer accumulation, wrong inputs, and the
reference quantizers against the gguf package's.

Every kernel test runs in three modes (see conftest.py): simd128, relaxed SIMD with wasmtime's
relaxed_simd_deterministic on, and off. In the "off" mode each test also reruns the same work on
the deterministic module and requires bit-identical outputs.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from kernelgen import reference
from kernelgen.host.api import Act, Kernels
from kernelgen.compiler.parse import parse
from kernelgen.compiler.quant import check_quant

from conftest import TARGETS
from helpers import (ROW_TUNES, act_dtype, assert_bitwise_equal, assert_q_close, consts, rng_for, rows_tune,
                     same_as_deterministic, unit_scale_qmatvec_and_qdots)

Q_K = (32, 64, 96, 160, 4096 + 32)  # one block ... not a multiple of 128
Q_ROWS = (1, 2, 3, 5, 7, 9, 33, 300)  # 300: qtiles' windows of slabs (SLAB_ROWS) and the rows past them
QBLOCK = 32


# ---- helpers -----------------------------------------------------------------------------------


def q8_blocks(values: np.ndarray, scale: float | np.ndarray = 1.0) -> np.ndarray:
    """int8 weights (rows, k) -> Q8_0 blocks (rows, k // 32) with f16 scale `scale`."""
    rows, k = values.shape
    b = np.empty((rows, k // QBLOCK), reference.Q8_0)
    b["d"] = scale
    b["qs"] = values.reshape(rows, -1, QBLOCK)
    return b


def random_weights(kind: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Q8_0 blocks: GGUF-quantized normal data, or random stored bytes (every int8 incl. -128, f16
    scales of both signs)."""
    if kind == "gguf":
        x = rng.standard_normal((rows, k)).astype(np.float32) * rng.uniform(0.1, 3, (rows, 1)).astype(np.float32)
        return reference.quantize_q8_0(x)
    qs = rng.integers(-128, 128, (rows, k), dtype=np.int8)
    return q8_blocks(qs, rng.uniform(-0.05, 0.05, (rows, k // QBLOCK)).astype(np.float16))


def q8_reference(k: Kernels, blocks: np.ndarray, act: Act) -> tuple[np.ndarray, np.ndarray]:
    q = k.quants["q8_0"]
    rows = blocks.shape[0]
    zero, _ = consts(k)
    return reference.qmatvec(q.scale_ref(blocks), q.unpack_ref(blocks).reshape(rows, -1), k.act_values(act), act.d, zero, QBLOCK)


# ---- quantize_act ------------------------------------------------------------------------------


def _blocks(*parts: np.ndarray) -> np.ndarray:
    x = np.concatenate([np.asarray(p, np.float32).reshape(-1) for p in parts])
    assert x.size % 32 == 0
    return x


def _ties(act_max: int) -> np.ndarray:
    """Blocks whose scaled values fall exactly on .5: scales d = 1, 0.5 and 2 (exact in f32)."""
    out = []
    for d in (1.0, 0.5, 2.0):
        t = np.array([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5, act_max - 0.5, -(act_max - 0.5),
                      10.5, -10.5, 0.0, -0.0, act_max, -act_max], np.float64)
        b = np.resize(t, 32) * d
        b[0] = act_max * d  # amax: d exact
        out.append(b)
    return _blocks(*out)


QACT_CASES: dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
    "normal_32": lambda r, m: r.standard_normal(32),
    "normal_64": lambda r, m: r.standard_normal(64),
    "normal_96": lambda r, m: r.standard_normal(96) * np.repeat(r.uniform(0.01, 100, 3), 32),
    "normal_4096": lambda r, m: r.standard_normal(4096) * np.repeat(10.0 ** r.uniform(-6, 6, 128), 32),
    "huge_1e30": lambda r, m: r.standard_normal(64) * 1e30,
    "near_f32_max": lambda r, m: r.uniform(-3.4e38, 3.4e38, 32),
    "tiny_1e-30": lambda r, m: r.standard_normal(64) * 1e-30,
    "subnormal_1e-40": lambda r, m: r.standard_normal(64) * 1e-40,
    "smallest_subnormal": lambda r, m: _blocks(np.where(r.random(32) < 0.5, 1.4e-45, -1.4e-45),
                                               np.r_[1.4e-45, np.zeros(31)]),
    "mixed_magnitudes": lambda r, m: _blocks(np.r_[1e30, 1e-30, 1e-40, -1e30, r.standard_normal(28)],
                                             np.r_[1e-40, 1e-30, r.standard_normal(30) * 1e-38]),
    "zeros_block": lambda r, m: _blocks(np.zeros(32), r.standard_normal(32), np.zeros(32)),
    "neg_zero_block": lambda r, m: _blocks(np.full(32, -0.0), np.r_[-0.0, r.standard_normal(31)]),
    "nan_blocks": lambda r, m: _blocks(np.r_[np.nan, r.standard_normal(31)], np.full(32, np.nan),
                                       r.standard_normal(32), np.r_[r.standard_normal(31), np.nan]),
    "pos_inf": lambda r, m: _blocks(np.r_[r.standard_normal(5), np.inf, r.standard_normal(26)],
                                    r.standard_normal(32)),
    "neg_inf": lambda r, m: _blocks(r.standard_normal(32), np.r_[r.standard_normal(31), -np.inf]),
    "both_infs_and_zero": lambda r, m: _blocks(np.r_[np.inf, -np.inf, 0.0, -0.0, r.standard_normal(28)]),
    "inf_and_nan": lambda r, m: _blocks(np.r_[np.inf, np.nan, r.standard_normal(30)]),
    "ties": lambda r, m: _ties(m),
    "integers_at_scale": lambda r, m: _blocks(np.r_[m, r.integers(-m, m + 1, 31)].astype(np.float64)),
}


@pytest.mark.parametrize("case", list(QACT_CASES))
def test_quantize_act_matches_reference_exactly(mode, kgen, case):
    k = kgen()
    zero, act_max = consts(k)
    with np.errstate(all="ignore"):
        x = QACT_CASES[case](rng_for("qact", case), act_max).astype(np.float32)

    def run(m: Kernels) -> Act:
        return m.quantize_act(x)

    act = run(k)
    ref_q, ref_d = reference.quantize_act(x, act_max, zero)
    assert act.q.dtype == act_dtype(k)  # the stored layout (int16 on simd128); the values are the reference's
    assert act.q.shape == ref_q.shape == x.shape
    assert act.d.dtype == np.float32 and act.d.shape == ref_d.shape == (x.size // 32,)
    np.testing.assert_array_equal(k.act_values(act), ref_q, err_msg=f"quantize_act {case}: q differs")
    nan = np.isnan(ref_d)
    np.testing.assert_array_equal(np.isnan(act.d), nan, err_msg=f"quantize_act {case}: NaN scales differ")
    np.testing.assert_array_equal(act.d[~nan].view(np.uint32), ref_d[~nan].view(np.uint32),
                                  err_msg=f"quantize_act {case}: d differs")
    # each block's sum of its values (the kernels take the zero and minimum terms from it)
    assert act.s.dtype == np.int32 and act.s.shape == act.d.shape
    np.testing.assert_array_equal(act.s, (ref_q.astype(np.int64) - zero).reshape(-1, 32).sum(-1),
                                  err_msg=f"quantize_act {case}: sums differ")
    same_as_deterministic(mode, kgen, None, run, act)


def test_quantize_act_ties_round_half_to_even(kernels):
    zero, act_max = consts(kernels)
    x = np.resize(np.array([act_max, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5], np.float32), 32)
    act = kernels.quantize_act(x)
    assert act.d[0] == 1.0
    want = np.resize(np.array([act_max, 0, 2, 2, 0, -2, -2, 4]), 32) + zero
    np.testing.assert_array_equal(kernels.act_values(act).astype(np.int64), want)


def test_quantize_act_nan_gives_zero(kernels):
    zero, _ = consts(kernels)
    x = np.r_[np.full(32, np.nan), np.r_[np.nan, np.ones(31)]].astype(np.float32)
    act = kernels.quantize_act(x)
    assert (kernels.act_values(act)[:33].astype(np.int64) == zero).all()


def test_quantize_act_stored_range_for_finite_inputs(mode, kgen):
    k = kgen()
    zero, act_max = consts(k)
    rng = rng_for("qact-range")
    scales = np.repeat(np.r_[10.0 ** rng.uniform(-44, 38, 120), 0.0, 3.4e38, 1e-45, 1.0, 1e-40, 7, 8, 9], 32)
    x = np.clip(rng.standard_normal(scales.size) * scales, -3.4e38, 3.4e38).astype(np.float32)
    x[rng.random(x.size) < 0.05] = -0.0
    assert np.isfinite(x).all() and x.size == 128 * 32
    act = k.quantize_act(x)
    q = act.q.astype(np.int64)
    # int8 values on both targets, stored widened for the i16 dot on simd128
    assert act.q.dtype == (np.int16 if k.target == "simd128" else np.int8)
    assert q.min() >= -127 and q.max() <= 127
    assert np.abs(q - zero).max() == act_max  # each block's amax maps to +-ACT_MAX
    assert np.isfinite(act.d).all() and (act.d >= 0).all()


def test_quantize_act_wrong_inputs(kernels):
    with pytest.raises(TypeError):
        kernels.quantize_act(np.zeros(32, np.float64))
    with pytest.raises(TypeError):
        kernels.quantize_act(list(range(32)))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        kernels.quantize_act(np.zeros(33, np.float32))
    with pytest.raises(ValueError):
        kernels.quantize_act(np.zeros(0, np.float32))
    with pytest.raises(ValueError):
        kernels.quantize_act(np.zeros((2, 2, 32), np.float32))
    with pytest.raises(ValueError):
        kernels.quantize_act(np.zeros((2, 33), np.float32))
    with pytest.raises(ValueError):
        kernels.quantize_act(np.zeros((0, 32), np.float32))
    assert kernels.quantize_act(np.ones(32, np.float32)).d[0] > 0


# ---- Q8_0: the declaration in kernels.dsl vs the GGUF reference (no wasm) -------------------------


@pytest.fixture(scope="module")
def q8(dsl_source):
    (q,) = [check_quant(d) for d in parse(dsl_source).quants if d.name == "q8_0"]
    return q


def test_q8_0_dtype_is_the_gguf_block(q8, module_cache):
    assert q8.dtype == reference.Q8_0
    assert q8.dtype.itemsize == 34 and q8.stored_bytes == 34 and q8.block == 32
    assert [(f.name, f.offset) for f in q8.fields] == [("d", 0), ("qs", 2)]
    for target in TARGETS:  # the manifest's copy of the declaration is the same
        assert module_cache.get(target).quants["q8_0"] == q8


@pytest.mark.parametrize("shape", [(1, 32), (3, 96), (5, 4096 + 32)])
def test_q8_0_dequantize_ref_equals_gguf_reference(q8, shape):
    rng = rng_for("q8-deq", shape)
    x = (rng.standard_normal(shape) * rng.uniform(1e-3, 1e3, (shape[0], 1))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block (d = 0)
    blocks = reference.quantize_q8_0(x)
    assert blocks.dtype == reference.Q8_0 and blocks.shape == (shape[0], shape[1] // 32)
    got = q8.dequantize_ref(blocks)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, reference.dequantize_q8_0(blocks))
    # and for arbitrary stored bytes (every int8 incl. -128, any finite f16 scale incl. subnormal/neg)
    raw = rng.integers(0, 256, (shape[0], shape[1] // 32 * 34), dtype=np.uint8)
    sb = raw.view(reference.Q8_0)
    sb["d"] = np.where(np.isfinite(sb["d"]), sb["d"], np.float16(1.0))
    np.testing.assert_array_equal(q8.dequantize_ref(sb), reference.dequantize_q8_0(sb))
    np.testing.assert_array_equal(q8.unpack_ref(sb), sb["qs"].astype(np.int32))
    np.testing.assert_array_equal(q8.scale_ref(sb), sb["d"].astype(np.float32))
    np.testing.assert_array_equal(q8.dequantize_ref(raw), q8.dequantize_ref(sb))


def test_q8_0_pack_raw_bytes_equals_structured(q8):
    rng = rng_for("q8-pack")
    blocks = random_weights("raw", 4, 160, rng)
    raw = blocks.view(np.uint8).reshape(4, 5 * 34)
    a, b = q8.pack(blocks), q8.pack(raw)
    assert list(a) == list(b) == ["q", "scale"]
    for name in a:
        assert a[name].dtype == b[name].dtype
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    np.testing.assert_array_equal(a["q"].view(np.int8), blocks["qs"].reshape(-1))
    np.testing.assert_array_equal(a["scale"], blocks["d"].astype(np.float32).reshape(-1))


def test_strided_and_empty_inputs(mode, kgen):
    k = kgen()
    rng = rng_for("strided")
    x = rng.standard_normal(256).astype(np.float32)
    assert_bitwise_equal(k.quantize_act(x[::2]), k.quantize_act(x[::2].copy()), "strided quantize_act")
    assert_bitwise_equal(k.dot_f32(x[::2], x[1::2]), k.dot_f32(x[::2].copy(), x[1::2].copy()), "strided dot")
    w = rng.standard_normal((6, 64)).astype(np.float32)
    assert_bitwise_equal(k.matvec_f32(w[::2, ::2], x[:32]), k.matvec_f32(w[::2, ::2].copy(), x[:32]),
                         "strided matvec")
    assert k.matvec_f32(np.zeros((0, 5), np.float32), np.ones(5, np.float32)).shape == (0,)
    blocks = random_weights("raw", 3, 160, rng)
    raw = blocks.view(np.uint8).reshape(3, 5 * 34)
    act = k.quantize_act(x[:64])
    assert_bitwise_equal(k.qmatvec(k.pack("q8_0", raw[:, :68]), act),  # a non-contiguous byte slice
                         k.qmatvec(k.pack("q8_0", blocks[:, :2].copy()), act), "sliced raw blocks")


def test_module_pack_raw_bytes_equals_structured(mode, kgen):
    rng = rng_for("pack-raw")
    blocks = random_weights("gguf", 5, 96, rng)
    raw = blocks.view(np.uint8).reshape(5, 3 * 34)
    x = rng.standard_normal(96).astype(np.float32)

    def run(k: Kernels) -> list[np.ndarray]:
        act = k.quantize_act(x)
        ws, wr = k.pack("q8_0", blocks), k.pack("q8_0", raw)
        assert (ws.rows, ws.k, ws.quant) == (wr.rows, wr.k, wr.quant) == (5, 96, "q8_0")
        return [k.qmatvec(ws, act), k.qmatvec(wr, act)]

    ys, yr = run(kgen())
    assert_bitwise_equal(ys, yr, "structured vs raw-byte blocks")
    same_as_deterministic(mode, kgen, None, run, [ys, yr])


# ---- qdot / qmatvec vs the reference -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["gguf", "raw"])
@pytest.mark.parametrize("k", Q_K, ids=lambda k: f"k{k}")
@pytest.mark.parametrize("rows_variant", ROW_TUNES, ids=lambda r: f"rows{r}")
def test_qmatvec_matches_reference(mode, kgen, rows_variant, k, kind):
    tune = rows_tune(rows_variant)
    assert kgen(tune).tune_of("qmatvec", "q8_0")["rows"] == rows_variant
    rng = rng_for("qmatvec", k, kind)
    x = (rng.standard_normal(k) * np.repeat(rng.uniform(0.1, 10, k // 32), 32)).astype(np.float32)
    weights = [random_weights(kind, rows, k, rng) for rows in Q_ROWS]

    def run(m: Kernels) -> tuple[Act, list[np.ndarray]]:
        act = m.quantize_act(x)
        return act, [m.qmatvec(m.pack("q8_0", b), act) for b in weights]

    km = kgen(tune)
    act, ys = run(km)
    for b, y in zip(weights, ys):
        assert y.shape == (b.shape[0],) and y.dtype == np.float32
        ref, mag = q8_reference(km, b, act)
        assert_q_close(y, ref, mag, f"qmatvec rows={b.shape[0]} k={k} {kind}")
    same_as_deterministic(mode, kgen, tune, run, [act, ys])


@pytest.mark.parametrize("kind", ["gguf", "raw"])
@pytest.mark.parametrize("k", Q_K, ids=lambda k: f"k{k}")
def test_qdot_matches_reference(mode, kgen, k, kind):
    rng = rng_for("qdot", k, kind)
    x = rng.standard_normal(k).astype(np.float32)
    blocks = random_weights(kind, 1, k, rng)

    def run(m: Kernels) -> tuple[Act, float]:
        act = m.quantize_act(x)
        return act, m.qdot(m.pack("q8_0", blocks), act)

    km = kgen()
    act, got = run(km)
    assert isinstance(got, float)
    ref, mag = q8_reference(km, blocks, act)
    assert_q_close(np.array([got], np.float32), ref, mag, f"qdot k={k} {kind}")
    same_as_deterministic(mode, kgen, None, run, [act, got])


def test_qmatvec_approximates_float_matvec(kernels):
    """Sanity of the whole chain against plain float math (loose: quantization error)."""
    rng = rng_for("qmatvec-float")
    w = rng.standard_normal((16, 1024)).astype(np.float32)
    x = rng.standard_normal(1024).astype(np.float32)
    blocks = reference.quantize_q8_0(w)
    y = kernels.qmatvec(kernels.pack("q8_0", blocks), kernels.quantize_act(x))
    yf = reference.dequantize_q8_0(blocks).astype(np.float64) @ x
    assert np.linalg.norm(y - yf) <= 0.05 * np.linalg.norm(yf)


def test_qmatvec_deterministic_on_off_identical(any_module):
    rng = rng_for("q-det")
    x = rng.standard_normal(4096 + 32).astype(np.float32)
    blocks = random_weights("raw", 9, x.size, rng)
    for r in ROW_TUNES:
        outs = []
        for det in (True, False):
            m = any_module("relaxed-simd", det, rows_tune(r))
            act = m.quantize_act(x)
            w = m.pack("q8_0", blocks)
            outs.append([act, m.qmatvec(w, act), m.qdot(m.pack("q8_0", blocks[:1]), act)])
        assert_bitwise_equal(outs[0], outs[1], f"rows={r}")


# ---- exact integer accumulation ----------------------------------------------------------------

EXACT_K = (32, 160, 512)  # |sum| <= 512 * 128 * 128 = 2^23: every partial sum is exact in f32


def weight_patterns(k: int) -> dict[str, np.ndarray]:
    alt = np.resize(np.array([-128, 127], np.int8), k)
    rng = rng_for("exact-w", k)
    return {
        "all_-128": np.full(k, -128, np.int8),
        "all_127": np.full(k, 127, np.int8),
        "alt_-128_127": alt,
        "alt_127_-128": alt[::-1].copy() if k % 2 == 0 else np.roll(alt, 1),
        "pairs_-128": np.resize(np.array([-128, -128, 127, 127], np.int8), k),
        "random_extremes": rng.choice(np.array([-128, 127], np.int8), k),
        "random_int8": rng.integers(-128, 128, k, dtype=np.int8),
    }


def activation_patterns(target: str, k: int) -> dict[str, np.ndarray]:
    """Activation values at the extremes of quantize_act's range [-127, 127], the same int8 on both
    targets (-128 is refused: test_act_values_outside_the_range_are_refused)."""
    rng = rng_for("exact-a", target, k)
    v = np.array([-127, 0, 127], np.int8)
    return {
        "all_-127": np.full(k, -127, np.int8),
        "all_127": np.full(k, 127, np.int8),
        "alt_-127_127": np.resize(v[[0, 2]], k),
        "alt_127_-127": np.resize(v[[2, 0]], k),
        "pairs_127_-127": np.resize(v[[2, 2, 0, 0]], k),
        "random_extremes": rng.choice(v[[0, 2]], k),
        "random_with_zeros": rng.choice(v, k),
    }


def test_act_values_outside_the_range_are_refused(kernels):
    """-128 is a valid int8 but outside quantize_act's range: relaxed SIMD's idots takes |a| in the
    relaxed dot's 7-bit operand, so act_from_values refuses it on both targets."""
    with pytest.raises(ValueError, match=r"\[-127, 127\]"):
        kernels.act_from_values(np.r_[-128, np.zeros(31, np.int8)].astype(np.int8), np.ones(1, np.float32))
    with pytest.raises(ValueError, match=r"\[-127, 127\]"):
        kernels.act_from_values(np.full(32, 128), np.ones(1, np.float32))


@pytest.mark.parametrize("k", EXACT_K, ids=lambda k: f"k{k}")
@pytest.mark.parametrize("rows_variant", ROW_TUNES, ids=lambda r: f"rows{r}")
def test_integer_accumulation_is_exact(mode, kgen, rows_variant, k):
    """Extreme weights and activations, whole four-block groups of them (k 512): also the bound of
    simd128's split dot (DOT_SHIFT 8: a group's lane holds one block's 32 products of up to
    128 * 128 * 256, 2^27, before qexact shifts it out)."""
    tune = rows_tune(rows_variant)
    km = kgen(tune)
    zero, _ = consts(km)
    wp = weight_patterns(k)
    w = np.stack(list(wp.values()))  # 7 rows: a full group of 4 (or 2) plus a tail
    blocks = q8_blocks(w, 1.0)
    acts = activation_patterns(mode.target, k)

    def run(m: Kernels) -> list[np.ndarray]:
        return unit_scale_qmatvec_and_qdots(m, "q8_0", blocks, acts.values())

    outs = run(km)
    for i, (aname, a) in enumerate(acts.items()):
        want = (w.astype(np.int64) * (a.astype(np.int64) - zero)[None, :]).sum(axis=1)
        assert np.abs(want).max() < 2 ** 24
        for kernel, got in (("qmatvec", outs[2 * i]), ("qdot", outs[2 * i + 1])):
            wrong = got.astype(np.int64) != want
            assert not wrong.any() and (got == want).all(), (
                f"{kernel} k={k} act {aname}: weights {[n for n, b in zip(wp, wrong) if b]} "
                f"got {got[wrong].tolist()} want {want[wrong].tolist()}")
    same_as_deterministic(mode, kgen, tune, run, outs)


def test_integer_accumulation_with_scales(mode, kgen):
    """Exact too with power-of-two weight and activation scales: weights in [-4, 4], scales
    2^-2..2^2 and 2^-1..2^1 keep every term a multiple of 2^-3 below 2^18, 8 blocks below 2^21."""
    k = 256
    km = kgen()
    zero, _ = consts(km)
    rng = rng_for("exact-scaled", mode.target)
    w = rng.integers(-4, 5, (5, k), dtype=np.int8)
    scales = (2.0 ** rng.integers(-2, 3, (5, k // 32))).astype(np.float16)
    blocks = q8_blocks(w, scales)
    a = activation_patterns(mode.target, k)["random_extremes"]
    ad = (2.0 ** rng.integers(-1, 2, k // 32)).astype(np.float32)

    def run(m: Kernels) -> np.ndarray:
        return m.qmatvec(m.pack("q8_0", blocks), m.act_from_values(a, ad))

    got = run(km)
    ref, _ = reference.qmatvec(scales.astype(np.float32), w.astype(np.int32), a, ad, zero, 32)
    np.testing.assert_array_equal(got.astype(np.float64), ref)
    same_as_deterministic(mode, kgen, None, run, got)


# ---- wrong inputs: clear errors, no crash, no leaked memory -------------------------------------


def test_q_wrong_inputs_raise_clear_errors(kernels):
    rng = rng_for("wrong")
    blocks = random_weights("gguf", 3, 64, rng)
    w = kernels.pack("q8_0", blocks)
    w1 = kernels.pack("q8_0", blocks[:1])
    act = kernels.quantize_act(rng.standard_normal(64).astype(np.float32))
    short = kernels.quantize_act(rng.standard_normal(32).astype(np.float32))
    mark = kernels.module.in_use()
    with pytest.raises(ValueError, match="activations"):
        kernels.qmatvec(w, short)
    with pytest.raises(ValueError):
        kernels.qdot(w1, short)
    with pytest.raises(TypeError, match="pack"):
        kernels.qmatvec(blocks, act)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        kernels.qmatvec(kernels.quants["q8_0"].pack(blocks)["q"], act)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        kernels.qdot(blocks[:1], act)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        kernels.qmatvec(w, act.q)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        kernels.qdot(w, act)  # three rows: not a dot
    with pytest.raises(ValueError):
        kernels.pack("q8_0", blocks.reshape(-1))  # 1-D structured
    with pytest.raises(ValueError):
        kernels.pack("q8_0", blocks.view(np.uint8).reshape(-1))  # 1-D bytes
    with pytest.raises(ValueError, match="34"):
        kernels.pack("q8_0", np.zeros((2, 35), np.uint8))
    with pytest.raises(ValueError):
        kernels.pack("q8_0", np.zeros((2, 33), np.uint8))
    with pytest.raises(ValueError):
        kernels.pack("q8_0", np.zeros((2, 34), np.float32))
    with pytest.raises(KeyError, match="no_such_quant"):
        kernels.pack("no_such_quant", blocks)
    with pytest.raises(KeyError):
        kernels.export_name("qmatvec", "no_such_quant")
    with pytest.raises(KeyError):
        kernels.export_name("no_such_kernel")
    assert kernels.module.in_use() == mark  # nothing allocated by the failed calls
    ref, mag = q8_reference(kernels, blocks, act)  # and the module still works
    assert_q_close(kernels.qmatvec(w, act), ref, mag, "after errors")


def test_act_with_wrong_scale_count_is_rejected(kernels):
    k = 64
    w = kernels.pack("q8_0", q8_blocks(np.ones((1, k), np.int8)))
    zero, _ = consts(kernels)
    sums = np.full(k // 32, 32 * (zero + 1), np.int32)
    bad = Act(q=np.full(k, zero + 1, act_dtype(kernels)), d=np.ones(1, np.float32), s=sums)  # needs 2 scales
    with pytest.raises(ValueError, match="scales"):
        kernels.qmatvec(w, bad)
    bad = Act(q=np.full(k, zero + 1, act_dtype(kernels)), d=np.ones(k // 32, np.float32), s=sums[:1])  # and 2 sums
    with pytest.raises(ValueError, match="sums"):
        kernels.qmatvec(w, bad)


def test_act_with_wrong_byte_dtype_is_rejected(kernels):
    k = 64
    w = kernels.pack("q8_0", q8_blocks(np.ones((1, k), np.int8)))
    bad = Act(q=np.ones(k, np.float32), d=np.ones(k // 32, np.float32), s=np.full(k // 32, 32, np.int32))  # 4 bytes per value
    with pytest.raises(TypeError, match="activation values"):
        kernels.qmatvec(w, bad)


# ---- the references against the gguf package's quantizers ------------------------------------


def _gguf_rows(rng: np.random.Generator) -> np.ndarray:
    """f32[rows, 64]: blocks of tie values (amax 127: Q8_0's d = 1, so each value is what gets
    rounded), signed zeros, halves, then random rows at two scales."""
    ties = np.float32([0.49999997, 0.5, -0.5, 1.5, -2.5, 2.5000002, 126.5, -126.5, 0.0, -0.0, 3.0, 127.0]
                      + [0.25] * 20)
    halves = np.arange(-16, 16, dtype=np.float32) + np.float32(0.5)
    special = np.stack([np.concatenate([ties, -ties]), np.concatenate([halves, halves / 8])])
    return np.concatenate([special, rng.standard_normal((8, 64)) * 3, rng.uniform(-1, 1, (4, 64)) * 1e-3]
                          ).astype(np.float32)


@pytest.mark.parametrize("quant", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_reference_quantizers_are_byte_identical_to_gguf(quant):
    """reference.quantize_* equal the gguf package's quantizers (llama.cpp's, C roundf) byte for byte,
    on tie values as well as random data."""
    import gguf  # a test dependency (pyproject.toml: test extra)
    x = _gguf_rows(np.random.default_rng(11))
    ours = {"q8_0": reference.quantize_q8_0, "q4_0": reference.quantize_q4_0, "q4_1": reference.quantize_q4_1,
            "q5_0": reference.quantize_q5_0, "q5_1": reference.quantize_q5_1}[quant](x)
    theirs = gguf.quants.quantize(x, getattr(gguf.GGMLQuantizationType, quant.upper()))
    assert ours.view(np.uint8).reshape(theirs.shape).tobytes() == theirs.tobytes()


def test_roundf_ties_away_from_zero_in_float32():
    v = np.float32([0.49999997, 0.5, 1.5, 2.5, -0.5, -2.5, -0.49999997, 8388607.5, 3e30, -0.0])
    assert reference.roundf(v).tolist() == [0.0, 1.0, 2.0, 3.0, -1.0, -3.0, -0.0, 8388608.0, float(np.float32(3e30)), -0.0]
