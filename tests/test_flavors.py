"""A target's flavors (ops.Flavor): other builds of the same kernels for engines that lower the
relaxed dot otherwise (relaxed SIMD's "vnni": Chromium's one-instruction dot-add on AVX-VNNI).
Hosts pick one at load time, so a flavor must give its base build's results bit for bit on every
input, under wasmtime's relaxed_simd_deterministic on and off: checked here for every quant type's
dot, mat-vec (one thread and the pool) and GEMM, with K tails, one block, odd row counts, codes and
activations at their extremes. The JS runtime's choice is tested in runtime/test (Node, Chromium).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import kernelgen
from kernelgen.compiler.build import Memo, _module, compile_source, from_built, write_outputs
from kernelgen.compiler.check import check
from kernelgen.compiler.parse import parse
from kernelgen.compiler.ops import TARGETS
from kernelgen.errors import KernelgenError
from kernelgen.host import module as host_module
from kernelgen.host.manifest import manifest_text

from conftest import DSL_PATH
from helpers import assert_bitwise_equal, random_blocks, rng_for

FLAVORED = [(t.name, f.name) for t in TARGETS.values() for f in t.flavors]


@pytest.fixture(scope="module")
def builds() -> dict:
    """Each flavored target's base build with its flavors, compiled once."""
    return {t: compile_source(DSL_PATH.read_text(encoding="utf-8"), targets=(t,))[0] for t in {t for t, _ in FLAVORED}}


def test_relaxed_simd_has_the_vnni_flavor_for_vpdpbusd_engines():
    assert ("relaxed-simd", "vnni") in FLAVORED
    vnni = next(f for f in TARGETS["relaxed-simd"].flavors if f.name == "vnni")
    assert vnni.when == {"sevenBit": "unsigned", "saturates": False}  # runtime/features.mjs's probe fields
    assert not TARGETS["simd128"].flavors


@pytest.mark.parametrize("target, flavor", FLAVORED)
def test_a_flavors_manifest_is_its_bases_but_for_its_wasm(builds, target, flavor):
    base = builds[target]
    f = base.flavors[flavor]
    assert base.manifest["flavors"][flavor]["dir"] == flavor
    differ = {k for k in {*base.manifest, *f.manifest} if base.manifest.get(k) != f.manifest.get(k)}
    assert differ == {"flavor", "flavors", "constants", "wasm_bytes", "wasm_sha256"}  # its inputs are the base's
    flavored = TARGETS[target].flavored(flavor)
    assert f.manifest["constants"] == flavored.constants != base.manifest["constants"]
    assert f.wasm != base.wasm
    # the flavor's ops and constants are its only difference: the i16 types' dots through the relaxed dot-add
    assert f.wat.count("i32x4.relaxed_dot_i8x16_i7x16_add_s") > base.wat.count("i32x4.relaxed_dot_i8x16_i7x16_add_s")
    assert f"for target {target}/{flavor}." in f.wat.splitlines()[0]


def _extreme_blocks(q, rows: int, nb: int, rng: np.random.Generator) -> np.ndarray:
    """random_blocks with some rows' value bytes all 0x80 or 0x7f (Q8_0's -128 and 127; saturating
    codes for the packed types)."""
    raw = random_blocks(q, rows, nb, rng).view(np.uint8).reshape(rows, nb, q.stored_bytes).copy()
    value_fields = [f for f in q.fields if f.type in ("i8", "u8")]
    for r, byte in ((0, 0x80), (rows - 1, 0x7F)):
        for f in value_fields:
            off = q.dtype.fields[f.name][1]
            raw[r, :, off:off + q.dtype[f.name].itemsize] = byte
    for r in (0, rows - 1):  # kept where the type takes them (a zero point past 127 is no valid block)
        try:
            q.pack(raw[r:r + 1].view(q.dtype).reshape(1, nb))
        except ValueError:
            raw[r] = random_blocks(q, 1, nb, rng).view(np.uint8).reshape(nb, q.stored_bytes)
    return raw.view(q.dtype).reshape(rows, nb)


@pytest.mark.parametrize("deterministic", [False, True], ids=["nondet", "det"])
@pytest.mark.parametrize("target, flavor", FLAVORED)
def test_a_flavor_gives_its_bases_results_bit_for_bit(builds, target, flavor, deterministic):
    base = from_built(builds[target], deterministic)
    other = from_built(builds[target].flavors[flavor], deterministic)
    assert other.flavor == flavor and base.flavor is None
    rng = rng_for("flavors", target, flavor)
    for quant, q in base.quants.items():
        for rows, nb in ((7, 9), (1, 1), (5, 4)):  # a K tail past the four-block steps, one block, whole steps
            cols = nb * q.block
            blocks = _extreme_blocks(q, rows, nb, rng)
            x = rng.standard_normal((3, cols)).astype(np.float32)
            x[0, ::2] *= 1e3  # each block's largest value sets its scale: +-127 (ACT_MAX) in many blocks
            x[1, :] = np.where(np.arange(cols) % 3, 5.0, -5.0)  # every activation at +-127

            def run(k: kernelgen.Kernels) -> list:
                w = k.pack(quant, blocks)
                acts = k.quantize_act(x)
                act0 = k.quantize_act(x[1])
                with k.pool(2) as pool:
                    threaded = k.qmatvec(w, act0, pool=pool, chunk=1)
                out = [k.qmatvec(w, act0), threaded, k.qmatmul(w, acts),
                       np.array([k.qdot(k.pack(quant, blocks[r:r + 1]), act0) for r in range(rows)], np.float32)]
                k.reset()
                return out

            assert_bitwise_equal(run(other), run(base), f"{quant} {rows}x{cols}: {flavor} vs base")


