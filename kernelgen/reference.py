"""numpy references, written from the formats' definitions and not from the emitter.

The GGUF quantizers follow llama.cpp's reference quantizers in float32, C `roundf` included (ties
away from zero, on the float32 value): tests check them byte for byte against the `gguf` package's,
and the reference derived from the kernels.dsl declaration (quant.py) against them. Activation quantization mirrors the kernel's float32
operations one for one, so its integers must match exactly.
"""
from __future__ import annotations

import numpy as np

Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])


def roundf(v: np.ndarray) -> np.ndarray:
    """C `roundf` on float32: ties away from zero. Computed exactly: `trunc(v + 0.5)` is not (at
    0.49999997 the sum rounds up to 1.0 in float32)."""
    v = np.asarray(v, np.float32)
    t = np.trunc(v)
    return t + np.copysign(np.abs(v - t) >= np.float32(0.5), v).astype(np.float32)


def _values(x: np.ndarray, block: int, what: str) -> np.ndarray:
    """x as float32 [..., k] with k a positive multiple of `block`: real numbers only (a complex
    value would lose its imaginary part in the cast, an object array fail inside numpy)."""
    a = np.asarray(x) if not isinstance(x, np.ma.MaskedArray) else None
    if a is None or a.dtype.kind not in "fiub" or a.ndim < 1 or a.shape[-1] == 0 or a.shape[-1] % block:
        got = "a masked array" if a is None else f"dtype {a.dtype}, shape {a.shape}"
        raise ValueError(f"{what}: expected real values [..., k] with k a positive multiple of {block}, got {got}")
    return a.astype(np.float32)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """f32[rows, k] (k a multiple of 32) -> GGUF Q8_0 blocks, structured (rows, k // 32)."""
    x = _values(x, 32, "quantize_q8_0")
    xb = x.reshape(x.shape[:-1] + (-1, 32))
    amax = np.abs(xb).max(axis=-1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = roundf(xb * inv[..., None]).astype(np.int8)
    out = np.empty(xb.shape[:-1], Q8_0)
    out["d"] = d.astype(np.float16)
    out["qs"] = q
    return out


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q8_0 blocks (rows, n) -> f32[rows, n * 32]."""
    v = blocks["d"].astype(np.float32)[..., None] * blocks["qs"].astype(np.float32)
    return v.reshape(blocks.shape[:-1] + (-1,))


def quantize_act(x: np.ndarray, act_max: int, act_zero: int) -> tuple[np.ndarray, np.ndarray]:
    """The activation quantization of kernels.dsl in float32: per 32 values d = amax / act_max,
    q = nearest(clamp(x * (1 / d), +-act_max)), NaN -> 0, stored as q + act_zero (int8 when
    act_zero is 0, else uint8)."""
    xb = np.asarray(x, np.float32).reshape(-1, 32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        amax = np.abs(xb).max(axis=1)
        d = (amax / np.float32(act_max)).astype(np.float32)
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        v = xb * inv[:, None]
        lim = np.float32(act_max)
        v = np.clip(v, -lim, lim)  # NaN passes through, as with wasm's f32x4.min/max
        q = np.nan_to_num(np.rint(v), nan=0.0).astype(np.int32)
    return (q + act_zero).astype(np.int8 if act_zero == 0 else np.uint8).reshape(-1), d


def int_dots(w_int: np.ndarray, a_bytes: np.ndarray, act_zero: int, block: int) -> np.ndarray:
    """Exact per-block integer dots: w_int (rows, k) unpacked weights, a_bytes (k,) activation
    (int8 or uint8) holding q + act_zero -> int64 (rows, k // block)."""
    a = a_bytes.astype(np.int64).reshape(-1) - act_zero
    prod = w_int.astype(np.int64) * a[None, :]
    return prod.reshape(prod.shape[0], -1, block).sum(axis=-1)


def qmatvec(scale: np.ndarray, w_int: np.ndarray, a_bytes: np.ndarray, a_d: np.ndarray, act_zero: int,
            block: int, offset: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """y = sum over blocks of scale * d_a * int_dot (+ offset * d_a * sum(a)), in float64, and the
    sum of the terms' magnitudes (the scale of float rounding error) for the tolerance."""
    isum = int_dots(w_int, a_bytes, act_zero, block).astype(np.float64)
    ad = a_d.astype(np.float64)
    terms = [scale.astype(np.float64) * ad[None, :] * isum]
    if offset is not None:
        asum = (a_bytes.astype(np.int64) - act_zero).reshape(-1, block).sum(axis=1).astype(np.float64)
        terms.append(offset.astype(np.float64) * ad[None, :] * asum[None, :])
    # Each term is rounded on its own in f32, so their magnitudes add even where they cancel.
    return sum(terms).sum(axis=1), sum(np.abs(t) for t in terms).sum(axis=1)


Q4_0 = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])
Q4_1 = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))])


