"""The packed layouts (README, "Packed layouts"): which types each target packs in groups of four
rows, and the grouped planes byte for byte against a reference written here from the layout's
definition (rows padded with zero blocks; per block, granule c of each row in turn), not from
QuantFormat._grouped. The kernels on these planes are checked against float64 throughout the
suite (every type, both targets, odd row counts); here the bytes themselves."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kernelgen.compiler.build import compile_source, from_built
from kernelgen.compiler.lower import _i16_units
from kernelgen.compiler.ops import TARGETS
from kernelgen import quantformat
from kernelgen.quantformat import GRANULE, GROUP_ROWS

from helpers import assert_q_close, random_blocks, rng_for


@pytest.fixture(scope="module")
def quants(module_cache) -> dict:
    return module_cache.get("relaxed-simd").quants


def test_each_target_groups_exactly_its_i7_types(module_cache) -> None:
    for target in TARGETS:
        m = module_cache.get(target).manifest["quants"]
        for name, q in m.items():
            assert q["group"] == (GROUP_ROWS if q["dot"] == "i7" else 1), (target, name)
    assert {n for n, q in module_cache.get("relaxed-simd").manifest["quants"].items() if q["group"] == 1} == {"q8_0", "iq4_nl", "iq4_xs"}


def _by_hand(rows_planes: dict[str, np.ndarray], q, rows: int) -> dict[str, np.ndarray]:
    """The grouped planes from the rows layout's, one granule at a time."""
    padded = -(-rows // GROUP_ROWS) * GROUP_ROWS
    out = {}
    for name, plane in rows_planes.items():
        b = plane.view(np.uint8).reshape(padded, -1)  # each row's bytes in block order
        rec = q.record if name == "scale" else None
        unit = rec.bytes if rec else (q.kernel.bytes if name == "q" else 4)  # bytes of one block (record) of a row
        # f32s and codes in granules; past them a record's integers byte by byte (an offset's of two
        # sub-blocks of 16 per block, Q2_K's, by pairs), sub-block scales by pairs
        split = 4 * len(rec.factors) if rec else unit - 4 if name == "q" and q.sub_scales else unit  # (two int8 pairs)
        rest = 2 if name == "q" or q.sub_offsets else 1
        got = bytearray()
        for g in range(padded // GROUP_ROWS):
            for u in range(b.shape[1] // unit):
                for c in range(0, split, GRANULE):
                    for r in range(GROUP_ROWS):
                        got += bytes(b[g * GROUP_ROWS + r, u * unit + c:u * unit + c + GRANULE])
                for c in range(split, unit, rest):
                    for r in range(GROUP_ROWS):
                        got += bytes(b[g * GROUP_ROWS + r, u * unit + c:u * unit + c + rest])
        out[name] = np.frombuffer(bytes(got), np.uint8)
    return out


@pytest.mark.parametrize("rows", [1, 4, 7])
def test_grouped_planes_are_the_rows_planes_interleaved_by_granule(quants, rows) -> None:
    rng = rng_for("grouped-planes", rows)
    for name, q in quants.items():
        if q.group == 1:
            continue
        b = random_blocks(q, rows, 2 * 256 // q.block if q.sub else 3, rng)
        flat = dataclasses.replace(q, group=1)
        padded = np.concatenate([b, np.zeros((-rows % GROUP_ROWS, b.shape[1]), b.dtype)])
        rows_planes = flat.pack(padded)
        if q.sub_scales:  # rows one by one an i32 per sub-block scale (s in both i16 halves), grouped int8 twice
            assert q.kernel.bytes == flat.kernel.bytes - 4
            blocks = rows_planes["q"].reshape(padded.shape[0], -1, flat.kernel.bytes)
            codes = flat.kernel.bytes - 8  # Q6_K's bytes (32), Q3_K's nibbles (16) or Q2_K's crumbs (8), then the two i32s
            s = blocks[..., codes:].copy().view("<i2")[..., ::2]  # (rows, blocks, 2): each half's s
            assert (blocks[..., codes:].copy().view("<i2")[..., 1::2] == s).all()
            pairs = np.repeat(s.astype(np.int8), 2, axis=-1).view(np.uint8)
            rows_planes["q"] = np.concatenate([blocks[..., :codes], pairs], axis=-1).reshape(-1)
        elif q.kernel.bytes != flat.kernel.bytes:  # a scalar byte field (q4_onnx's zero point) takes a granule
            assert name == "q4_onnx" and q.kernel.bytes == flat.kernel.bytes + GRANULE - 1
            z = padded["z"].reshape(padded.shape[0], -1, 1)
            qs = rows_planes["q"].reshape(padded.shape[0], -1, flat.kernel.bytes)[..., 1:]
            rows_planes["q"] = np.concatenate([np.repeat(z, GRANULE, axis=-1), qs], axis=-1).reshape(-1)
        want = _by_hand(rows_planes, q, rows)
        got = q.pack(b)
        assert list(got) == list(want), name
        for plane in got:
            assert got[plane].dtype == rows_planes[plane].dtype, (name, plane)
            np.testing.assert_array_equal(got[plane].view(np.uint8), want[plane], err_msg=f"{name} plane {plane}")
        assert sum(p.nbytes for p in got.values()) == q.packed_bytes(rows, b.shape[1] * q.block)


@pytest.mark.parametrize("target", TARGETS)
def test_pack_in_parts_of_rows_is_pack_in_one(module_cache, monkeypatch, target) -> None:
    """QuantFormat.pack evaluates PACK_VALUES values (whole groups of rows) at a time: with parts of
    one group, every type's planes equal the one-part pack's over odd rows, and an invalid block in a
    later part is named by its row in the matrix."""
    rng = rng_for("pack-parts", target)
    for name, q in module_cache.get(target).quants.items():
        b = random_blocks(q, 11, 2 * 256 // q.block if q.sub else 3, rng)
        whole = q.pack(b)
        monkeypatch.setattr(quantformat, "PACK_VALUES", 1)
        parts = q.pack(b)
        monkeypatch.undo()
        assert list(parts) == list(whole), name
        for plane in whole:
            np.testing.assert_array_equal(parts[plane], whole[plane], err_msg=f"{name} plane {plane}")
    q = module_cache.get(target).quants["q4_onnx"]
    b = random_blocks(q, 11, 3, rng)
    b["z"][9, 2], b["qs"][9, 2] = 200, 0  # 0 - 200
    monkeypatch.setattr(quantformat, "PACK_VALUES", 1)
    with pytest.raises(ValueError, match=r"block \(9, 2\) unpacks to -200 at element 0, outside int8"):
        q.pack(b)


def test_a_lane_group_of_a_grouped_block_holds_four_values_of_each_row(quants) -> None:
    """What the kernels read (Q.codes(p, j): values 4j..4j+3 of each row): Q4_0's nibble vectors
    give codes 4j.. of the low halves for j < 4 and 16 + 4(j - 4).. of the high ones after."""
    q = quants["q4_0"]
    rng = rng_for("grouped-lanes")
    b = random_blocks(q, 4, 1, rng)
    codes = (q.unpack_ref(b)[:, 0] + 8).astype(np.uint8)  # (4 rows, 32): the codes, value + 8
    vectors = q.pack(b)["q"].reshape(4, 16)  # one group, one block: four vectors of nibbles
    for j in range(8):
        lanes = (vectors[j % 4] & 15) if j < 4 else (vectors[j % 4] >> 4)
        np.testing.assert_array_equal(lanes.reshape(4, 4), codes[:, 4 * j:4 * j + 4], err_msg=f"lane group {j}")


@pytest.mark.parametrize("group", [1, GROUP_ROWS])
def test_q2_k_packs_its_codes_in_2_bits(quants, group) -> None:
    """Q2_K's codes take 2 bits in plane q (ENCODINGS "crumb"), not a nibble: per row and kernel
    block 8 bytes, byte b holding elements b, b + 8, b + 16 and b + 24 from its low bit pair up;
    rows one by one (simd128) an i32 per sub-block scale after them, grouped (relaxed SIMD) an int8
    pair per row. The codes come from gguf's dequantizer on blocks with d 1, dmin 0 and every
    sub-block scale 1 (value = code); grouped, lane group j is bit pair j / 2 of the 16 bytes at
    16 (j % 2): elements 4j..4j+3 of each row, what the kernels read."""
    q = dataclasses.replace(quants["q2_k"], group=group)
    assert q.encoding == ("crumb", 0)
    b = random_blocks(q, GROUP_ROWS, 2, rng_for("q2_k-crumbs"))
    b["d"], b["dmin"], b["scales"] = 1, 0, 0x71  # minimum 7, times dmin 0
    raw = np.ascontiguousarray(b).view(np.uint8).reshape(GROUP_ROWS, -1)
    codes = dequantize(raw, GGMLQuantizationType.Q2_K).reshape(GROUP_ROWS, 16, 32).astype(np.uint8)  # (rows, kernel blocks, 32)
    per_block = 8 + (8 if group == 1 else 4)  # the codes, then the sub-block scales
    assert q.kernel.bytes == per_block and q.packed_bytes(GROUP_ROWS, 512) == GROUP_ROWS * 16 * (per_block + 3)
    plane = q.pack(b)["q"].reshape(-1, 16, group, per_block)  # (groups, kernel blocks, rows of a group, bytes)
    if group == 1:
        crumbs = plane[:, :, 0, :8]  # (rows, blocks, 8)
    else:  # granules of 4 bytes: each row's bytes 0-3, then each row's 4-7
        crumbs = plane.reshape(1, 16, -1)[..., :8 * GROUP_ROWS].reshape(16, 2, GROUP_ROWS, 4)
        for j in range(8):
            lanes = (plane.reshape(16, -1)[:, 16 * (j % 2):16 * (j % 2) + 16] >> (2 * (j // 2))) & 3
            np.testing.assert_array_equal(lanes.reshape(16, GROUP_ROWS, 4), codes[..., 4 * j:4 * j + 4].transpose(1, 0, 2),
                                          err_msg=f"lane group {j}")
        crumbs = crumbs.transpose(2, 0, 1, 3).reshape(GROUP_ROWS, 16, 8)
    got = np.concatenate([(crumbs >> (2 * k)) & 3 for k in range(4)], axis=-1)
    np.testing.assert_array_equal(got, codes)


# Constant zeros under sub-block scales (Q6_K's 32) at each width of the i16 sums (Q.u16: how many
# lane groups hdot7 adds before the widening), on types declared here: 7-bit codes less 100 (1 lane
# group), less 64 (2) and Q6_K's (4). qgtile takes the zero's pairs with the activations from one
# relaxed dot per load, summed across the widening's lane groups (lanesums).
ZERO_TYPES = {
    "zero7": (2, "block 32;\n    sub 16;\n    field d: f16;\n    field sc: i8[2];\n    field qs: u8[32];\n"
                 "    unpack (qs[i] & 127) - 64;\n    dequant d * sc[s] * q;"),
    "zero1": (1, "block 32;\n    sub 16;\n    field d: f16;\n    field sc: i8[2];\n    field qs: u8[32];\n"
                 "    unpack (qs[i] & 127) - 100;\n    dequant d * sc[s] * q;"),
}


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_constant_zero_under_sub_block_scales_at_every_i16_width(deterministic) -> None:
    library = (Path(__file__).resolve().parents[1] / "kernels.dsl").read_text(encoding="utf-8")
    decls = "".join(f"\nquant {name} {{\n    {body}\n}}\n" for name, (_, body) in ZERO_TYPES.items())
    (built,) = compile_source(library + decls, targets=("relaxed-simd",), quants=("q6_k", *ZERO_TYPES), code_budget=None)
    k = from_built(built, deterministic)
    rng = rng_for("zero-widths")
    widths = {}
    for name in ("q6_k", *ZERO_TYPES):
        q = k.quants[name]
        widths[name] = _i16_units(q, k.manifest["activation"]["max"])
        assert k.manifest["quants"][name]["group"] == GROUP_ROWS, name
        rows, kdim = 7, 2 * q.block
        blocks = random_blocks(q, rows, kdim // q.block, rng)
        blocks.view(np.uint8).reshape(rows, -1, q.stored_bytes)[0, 0, :] = 0  # codes 0: the zero's full weight
        x = rng.standard_normal(kdim).astype(np.float32)
        x[:32] = np.abs(x[:32])  # a block of positive activations: the pairs with the zero at their largest
        act = k.quantize_act(x)
        a = k.act_values(act).astype(np.float64) * np.repeat(act.d.astype(np.float64), 32)
        deq = q.dequantize_ref(blocks).astype(np.float64)
        y = k.qmatvec(k.pack(name, blocks), act)
        assert_q_close(y, deq @ a, np.abs(deq * a).sum(axis=1), f"{name} qmatvec")
    assert widths == {"q6_k": 4, **{n: w for n, (w, _) in ZERO_TYPES.items()}}
