"""The encoder-layer kernels of kernels.dsl (erf, GELU, bias, LayerNorm, mean pooling, L2
normalisation: what a BERT sentence encoder needs besides its matrix products) against float64
numpy, in the three modes of conftest.py, with adversarial rows. Threaded GELU and LayerNorm are
checked bit-identical to one thread in tests/test_pool.py.

Measured bounds (both targets, this file's inputs): erf within 2 ulp of the correctly rounded
float32 erf; GELU within 2^-21 relative plus 2^-22 |v| absolute (the absolute part is 1 + erf's
cancellation for v far below zero, where gelu itself is below 6e-9 |v|); LayerNorm within
2^-19 ((1 + |mean| / sd) |gamma| + |beta|); pooling and L2 normalisation within 2^-21 relative.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from kernelgen.host.api import Kernels

from helpers import bits_of, rng_for, same_as_deterministic

_erf64 = np.vectorize(math.erf, otypes=[np.float64])


def f32_ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in float32 ulps, counted through zero across a sign change."""
    def ordered(x: np.ndarray) -> np.ndarray:
        i = np.ascontiguousarray(x, np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    return np.abs(ordered(a) - ordered(b))


def gelu64(v: np.ndarray) -> np.ndarray:
    v = v.astype(np.float64)
    with np.errstate(invalid="ignore"):
        return 0.5 * v * (1.0 + _erf64(v / math.sqrt(2.0)))


# ---- erf ---------------------------------------------------------------------------------------


def erf_inputs() -> np.ndarray:
    rng = rng_for("erf")
    return np.concatenate([
        np.linspace(-4.5, 4.5, 900_001, dtype=np.float32),
        np.linspace(0.9, 0.95, 50_001, dtype=np.float32),  # the seam between the two polynomials
        np.linspace(3.8, 4.0, 20_001, dtype=np.float32),   # where erf reaches 1
        (rng.standard_normal(100_000) * 2).astype(np.float32),
        np.geomspace(1e-38, 1e-3, 20_000, dtype=np.float32), -np.geomspace(1e-45, 1e-3, 20_000, dtype=np.float32),
    ])


def test_erf_f32_within_2_ulp(mode, kgen):
    x = erf_inputs()

    def run(k: Kernels) -> np.ndarray:
        return k.erf_f32(x)

    got = run(kgen())
    ref = _erf64(x.astype(np.float64)).astype(np.float32)
    u = f32_ulps(got, ref)
    worst = int(u.argmax())
    assert u.max() <= 2, f"erf_f32 [{mode.id}]: x={x[worst]!r} got {got[worst]!r} want {ref[worst]!r} ({u[worst]} ulp)"
    np.testing.assert_array_equal(bits_of(run(kgen())[:5]), bits_of(got[:5]))
    same_as_deterministic(mode, kgen, None, run, got)


def test_erf_f32_special_values_and_symmetry(mode, kgen):
    k = kgen()
    x = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1e30, -1e30, 3.921875, -3.921875, 1e-45])
    got = k.erf_f32(x)
    assert bits_of(got[:2]).tolist() == [0, 0x80000000], "erf(+-0) = +-0"
    assert got[2:4].tolist() == [1.0, -1.0] and np.isnan(got[4]) and got[5:9].tolist() == [1.0, -1.0, 1.0, -1.0]
    assert got[9] > 0
    y = np.linspace(0, 5, 10_001, dtype=np.float32)
    np.testing.assert_array_equal(bits_of(k.erf_f32(-y)), bits_of(-k.erf_f32(y)), err_msg="erf is odd, bit for bit")


@pytest.mark.parametrize("n", (1, 2, 3, 4, 5, 7, 9), ids=lambda n: f"n{n}")
def test_erf_f32_partial_vector_lengths(mode, kgen, n):
    x = np.linspace(-2, 2, n, dtype=np.float32)
    got = kgen().erf_f32(x)
    assert got.shape == (n,)
    assert f32_ulps(got, _erf64(x.astype(np.float64)).astype(np.float32)).max() <= 2


# ---- GELU and bias -----------------------------------------------------------------------------


def assert_gelu_close(got: np.ndarray, v: np.ndarray, what: str) -> None:
    ref = gelu64(v)
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(got[np.isinf(ref)], ref[np.isinf(ref)], err_msg=f"{what}: infinities")
    err = np.abs(got[fin].astype(np.float64) - ref[fin])
    bound = 2.0 ** -21 * np.abs(ref[fin]) + 2.0 ** -22 * np.abs(v[fin].astype(np.float64))
    bad = ~(err <= bound)
    assert not bad.any(), f"{what}: v={v[fin][bad][:4]} got {got[fin][bad][:4]} want {ref[fin][bad][:4]}"


