"""The walkthroughs of docs/adding-a-quant-type.md, done as they say: each section's declaration
appended to a copy of kernels.dsl (under a free name if kernels.dsl declares it), `kernelgen check`
and `kernelgen build --target all` run, and the built type checked against the `gguf` package:
dequantization value for value, mat-vec and dot against float64 on both targets, threaded too."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf.quants import dequantize

import kernelgen
from kernelgen import cli
from kernelgen.compiler.parse import parse

from helpers import assert_bitwise_equal, assert_q_close, random_blocks

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "adding-a-quant-type.md").read_text(encoding="utf-8")
LIBRARY = (ROOT / "kernels.dsl").read_text(encoding="utf-8")
WALKTHROUGHS = {"super-block": G.Q3_K, "codebook": G.MXFP4}  # section title word -> its GGUF type


def declaration(section: str) -> tuple[str, str]:
    """(free type name, declaration) of the walkthrough whose heading names `section`."""
    text = DOC.split(f"## Walkthrough: a {section} type")[1].split("\n## ")[0]
    (decl,) = re.findall(r"```dsl\n(.*?)```", text, re.S)
    name = re.search(r"^quant (\w+) \{", decl, re.M).group(1)
    taken = {q.name for q in parse(LIBRARY).quants}
    free = name if name not in taken else next(f"{name}_doc{i}" for i in range(100) if f"{name}_doc{i}" not in taken)
    return free, decl.replace(f"quant {name} {{", f"quant {free} {{")


@pytest.fixture(scope="module", params=list(WALKTHROUGHS))
def walked(request, tmp_path_factory) -> tuple[Path, str, G]:
    tmp = tmp_path_factory.mktemp(f"walk-{request.param}")
    name, decl = declaration(request.param)
    dsl = tmp / "kernels.dsl"
    dsl.write_text(LIBRARY + "\n" + decl, encoding="utf-8")
    assert cli.main(["check", "--dsl", str(dsl)]) == 0
    assert cli.main(["build", "--target", "all", "--dsl", str(dsl), "--out", str(tmp / "out")]) == 0
    return tmp / "out", name, WALKTHROUGHS[request.param]


@pytest.mark.parametrize("target", ["simd128", "relaxed-simd"])
def test_walkthrough_type_matches_gguf_and_float64(walked, target):
    out, name, qtype = walked
    k = kernelgen.load(out, target)
    q = k.quants[name]
    rng = np.random.default_rng(13)
    rows, kdim = 5, 2 * 256
    blocks = random_blocks(q, rows, kdim // q.block, rng)
    if name.startswith("mxfp4"):
        blocks["e"][0, :2] = [0, 255]  # every exponent byte dequantizes as gguf's does
        with np.errstate(over="ignore"):
            assert_bitwise_equal(q.dequantize_ref(blocks), dequantize(blocks.view(np.uint8).reshape(rows, -1), qtype),
                                 f"{name} dequantize")
        blocks = random_blocks(q, rows, kdim // q.block, rng)
    deq = q.dequantize_ref(blocks)
    assert_bitwise_equal(deq, dequantize(blocks.view(np.uint8).reshape(rows, -1), qtype), f"{name} dequantize")

    act = k.quantize_act(rng.standard_normal(kdim).astype(np.float32))
    zero = k.manifest["constants"]["ACT_ZERO"]
    a = (k.act_values(act).astype(np.float64) - zero) * np.repeat(act.d.astype(np.float64), 32)
    ref = deq.astype(np.float64) @ a
    mag = np.abs(deq.astype(np.float64) * a).sum(axis=1)
    w = k.pack(name, blocks)
    y = k.qmatvec(w, act)
    assert_q_close(y, ref, mag, f"{name} qmatvec")
    with k.pool(2) as pool:
        assert_bitwise_equal(k.qmatvec(w, act, pool=pool), y, f"{name} threaded")
    assert_q_close(np.float32([k.qdot(k.pack(name, blocks[:1]), act)]), ref[:1], mag[:1], f"{name} qdot")
