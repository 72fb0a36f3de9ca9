"""GGUF's flat and codebook quant types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4; the K-quants and IQ4_XS in super-blocks) as declared in
kernels.dsl, against llama.cpp's own definitions in the `gguf` package: the dequantization derived
from each declaration equals gguf.quants.dequantize bit for bit, and every dot and mat-vec (both
targets, relaxed determinism on and off, threaded and not) equals float64 dequantize(W) @ act up to
float rounding, with exact integer parts."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

from kernelgen import reference
from kernelgen.host import formats
from kernelgen.host.api import Act, Kernels

from helpers import (act_dtype, assert_bitwise_equal, assert_q_close, consts, rng_for, same_as_deterministic,
                     unit_scale_qmatvec_and_qdots)

DSL_PATH = Path(__file__).resolve().parents[1] / "kernels.dsl"

GGUF = {"q8_0": G.Q8_0, "q4_0": G.Q4_0, "q4_1": G.Q4_1, "q5_0": G.Q5_0, "q5_1": G.Q5_1, "iq4_nl": G.IQ4_NL, "mxfp4": G.MXFP4,
        "q4_k": G.Q4_K, "q5_k": G.Q5_K, "q6_k": G.Q6_K, "q3_k": G.Q3_K, "q2_k": G.Q2_K,
        "iq4_xs": G.IQ4_XS}
NEW = ("q5_0", "q5_1", "iq4_nl", "mxfp4", "q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "iq4_xs")


@pytest.fixture(scope="module")
def quants(module_cache) -> dict:
    return module_cache.get("simd128").quants


def finite_f16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random finite f16 bit patterns: every exponent (subnormals, +-0 included), any sign."""
    bits = rng.integers(0, 0x10000, shape, dtype=np.uint32).astype(np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] ^= 0x4000  # inf/NaN exponent -> a finite one
    return bits.view(np.float16)


def random_blocks(q, rng: np.random.Generator, rows: int, nb: int, scale: tuple[float, float] | None = None) -> np.ndarray:
    """Random stored bytes; f16 fields finite (all of f16 when `scale` is None, else uniform in it);
    MXFP4's exponent any byte (None) or one that keeps the kernels' products finite."""
    b = rng.integers(0, 256, (rows, nb * q.stored_bytes), dtype=np.uint8).view(q.dtype).copy()
    for f in q.fields:
        if f.type == "f16":
            b[f.name] = finite_f16(rng, b.shape) if scale is None else rng.uniform(*scale, b.shape)
        elif f.name == "e" and scale is not None:
            b[f.name] = rng.integers(118, 131, b.shape)  # 2^-10 .. 2^2
    return b


def gguf_dequant(quant: str, blocks: np.ndarray) -> np.ndarray:
    raw = np.ascontiguousarray(blocks).view(np.uint8).reshape(blocks.shape[0], -1)
    return dequantize(raw, GGUF[quant]).astype(np.float32)


# ---- the derived dequantization is llama.cpp's, value for value ---------------------------------


@pytest.mark.parametrize("quant", GGUF)
def test_dequant_equals_gguf_on_random_bytes(quants, quant):
    q = quants[quant]
    rng = rng_for("gguf-deq", quant)
    b = random_blocks(q, rng, 16, 9)
    if quant == "mxfp4":
        b["e"][0, :2] = [0, 255]  # the subnormal and the largest scale
    with np.errstate(over="ignore", invalid="ignore"):
        assert_bitwise_equal(q.dequantize_ref(b), gguf_dequant(quant, b), f"{quant} dequantize")


def quantized_blocks(quant: str, q, x: np.ndarray) -> np.ndarray:
    """Blocks of `quant` quantized from x: gguf's quantizer where it has one, else kernelgen.reference's."""
    if quant == "iq4_nl":
        return reference.quantize_iq4_nl(x)
    if quant == "iq4_xs":
        return reference.quantize_iq4_xs(x)
    if quant in ("q4_k", "q5_k"):
        return reference.quantize_k(x, 4 if quant == "q4_k" else 5)
    if quant == "q6_k":
        return reference.quantize_q6_k(x)
    if quant == "q3_k":
        return reference.quantize_q3_k(x)
    if quant == "q2_k":
        return reference.quantize_q2_k(x)
    return quantize(x, GGUF[quant]).view(q.dtype)


@pytest.mark.parametrize("quant", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4", "iq4_nl", "q4_k", "q5_k", "q6_k", "q3_k", "q2_k",
                                   "iq4_xs"])