def test_gelu_f32_matches_float64(mode, kgen):
    rng = rng_for("gelu")
    x = np.concatenate([(rng.standard_normal((64, 1536)) * 3).ravel(),
                        np.linspace(-12, 12, 64 * 1536)]).astype(np.float32).reshape(-1, 1536)
    x[0, :16] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e30, -1e30, FLT_MAX, -FLT_MAX, 1e-30, -1e-30, 5.5, -5.5, 8, -8, 1]
    bias = (rng.standard_normal(1536) * 0.5).astype(np.float32)
    bias[:16] = 0.0

    def run(k: Kernels) -> list[np.ndarray]:
        return [k.gelu_f32(x), k.gelu_f32(x, bias)]

    plain, biased = got = run(kgen())
    assert_gelu_close(plain, x, "gelu_f32")
    assert_gelu_close(biased, x + bias, "gelu_f32 with bias")  # the sum rounded to f32 as the kernel does
    # gelu(+-0) = 0 (v/2 erf(v/sqrt 2) + v/2 in one multiply-add: -0 comes out +0), gelu(inf) = inf;
    # gelu(-inf) is NaN as in float64 (-inf * (1 + erf(-inf)) = -inf * 0)
    assert (plain[0, :2] == 0).all() and plain[0, 2] == np.inf
    assert np.isnan(plain[0, 3:5]).all() and plain[0, 5] == np.float32(1e30) and plain[0, 7] == FLT_MAX
    same_as_deterministic(mode, kgen, None, run, got)


def test_add_bias_f32_is_numpy_f32_addition(mode, kgen):
    rng = rng_for("bias")
    x = rng.standard_normal((5, 1152)).astype(np.float32)
    x[0, :4] = [np.inf, np.nan, -0.0, FLT_MAX]
    b = rng.standard_normal(1152).astype(np.float32)
    b[:4] = [-np.inf, 1.0, 0.0, FLT_MAX]
    got = kgen().add_bias_f32(x, b)
    with np.errstate(over="ignore", invalid="ignore"):
        np.testing.assert_array_equal(bits_of(got), bits_of(x + b))


FLT_MAX = float(np.finfo(np.float32).max)


# ---- LayerNorm ---------------------------------------------------------------------------------