def _split_nibbles(q: np.ndarray) -> np.ndarray:
    """32 values 0..15 per block -> 16 bytes, element j in the low nibble of byte j, j+16 in the high."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def _quantize_offset(x: np.ndarray, half: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's reference rule of Q4_0 (half = 8) and Q5_0 (half = 16), per block of 32:
    d = (the value of largest magnitude) / -half, q = min(2 half - 1, trunc(x / d + half + 0.5));
    value d * (q - half). Returns d (f32) and q (int32)."""
    xb = _values(x, 32, "quantize").reshape(np.shape(x)[:-1] + (-1, 32))
    idx = np.abs(xb).argmax(axis=-1)
    vmax = np.take_along_axis(xb, idx[..., None], axis=-1)[..., 0]
    d = vmax / np.float32(-half)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    return d, np.minimum(2 * half - 1, np.trunc(xb * inv[..., None] + np.float32(half + 0.5)).astype(np.int32))


def _quantize_min(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's reference rule of Q4_1 (16 levels) and Q5_1 (32), per block of 32: m = min,
    d = (max - min) / (levels - 1), q = trunc((x - m) / d + 0.5), as the C code's byte (Q4_1 clamps
    it to 15; Q5_1 keeps its low five bits). Returns d, q (int32) and m (f32)."""
    xb = _values(x, 32, "quantize").reshape(np.shape(x)[:-1] + (-1, 32))
    lo, hi = xb.min(axis=-1), xb.max(axis=-1)
    d = (hi - lo) / np.float32(levels - 1)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.trunc((xb - lo[..., None]) * inv[..., None] + np.float32(0.5)).astype(np.int32)
    return d, np.minimum(15, q) if levels == 16 else q & 31, lo


Q5_0 = np.dtype([("d", "<f2"), ("qh", "u1", (4,)), ("qs", "u1", (16,))])
Q5_1 = np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "u1", (4,)), ("qs", "u1", (16,))])


def _flat_blocks(dtype: np.dtype, d: np.ndarray, q: np.ndarray, m: np.ndarray | None = None) -> np.ndarray:
    """Q4_0, Q4_1, Q5_0 or Q5_1 blocks from each block's d (and m) and 32 codes q: the low four bits
    as nibbles (_split_nibbles), the fifth, where the type has qh, as bit j of its little-endian
    32-bit word for element j."""
    out = np.empty(d.shape, dtype)
    out["d"] = d.astype(np.float16)
    if m is not None:
        out["m"] = m.astype(np.float16)
    if "qh" in dtype.names:
        qh = np.bitwise_or.reduce((q >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32), axis=-1)
        out["qh"] = qh.astype("<u4")[..., None].view(np.uint8)
    out["qs"] = _split_nibbles(q & 15)
    return out


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """llama.cpp's reference Q4_0 (_quantize_offset, 16 levels); value d * (q - 8)."""
    return _flat_blocks(Q4_0, *_quantize_offset(x, 8))


def quantize_q5_0(x: np.ndarray) -> np.ndarray:
    """llama.cpp's reference Q5_0 (_quantize_offset, 32 levels); value d * (q - 16)."""
    return _flat_blocks(Q5_0, *_quantize_offset(x, 16))


def quantize_q4_1(x: np.ndarray) -> np.ndarray:
    """llama.cpp's reference Q4_1 (_quantize_min, 16 levels); value d * q + m."""
    return _flat_blocks(Q4_1, *_quantize_min(x, 16))