def test_dequant_equals_gguf_on_quantized_blocks(quants, quant):
    q = quants[quant]
    rng = rng_for("gguf-quantized", quant)
    x = (rng.standard_normal((6, 256)) * rng.uniform(0.01, 30, (6, 1))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    x[1, 5] = 1e4  # an outlier
    b = quantized_blocks(quant, q, x)
    got = q.dequantize_ref(b)
    assert_bitwise_equal(got, gguf_dequant(quant, b), f"{quant} dequantize")
    # and the quantization is sane (MXFP4 clips values above 1.5 * 2^floor(log2(amax)): 1/4 of amax;
    # the K-quants' error is within a step of the super-block's 6-bit scale grid)
    step = np.abs(x).reshape(6, -1, q.block).max(axis=-1, keepdims=True) / 3.5
    assert np.all(np.abs(got - x).reshape(6, -1, q.block) <= step + 1e-6), quant


@pytest.mark.parametrize("bits", [4, 5])
def test_reference_k_quantizer_error_is_within_a_step(bits):
    rng = rng_for("k-quant", bits)
    x = (rng.standard_normal((6, 512)) * rng.uniform(0.01, 5, (6, 1))).astype(np.float32)
    x[0, :32] = 0.0
    x[1, 7] = 300.0
    b = reference.quantize_k(x, bits)
    got = dequantize(b.view(np.uint8).reshape(6, -1), G.Q4_K if bits == 4 else G.Q5_K)
    amax = np.abs(x).reshape(6, -1, 256).max(axis=-1, keepdims=True)
    assert np.all(np.abs(got - x).reshape(6, -1, 256) <= amax / 2 ** (bits - 1))


@pytest.mark.parametrize("quant, before, bound", [("q4_k", 0.0785, 0.073), ("q5_k", 0.0382, 0.0365),
                                                  ("q6_k", 0.0194, 0.0180), ("q3_k", 0.1551, 0.1535),
                                                  ("q2_k", 0.3282, 0.29)])
def test_reference_k_quantizers_search_their_scales(quant, before, bound):
    """The K-quant reference quantizers fit each sub-block's scale (and minimum) by a weighted search,
    as llama.cpp's do: on Gaussian rows their relative RMS error (gguf's dequantization against x)
    is below `bound`, where the plain grids over each sub-block's range gave `before` (measured,
    same data): 0.0719, 0.0360, 0.0178, 0.1530, 0.2751 now (Q3_K's search weighs large values: its
    RMS gains little)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 4096)) * rng.uniform(0.01, 1, (64, 1))).astype(np.float32)
    b = quantized_blocks(quant, None, x)
    err = gguf_dequant(quant, b) - x
    assert np.sqrt((err ** 2).mean() / (x ** 2).mean()) < bound < before


@pytest.mark.parametrize("start, end", [("quant iq4_xs {", "\n}"), ("table iq4nl_values", "};"), ("quant q3_k {", "\n}")])
def test_the_docs_declarations_are_kernels_dsls(start, end):
    """docs/adding-a-quant-type.md shows IQ4_XS's declaration, the file-level codebook it reads, and
    the super-block walkthrough's Q3_K as kernels.dsl has them (less the comments)."""
    doc = (DSL_PATH.parent / "docs" / "adding-a-quant-type.md").read_text(encoding="utf-8")
    dsl = DSL_PATH.read_text(encoding="utf-8")

    def decl(text: str) -> list[str]:
        part = text[text.index(start):]
        return [ln for ln in part[:part.index(end) + len(end)].splitlines() if not ln.strip().startswith("#")]

    assert decl(dsl) == decl(doc)


def test_reference_iq4_xs_scales_and_entries():
    """quantize_iq4_xs: d is the largest sub-block scale / 32 (that sub-block's 6-bit scale -32, its
    largest value the codebook's -127 entry), the other sub-blocks' scales the nearest multiples of d,
    each value the nearest entry; its error is within half the widest gap of the codebook times a
    sub-block's scale."""
    rng = rng_for("iq4_xs-ref")
    x = (rng.standard_normal((4, 512)) * rng.uniform(0.01, 10, (4, 1))).astype(np.float32)
    x[0, :256] = 0.0  # an all-zero super-block
    x[1, 40] = -500.0  # an outlier: sub-block 1 sets d
    b = reference.quantize_iq4_xs(x)
    got = gguf_dequant("iq4_xs", b)
    assert np.all(got[0, :256] == 0)
    assert got[1, 40] == np.float32(b["d"][1, 0]) * np.float32(-32) * np.float32(-127)
    step = np.abs(x).reshape(4, -1, 256).max(axis=-1, keepdims=True) / 127 * 32 / 31  # a sub-block scale at most
    assert np.all(np.abs(got - x).reshape(4, -1, 256) <= step * 24 / 2 + np.abs(x).reshape(4, -1, 256) / 31)


def test_reference_iq4_nl_picks_the_nearest_entry():
    x = np.linspace(-1, 1, 32, dtype=np.float32)[None, :]
    b = reference.quantize_iq4_nl(x)
    assert b["d"][0, 0] == np.float16(1 / 127)  # -1 maps to the first entry, -127
    d = np.float32(b["d"][0, 0])
    grid = d * reference.IQ4_NL_VALUES.astype(np.float32)
    qs = b["qs"][0, 0].astype(np.int32)
    codes = np.concatenate([qs & 15, qs >> 4])
    assert np.all(np.abs(grid[codes] - x[0]) <= np.abs(grid[None, :] - x[0][:, None]).min(axis=1))


def test_q5_1_packs_its_values_as_bytes(quants):
    """Q5_1's fifth bits are unpacked once, at pack time: plane q holds each block's 32 values (gguf's
    own dequantization (x - m) / d gives them back) as bytes, the kernels' cheapest unpack."""
    q = quants["q5_1"]
    b = random_blocks(q, rng_for("q5_1-bytes"), 5, 3, (0.5, 2.0))
    b["qs"][0], b["qh"][0] = 0xFF, 0xFF  # all 31
    b["qs"][1], b["qh"][1] = 0x00, 0x00  # all 0
    b["qh"][2] = [0x55, 0xAA, 0x0F, 0xF0]  # alternating fifth bits
    planes = q.pack(b)
    assert q.planes["q"] == ("u1", 32) and planes["q"].dtype == np.uint8
    values = planes["q"].reshape(5, 3, 32).astype(np.float64)
    d, m = b["d"].astype(np.float64)[..., None], b["m"].astype(np.float64)[..., None]
    np.testing.assert_array_equal(values, (gguf_dequant("q5_1", b).reshape(5, 3, 32) - m) / d)
    assert (values[0] == 31).all() and (values[1] == 0).all()


@pytest.mark.parametrize("target, zero", [("simd128", 0), ("relaxed-simd", 32)])
def test_q6_k_packs_values_for_simd128_and_codes_for_relaxed_simd(module_cache, target, zero):
    """Q6_K's integers (-32..31, under int8 sub-block scales) go in plane q as the dots read them:
    SIMD128's i16 dot takes the values, so it stores them as int8 and adds nothing back per half
    (QuantFormat.signed_bytes); relaxed SIMD's 7-bit operand takes the codes, values + 32 (its
    zero comes off with the activations' sums). Both are gguf's own values, -32 and 31 included,
    and the manifest says which (encoding zero), so hosts pack alike."""
    q = module_cache.get(target).quants["q6_k"]
    b = random_blocks(q, rng_for("q6_k-signed"), 4, 2, (0.5, 2.0))
    b["scales"][b["scales"] == 0] = 1  # gguf's values come back as dequant / (d * scale)
    b["ql"][0, 0], b["qh"][0, 0] = 0x00, 0x00  # all -32
    b["ql"][0, 1], b["qh"][0, 1] = 0xFF, 0xFF  # all 31
    values = np.rint(gguf_dequant("q6_k", b).astype(np.float64).reshape(4, 2, 16, 16)
                     / (b["d"].astype(np.float64)[..., None, None] * b["scales"].astype(np.float64)[..., None]))
    stored = q.pack(b)["q"].view(np.int8).astype(np.int64)
    if q.group > 1:  # four rows' values side by side, 4 at a time (the grouped layout)
        stored = stored.reshape(1, 2, 8, 36 * 4)[..., :128].reshape(2, 8, 8, 4, 4).transpose(3, 0, 1, 2, 4)
    else:  # each 32 values, then the two halves' scales as i32s
        stored = stored.reshape(4, 2, 8, 40)[..., :32]
    np.testing.assert_array_equal(stored.reshape(4, 2, 256), values.reshape(4, 2, 256) + zero)
    assert module_cache.get(target).manifest["quants"]["q6_k"]["encoding"] == {"kind": "byte", "zero": -zero}
    assert (values[0, 0] == -32).all() and (values[0, 1] == 31).all()


@pytest.mark.parametrize("quant, per32, factors", [("q4_k", 19, {"scale", "offset"}), ("q5_k", 35, {"scale", "offset"}),
                                                  ("q6_k", 41, {"scale"})])
def test_super_block_records_hold_the_per_block_scales(quants, quant, per32, factors):
    """A K-quant's scales and offsets travel as one record per super-block (F as f32, I a byte per
    kernel block), not as f32s per 32 values: Q4_K packs 19 bytes per 32 values (llama.cpp's block:
    18), 24 before. Each kernel block's f32 F * I is the reference scale and offset bit for bit, on
    random stored bytes with every finite f16 (subnormals, -0, either sign of d and dmin). Q6_K's
    record holds d alone: its sub-blocks of 16 keep their integer scales with the codes."""
    from kernelgen.quantformat import NumpyEval, fold
    q = quants[quant]
    assert q.record is not None and set(q.record.factors) == factors and q.record.blocks == 8
    assert q.packed_bytes(1, 256) == 8 * per32
    b = random_blocks(q, rng_for("records", quant), 7, 5)
    b["d"][0, 0] = np.float16(-0.0)
    rec = q.pack(b)["scale"].reshape(7, 5, q.record.bytes)
    for name, ref in (("scale", q.scale_ref(b)), ("offset", q.offset_ref(b) if q.offset is not None else None)):
        if name not in factors:
            continue
        x = q.record.factors[name]
        f = rec[..., x.f_at:x.f_at + 4].copy().view("<f4")  # (7, 5, 1)
        if x.i is None:  # the kernel block's part of the scale, the same for the 8 of a super-block
            assert_bitwise_equal(f[..., 0], fold(q.sub_scales[0], NumpyEval(b)).astype(np.float32), f"{quant} {name}")
            continue
        i = rec[..., x.i_at:x.i_at + 8].view(np.int8 if x.signed else np.uint8).astype(np.float32)
        assert_bitwise_equal((i * f).reshape(7, -1), ref, f"{quant} {name}")


def test_a_super_block_too_small_for_a_record_keeps_f32_planes_and_computes_right():
    """The kernels read four blocks' scales from one record: a super-block of 64 values (two kernel
    blocks) has no record, keeps f32 scale planes, and its mat-vec equals the reference."""
    from kernelgen.compiler.build import compile_kernels
    decl = ("quant k64 {\n    block 64;\n    sub 32;\n    field d: f16;\n    field sc: u8[2];\n    field qs: u8[32];\n"
            "    unpack (qs[i % 32] >> (i / 32 * 4)) & 15;\n    dequant d * sc[s] * q;\n}\n")
    k = compile_kernels(DSL_PATH.read_text(encoding="utf-8") + decl, "simd128")
    q = k.quants["k64"]
    assert q.record is None and q.planes["scale"] == ("<f4", 4)
    rng = rng_for("k64")
    b = random_blocks(q, rng, 5, 6, (0.5, 2.0))
    act = k.quantize_act(rng.standard_normal(6 * 64).astype(np.float32))
    got = k.qmatvec(k.pack("k64", b), act)
    ref, mag = reference.qmatvec(q.scale_ref(b), q.unpack_ref(b).reshape(5, -1), k.act_values(act), act.d,
                                 consts(k)[0], 32)
    assert np.all(np.abs(got - ref) <= 1e-5 * mag + 1e-30)


@pytest.mark.parametrize("target", ["simd128", "relaxed-simd"])
def test_sub_blocks_of_16_with_wide_values_keep_a_scale_per_half(target):
    """Q6_K's values (at most 32) take both halves of a block under one widening dot on simd128
    (idotss: its lanes of four products must fit i16). A type with sub-blocks of 16 and int8 values
    does not (Q.sub16 is 0) and still computes right, -128 and 127 included, GEMM and mat-vec."""
    from kernelgen.compiler.build import compile_source, from_built
    decl = ("quant k8s {\n    block 256;\n    sub 16;\n    field d: f16;\n    field sc: i8[16];\n"
            "    field qs: i8[256];\n    unpack qs[i];\n    dequant d * sc[s] * q;\n}\n")
    (built,) = compile_source(DSL_PATH.read_text(encoding="utf-8") + decl, targets=(target,), code_budget=None)
    k = from_built(built)
    q = k.quants["k8s"]
    rng = rng_for("k8s")
    b = random_blocks(q, rng, 3, 5, (0.5, 2.0))
    b["qs"][0, 0, :32], b["qs"][1, 0, :32] = -128, 127
    x = rng.standard_normal((2, 5 * 256)).astype(np.float32)
    x[0, :32] = 100.0  # activations of +-127 against the extreme values
    w = k.pack("k8s", b)
    both = k.qmatmul(w, k.quantize_act(x))
    for t in range(2):
        act = k.quantize_act(x[t])
        y = k.qmatvec(w, act)
        assert_bitwise_equal(both[t], y, f"k8s qmatmul token {t} vs qmatvec")
        assert_q_close(y, *f64_reference(k, "k8s", b, act), f"k8s qmatvec token {t}")
    if target == "simd128":  # Q6_K takes the one-dot path, this type does not
        assert "i16x8.narrow_i32x4_s" in built.wat.split("(func $qtile_q6_k__")[1].split("\n  (func ")[0]
        assert "i16x8.narrow_i32x4_s" not in built.wat.split("(func $qtile_k8s__")[1].split("\n  (func ")[0]


def test_grouped_sub_block_scales_are_int8_pairs(module_cache):
    """Relaxed SIMD's grouped Q6_K holds each sub-block scale as an int8 twice after the codes (plane
    q 36 bytes per row and 32 values, 37 with the record; 41 with rows' i32s): a half's eight bytes
    are the group's four rows' scales in their lane pairs, what qgtile's i16x8.load8x8 reads, -128
    and 127 included (the language keeps a sub-block scale in int8)."""
    import dataclasses
    q6 = module_cache.get("relaxed-simd").quants["q6_k"]
    assert q6.group == 4 and q6.packed_bytes(4, 256) == 4 * 8 * 37
    assert dataclasses.replace(q6, group=1).packed_bytes(4, 256) == 4 * 8 * 41
    b = random_blocks(q6, rng_for("q6k-pairs"), 4, 1)
    b["scales"][0, 0, :2] = (-128, 127)
    codes = q6.pack(b)["q"].reshape(8, 4 * 36)  # one group: per kernel block k, four rows' codes then scales
    at = 4 * 32
    for k in range(8):
        for h in range(2):
            lanes = codes[k, at + 8 * h:at + 8 * h + 8].view(np.int8)
            np.testing.assert_array_equal(lanes, np.repeat(b["scales"][:, 0, 2 * k + h], 2), err_msg=f"block {k} half {h}")


def test_idotss_is_refused_on_relaxed_simd():
    from kernelgen.compiler.build import compile_kernels
    from kernelgen.errors import DslError
    src = ("export kernel f(w: ptr, s: ptr, a: ptr, y: ptr) {\n"
           "    i32x4.store(y, idotss(i32x4.splat(0), i8x16.load(w), i8x16.load(w + 16), s, a));\n}\n")
    compile_kernels(src, "simd128")
    with pytest.raises(DslError, match=r":2:\d+: idotss takes SIMD128's i16 activations"):
        compile_kernels(src, "relaxed-simd")


IDOTN_SRC = ("export kernel f(w: ptr, a: ptr, y: ptr) {\n"
             "    i32x4.store(y, idotn(i32x4.splat(0), i8x16.load(w), a));\n}\n")


def test_idotn_lanes_are_the_split_dots_of_the_nibble_codes():
    """SIMD128's idotn reads 32 codes straight from 16 packed bytes (byte j: code j low, j + 16 high)
    against activations in the split i16 layout: lane k is 256 times the products of values 4k..4k+3
    and 16+4k..16+4k+3, the lanes of unpacking each half and _idot_split's dots, with codes 0 and 15
    against activations of -127 and 127 (every product at its largest)."""
    from kernelgen.compiler.build import compile_kernels
    k = compile_kernels(IDOTN_SRC, "simd128")
    rng = rng_for("idotn")
    cases = [(np.full(32, 15), np.full(32, 127)), (np.full(32, 15), np.full(32, -127)),
             (np.tile([0, 15], 16), np.tile([-127, 127], 16)), (np.arange(32) % 16, np.arange(32) * 8 - 127)]
    cases += [(rng.integers(0, 16, 32), rng.integers(-127, 128, 32)) for _ in range(20)]
    y = k.module.alloc(16)
    for codes, act in cases:
        packed = (codes[:16] | codes[16:] << 4).astype(np.uint8)
        split = np.concatenate([np.concatenate([h[0::2], h[1::2]]) for h in (act[:16], act[16:])]).astype(np.int16)
        k.call("f", k.module.put(packed), k.module.put(split), y)
        prod = codes.astype(np.int64) * act
        want = [256 * (prod[4 * j:4 * j + 4].sum() + prod[16 + 4 * j:20 + 4 * j].sum()) for j in range(4)]
        np.testing.assert_array_equal(k.module.get(y, np.int32, 4), want, err_msg=f"codes {codes}, act {act}")


IDOTNS_SRC = ("export kernel f(w: ptr, s: ptr, a: ptr, y: ptr) {\n"
              "    i32x4.store(y, idotns(i32x4.splat(0), i8x16.load(w), s, a));\n}\n")


IDOTNSZ_SRC = ("export kernel f(w: ptr, s: ptr, a: ptr, y: ptr) {\n"
               "    i32x4.store(y, idotnsz(i32x4.splat(0), i8x16.load(w), nibzeros(a, 4), s, a));\n}\n")


@pytest.mark.parametrize("op", ["idotn", "idotns", "idotnsz"])
def test_nibble_dots_are_refused_on_relaxed_simd(op):
    from kernelgen.compiler.build import compile_kernels
    from kernelgen.errors import DslError
    with pytest.raises(DslError, match=rf":2:\d+: (nibzeros|{op}) takes SIMD128's i16 activations"):
        compile_kernels({"idotn": IDOTN_SRC, "idotns": IDOTNS_SRC, "idotnsz": IDOTNSZ_SRC}[op], "relaxed-simd")


@pytest.mark.parametrize("zero", ["z", "65", "-1"])
def test_nibzeros_takes_a_constant_zero_within_its_bound(zero):
    """nibzeros' zero becomes a vector constant, and its products' lanes must fit i16: a run-time
    value or one outside [0, 64] is an error at the call."""
    from kernelgen.compiler.build import compile_kernels
    from kernelgen.errors import DslError
    src = ("export kernel f(a: ptr, z: i32, y: ptr) {\n"
           f"    i16x8.store(y, nibzeros(a, {zero}));\n}}\n")
    with pytest.raises(DslError, match=r":2:\d+: nibzeros' zero must be (a compile-time integer|in \[0, 64\], got)"):
        compile_kernels(src, "simd128")


@pytest.mark.parametrize("zero", [0, 4, 49])
def test_sub_scaled_nibble_dots_sum_to_the_dot_of_the_codes_less_the_zero(zero):
    """SIMD128's idotns reads 32 codes from 16 packed bytes as idotn does and weighs each half of 16
    by its sub-block scale (an i32 holding it in both i16 halves, as Q2_K's packed plane stores it);
    idotnsz with nibzeros takes a constant zero off the codes first (Q3_K's 4; 49, the largest
    Q.nibss admits): the lanes sum to s0 * (c - z)[:16].a[:16] + s1 * (c - z)[16:].a[16:], exactly,
    with codes 0 and 15 against activations of -127 and 127 and scales of -128 and 127."""
    from kernelgen.compiler.build import compile_kernels
    src = IDOTNSZ_SRC.replace("nibzeros(a, 4)", f"nibzeros(a, {zero})") if zero else IDOTNS_SRC
    k = compile_kernels(src, "simd128")
    rng = rng_for(f"idotns-{zero}")
    cases = [(np.full(32, 15), np.full(32, 127), (127, 127)), (np.full(32, 15), np.full(32, -127), (-128, 127)),
             (np.full(32, 0), np.full(32, -127), (-128, 127)), (np.tile([0, 15], 16), np.tile([-127, 127], 16), (1, -1)),
             (np.arange(32) % 16, np.arange(32) * 8 - 127, (3, 0))]
    cases += [(rng.integers(0, 16, 32), rng.integers(-127, 128, 32), tuple(rng.integers(-128, 128, 2))) for _ in range(20)]
    y = k.module.alloc(16)
    for codes, act, (s0, s1) in cases:
        packed = (codes[:16] | codes[16:] << 4).astype(np.uint8)
        split = np.concatenate([np.concatenate([h[0::2], h[1::2]]) for h in (act[:16], act[16:])]).astype(np.int16)
        scales = np.array([s0, s0, s1, s1], dtype=np.int16)
        k.call("f", k.module.put(packed), k.module.put(scales), k.module.put(split), y)
        prod = (codes.astype(np.int64) - zero) * act
        assert k.module.get(y, np.int32, 4).sum() == s0 * prod[:16].sum() + s1 * prod[16:].sum(), (codes, act, s0, s1)


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q4_k", "q2_k", "q3_k"])
def test_nibble_types_take_idotn_on_simd128_with_results_unchanged(name):
    """Q4_0, Q4_1 and Q4_K (Q.nib16) take idotn in SIMD128's tiles, Q2_K (its 2-bit codes packed as
    nibbles there: Q.nibss) idotns, Q3_K (its codes less 4, nibbles too) idotnsz, and every qmatvec
    variant gives the rows-1 results bit for bit, which the one-block steps (qleft) compute, on K
    tails and outlier blocks."""
    from kernelgen.compiler.build import compile_source, from_built
    src = DSL_PATH.read_text(encoding="utf-8")
    outs = {}
    for rows in (1, 2, 4):
        (built,) = compile_source(src, targets=("simd128",), tune={"qmatvec": {"rows": rows, "accs": 1}},
                                  code_budget=None, quants=(name,))
        assert "0x00f0" in built.wat  # idotn's mask of the high nibbles of even bytes
        assert ("idotns(" in built.wat) == (name == "q2_k")
        assert ("idotnsz(" in built.wat) == (name == "q3_k")
        k = from_built(built)
        q = k.quants[name]
        rng = rng_for(f"idotn-{name}")
        nb = 13 if q.block == 32 else 3
        b = random_blocks(q, rng, 7, nb, (0.5, 2.0))
        x = rng.standard_normal(nb * q.block).astype(np.float32)
        x[:32] = 1e4  # activations of +-127
        outs[rows] = k.qmatvec(k.pack(name, b), k.quantize_act(x))
        assert_q_close(outs[rows], *f64_reference(k, name, b, k.quantize_act(x)), f"{name} rows {rows}")
    for rows in (2, 4):
        assert_bitwise_equal(outs[rows], outs[1], f"{name} qmatvec rows {rows} vs rows 1")


def test_each_targets_packed_layout_round_trips_through_the_manifest():
    """Every declared type as each target packs it (Target.layout: the grouped layout, SIMD128's
    nibbles for Q2_K's 2-bit codes) comes back from its manifest entry as it was, so a host packs
    what the kernels read."""
    from kernelgen.compiler.check import check
    from kernelgen.compiler.ops import TARGETS
    from kernelgen.compiler.parse import parse
    from kernelgen.quantformat import QuantFormat
    declared = check(parse(DSL_PATH.read_text(encoding="utf-8"))).quants
    for target in TARGETS.values():
        for name, q in declared.items():
            laid = target.layout(q)
            assert QuantFormat.from_json(name, laid.to_json()) == laid, f"{name} on {target.name}"
    assert TARGETS["simd128"].layout(declared["q2_k"]).encoding[0] == "nib"
    assert TARGETS["relaxed-simd"].layout(declared["q2_k"]).encoding[0] == "crumb"


def test_a_manifest_of_another_packed_layout_is_refused(quants):
    """A library built for another packing (a manifest whose planes are not what this kernelgen's
    pack writes: Q4_K's f32 scale and offset planes of an older build) is refused with a rebuild
    hint, not packed into a layout its kernels misread."""
    from kernelgen.quantformat import QuantFormat
    d = quants["q4_k"].to_json()
    assert QuantFormat.from_json("q4_k", d).planes == quants["q4_k"].planes
    d["planes"] = {"q": {"dtype": "|u1", "bytes_per_block": 16}, "scale": {"dtype": "<f4", "bytes_per_block": 4},
                   "offset": {"dtype": "<f4", "bytes_per_block": 4}}
    with pytest.raises(ValueError, match="rebuild the library"):
        QuantFormat.from_json("q4_k", d)


def test_codebook_lookups_take_relaxed_swizzle_on_relaxed_simd():
    """A codebook's nibble indices are below 16, where relaxed_swizzle is defined as swizzle: relaxed
    SIMD's build uses it (no saturating add on x86), simd128's the plain swizzle. (Its results are the
    exact dots of the tests here, under wasmtime's relaxed determinism on and off.)"""
    from kernelgen import library
    wat = {t: (library.out() / t / "kernels.wat").read_text(encoding="utf-8") for t in ("simd128", "relaxed-simd")}
    assert "i8x16.relaxed_swizzle" in wat["relaxed-simd"] and "i8x16.swizzle" not in wat["relaxed-simd"]
    assert "i8x16.swizzle" in wat["simd128"] and "relaxed_swizzle" not in wat["simd128"]


# ---- kernels against float64 dequantize(W) @ act ------------------------------------------------


def f64_reference(k: Kernels, quant: str, blocks: np.ndarray, act: Act) -> tuple[np.ndarray, np.ndarray]:
    """float64 dequantize(W) @ (the module's activations, dequantized), and the sum of the magnitudes
    of the per-block terms the kernel rounds in f32 (the scale of its float error)."""
    q = k.quants[quant]
    zero, _ = consts(k)
    rows = blocks.shape[0]
    w = q.dequantize_ref(blocks).astype(np.float64)
    a = (k.act_values(act).astype(np.float64) - zero) * np.repeat(act.d.astype(np.float64), 32)
    terms = (w * a).reshape(rows, -1, 32)
    # per block: scale * d_a * int_dot and offset * d_a * sum(a), each rounded on its own
    per = q.block // q.subs  # values per scale: 32, or a sub-block of 16
    wi = q.unpack_ref(blocks).reshape(rows, -1, per).astype(np.float64)
    ai = (k.act_values(act).astype(np.float64) - zero).reshape(-1, per)
    ad = np.repeat(act.d.astype(np.float64), 32 // per)
    mag = np.abs(q.scale_ref(blocks) * ad * (wi * ai).sum(-1))
    if q.offset is not None:
        mag = mag + np.abs(q.offset_ref(blocks) * ad * ai.sum(-1))
    return terms.sum(axis=(1, 2)), mag.sum(axis=1)


@pytest.mark.parametrize("quant", NEW)
def test_qmatvec_and_qdot_match_float64_dequantization(mode, kgen, quant):
    km = kgen()
    q = km.quants[quant]
    cases = []
    # one block, a tail past four blocks, many blocks (super-blocks: one, three, seventeen)
    for k in ((32, 96, 4128) if q.block == 32 else (256, 768, 4352)):
        rng = rng_for("gguf-mv", quant, k)
        x = (rng.standard_normal(k) * np.repeat(rng.uniform(0.1, 10, k // 32), 32)).astype(np.float32)
        for rows in (1, 3, 9):
            xw = (rng.standard_normal((rows, k)) * rng.uniform(0.01, 3, (rows, 1))).astype(np.float32)
            xw[0, :32] = 0.0  # all-zero block
            xw[-1, -1] = 500.0  # outlier block
            cases.append((k, rows, "quantized", x, quantized_blocks(quant, q, xw)))
            cases.append((k, rows, "random", x, random_blocks(q, rng, rows, k // q.block, (-0.05, 0.05))))

    def run(m: Kernels) -> list:
        out = []
        with m.pool(2) as pool:
            for k, rows, kind, x, b in cases:
                act = m.quantize_act(x)
                w = m.pack(quant, b)
                y = m.qmatvec(w, act)
                assert_bitwise_equal(m.qmatvec(w, act, pool=pool), y, f"{quant} threaded vs one thread")
                out += [act, y, np.float32(m.qdot(m.pack(quant, b[:1]), act))]
        return out

    outs = run(km)
    for i, (k, rows, kind, x, b) in enumerate(cases):
        act, y, d = outs[3 * i:3 * i + 3]
        ref, mag = f64_reference(km, quant, b, act)
        assert_q_close(y, ref, mag, f"{quant} qmatvec rows={rows} k={k} {kind}")
        assert_q_close(np.float32([d]), ref[:1], mag[:1], f"{quant} qdot k={k} {kind}")
    same_as_deterministic(mode, kgen, None, run, outs)


def test_relaxed_quantizes_and_dots_as_simd128(module_cache):
    """One activation format (issue 13.3): the same x gives the same int8 activations on both
    targets, and every declared type's relaxed integer dots are simd128's (both exact; "i7" types
    through the codes in the relaxed dot's 7-bit operand, "i16" ones through the i16 dot), so the
    relaxed mat-vec's error against float64 dequantize(W) @ act is simd128's up to float rounding,
    and bit-identical with wasmtime's relaxed_simd_deterministic on and off."""
    s, det, nondet = (module_cache.get("simd128"), module_cache.get("relaxed-simd", True),
                      module_cache.get("relaxed-simd", False))
    assert {n: q["dot"] for n, q in det.manifest["quants"].items()} == {
        n: "i16" if n in ("q8_0", "iq4_nl", "iq4_xs") else "i7" for n in det.quants}
    rng = rng_for("relaxed-as-simd128")
    for quant, q in s.quants.items():
        k = 160 if q.block == 32 else 512  # a block tail past the four-block steps; two super-blocks
        x = (rng.standard_normal(k) * np.repeat(rng.uniform(0.01, 10, k // 32), 32)).astype(np.float32)
        x[-1] = 300.0  # an outlier block
        b = random_blocks(q, rng, 9, k // q.block, (-0.05, 0.05))
        if quant == "q4_onnx":  # (random_blocks makes GGUF's f16 fields only)
            b["z"] %= 16  # a UINT4 zero point
            b["d"] = rng.uniform(-0.05, 0.05, b.shape)
        acts = [m.quantize_act(x) for m in (s, det, nondet)]
        for a in acts[1:]:
            np.testing.assert_array_equal(det.act_values(a).astype(np.int16), s.act_values(acts[0]), err_msg=f"{quant}: activations")
            np.testing.assert_array_equal(a.d, acts[0].d, err_msg=f"{quant}: activation scales")
        ys = [m.qmatvec(m.pack(quant, b), acts[0] if m is s else a) for m, a in zip((s, det, nondet), acts)]
        ref, mag = f64_reference(s, quant, b, acts[0])
        for y, what in zip(ys, ("simd128", "relaxed det", "relaxed nondet")):
            assert_q_close(y, ref, mag, f"{quant} {what}")
        assert_q_close(ys[1], ys[0].astype(np.float64), mag, f"{quant} relaxed vs simd128")
        assert_bitwise_equal(ys[1], ys[2], f"{quant} relaxed deterministic on and off")


def unit_blocks(quant: str, q, k: int) -> np.ndarray:
    """Rows whose scale is 1 (and minimum an integer): every code of the type, in patterns."""
    nb = k // q.block
    rng = rng_for("gguf-unit", quant, k)
    if quant == "q6_k":  # d = 1, sub-block scales 1 and -2: values -32..31 times them
        b = rng.integers(0, 256, (4, nb * q.stored_bytes), dtype=np.uint8).view(q.dtype).copy()
        b["d"], b["scales"] = 1.0, np.resize([1, -2], 16)
        b["ql"][0], b["qh"][0], b["ql"][1], b["qh"][1] = 0, 0, 0xFF, 0xFF
        return b
    if quant == "q3_k":  # d = 1, every 6-bit scale 33 (a sub-block scale of 1): values -4..3
        b = rng.integers(0, 256, (4, nb * q.stored_bytes), dtype=np.uint8).view(q.dtype).copy()
        b["d"], b["scales"][..., :8], b["scales"][..., 8:] = 1.0, 0x11, 0xAA
        b["qs"][0], b["hmask"][0], b["qs"][1], b["hmask"][1] = 0, 0, 0xFF, 0xFF
        return b
    if quant == "q2_k":  # d = dmin = 1, every 4-bit scale 1, minimums 0 and 3 in turn: values 0..3 less them
        b = rng.integers(0, 256, (4, nb * q.stored_bytes), dtype=np.uint8).view(q.dtype).copy()
        b["d"], b["dmin"], b["scales"] = 1.0, 1.0, np.resize([0x01, 0x31], 16)
        b["qs"][0], b["qs"][1] = 0x00, 0xFF
        return b
    if quant == "iq4_xs":  # d = 1, every 6-bit scale 33 (a sub-block scale of 1): the codebook's entries
        b = rng.integers(0, 256, (4, nb * q.stored_bytes), dtype=np.uint8).view(q.dtype).copy()
        b["d"], b["scales_h"], b["scales_l"] = 1.0, 0xAAAA, 0x11
        codes = np.arange(16, dtype=np.uint8)
        b["qs"][0], b["qs"][1], b["qs"][2] = 0x00, 0xFF, np.resize(codes | (codes[::-1] << 4), 128)
        return b
    if q.sub:  # K-quants: d = dmin = 1, every 6-bit scale 1, minimums 0 (sub-blocks 0-3) and 3 (4-7)
        b = rng.integers(0, 256, (4, nb * q.stored_bytes), dtype=np.uint8).view(q.dtype).copy()
        b["d"], b["dmin"] = 1.0, 1.0
        b["scales"] = [1, 1, 1, 1, 0, 0, 0, 0, 1 | 3 << 4, 1 | 3 << 4, 1 | 3 << 4, 1 | 3 << 4]
        b["qs"][0], b["qs"][1] = 0x00, 0xFF
        if "qh" in q.dtype.names:
            b["qh"][0], b["qh"][1] = 0x00, 0xFF
        return b
    rows = []
    for pattern in ("lo", "hi", "random"):
        b = np.zeros(nb, q.dtype)
        b["qs"] = {"lo": 0x00, "hi": 0xFF}.get(pattern, 0) if pattern != "random" else rng.integers(0, 256, (nb, 16))
        if "d" in q.dtype.names:
            b["d"] = 1.0
        if quant == "mxfp4":
            b["e"] = 128  # 2^0
        if quant in ("q5_0", "q5_1"):
            b["qh"] = rng.integers(0, 256, (nb, 4)) if pattern == "random" else (0xFF if pattern == "hi" else 0)
        if quant == "q5_1":
            b["m"] = -16.0
        rows.append(b)
    codes = np.arange(16, dtype=np.uint8)  # and one row with every code at both nibbles
    b = np.zeros(nb, q.dtype)
    b["qs"] = codes | (codes[::-1] << 4)
    if "d" in q.dtype.names:
        b["d"] = 1.0
    if quant == "mxfp4":
        b["e"] = 128
    rows.append(b)
    return np.stack(rows)


@pytest.mark.parametrize("quant", NEW)
def test_integer_accumulation_is_exact(mode, kgen, quant):
    km = kgen()
    q = km.quants[quant]
    zero, _ = consts(km)
    k = 160 if q.block == 32 else 512
    blocks = unit_blocks(quant, q, k)
    rng = rng_for("gguf-act", mode.target)
    lo, hi = -127, 127  # int8 activations at quantize_act's extremes, on both targets
    acts = [np.full(k, lo, act_dtype(km)), np.full(k, hi, act_dtype(km)),
            rng.choice(np.array([lo, hi]), k).astype(act_dtype(km))]

    def run(m: Kernels) -> list[np.ndarray]:
        return unit_scale_qmatvec_and_qdots(m, quant, blocks, acts)

    outs = run(km)
    deq = q.dequantize_ref(blocks)
    w = deq.astype(np.int64)  # integer scales and minimums: every value an integer
    assert np.array_equal(w, deq)
    for j, a in enumerate(acts):
        av = a.astype(np.int64) - zero
        want = (w * av).sum(axis=1)
        assert np.abs(want).max() < 2 ** 24
        for got in outs[2 * j:2 * j + 2]:
            assert np.array_equal(got.astype(np.int64), want), f"{quant}: got {got} want {want}"
    same_as_deterministic(mode, kgen, None, run, outs)


@pytest.mark.parametrize("quant", ["q5_0", "q5_1", "iq4_nl", "q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "iq4_xs"])
def test_non_finite_scales_poison_only_their_row(mode, kgen, quant):
    """A NaN or infinite f16 scale (d; the K-quants' super-block d) makes gguf's dequantized block
    non-finite; the kernels' row is then NaN (NaN scale) or not finite (infinite scale), and the
    other rows are unaffected."""
    km = kgen()
    q = km.quants[quant]
    rng = rng_for("gguf-nan", quant)
    nb = 4 if q.block == 32 else 2
    b = random_blocks(q, rng, 3, nb, (-0.05, 0.05))
    for f in ("qs", "ql"):  # nonzero codes everywhere, so inf * code is inf, not NaN from 0 * inf
        if f in q.dtype.names:
            b[f][:, :] = 0x99
    b["d"][0, 1] = np.nan
    b["d"][1, nb - 1] = np.inf
    x = rng.standard_normal(nb * q.block).astype(np.float32)
    act = km.quantize_act(x)
    with np.errstate(invalid="ignore", over="ignore"):  # (inf * a zero sub-block scale: NaN)
        y = km.qmatvec(km.pack(quant, b), act)
        deq = gguf_dequant(quant, b)
    assert np.isnan(deq[0]).any() and not np.isfinite(deq[1]).all()
    assert np.isnan(y[0]) and not np.isfinite(y[1])
    ref, mag = f64_reference(km, quant, b[2:], act)
    assert_q_close(y[2:], ref, mag, f"{quant} finite row")


def test_mxfp4_largest_exponent_overflows_as_gguf(mode, kgen):
    """MXFP4's scale is a power of two, never NaN; exponent byte 255 (2^127 for the doubled codes)
    times the largest code overflows f32: gguf's dequantized block is infinite, and so is the
    kernels' row when its dot is large (activations all 1: every product adds up)."""
    km = kgen()
    q = km.quants["mxfp4"]
    b = random_blocks(q, rng_for("gguf-mxfp4-inf"), 3, 4, (-0.05, 0.05))
    b["qs"][1] = 0x77  # code 7: value 12 (doubled 6.0) at every element
    b["e"][1] = 255
    b["qs"][0] = 0xFF  # code 15: value -12
    b["e"][0, 2] = 255
    act = km.quantize_act(np.ones(128, np.float32))
    y = km.qmatvec(km.pack("mxfp4", b), act)
    with np.errstate(invalid="ignore", over="ignore"):
        deq = gguf_dequant("mxfp4", b)
    assert np.isposinf(deq[1]).all() and np.isneginf(deq[0, 64:96]).all()
    assert np.isposinf(y[1]) and np.isneginf(y[0])
    ref, mag = f64_reference(km, "mxfp4", b[2:], act)
    assert_q_close(y[2:], ref, mag, "mxfp4 finite row")


# ---- GGUF files --------------------------------------------------------------------------------


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, G | None]], setup=lambda w: None) -> None:
    """A .gguf file of `tensors` (data, or stored bytes and their type); `setup(writer)` adds metadata."""
    w = GGUFWriter(path, "kernelgen-test")
    setup(w)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_tensors(rng: np.random.Generator, rows: int, k: int) -> dict[str, tuple[np.ndarray, G | None]]:
    """One tensor per type a model file holds: floats, and quantized ones as stored bytes."""
    def x() -> np.ndarray:
        return (rng.standard_normal((rows, k)) * rng.uniform(0.1, 2, (rows, 1))).astype(np.float32)

    def raw(b: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(b).view(np.uint8).reshape(rows, -1)

    special = x()  # BF16's edge values: NaN, infinities, -0, a subnormal, the largest finite and an f16 overflow
    special.reshape(-1)[:8] = [np.nan, np.inf, -np.inf, -0.0, 1e-40, 3.3895314e38, -7e4, 1.0 + 2**-9]
    return {"embd.f32": (x(), None), "norm.f16": (x().astype(np.float16), None),
            "norm.bf16": (quantize(special, G.BF16), G.BF16),
            "attn_q.q8_0": (quantize(x(), G.Q8_0), G.Q8_0), "attn_k.q4_0": (quantize(x(), G.Q4_0), G.Q4_0),
            "ffn_up.q4_k": (raw(reference.quantize_k(x(), 4)), G.Q4_K),
            "ffn_gate.q5_k": (raw(reference.quantize_k(x(), 5)), G.Q5_K),
            "attn_v.iq4_nl": (raw(reference.quantize_iq4_nl(x())), G.IQ4_NL),
            "attn_o.iq4_xs": (raw(reference.quantize_iq4_xs(x())), G.IQ4_XS),
            "ffn_down.mxfp4": (quantize(x(), G.MXFP4), G.MXFP4),
            "attn_out.q3_k": (raw(reference.quantize_q3_k(x())), G.Q3_K),
            "output.q6_k": (raw(reference.quantize_q6_k(x())), G.Q6_K),
            "token_embd.q2_k": (raw(reference.quantize_q2_k(x())), G.Q2_K)}


def test_load_gguf_packs_every_tensor(mode, kgen, tmp_path):
    km = kgen()
    rows, k = 5, 512
    rng = rng_for("gguf-file")
    tensors = gguf_tensors(rng, rows, k)
    write_gguf(tmp_path / "model.gguf", tensors)
    loaded = formats.load_gguf(km, tmp_path / "model.gguf")
    assert list(loaded) == list(tensors)
    assert_bitwise_equal(loaded["embd.f32"], tensors["embd.f32"][0], "F32 tensor")
    assert_bitwise_equal(loaded["norm.f16"], tensors["norm.f16"][0], "F16 tensor")
    bf16 = loaded["norm.bf16"]
    assert (bf16.dtype, bf16.shape) == (np.float32, (rows, k))
    assert_bitwise_equal(bf16, dequantize(tensors["norm.bf16"][0], G.BF16), "BF16 tensor")
    act = km.quantize_act(rng.standard_normal(k).astype(np.float32))
    for name, (data, qtype) in tensors.items():
        if qtype in (None, G.BF16):
            continue
        quant = qtype.name.lower()
        w = loaded[name]
        assert (w.quant, w.rows, w.k) == (quant, rows, k)
        blocks = data.view(km.quants[quant].dtype)
        assert_bitwise_equal(km.quants[quant].dequantize_ref(blocks), dequantize(data, qtype), f"{name} dequantize")
        ref, mag = f64_reference(km, quant, blocks, act)
        assert_q_close(km.qmatvec(w, act), ref, mag, f"{name} qmatvec")


def test_build_quant_from_a_gguf_file_builds_its_types(tmp_path, capsys):
    """`kernelgen build --quant-from FILE.gguf` builds the declared types the file's tensors use (in
    declaration order; with --quant, both); a tensor of an undeclared type, a file that is not GGUF, a
    missing file and a file of floats only exit 2 naming the problem, and write nothing."""
    from kernelgen.cli import main

    rng = rng_for("gguf-quant-from")
    tensors = gguf_tensors(rng, 2, 256)
    model = tmp_path / "model.gguf"
    write_gguf(model, {n: tensors[n] for n in ("embd.f32", "output.q6_k", "attn_q.q8_0", "ffn_up.q4_k")})
    base = ["build", "--dsl", str(DSL_PATH), "--no-store", "--target", "simd128"]
    assert main([*base, "--quant-from", str(model), "--quant", "q4_0", "--out", str(tmp_path / "o")]) == 0
    manifest = json.loads((tmp_path / "o" / "simd128" / "kernels.json").read_text(encoding="utf-8"))
    assert list(manifest["quants"]) == ["q8_0", "q4_0", "q4_k", "q6_k"]  # in declaration order
    assert formats.gguf_quants(model, ["q6_k", "q8_0", "q4_k", "q4_0"]) == ["q6_k", "q8_0", "q4_k"]
    capsys.readouterr()
    floats = tmp_path / "floats.gguf"
    write_gguf(floats, {"embd.f32": tensors["embd.f32"]})
    odd = tmp_path / "odd.gguf"
    write_gguf(odd, {"a.q8_0": tensors["attn_q.q8_0"],
                     "b.iq2_xxs": (np.zeros((2, 66), np.uint8), G.IQ2_XXS)})  # one IQ2_XXS super-block per row
    text = tmp_path / "text.gguf"
    text.write_text("not a model")
    for path, message in ((odd, f"--quant-from {odd}: tensor 'b.iq2_xxs' has type IQ2_XXS, which this build does not "
                                "support (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, "
                                "Q6_K, IQ4_NL, IQ4_XS, MXFP4)"),
                          (text, f"--quant-from {text}: not a readable GGUF file"),
                          (tmp_path / "none.gguf", f"--quant-from {tmp_path / 'none.gguf'}: cannot read"),
                          (floats, f"--quant-from {floats}: no quantized tensor (only F32/F16/BF16): name --quant")):
        assert main([*base, "--quant-from", str(path), "--out", str(tmp_path / "bad")]) == 2, path
        assert message in capsys.readouterr().err, path
        assert not (tmp_path / "bad").exists()


def test_load_gguf_of_a_q4_k_m_file_of_a_576_wide_model(kernels, tmp_path):
    """A Q4_K_M file as llama.cpp writes one for a small model (SmolLM2-135M's widths: hidden 576,
    FFN 1536): Q4_K and Q6_K where a row is a multiple of 256 values (the FFN's down projection), and
    their fallbacks elsewhere, Q5_0 for Q4_K and Q8_0 for Q6_K; F32 norms. Every tensor loads and
    its mat-vec matches gguf's dequantization."""
    rng = rng_for("gguf-q4_k_m")

    def x(rows: int, k: int) -> np.ndarray:
        return (rng.standard_normal((rows, k)) * rng.uniform(0.02, 0.2, (rows, 1))).astype(np.float32)

    def raw(b: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(b).view(np.uint8).reshape(b.shape[0], -1)

    tensors = {"token_embd.weight": (quantize(x(16, 576), G.Q8_0), G.Q8_0),
               "blk.0.attn_norm.weight": (x(1, 576)[0], None),
               "blk.0.attn_q.weight": (quantize(x(9, 576), G.Q5_0), G.Q5_0),
               "blk.0.attn_v.weight": (quantize(x(3, 576), G.Q8_0), G.Q8_0),
               "blk.0.ffn_up.weight": (quantize(x(24, 576), G.Q5_0), G.Q5_0),
               "blk.0.ffn_down.weight": (raw(reference.quantize_q6_k(x(9, 1536))), G.Q6_K),
               "blk.1.ffn_down.weight": (raw(reference.quantize_k(x(9, 1536), 4)), G.Q4_K)}
    write_gguf(tmp_path / "smol-q4_k_m.gguf", tensors)
    loaded = formats.load_gguf(kernels, tmp_path / "smol-q4_k_m.gguf")
    assert list(loaded) == list(tensors)
    assert_bitwise_equal(loaded["blk.0.attn_norm.weight"], tensors["blk.0.attn_norm.weight"][0], "F32 norm")
    acts = {k: kernels.quantize_act(rng.standard_normal(k).astype(np.float32)) for k in (576, 1536)}
    for name, (data, qtype) in tensors.items():
        if qtype is None:
            continue
        quant, w = qtype.name.lower(), loaded[name]
        assert (w.quant, w.rows, w.k) == (quant, data.shape[0], 1536 if "ffn_down" in name else 576)
        ref, mag = f64_reference(kernels, quant, data.view(kernels.quants[quant].dtype), acts[w.k])
        assert_q_close(kernels.qmatvec(w, acts[w.k]), ref, mag, f"{name} ({qtype.name}) qmatvec")


def test_load_gguf_rejects_an_unsupported_tensor_and_loads_nothing(kernels, tmp_path):
    rng = rng_for("gguf-file-q6k")
    tensors = gguf_tensors(rng, 2, 256)
    iq2 = rng.integers(0, 256, (2, 66), dtype=np.uint8)  # IQ2_XXS: 66 bytes per 256 values
    write_gguf(tmp_path / "iq2.gguf", {**tensors, "output.iq2_xxs": (iq2, G.IQ2_XXS)})
    top = kernels.module.in_use()
    with pytest.raises(ValueError, match=r"tensor 'output.iq2_xxs' has type IQ2_XXS, which this build does not support "
                                         r"\(supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, "
                                         r"MXFP4\)"):
        formats.load_gguf(kernels, tmp_path / "iq2.gguf")
    assert kernels.module.in_use() == top


def test_load_gguf_frees_what_it_packed_when_packing_fails(kernels, tmp_path, monkeypatch):
    write_gguf(tmp_path / "model.gguf", gguf_tensors(rng_for("gguf-file-fail"), 2, 256))
    top = kernels.module.in_use()
    pack = kernels.pack
    calls = []

    def failing_pack(quant, blocks):
        calls.append(quant)
        if len(calls) == 3:
            raise ValueError("pack failed")
        return pack(quant, blocks)

    monkeypatch.setattr(kernels, "pack", failing_pack)
    with pytest.raises(ValueError, match="pack failed"):
        formats.load_gguf(kernels, tmp_path / "model.gguf")
    assert len(calls) == 3 and kernels.module.in_use() == top