def layernorm64(v: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    v = v.astype(np.float64)
    mean = v.mean(1, keepdims=True)
    var = ((v - mean) ** 2).mean(1, keepdims=True)
    return (v - mean) / np.sqrt(var + eps) * gamma + beta


def layernorm_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """Rows of every scale the encoder meets and harder: large offsets against a small spread,
    a row with one outlier, huge and tiny magnitudes."""
    rows = [rng.standard_normal(n) * s + m for s, m in ((1, 0), (0.01, 0), (30, 5), (1, 100), (0.1, 50),
                                                      (1e-20, 0), (1e15, 0))]
    spike = rng.standard_normal(n)
    spike[n // 2] = 1e4
    return np.array(rows + [spike], np.float32)


@pytest.mark.parametrize("n", (4, 36, 384), ids=lambda n: f"n{n}")
def test_layernorm_f32_matches_float64(mode, kgen, n):
    rng = rng_for("layernorm", n)
    x = layernorm_rows(rng, n)
    res = (rng.standard_normal(x.shape) * 0.5).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    gamma = (rng.standard_normal(n) * 2).astype(np.float32)
    beta = rng.standard_normal(n).astype(np.float32)

    def run(k: Kernels) -> list[np.ndarray]:
        return [k.layernorm_f32(x, gamma, beta, 1e-12), k.layernorm_f32(x, gamma, beta, 1e-5, res, b)]

    got = run(kgen())
    for out, v, eps, what in ((got[0], x, 1e-12, "plain"), (got[1], (x + res) + b, 1e-5, "residual and bias")):
        ref = layernorm64(v, gamma, beta, eps)
        v64 = v.astype(np.float64)
        ratio = 1 + np.abs(v64.mean(1, keepdims=True)) / np.sqrt(v64.var(1, keepdims=True) + eps)
        bound = 2.0 ** -19 * (ratio * np.abs(gamma) + np.abs(beta))  # measured: up to 12 * 2^-23 of it
        err = np.abs(out - ref)
        assert (err <= bound).all(), f"layernorm_f32 {what} [{mode.id}]: worst row {np.unravel_index(err.argmax(), err.shape)}"
    same_as_deterministic(mode, kgen, None, run, got)


def test_layernorm_f32_exact_cases(mode, kgen):
    k = kgen()
    n = 384
    ones, zeros = np.ones(n, np.float32), np.zeros(n, np.float32)
    beta = np.linspace(-1, 1, n, dtype=np.float32)
    x = np.array([np.full(n, 1.5), np.zeros(n), np.tile([1.0, -1.0], n // 2)], np.float32)
    got = k.layernorm_f32(x, ones, beta, 0.0 + 1e-12)
    np.testing.assert_array_equal(got[:2], np.stack([beta, beta]), err_msg="a constant row (exact mean) gives beta")
    np.testing.assert_allclose(got[2], x[2] + beta, rtol=0, atol=1e-6)
    bad = x.copy()
    bad[1, 5] = np.nan
    out = k.layernorm_f32(bad, ones, zeros)
    assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2]]).all(), "a NaN poisons its row only"


# ---- attention --------------------------------------------------------------------------------


def attention64(qkv: np.ndarray, lengths: list[int], heads: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 multi-head attention of sentences one after another in qkv's rows, and the bound
    the kernel's rounding keeps to (kernels.dsl attention_f32): per output, (1e-5 (softmax_f32's
    relative bound) + 3 E + (L + 1) 2^-24) sum_j p_j |v_j|, E the largest score error of its query,
    (d / 4 + 2) 2^-24 sum_c |q_c k_jc| (a score error e moves each p by at most e^(2e) - 1 relative)."""
    x = qkv.astype(np.float64)
    n = x.shape[1] // 3
    d = n // heads
    out, bound = np.zeros((x.shape[0], n)), np.zeros((x.shape[0], n))
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        for h in range(heads):
            c = slice(h * d, (h + 1) * d)
            q, k, v = x[rows, c], x[rows, n:][:, c], x[rows, 2 * n:][:, c]
            s = q @ k.T
            p = np.exp(s - s.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            out[rows, c] = p @ v
            e = ((d / 4 + 2) * 2.0 ** -24 * (np.abs(q) @ np.abs(k).T)).max(1, keepdims=True)
            bound[rows, c] = (1e-5 + 3 * e + (length + 1) * 2.0 ** -24) * (p @ np.abs(v))
        start += length
    return out, bound


@pytest.mark.parametrize("heads, d, scale", ((12, 32, 1.0), (3, 16, 4.0), (2, 64, 0.5)),
                         ids=lambda v: str(v))
def test_attention_f32_matches_float64(mode, kgen, heads, d, scale):
    """Sentences of 1 .. 33 tokens (lengths that are and are not multiples of 4), one head size
    below, at and above MiniLM's; scale 4 makes scores of +-100s (exp overflows without the max)."""
    lengths = [5, 1, 16, 3, 33, 4, 7, 2]
    rng = rng_for("attention", heads, d)
    qkv = (rng.standard_normal((sum(lengths), 3 * heads * d)) * scale).astype(np.float32)

    def run(k: Kernels) -> np.ndarray:
        return k.attention_f32(qkv, lengths, heads)

    got = run(kgen())
    ref, bound = attention64(qkv, lengths, heads)
    err = np.abs(got - ref)
    assert got.shape == ref.shape and (err <= bound).all(), \
        f"attention_f32 [{mode.id}]: worst {np.unravel_index((err - bound).argmax(), err.shape)}"
    n = heads * d
    np.testing.assert_array_equal(got[5], qkv[5, 2 * n:], err_msg="a one-token sentence attends to itself: its v")
    same_as_deterministic(mode, kgen, None, run, got)


def test_attention_f32_sees_only_its_own_sentence(mode, kgen):
    """The padding mask: a sentence's output depends on its own tokens only, whatever the others
    hold (NaN and huge values in a neighbour stay there), and on nothing's order or batch."""
    heads, d = 2, 16
    lengths = [3, 6, 2]
    rng = rng_for("attention-mask")
    qkv = rng.standard_normal((11, 3 * heads * d)).astype(np.float32)
    bad = qkv.copy()
    bad[3:9] = np.nan  # the middle sentence
    bad[4, :] = 3e38
    k = kgen()
    alone = [k.attention_f32(qkv[a:b], [b - a], heads) for a, b in ((0, 3), (3, 9), (9, 11))]
    together = k.attention_f32(qkv, lengths, heads)
    np.testing.assert_array_equal(together, np.concatenate(alone), err_msg="batching changed bits")
    poisoned = k.attention_f32(bad, lengths, heads)
    np.testing.assert_array_equal(poisoned[[0, 1, 2, 9, 10]], together[[0, 1, 2, 9, 10]])
    assert np.isnan(poisoned[3:9]).all()
    same_as_deterministic(mode, kgen, None, lambda m: m.attention_f32(qkv, lengths, heads), together)


def test_attention_f32_rejects_bad_arguments(kernels):
    k = kernels
    qkv = np.zeros((5, 96), np.float32)
    with pytest.raises(ValueError, match="summing to the 5 rows"):
        k.attention_f32(qkv, [2, 2], 2)
    with pytest.raises(ValueError, match="positive integers"):
        k.attention_f32(qkv, [5, 0], 2)
    with pytest.raises(ValueError, match="positive integers"):
        k.attention_f32(qkv, [2.5, 2.5], 2)
    with pytest.raises(ValueError, match="positive integers"):
        k.attention_f32(qkv, [], 2)
    with pytest.raises(ValueError, match="multiple of 16"):
        k.attention_f32(qkv, [5], 3)  # d = 32 / 3
    with pytest.raises(ValueError, match="multiple of 16"):
        k.attention_f32(np.zeros((5, 24), np.float32), [5], 1)  # d = 8
    with pytest.raises(TypeError, match="float32"):
        k.attention_f32(qkv.astype(np.float64), [5], 2)
    with pytest.raises(ValueError, match="outside"):
        k.attention_f32(qkv, [5], 0)


# ---- mean pooling and L2 normalisation ---------------------------------------------------------


def test_mean_pool_f32_under_the_mask(mode, kgen):
    rng = rng_for("pool")
    x = rng.standard_normal((5, 9, 384)).astype(np.float32) * 4
    mask = np.array([[1] * 9, [1] * 3 + [0] * 6, [1] + [0] * 8, [0] * 9, [1, 0, 1, 0, 1, 1, 0, 0, 1]], np.int64)
    x[mask == 0] = np.nan  # padding holds garbage: it must never reach the result
    x[1, 8, :4] = np.inf

    def run(k: Kernels) -> np.ndarray:
        return k.mean_pool_f32(x, mask)

    got = run(kgen())
    xs = np.where(mask[:, :, None] > 0, x.astype(np.float64), 0.0)
    ref = xs.sum(1) / np.maximum(mask.sum(1), 1e-9)[:, None]
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[3], 0.0, err_msg="an all-padding sequence pools to zero")
    np.testing.assert_array_equal(got[2], x[2, 0], err_msg="one token: the token itself")
    np.testing.assert_allclose(got, ref, rtol=2.0 ** -21, atol=2.0 ** -21 * np.abs(xs).max())
    weights = np.linspace(0.5, 2, 9)[None].repeat(5, 0) * (mask > 0)
    wref = (np.nan_to_num(xs) * weights[:, :, None]).sum(1) / np.maximum(weights.sum(1), 1e-9)[:, None]
    np.testing.assert_allclose(kgen().mean_pool_f32(x, weights), wref, rtol=2.0 ** -20, atol=1e-5)
    same_as_deterministic(mode, kgen, None, run, got)