def quantize_q5_1(x: np.ndarray) -> np.ndarray:
    """llama.cpp's reference Q5_1 (_quantize_min, 32 levels); value d * q + m."""
    return _flat_blocks(Q5_1, *_quantize_min(x, 32))


IQ4_NL = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """A simple valid IQ4_NL quantizer (not llama.cpp's, which searches scales): d = (the value of
    largest magnitude) / -127 as f16, so that value is the codebook's first entry, then each value
    the nearest codebook entry times d (the first of two at equal distance)."""
    xb = _values(x, 32, "quantize").reshape(np.shape(x)[:-1] + (-1, 32))
    idx = np.abs(xb).argmax(axis=-1)
    vmax = np.take_along_axis(xb, idx[..., None], axis=-1)[..., 0]
    d = (vmax / np.float32(-127)).astype(np.float16)
    grid = d.astype(np.float32)[..., None, None] * IQ4_NL_VALUES.astype(np.float32)
    q = np.abs(grid - xb[..., None]).argmin(axis=-1)
    out = np.empty(xb.shape[:-1], IQ4_NL)
    out["d"] = d
    out["qs"] = _split_nibbles(q)
    return out


IQ4_XS = np.dtype([("d", "<f2"), ("scales_h", "<u2"), ("scales_l", "u1", (4,)), ("qs", "u1", (128,))])


def quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    """A simple valid IQ4_XS quantizer (not llama.cpp's, which searches scales): each sub-block of
    32 wants the scale quantize_iq4_nl gives it (its largest-magnitude value / -127); d (f16, of
    either sign) is the largest of those in magnitude / -32, so that sub-block's 6-bit scale l - 32
    is -32, and each other's the nearest multiple of d in -32..31; then each value is the nearest
    codebook entry times d * (l - 32)."""
    xs = _values(x, 256, "quantize").reshape(np.shape(x)[:-1] + (-1, 8, 32))
    idx = np.abs(xs).argmax(axis=-1)
    want = np.take_along_axis(xs, idx[..., None], axis=-1)[..., 0] / np.float32(-127)  # per sub-block
    top = np.take_along_axis(want, np.abs(want).argmax(axis=-1)[..., None], axis=-1)
    d = (top[..., 0] / np.float32(-32)).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.where(df != 0, np.clip(np.rint(want / df), -32, 31), 0).astype(np.int32) + 32
    step = df * (ls - 32).astype(np.float32)
    grid = step[..., None, None] * IQ4_NL_VALUES.astype(np.float32)
    q = np.abs(grid - xs[..., None]).argmin(axis=-1)
    out = np.empty(xs.shape[:-2], IQ4_XS)
    out["d"] = d
    out["scales_h"] = ((ls >> 4) << (2 * np.arange(8))).sum(axis=-1).astype(np.uint16)
    out["scales_l"] = (ls[..., 0::2] & 15) | ((ls[..., 1::2] & 15) << 4)
    out["qs"] = _split_nibbles(q).reshape(out.shape + (128,))
    return out


Q4_K = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)), ("qs", "u1", (128,))])
Q5_K = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)), ("qh", "u1", (32,)), ("qs", "u1", (128,))])


