"""The committed out/ is what the current compiler makes of the current kernels.dsl, byte for byte.

The manifests' inputs hash covers the DSL, target, tune values and tool versions but not the
compiler's own code, so this comparison is what catches an out/ left stale by a compiler change.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernelgen.compiler.build import TARGET_NAMES, build

ROOT = Path(__file__).resolve().parents[1]
FILES = ("kernels.wat", "kernels.wasm", "kernels.json")
STORE = ROOT / "tuning" / "store.jsonl"
HOW = ("out/ is stale: run `kernelgen build --tune-host-from out/relaxed-simd/kernels.json` (from the "
       "repository root) and commit out/")


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A build of each target with the tunings the committed manifest was built with: the committed
    store's records for the host it names (or none, when it used no store)."""
    out = tmp_path_factory.mktemp("fresh") / "out"
    for target in TARGET_NAMES:
        manifest = json.loads((ROOT / "out" / target / "kernels.json").read_text(encoding="utf-8"))
        tune_host = manifest["tune"]["host"]
        build(ROOT / "kernels.dsl", out, (target,), store=STORE if tune_host else None, tune_host=tune_host)
    return out


def _first_difference(a: bytes, b: bytes) -> str:
    if a[:4] == b"\0asm" or b[:4] == b"\0asm":
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return f"{len(a)} vs {len(b)} bytes, first difference at byte {k}"
    la, lb = a.decode("utf-8", "replace").splitlines(), b.decode("utf-8", "replace").splitlines()
    for n, (x, y) in enumerate(zip(la, lb), 1):
        if x != y:
            return f"first difference at line {n}:\n  committed: {x.strip()[:120]}\n  fresh:     {y.strip()[:120]}"
    return f"{len(la)} vs {len(lb)} lines"


@pytest.mark.parametrize("target", TARGET_NAMES)
@pytest.mark.parametrize("name", FILES)
def test_committed_out_is_fresh(fresh: Path, target: str, name: str) -> None:
    committed = ROOT / "out" / target / name
    assert committed.is_file(), f"out/{target}/{name} is missing; {HOW}"
    want, got = committed.read_bytes(), (fresh / target / name).read_bytes()
    assert got == want, f"out/{target}/{name} differs from a fresh build ({_first_difference(want, got)}); {HOW}"


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_committed_out_uses_the_timings_of_every_kernel_the_store_times(target: str) -> None:
    """No tuned kernel of the committed build fell back to its defaults because the store times only
    older versions of it (an edit since its tuning: a rename in ftile_nt once did so unnoticed), or
    because only another host times it (tune.untimed: GEMM tiles once did so after out/ changed hosts),
    and none was picked without some of its timings (tune.partial: a re-time in one engine only)."""
    manifest = json.loads((ROOT / "out" / target / "kernels.json").read_text(encoding="utf-8"))
    stale = manifest["tune"].get("stale", {})
    assert not stale, (f"out/{target} was built without the timings of {', '.join(stale)}: the store times other "
                       f"versions of their source; run `kernelgen tune --kernel NAME` for each, then build")
    untimed = manifest["tune"].get("untimed", {})
    assert not untimed, (f"out/{target} was built without timings of {', '.join(untimed)} on its host, which the "
                         f"store times on other hosts only: run `kernelgen tune --kernel NAME` on out/'s host, then build")
    partial = manifest["tune"].get("partial", {})
    assert not partial, (f"out/{target}'s picks of {', '.join(partial)} were made without some of the store's timings "
                         f"({partial}): run `kernelgen tune --kernel NAME --engine ENGINE` for the engines named, then build")


def test_committed_store_times_the_code_this_compiler_emits() -> None:
    """Every timing in the committed store records the code it ran (a fingerprint), and that is still
    what the compiler makes of its variant: a change to the lowering of some type leaves its source,
    and so its timings' key, as it was, and its old timings would go on picking its variants (Q2_K's
    did, measured on 4-bit codes, after its codes became 2-bit)."""
    from kernelgen.compiler.check import check
    from kernelgen.compiler.parse import parse
    from kernelgen.tuning.store import load_store, stale

    records = load_store(STORE)
    unmarked = [r for r in records if r.code is None]
    assert not unmarked, f"{len(unmarked)} timing(s) in {STORE.name} record no code fingerprint, e.g. {unmarked[0].origin}"
    old = stale(records, check(parse((ROOT / "kernels.dsl").read_text(encoding="utf-8"))))
    kinds = sorted({f"{r.target} {r.kernel} {r.quant or ''}".strip() for r in old})
    assert not old, (f"{len(old)} timing(s) time code the compiler no longer emits ({', '.join(kinds[:6])}): "
                     f"run `kernelgen prune`, time them again (`kernelgen tune`), then build out/")