def test_l2_normalize_f32(mode, kgen):
    rng = rng_for("l2")
    x = rng.standard_normal((7, 384)).astype(np.float32)
    x[1] *= np.float32(1e30)   # squares overflow f32
    x[2] *= np.float32(1e-30)  # squares underflow f32
    x[3] = 0.0
    x[4, :] = 0.0
    x[4, 17] = -3e-45          # a single subnormal
    x[5, 9] = np.inf
    x[6, 2] = np.nan

    def run(k: Kernels) -> np.ndarray:
        return k.l2_normalize_f32(x)

    got = run(kgen())
    x64 = x[:5].astype(np.float64)
    with np.errstate(invalid="ignore"):
        ref = x64 / np.linalg.norm(x64, axis=1, keepdims=True)
    ref[3] = 0.0
    np.testing.assert_allclose(got[:5], ref, rtol=2.0 ** -21, atol=2.0 ** -21)
    assert got[4, 17] == -1.0 and (np.delete(got[4], 17) == 0).all()
    assert np.isnan(got[5:]).all(), "a row holding inf or NaN comes out NaN"
    same_as_deterministic(mode, kgen, None, run, got)


def test_encoder_api_rejects_bad_arrays(kernels):
    k = kernels
    x = np.zeros((3, 8), np.float32)
    v8 = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="multiple of 4"):
        k.gelu_f32(np.zeros((3, 6), np.float32))
    with pytest.raises(ValueError, match="8 values"):
        k.gelu_f32(x, np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="float32"):
        k.add_bias_f32(x.astype(np.float64), v8)
    with pytest.raises(ValueError, match="residual"):
        k.layernorm_f32(x, v8, v8, residual=np.zeros((2, 8), np.float32))
    with pytest.raises(ValueError, match="eps"):
        k.layernorm_f32(x, v8, v8, eps=-1.0)
    with pytest.raises(ValueError, match="mask"):
        k.mean_pool_f32(np.zeros((2, 3, 8), np.float32), np.zeros((2, 4)))
    with pytest.raises(ValueError, match="2-D"):
        k.l2_normalize_f32(v8)
    with k.pool(2) as pool, pytest.raises(ValueError, match="has no pool job"):
        k._map("erf_f32", np.float32, v8, pool=pool)
