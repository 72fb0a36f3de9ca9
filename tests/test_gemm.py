"""Matrix products: qmatmul (every quant type) and matmul_f32 (both attention forms).

The property the prefill kernels promise: row t of qmatmul(W, A) is qmatvec(W, A[t]) bit for bit,
for every quant type, target, tile variant, qmatvec summation variant (its `accs`) and thread
count. Integer parts are checked exactly on codes and activations at their extremes; float
results against float64 numpy within the bounds kernels.dsl states.
"""
from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np
import pytest

from conftest import DSL_PATH, TARGETS
from helpers import act_dtype, assert_bitwise_equal, assert_q_close, consts, random_blocks, rng_for
from kernelgen.compiler.build import Built, compile_source, from_built
from kernelgen.compiler.check import check, variants
from kernelgen.compiler.parse import parse
from kernelgen.host.api import Act, Kernels
from kernelgen.tuning.tune import run_case

SOURCE = DSL_PATH.read_text(encoding="utf-8")
CHECKED = check(parse(SOURCE))
QUANTS = tuple(CHECKED.quants)
QMATMUL_TILES = variants(CHECKED, "qmatmul")
ACCS = tuple(t.domain for t in CHECKED.kernels["qmatvec"].ast.tunes if t.name == "accs")[0]
# Shapes with every token and row tail below the largest tile (4), K of one block and K past a
# multiple of four blocks (qstep1's leftover blocks, for accs 1 and 2), and rows enough for qtiles'
# windows of slabs (kernels.dsl's SLAB_ROWS, 64: two windows of four 64-row slabs and 75 rows past them).
Q_SHAPES = ((1, 1, 32), (3, 5, 32), (5, 7, 288), (4, 6, 128), (2, 9, 160), (2, 587, 32))


@functools.lru_cache(maxsize=None)
def _built(target: str, tune_json: str) -> Built:
    (b,) = compile_source(SOURCE, str(DSL_PATH), targets=(target,), tune=json.loads(tune_json))
    return b


def module(target: str, tune: dict, deterministic: bool = True) -> Kernels:
    """A module per (target, tune), compiled once; instantiated fresh for each wasmtime mode."""
    return from_built(_built(target, json.dumps(tune, sort_keys=True)), deterministic)


