"""A quant type declared outside kernels.dsl (GGUF Q5_0) gets working kernels on both targets with no
Python change: the walkthrough of docs/adding-a-quant-type.md, as a test."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kernelgen
from kernelgen import cli
from kernelgen.reference import qmatvec as qmatvec_ref

ROOT = Path(__file__).resolve().parents[1]
Q5_0 = """
# Q5_0: 5-bit values; low 4 bits as in Q4_0, the fifth bits in a 32-bit mask; value d * (q - 16).
quant q5_0 {
    block 32;
    field d: f16;
    field qh: u8[4];
    field qs: u8[16];
    unpack (nib(qs, i) | (bit(qh, i) << 4)) - 16;
    dequant d * q;
}
"""


def q5_0_dequant_llama(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 from llama.cpp's definition: value j < 16 is (qs[j] & 15) | bit j of qh << 4, value j + 16
    is (qs[j] >> 4) | bit j + 16 of qh << 4, both minus 16, times d."""
    qh = blocks["qh"].astype(np.uint32)
    mask = qh[..., 0] | qh[..., 1] << 8 | qh[..., 2] << 16 | qh[..., 3] << 24
    j = np.arange(16)
    qs = blocks["qs"].astype(np.int32)
    lo = (qs & 15) | (((mask[..., None] >> j) & 1) << 4).astype(np.int32)
    hi = (qs >> 4) | (((mask[..., None] >> (j + 16)) & 1) << 4).astype(np.int32)
    q = np.concatenate([lo, hi], axis=-1) - 16
    return (blocks["d"].astype(np.float32)[..., None] * q).reshape(blocks.shape[:-1] + (-1,))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("q5")
    dsl = tmp / "kernels.dsl"
    dsl.write_text((ROOT / "kernels.dsl").read_text(encoding="utf-8") + Q5_0, encoding="utf-8")
    assert cli.main(["build", "--target", "all", "--dsl", str(dsl), "--out", str(tmp / "out")]) == 0
    return tmp / "out"


def random_blocks(dtype: np.dtype, rows: int, nb: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, nb * dtype.itemsize), dtype=np.uint8)
    blocks = raw.view(dtype).copy()
    blocks["d"] = rng.uniform(0.001, 0.05, blocks.shape).astype(np.float16)
    return blocks


@pytest.mark.parametrize("target", ["simd128", "relaxed-simd"])
def test_declared_q5_0_matches_its_definition(built: Path, target: str) -> None:
    k = kernelgen.load(built, target)
    q5 = k.quants["q5_0"]
    assert q5.stored_bytes == 22 and q5.bytes == 20
    assert k.manifest["exports"][k.export_name("qmatvec", "q5_0")]["quant"] == "q5_0"
    assert "qdot_q5_0" in k.manifest["exports"] and k.job_name("qmatvec_job", "q5_0")
    rows, nb = 9, 5
    blocks = random_blocks(q5.dtype, rows, nb, seed=5)
    blocks["qh"][0, 0] = [0xFF, 0xFF, 0xFF, 0xFF]  # every fifth bit set: values up to 15
    blocks["qs"][0, 0] = 0xFF
    blocks["qh"][0, 1] = 0  # no fifth bit, low nibbles 0: the extreme -16
    blocks["qs"][0, 1] = 0
    assert np.array_equal(q5.dequantize_ref(blocks), q5_0_dequant_llama(blocks))

    x = np.random.default_rng(6).standard_normal(nb * 32).astype(np.float32)
    act = k.quantize_act(x)
    y = k.qmatvec(k.pack("q5_0", blocks), act)
    ref, mag = qmatvec_ref(q5.scale_ref(blocks), q5.unpack_ref(blocks).reshape(rows, -1), act.q, act.d,
                           k.manifest["constants"]["ACT_ZERO"], 32)
    assert np.all(np.abs(y - ref) <= 1e-5 * mag + 1e-30)
    d = k.qdot(k.pack("q5_0", blocks[:1]), act)
    assert abs(d - ref[0]) <= 1e-5 * mag[0] + 1e-30