def _fit_step_min(xs: np.ndarray, top: int, tries: int = 21) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block xs[..., n]: the step s > 0 and minimum m >= 0 of a grid s * q - m, q in 0..top,
    with the least squared error weighted by rms(x) + |x| (large values count more), among the
    plain grid over [min(x, 0), max(x)] and `tries` grids of top - 1 + 0.1 t steps over that span,
    each refitted by weighted least squares for its codes (m clamped to 0 when the fit wants it
    negative). This is the search llama.cpp's Q4_K/Q5_K quantizer does (make_qkx2_quants: the
    same weights, steps and clamp), written from that description."""
    x = xs.astype(np.float64)
    w = np.sqrt((x ** 2).mean(-1, keepdims=True)) + np.abs(x)
    lo = np.minimum(x.min(-1), 0)
    span = x.max(-1) - lo
    sw, swx = w.sum(-1), (w * x).sum(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = lambda steps: np.clip(np.rint((x - lo[..., None]) * np.where(span > 0, steps / span, 0)[..., None]), 0, top)  # noqa: E731
        error = lambda s, m, q: (w * (s[..., None] * q - m[..., None] - x) ** 2).sum(-1)  # noqa: E731
        step, low = np.where(span > 0, span / top, 0), -lo
        best = error(step, low, codes(np.float64(top)))
        for t in range(tries):
            q = codes(np.float64(top - 1 + 0.1 * t))
            swq, swqq, swxq = (w * q).sum(-1), (w * q * q).sum(-1), (w * x * q).sum(-1)
            det = sw * swqq - swq * swq
            s, m = (sw * swxq - swx * swq) / det, (swq * swxq - swqq * swx) / det
            s, m = np.where(m < 0, swxq / swqq, s), np.maximum(m, 0)
            e = error(s, m, q)
            better = (det > 0) & (s > 0) & (e < best)
            step, low, best = np.where(better, s, step), np.where(better, m, low), np.where(better, e, best)
    return step.astype(np.float32), low.astype(np.float32)


def _min_sub_blocks(x: np.ndarray, sub: int, top: int, scale_max: int,
                    what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Super-blocks of 256 in sub-blocks of `sub` values, each s * q - m with its step and minimum
    as integers of the f16 d and dmin (Q4_K, Q5_K, Q2_K): per sub-block the step and minimum of
    _fit_step_min over codes 0..top; d and dmin the largest step and minimum over scale_max; each
    sub-block's scale and minimum the nearest multiples of them (0..scale_max); each value the
    nearest code of the stored (f16) scales, clamped to 0..top. Returns (d, dmin [..., n], scales,
    minimums [..., n, 256 / sub] as uint8, codes [..., n, 256] as uint8)."""
    xs = _values(x, 256, what).reshape(np.shape(x)[:-1] + (-1, 256 // sub, sub))
    steps, mins = _fit_step_min(xs, top)
    d = (steps.max(axis=-1) / np.float32(scale_max)).astype(np.float16)
    dmin = (mins.max(axis=-1) / np.float32(scale_max)).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.rint(steps / d.astype(np.float32)[..., None])).clip(0, scale_max).astype(np.uint8)
        mn = np.nan_to_num(np.rint(mins / dmin.astype(np.float32)[..., None])).clip(0, scale_max).astype(np.uint8)
        scale = d.astype(np.float32)[..., None] * sc
        q = np.nan_to_num(np.rint((xs + (dmin.astype(np.float32)[..., None] * mn)[..., None]) / scale[..., None]))
    return d, dmin, sc, mn, q.clip(0, top).astype(np.uint8).reshape(xs.shape[:-2] + (256,))


def quantize_k(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4) or Q5_K (bits 5), llama.cpp's layouts: per sub-block of 32, the step and
    minimum of _fit_step_min; the super-block's d and dmin the largest step and minimum over 63,
    each sub-block's 6-bit scale and minimum the nearest multiples of them, and each value the
    nearest code of the stored (f16) scales, clamped to 0 .. 2^bits - 1. (Not llama.cpp's bytes:
    its rounding and the refit of the 6-bit scales differ.)"""
    d, dmin, sc, mn, q = _min_sub_blocks(x, 32, (1 << bits) - 1, 63, "quantize_k")
    out = np.zeros(d.shape, Q4_K if bits == 4 else Q5_K)
    q = q.reshape(out.shape + (4, 2, 32))  # chunk of 64, half, element
    out["d"], out["dmin"] = d, dmin
    out["scales"][..., 0:4] = sc[..., :4] | (sc[..., 4:] >> 4) << 6
    out["scales"][..., 4:8] = mn[..., :4] | (mn[..., 4:] >> 4) << 6
    out["scales"][..., 8:12] = (sc[..., 4:] & 15) | (mn[..., 4:] & 15) << 4
    out["qs"] = ((q[..., 0, :] & 15) | (q[..., 1, :] & 15) << 4).reshape(out.shape + (128,))
    if bits == 5:  # bit s of qh[l]: the fifth bit of sub-block s's element l
        high = (q.reshape(out.shape + (8, 32)) >> 4).astype(np.uint8)
        out["qh"] = (high << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=-2, dtype=np.uint8)
    return out


Q6_K = np.dtype([("ql", "u1", (128,)), ("qh", "u1", (64,)), ("scales", "i1", (16,)), ("d", "<f2")])


def _fit_signed_step(xs: np.ndarray, half: int, tries: int = 19) -> np.ndarray:
    """Per sub-block xs[..., n]: the step s (either sign) of a grid s * q, q in -half..half - 1, with
    the least squared error weighted by x^2, among grids that put the value of largest magnitude at
    -(half + 0.1 t) steps for t in -(tries // 2)..tries // 2 (the grid's one extra negative code
    goes to the largest value's side), each refitted by weighted least squares for its codes. This
    is the search llama.cpp's Q6_K quantizer does (make_qx_quants), written from that description."""
    x = xs.astype(np.float64)
    w = x * x
    big = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)
    step, best = np.zeros(x.shape[:-1]), (w * x * x).sum(-1)  # all codes 0: the error of nothing
    with np.errstate(divide="ignore", invalid="ignore"):
        for t in range(-(tries // 2), tries // 2 + 1):
            q = np.clip(np.nan_to_num(np.rint(x * (-(half + 0.1 * t) / big))), -half, half - 1)
            swqq = (w * q * q).sum(-1)
            s = np.where(swqq > 0, (w * x * q).sum(-1) / swqq, 0)
            e = (w * (s[..., None] * q - x) ** 2).sum(-1)
            better = e < best
            step, best = np.where(better, s, step), np.where(better, e, best)
    return step.astype(np.float32)


def _signed_sub_blocks(x: np.ndarray, half: int, top: int, what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Super-blocks of 256 in sub-blocks of 16 under integer scales of one f16 d (Q6_K, Q3_K): per
    sub-block the step of _fit_signed_step over -half..half - 1; d the largest step's magnitude over
    `top` (f16); each sub-block's scale the nearest multiple of d (in -top..top); values the nearest
    of the stored scale, clamped to -half..half - 1. Returns (d [..., n], scales [..., n, 16],
    values [..., n, 256])."""
    xs = _values(x, 256, what).reshape(np.shape(x)[:-1] + (-1, 16, 16))
    steps = _fit_signed_step(xs, half)
    d = (np.abs(steps).max(axis=-1) / np.float32(top)).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.rint(steps / d.astype(np.float32)[..., None])).clip(-top, top).astype(np.int32)
        scale = d.astype(np.float32)[..., None] * sc
        q = np.nan_to_num(np.rint(xs / scale[..., None])).clip(-half, half - 1).astype(np.int32)
    return d, sc, q.reshape(xs.shape[:-2] + (256,))


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K, llama.cpp's layout: _signed_sub_blocks over -32..31 with int8 scales (top 127), values
    stored + 32. (Not llama.cpp's bytes: it maps the largest scale to -128 and rounds otherwise.)"""
    d, sc, q = _signed_sub_blocks(x, 32, 127, "quantize_q6_k")
    q = (q + 32).reshape(d.shape + (2, 4, 32))  # half of 128, quarter, element
    out = np.zeros(d.shape, Q6_K)
    out["d"], out["scales"] = d, sc
    lo = q & 15
    out["ql"] = np.concatenate([lo[..., 0, :] | lo[..., 2, :] << 4, lo[..., 1, :] | lo[..., 3, :] << 4],
                               axis=-1).reshape(d.shape + (128,))
    hi = q >> 4
    out["qh"] = (hi[..., 0, :] | hi[..., 1, :] << 2 | hi[..., 2, :] << 4 | hi[..., 3, :] << 6).reshape(d.shape + (64,))
    return out


Q3_K = np.dtype([("hmask", "u1", (32,)), ("qs", "u1", (64,)), ("scales", "u1", (12,)), ("d", "<f2")])


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    """Q3_K, llama.cpp's layout: _signed_sub_blocks over -4..3 with 6-bit scales (top 31, stored +
    32), values stored + 4 (two low bits in qs, the third in hmask). (Not llama.cpp's bytes: it maps
    the largest scale to -32.)"""
    d, sc, q = _signed_sub_blocks(x, 4, 31, "quantize_q3_k")
    u = q + 4
    out = np.zeros(d.shape, Q3_K)
    out["d"] = d
    stored = sc + 32  # sub-block s: low nibble in byte s % 8 (nibble s // 8), top bits in byte 8 + s % 4 at bit s // 4 * 2
    lo = stored & 15
    out["scales"][..., :8] = lo[..., :8] | lo[..., 8:] << 4
    top = (stored >> 4).reshape(stored.shape[:-1] + (4, 4))  # [s // 4, s % 4]
    out["scales"][..., 8:] = top[..., 0, :] | top[..., 1, :] << 2 | top[..., 2, :] << 4 | top[..., 3, :] << 6
    parts = u.reshape(u.shape[:-1] + (2, 4, 32))  # half of 128, bit pair, byte
    low = parts & 3
    out["qs"] = (low[..., 0, :] | low[..., 1, :] << 2 | low[..., 2, :] << 4 | low[..., 3, :] << 6).reshape(u.shape[:-1] + (64,))
    high = (u >> 2).reshape(u.shape[:-1] + (8, 32))  # bit i // 32 of byte i % 32
    out["hmask"] = sum(high[..., j, :] << j for j in range(8))
    return out


Q2_K = np.dtype([("scales", "u1", (16,)), ("qs", "u1", (64,)), ("d", "<f2"), ("dmin", "<f2")])


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """Q2_K, llama.cpp's layout: _min_sub_blocks over codes 0..3 in sub-blocks of 16, 4-bit scales
    and minimums (scale in the low nibble of scales[s], minimum in the high); codes in qs as Q3_K's
    two low bits. (Not llama.cpp's bytes: its search for the codes and scales differs.)"""
    d, dmin, sc, mn, q = _min_sub_blocks(x, 16, 3, 15, "quantize_q2_k")
    out = np.zeros(d.shape, Q2_K)
    out["d"], out["dmin"], out["scales"] = d, dmin, sc | mn << 4
    parts = q.reshape(q.shape[:-1] + (2, 4, 32))  # half of 128, bit pair, byte
    out["qs"] = (parts[..., 0, :] | parts[..., 1, :] << 2 | parts[..., 2, :] << 4 | parts[..., 3, :] << 6).reshape(d.shape + (64,))
    return out


def dequantize_q4(blocks: np.ndarray) -> np.ndarray:
    """Q4_0 or Q4_1 blocks -> f32, from the GGUF definitions."""
    qs = blocks["qs"].astype(np.int32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
    d = blocks["d"].astype(np.float32)[..., None]
    v = d * (q - 8) if "m" not in blocks.dtype.names else d * q + blocks["m"].astype(np.float32)[..., None]
    return v.reshape(blocks.shape[:-1] + (-1,))


def quantize_onnx_uint4(w: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric UINT4 per block of `block` along K of w[K, N] (the layout of a MatMul's B), as
    ONNX's blocked DequantizeLinear defines it: (values uint8 [K, N] in 0..15, f32 scales
    [K / block, N], zero points uint8 [K / block, N] in 0..15)."""
    w = _values(w, 1, "quantize_onnx_uint4")
    if w.ndim != 2 or not (isinstance(block, int) and block > 0) or w.shape[0] % block:
        raise ValueError(f"quantize_onnx_uint4: expected w [K, N] with K a multiple of a positive int block, got shape"
                         f" {w.shape}, block {block!r}")
    k, n = w.shape
    wb = w.reshape(k // block, block, n)
    lo = np.minimum(wb.min(axis=1), 0)
    hi = np.maximum(wb.max(axis=1), 0)
    scale = ((hi - lo) / np.float32(15)).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1), scale)
    zp = np.clip(np.rint(-lo / safe), 0, 15).astype(np.int32)
    q = np.clip(np.rint(wb / safe[:, None, :]) + zp[:, None, :], 0, 15).astype(np.uint8).reshape(k, n)
    return q, scale, zp.astype(np.uint8)


def dequantize_onnx_uint4(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, block: int = 32) -> np.ndarray:
    """DequantizeLinear (blocked along axis 0): w[k, n] = scale[k // block, n] * (q[k, n] - zp[k // block, n])."""
    q = np.asarray(q).astype(np.float32)
    zp = np.asarray(zero_point).astype(np.float32)
    return np.repeat(scale, block, axis=0)[:q.shape[0]] * (q - np.repeat(zp, block, axis=0)[:q.shape[0]])