@pytest.mark.parametrize("target, flavor", FLAVORED)
def test_load_picks_a_flavor_by_the_engines_probe_or_by_name(builds, target, flavor, tmp_path, monkeypatch):
    write_outputs([builds[target]], tmp_path)
    assert (tmp_path / target / flavor / "kernels.wasm").is_file()
    probe = host_module.relaxed_dot_probe()
    assert probe["sevenBit"] in ("signed", "unsigned") and isinstance(probe["saturates"], bool)
    when = builds[target].manifest["flavors"][flavor]["when"]
    auto = kernelgen.load(tmp_path, target)
    assert auto.flavor == (flavor if all(probe[k] == v for k, v in when.items()) else None)
    assert kernelgen.load(tmp_path, target, flavor="base").flavor is None
    assert kernelgen.load(tmp_path, target, flavor=flavor).flavor == flavor
    # the choice follows the probe: an engine that lowers the dot as `when` says gets the flavor
    monkeypatch.setattr(host_module, "relaxed_dot_probe", lambda deterministic=False: {**when, "topBitLane": 0})
    assert kernelgen.load(tmp_path, target).flavor == flavor
    shutil.rmtree(tmp_path / target / flavor)  # not deployed: auto gives way to the base build, asked for it is missing
    with pytest.warns(RuntimeWarning, match=f"the {flavor} flavor suits this engine but .* holds no build"):
        assert kernelgen.load(tmp_path, target).flavor is None
    with pytest.raises(KernelgenError, match="no build for target"):
        kernelgen.load(tmp_path, target, flavor=flavor)
    with pytest.raises(ValueError, match=f"one of this build's flavors \\({flavor}\\), got 'nope'"):
        kernelgen.load(tmp_path, target, flavor="nope")
    with pytest.raises(TypeError, match="load flavor"):
        kernelgen.load(tmp_path, target, flavor=1)


@pytest.mark.parametrize("target, flavor", FLAVORED)
def test_load_refuses_a_flavor_from_another_build(builds, target, flavor, tmp_path):
    write_outputs([builds[target]], tmp_path)
    d = tmp_path / target
    shutil.copy(d / "kernels.wasm", d / flavor / "kernels.wasm")  # the base's wasm under the flavor's manifest
    with pytest.raises(KernelgenError, match="the wasm does not match this manifest"):
        kernelgen.load(tmp_path, target, flavor=flavor)
    shutil.copy(d / "kernels.json", d / flavor / "kernels.json")  # and the base's manifest: not the flavor's
    with pytest.raises(KernelgenError, match=f"not the {flavor} flavor's manifest"):
        kernelgen.load(tmp_path, target, flavor=flavor)
    manifest = json.loads((d / "kernels.json").read_text())
    manifest["flavors"][flavor]["dir"] = "../.."
    (d / "kernels.json").write_bytes(manifest_text(manifest))
    with pytest.raises(KernelgenError, match="flavors must map names to a directory name"):
        kernelgen.load(tmp_path, target, flavor="base")


def test_the_committed_build_carries_each_flavor():
    out = Path(kernelgen.library.out())
    for target, flavor in FLAVORED:
        manifest = json.loads((out / target / "kernels.json").read_text())
        assert manifest["flavors"][flavor]["dir"] == flavor
        k = kernelgen.load(out, target, flavor=flavor)
        assert k.flavor == flavor and k.manifest["tune"] == manifest["tune"]


@pytest.mark.parametrize("target, flavor", FLAVORED)
def test_a_flavor_lowered_alone_is_the_one_built_beside_its_base(builds, target, flavor):
    """with_flavors reuses the base build's lowering of each function that takes none of the
    flavor's ops (lower's memo): the flavor it gives is byte for byte one lowered from scratch."""
    base = builds[target]
    checked = check(parse(DSL_PATH.read_text(encoding="utf-8"), str(DSL_PATH)))
    _, _, wasm, _ = _module(checked, target, base.manifest["tune"]["values"], "kernels.dsl", base.manifest["memory"]["max_pages"],
                            Memo(), flavor)
    assert wasm == base.flavors[flavor].wasm
