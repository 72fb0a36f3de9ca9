"""The memory model a user sees: packed matrices live until freed (free(), a `with` block, a scope,
or reset()), freeing in any order keeps the memory from growing, and a module built with
`--max-memory` stops at it with an error saying what was asked, what is free and what to do."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import kernelgen
from kernelgen import reference
from kernelgen.cli import main
from kernelgen.compiler.build import compile_source, from_built
from kernelgen.host.module import PAGE_SIZE

DSL_PATH = Path(__file__).resolve().parents[1] / "kernels.dsl"
TARGETS = ("simd128", "relaxed-simd")


@pytest.fixture(params=TARGETS)
def k(request: pytest.FixtureRequest, any_module):
    return any_module(request.param)


def weights(rows: int, cols: int, seed: int) -> np.ndarray:
    return reference.quantize_q8_0(np.random.default_rng(seed).standard_normal((rows, cols)))


def test_pack_and_free_a_thousand_matrices_without_growth(k) -> None:
    w = [weights(rows, 128, rows) for rows in (1, 3, 8, 17)]
    act = k.quantize_act(np.random.default_rng(0).standard_normal(128).astype(np.float32))
    expect = [k.qmatvec(p, act) for p in [k.pack("q8_0", b) for b in w]]
    k.reset()
    start, size = k.module.in_use(), k.module.memory.data_len()
    live: list = []
    for i in range(1000):
        live.append((i % 4, k.pack("q8_0", w[i % 4])))
        if len(live) == 3:  # free in a changing order: the middle, then the oldest, ...
            j, p = live.pop(i % 3)
            assert k.qmatvec(p, act).tobytes() == expect[j].tobytes()
            p.free()
    for _, p in live:
        p.free()
    assert k.module.in_use() == start and k.module.memory.data_len() == size


def test_freed_weights_are_refused_not_read(k) -> None:
    act = k.quantize_act(np.ones(64, np.float32))
    p = k.pack("q8_0", weights(2, 64, 1))
    p.free()
    p.free()  # again: nothing happens
    with pytest.raises(ValueError, match=re.escape("qmatvec: these weights were freed (free()); pack them again")):
        k.qmatvec(p, act)
    with k.pack("q8_0", weights(2, 64, 1)) as q:
        assert k.qmatvec(q, act).shape == (2,)
    with pytest.raises(ValueError, match="freed"):
        k.qmatvec(q, act)
    before = k.module.in_use()
    with k.scope():
        r = k.pack("q8_0", weights(4, 64, 2))
        kept_free = k.pack("q8_0", weights(4, 64, 3))
        kept_free.free()
    assert k.module.in_use() == before and not r.live
    with pytest.raises(ValueError, match="freed \\(at the end of their scope\\)"):
        k.qdot(r, act)
    s = k.pack("q8_0", weights(1, 64, 4))
    k.reset()
    t = k.pack("q8_0", weights(1, 64, 5))  # may take s's old address
    with pytest.raises(ValueError, match=re.escape("packed before reset(), which freed them")):
        k.qdot(s, act)
    s.free()  # a no-op: t keeps its memory
    assert t.live and np.isfinite(k.qdot(t, act))


def test_weights_freed_by_their_scope_stay_refused_when_their_memory_is_reused(k) -> None:
    act = k.quantize_act(np.ones(64, np.float32))
    with k.scope():
        old = k.pack("q8_0", weights(2, 64, 6))
    new = k.pack("q8_0", weights(2, 64, 7))  # takes old's addresses: first fit
    assert new.planes == old.planes and new.live and not old.live
    with pytest.raises(ValueError, match="freed \\(at the end of their scope\\)"):
        k.qmatvec(old, act)  # not new's rows under old's name
    old.free()  # a no-op: new keeps its memory
    assert new.live and k.qmatvec(new, act).shape == (2,)
    new.free()


@pytest.mark.parametrize("target", TARGETS)
def test_the_limit_is_reached_with_the_documented_error(target: str) -> None:
    (built,) = compile_source(DSL_PATH.read_text(encoding="utf-8"), targets=(target,), max_pages=16)
    k = from_built(built)
    assert built.manifest["memory"]["max_pages"] == 16
    assert "(memory 1 16 shared)" in built.wat
    w = weights(64, 1024, 0)  # 64 rows x 32 blocks x 40 bytes packed: 80 KiB
    packed = []
    with pytest.raises(MemoryError) as e:
        for _ in range(100):
            packed.append(k.pack("q8_0", w))
    msg = str(e.value)
    m = re.match(r"out of memory: pack\('q8_0'\) of 64 rows, plane '(\w+)', needs (\d+) bytes, and (\d+) of the "
                 r"module's 1048576 bytes are free \((\d+) in use by live allocations\); free packed matrices no "
                 r"longer needed \(Packed.free\(\), `with k.pack\(...\) as w:`, or `with k.scope\(\):`\), or rebuild "
                 r"with a larger maximum \(kernelgen build --max-memory; this build allows 16 pages of 64 KiB\)$", msg)
    assert m, msg
    assert int(m.group(3)) < int(m.group(2)) and k.module.memory.data_len() <= 16 * PAGE_SIZE
    in_use = k.module.in_use()
    assert len(packed) >= 10  # the megabyte held what fits
    packed.pop().free()
    assert k.module.in_use() < in_use  # the failed pack gave back the planes it had taken
    packed.append(k.pack("q8_0", w))  # and after a free() there is room again


def test_cli_max_memory_is_recorded_and_checked(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["build", "--target", "simd128", "--no-store", "--dsl", str(DSL_PATH), "--out", str(out),
                 "--max-memory", "1MiB"]) == 0
    manifest = json.loads((out / "simd128" / "kernels.json").read_text(encoding="utf-8"))
    assert manifest["memory"]["max_pages"] == 16
    assert "(import \"env\" \"memory\" (memory 1 16 shared))" in (out / "simd128" / "kernels.wat").read_text()
    assert kernelgen.load(out, "simd128").module.max_pages == 16
    for bad in ("1000", "1.5GiB", "5GiB", "0", "2TiB", "lots"):
        with pytest.raises(SystemExit) as e:
            main(["build", "--dsl", str(DSL_PATH), "--out", str(tmp_path / "no"), "--max-memory", bad])
        assert e.value.code == 2
    assert not (tmp_path / "no").exists()