def blocks_for(k: Kernels, quant: str, rows: int, kk: int, rng: np.random.Generator, extreme: bool) -> np.ndarray:
    """Stored blocks of `quant` from its declaration (helpers.random_blocks), or (extreme) integer
    blocks at their format's ends: value bytes only 0x00, 0x0F, 0xF0, 0x7F, 0x80, 0xFF, other byte
    arrays (packed sub-block scales) 0 or 1, the scale 1 (the first float field, or else the first
    scalar field's value that gives scale 1, as an e8m0 exponent needs), other float fields
    (minima) 0 or -8, other integer fields (zero points) 0, 8 or 15."""
    q = k.quants[quant]
    b = random_blocks(q, rows, kk // q.block, rng)
    if not extreme:
        return b
    scalars = [f for f in q.fields if f.count is None]
    floats = [f for f in scalars if f.type in ("f16", "f32")]
    scale = floats[0] if floats else scalars[0]
    for f in q.fields:
        if f.count is not None:
            pick = np.array([0x00, 0x0F, 0xF0, 0x7F, 0x80, 0xFF] if f.name in q.value_fields else [0, 1], np.uint8)
            b[f.name] = rng.choice(pick, b[f.name].shape).view(b[f.name].dtype)
        elif f is scale and f in floats:
            b[f.name] = 1.0
        elif f is scale:
            b[f.name] = _unit_scale_value(q, b[:1, :1].copy(), f.name)
        elif f in floats:
            b[f.name] = rng.choice([0.0, -8.0], b.shape)
        else:
            b[f.name] = rng.choice([0, 8, 15], b.shape)
    # 6-bit sub-block scales stored + 32 kept to 0 or 1, so the sums stay exact in f32 (a scale of
    # -32 would take them past 2^24): IQ4_XS's ls - 32 (packed in scales_l and scales_h), Q3_K's sc - 32
    if quant == "iq4_xs":
        b["scales_h"] = 0xAAAA
        b["scales_l"] = rng.choice(np.array([0x00, 0x01, 0x10, 0x11], np.uint8), b["scales_l"].shape)
    if quant == "q3_k":  # low nibbles in bytes 0-7, top two bits (2: stored 32 + the nibble) in 8-11
        b["scales"][..., :8] = rng.choice(np.array([0x00, 0x01, 0x10, 0x11], np.uint8), b["scales"][..., :8].shape)
        b["scales"][..., 8:] = 0xAA
    return b


def _unit_scale_value(q: Any, block: np.ndarray, field: str) -> int:
    """The value of integer field `field` that makes `block`'s scale 1."""
    for v in range(256):
        block[field] = v
        if q.scale_ref(block).flat[0] == 1:
            return v
    raise AssertionError(f"{q.name}: no value of {field} gives scale 1")


def row_length(k: Kernels, quant: str, k32: int) -> int:
    """A row length of the same number of blocks as k32 has blocks of 32, in `quant`'s blocks
    (super-blocks of 256 hold eight)."""
    return k32 * k.quants[quant].block // 32


def token_acts(k: Kernels, m: int, kk: int, rng: np.random.Generator) -> tuple[np.ndarray, Act]:
    """m tokens of normal data with a zero block and an outlier block, quantized in one call."""
    x = rng.standard_normal((m, kk)).astype(np.float32)
    x[0, :32] = 0.0
    if kk > 32:
        x[-1, 32:64] *= 1e4
    return x, k.quantize_act(x)


def row_of(act: Act, t: int) -> Act:
    return Act(act.q[t], act.d[t], act.s[t])


# ---- prefill equals decode ---------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("accs", ACCS, ids=lambda a: f"accs{a}")
@pytest.mark.parametrize("tile", QMATMUL_TILES, ids=lambda t: f"{t['tokens']}x{t['rows']}")
def test_qmatmul_rows_are_qmatvec_bit_for_bit(target, accs, tile):
    """Every quant type, both wasmtime modes, 1-3 threads with several chunk sizes."""
    tune = {"qmatmul": tile, "qmatvec": {"rows": 1, "accs": accs}}
    outs = {}
    for det in (True, False) if target == "relaxed-simd" else (True,):
        k = module(target, tune, det)
        assert k.tune_of("qmatmul", "q8_0") == tile and k.tune_of("qmatvec", "q8_0")["accs"] == accs
        got = []
        with k.pool(3) as pool:
            for quant in QUANTS:
                for m, n, k32 in Q_SHAPES:
                    kk = row_length(k, quant, k32)
                    rng = rng_for("prefill", quant, m, n, kk)
                    w = k.pack(quant, blocks_for(k, quant, n, kk, rng, extreme=False))
                    x, act = token_acts(k, m, kk, rng)
                    y = k.qmatmul(w, act)
                    assert y.shape == (m, n) and y.dtype == np.float32
                    for t in range(m):
                        one = k.quantize_act(x[t])
                        assert_bitwise_equal(one.q, act.q[t], f"quantize_act row {t}")
                        assert_bitwise_equal(k.qmatvec(w, one), y[t], f"{quant} {m}x{n}x{kk} token {t} vs qmatvec")
                    for threads in (1, 2, 3):
                        pool.set_threads(threads)
                        for chunk in (1, 3, None):
                            assert_bitwise_equal(k.qmatmul(w, act, pool, chunk), y,
                                                 f"{quant} {m}x{n}x{kk} on {threads} threads, chunk {chunk}")
                    got[len(got):] = [y]
        outs[det] = got
        k.reset()
    if len(outs) == 2:
        assert_bitwise_equal(outs[True], outs[False], "relaxed deterministic vs not")


# ---- exactness and the reference ---------------------------------------------------------------


def activation_rows(k: Kernels, m: int, kk: int, rng: np.random.Generator) -> np.ndarray:
    """m rows of activation values at their extremes, -127 / 127 (quantize_act's range, the same on
    both targets), whole rows and random mixes."""
    lo, hi = -127, 127
    rows = [np.full(kk, lo), np.full(kk, hi), np.resize([lo, hi], kk)]
    while len(rows) < m:
        rows.append(rng.choice([lo, hi], kk))
    return np.stack(rows[:m]).astype(act_dtype(k))


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("target", TARGETS)
def test_qmatmul_integer_parts_are_exact(target, quant):
    """Integer scales, extreme codes and activations: every result is the exact integer sum."""
    for tile in QMATMUL_TILES:
        k = module(target, {"qmatmul": tile})
        q = k.quants[quant]
        zero, _ = consts(k)
        for m, n, k32 in ((5, 7, 32), (6, 5, 160), (3, 3, 512)):
            kk = -(-k32 // q.block) * q.block  # |sum| <= 512 * 128 * (128 + 8) < 2^24: exact in f32
            rng = rng_for("exact", target, quant, m, n, kk)
            b = blocks_for(k, quant, n, kk, rng, extreme=True)
            a = activation_rows(k, m, kk, rng)
            y = k.qmatmul(k.pack(quant, b), k.act_from_values(a, np.ones((m, kk // 32), np.float32)))
            scale = q.scale_ref(b).reshape(n, -1)  # per block of 32, or per sub-block of 16 (Q6_K)
            g = kk // scale.shape[1]
            w = q.unpack_ref(b).reshape(n, -1, g).astype(np.int64)
            av = (a.astype(np.int64) - zero).reshape(m, -1, g)
            assert (scale == np.round(scale)).all()
            want = np.einsum("msi,nsi,ns->mn", av, w, scale.astype(np.int64))
            if q.offset is not None:
                off = q.offset_ref(b).reshape(n, -1)  # integer minima, [n, blocks of 32]
                assert (off == np.round(off)).all()
                want = want + av.reshape(m, off.shape[1], -1).sum(axis=2) @ off.astype(np.int64).T
            assert np.abs(want).max() < 2 ** 24
            assert (y == want).all(), f"{quant} {tile} {m}x{n}x{kk}: {np.argwhere(y != want)[:4].tolist()}"
        k.reset()


@pytest.mark.parametrize("target", TARGETS)
def test_qmatmul_matches_the_float64_reference(target):
    k = module(target, {})
    zero, _ = consts(k)
    for quant in QUANTS:
        q = k.quants[quant]
        for m, n, k32 in Q_SHAPES:
            kk = row_length(k, quant, k32)
            rng = rng_for("ref", target, quant, m, n, kk)
            b = blocks_for(k, quant, n, kk, rng, extreme=False)
            _, act = token_acts(k, m, kk, rng)
            y = k.qmatmul(k.pack(quant, b), act)
            scale = q.scale_ref(b).reshape(n, -1)  # per block of 32, or per sub-block of 16 (Q6_K)
            g = kk // scale.shape[1]
            offset = q.offset_ref(b).reshape(n, -1) if q.offset is not None else None
            w_int = q.unpack_ref(b).reshape(n, -1).astype(np.int64)
            w_deq = q.dequantize_ref(b).reshape(n, -1).astype(np.float64)
            for t in range(m):
                a_int = k.act_values(act)[t].astype(np.int64) - zero
                d_a = np.repeat(act.d[t].astype(np.float64), 32)
                ref = w_deq @ (a_int * d_a)
                # Every block's term is rounded on its own, and a leftover block's (qstep1) is split
                # over four lanes first: bound by the sum over blocks of |scale d_a| sum |w_i a_i|.
                abs_dots = (np.abs(w_int) * np.abs(a_int) * d_a).reshape(n, -1, g).sum(axis=2)
                mag = (np.abs(scale.astype(np.float64)) * abs_dots).sum(axis=1)
                if offset is not None:  # per block of 32, or per sub-block of 16 (Q2_K)
                    asum = (np.abs(a_int) * d_a).reshape(-1, kk // offset.shape[1]).sum(axis=1)
                    mag = mag + np.abs(offset.astype(np.float64) * asum).sum(axis=1)
                assert_q_close(y[t], ref, mag, f"{target} {quant} {m}x{n}x{kk} token {t}")
        k.reset()


def test_qmatmul_and_quantize_act_reject_bad_inputs():
    k = module("simd128", {})
    w = k.pack("q8_0", blocks_for(k, "q8_0", 3, 64, rng_for("bad"), extreme=False))
    one = k.quantize_act(np.ones(64, np.float32))
    many = k.quantize_act(np.ones((2, 64), np.float32))
    assert many.q.shape == (2, 64) and many.d.shape == many.s.shape == (2, 2) and many.tokens == 2 and one.tokens is None
    with pytest.raises(ValueError, match=r"\[m, k\]"):
        k.qmatmul(w, one)
    with pytest.raises(ValueError, match="one token"):
        k.qmatvec(w, many)
    with pytest.raises(ValueError, match="64"):
        k.qmatmul(w, k.quantize_act(np.ones((2, 32), np.float32)))
    with pytest.raises(ValueError, match="scales"):
        k.qmatmul(w, Act(many.q, many.d[:, :1].copy(), many.s))
    with pytest.raises(ValueError, match="sums"):
        k.qmatmul(w, Act(many.q, many.d, many.s[:, :1].copy()))
    with pytest.raises(ValueError, match="sums"):
        k.qmatmul(w, Act(many.q, many.d, many.s.astype(np.int16)))
    with pytest.raises(TypeError):
        k.qmatmul(w, Act(many.q.astype(np.uint8), many.d, many.s))
    with pytest.raises(TypeError):
        k.qmatmul(np.zeros((3, 64)), many)  # type: ignore[arg-type]
    k.reset()


# ---- linear: quantize_act, qmatmul and the bias in one call -------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_linear_is_quantize_act_qmatmul_and_bias_bit_for_bit(target):
    """linear keeps the activations in the module's memory; it must compute exactly what the three
    calls compute (each verified against float64 above and in test_encoder.py), threaded or not."""
    k = module(target, {})
    with k.pool(3) as pool:
        for quant in ("q8_0", "q4_0"):
            for m, n, k32 in ((1, 4, 32), (5, 8, 288), (7, 12, 384)):
                kk = row_length(k, quant, k32)
                rng = rng_for("linear", target, quant, m, n, kk)
                w = k.pack(quant, blocks_for(k, quant, n, kk, rng, extreme=False))
                x, act = token_acts(k, m, kk, rng)
                if m > 1:
                    x[m // 2, -32:] = np.inf  # a non-finite block
                act = k.quantize_act(x)
                bias = (rng.standard_normal(n) * 3).astype(np.float32)
                plain = k.qmatmul(w, act)
                want = {None: plain, "bias": k.add_bias_f32(plain, bias)}
                for with_bias, expected in want.items():
                    b = bias if with_bias else None
                    where = f"{target} {quant} {m}x{n}x{kk} bias={with_bias}"
                    assert_bitwise_equal(k.linear(w, x, b), expected, where)
                    assert_bitwise_equal(k.linear(w, x, b, pool), expected, f"{where} threaded")
                    assert_bitwise_equal(k.linear(w, x, b, pool, chunk=1), expected, f"{where} threaded, chunk 1")
        k.reset()


def test_linear_rejects_bad_inputs():
    k = module("simd128", {})
    w = k.pack("q8_0", blocks_for(k, "q8_0", 4, 64, rng_for("bad linear"), extreme=False))
    odd = k.pack("q8_0", blocks_for(k, "q8_0", 3, 64, rng_for("bad linear"), extreme=False))
    x = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match=r"\[m >= 1, 64\]"):
        k.linear(w, np.ones((2, 32), np.float32))
    with pytest.raises(ValueError, match=r"\[m >= 1, 64\]"):
        k.linear(w, np.ones((0, 64), np.float32))
    with pytest.raises(ValueError):
        k.linear(w, np.ones(64, np.float32))  # one token is still [1, k]
    with pytest.raises(ValueError, match="4 values"):
        k.linear(w, x, np.ones(3, np.float32))
    with pytest.raises(ValueError, match="multiple of 4"):
        k.linear(odd, x, np.ones(3, np.float32))
    with pytest.raises(TypeError):
        k.linear(w, x.astype(np.float64))
    with pytest.raises(TypeError):
        k.linear(np.zeros((4, 64)), x)  # type: ignore[arg-type]
    assert k.linear(odd, x).shape == (2, 3)  # without a bias any row count does
    k.reset()


# ---- matmul_f32 --------------------------------------------------------------------------------

F_SHAPES = ((1, 1, 1), (3, 5, 7), (5, 9, 4), (9, 7, 64), (4, 8, 33), (2, 3, 0), (6, 13, 128))
FORMS = {"nt": ("matmul_f32_nt", True), "nn": ("matmul_f32_nn", False)}


def f32_bound(form: str, k: int) -> float:
    """The bound kernels.dsl states, in units of 2^-24 * sum |a_i b_i|."""
    return k / 4 + 6 if form == "nt" else k + 1


def f32_operands(form: str, m: int, n: int, kk: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    a = (rng.standard_normal((m, kk)) * rng.uniform(0.01, 100, (m, 1))).astype(np.float32)
    b = rng.standard_normal((n, kk) if form == "nt" else (kk, n)).astype(np.float32)
    return a, b


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("target", TARGETS)
def test_matmul_f32_within_the_stated_bound_for_every_tile(target, form):
    kernel, transposed = FORMS[form]
    for tile in variants(CHECKED, kernel):
        outs = {}
        for det in (True, False) if target == "relaxed-simd" else (True,):
            k = module(target, {kernel: tile}, det)
            assert k.tune_of(kernel) == tile
            got = []
            with k.pool(3) as pool:
                for m, n, kk in F_SHAPES:
                    a, b = f32_operands(form, m, n, kk, rng_for("f32", form, m, n, kk))
                    y = k.matmul_f32(a, b, b_transposed=transposed)
                    bt = b.T if transposed else b
                    ref = a.astype(np.float64) @ bt.astype(np.float64)
                    mag = np.abs(a.astype(np.float64)) @ np.abs(bt.astype(np.float64))
                    err = np.abs(y - ref)
                    limit = f32_bound(form, kk) * 2.0 ** -24 * mag
                    assert y.shape == (m, n) and (err <= limit).all(), (
                        f"{target} {form} {tile} {m}x{n}x{kk}: worst {np.max(err / np.maximum(limit, 1e-300)):.2f}"
                        " of the bound")
                    for threads in (1, 2, 3):
                        pool.set_threads(threads)
                        for chunk in (1, 2, None):
                            assert_bitwise_equal(k.matmul_f32(a, b, transposed, pool, chunk), y,
                                                 f"{form} {tile} {m}x{n}x{kk} on {threads} threads")
                    got.append(y)
            outs[det] = got
            k.reset()
        if len(outs) == 2:
            assert_bitwise_equal(outs[True], outs[False], f"{form} {tile}: relaxed deterministic vs not")


@pytest.mark.parametrize("target", TARGETS)
def test_matmul_f32_propagates_inf_and_nan_to_their_outputs_only(target):
    k = module(target, {})
    a = np.ones((5, 8), np.float32)
    a[1, 3] = np.inf
    a[3, 6] = np.nan
    b = np.ones((8, 6), np.float32)
    for y in (k.matmul_f32(a, b), k.matmul_f32(a, np.ascontiguousarray(b.T), b_transposed=True)):
        assert np.isposinf(y[1]).all() and np.isnan(y[3]).all()
        assert (y[[0, 2, 4]] == 8).all()
    k.reset()


def test_matmul_f32_rejects_bad_shapes():
    k = module("simd128", {})
    a = np.ones((3, 4), np.float32)
    with pytest.raises(ValueError, match="b_transposed"):
        k.matmul_f32(a, np.ones((5, 3), np.float32), b_transposed=True)
    with pytest.raises(ValueError, match=r"b\[k, n\]"):
        k.matmul_f32(a, np.ones((5, 3), np.float32))
    with pytest.raises(TypeError):
        k.matmul_f32(a, np.ones((4, 3), np.float64))
    with pytest.raises(ValueError):
        k.matmul_f32(a, np.ones(4, np.float32))
    k.reset()


# ---- the tuner's cases -------------------------------------------------------------------------


@pytest.mark.parametrize("kernel, quant", [("qmatmul", "q4_1"), ("qmatmul_job", "q8_0"), ("matmul_f32_nt", None),
                                           ("matmul_f32_nn_job", None)])
def test_tuner_verifies_and_times_the_matrix_products(kernel, quant):
    seconds, status = run_case(SOURCE, CHECKED, "simd128", kernel, quant, (5, 9, 160),
                               {"threads": 2, "chunk": 2} if kernel.endswith("_job") else {}, min_batch=0.002,
                               samples=1)
    assert status == "ok" and seconds > 0


@pytest.mark.parametrize("kernel, old, new", [
    ("qmatmul", "f32.store(y + ((t0 + i / N) * n + r0 + i % N * rs) * 4, hsum(acc[i * A]));",
     "f32.store(y + ((t0 + i / N) * n + r0 + i % N * rs) * 4, hsum(acc[i * A]) * 1.001);"),
    ("matmul_f32_nt", "s = s + f32.load(arow[j / N] + c) * f32.load(brow[j % N] + c);",
     "s = s - f32.load(arow[j / N] + c) * f32.load(brow[j % N] + c);"),
    ("matmul_f32_nn", "s = s + f32.load(a + (t * k + i) * 4) * f32.load(b + (i * n + c) * 4);",
     "s = s + f32.load(a + (t * k + i) * 4) * f32.load(b + (i * n + c + 1) * 4);"),
])
def test_tuner_records_a_wrong_matrix_product_as_failed(kernel, old, new):
    """A tile (qmatmul), the k tail (nt) or the column tail (nn) broken: the tuner's check sees it."""
    assert old in SOURCE
    wrong = SOURCE.replace(old, new)
    _, status = run_case(wrong, check(parse(wrong)), "simd128", kernel, "q8_0" if kernel == "qmatmul" else None,
                         (5, 9, 166) if kernel != "qmatmul" else (5, 9, 160), {}, min_batch=0.002, samples=1)
    assert status.startswith("failed: wrong results"), status
