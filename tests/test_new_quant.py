"""docs/adding-a-quant-type.md, done as it says: its declaration (GGUF Q5_0) appended to a copy of
kernels.dsl, its commands run in that directory, its Python used on the result. No Python change is
needed, whatever kernels.dsl already declares: if the doc's type name is taken, the walkthrough
declares the same type under a free name."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import kernelgen
from kernelgen import cli
from kernelgen.compiler.check import check
from kernelgen.compiler.parse import parse
from kernelgen.reference import qmatvec as qmatvec_ref

from helpers import random_blocks

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "adding-a-quant-type.md"


LIBRARY = (ROOT / "kernels.dsl").read_text(encoding="utf-8")


def doc_declaration(library: str = LIBRARY) -> tuple[str, str]:
    """(type name, declaration text) of the doc's example, renamed if `library` declares its name."""
    step = DOC.read_text(encoding="utf-8").split("## 1.")[1].split("## 2.")[0]
    blocks = re.findall(r"```\n(.*?)```", step, re.S)
    (decl,) = [b for b in blocks if re.search(r"^quant \w+ \{", b, re.M)]
    name = re.search(r"^quant (\w+) \{", decl, re.M).group(1)
    declared = {q.name for q in parse(library).quants}
    free = name if name not in declared else next(f"{name}_doc{i}" for i in range(100) if f"{name}_doc{i}" not in declared)
    return free, decl.replace(f"quant {name} {{", f"quant {free} {{")


def doc_commands() -> list[list[str]]:
    """The `kernelgen ...` commands of the doc's step 2, in order."""
    step = DOC.read_text(encoding="utf-8").split("## 2.")[1].split("## 3.")[0]
    (sh,) = re.findall(r"```sh\n(.*?)```", step, re.S)
    return [line.split("#")[0].split()[1:] for line in sh.splitlines() if line.startswith("kernelgen ")]


@pytest.fixture(scope="module")
def walked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("newquant")
    name, decl = doc_declaration()
    (tmp / "kernels.dsl").write_text(LIBRARY + "\n" + decl, encoding="utf-8")
    mp = pytest.MonkeyPatch()
    mp.chdir(tmp)
    try:
        commands = doc_commands()
        assert [c[0] for c in commands] == ["check", "list", "build"]
        for argv in commands:
            assert cli.main(argv) == 0, argv
    finally:
        mp.undo()
    return tmp, name


@pytest.mark.parametrize("target", ["simd128", "relaxed-simd"])
def test_doc_walkthrough_gives_working_kernels(walked: tuple[Path, str], target: str) -> None:
    import gguf  # a test dependency: the independent definition of Q5_0

    tmp, name = walked
    k = kernelgen.load(tmp / "out", target)
    q5 = k.quants[name]
    assert q5.stored_bytes == 22 and q5.planes["q"] == ("u1", 32)  # bit() in a block of 32: re-encoded as bytes
    assert k.manifest["exports"][k.export_name("qmatvec", name)]["quant"] == name
    assert k.export_name("qmatmul", name) and k.manifest["exports"][k.export_name("qmatvec", name)]["parallel"]["job"] in k.manifest["jobs"]
    rows, nb = 9, 5
    rng = np.random.default_rng(5)
    blocks = random_blocks(q5, rows, nb, rng)
    blocks["qh"][0, 0] = 0xFF  # every fifth bit set and low nibbles 15: the extreme 15
    blocks["qs"][0, 0] = 0xFF
    blocks["qh"][0, 1] = 0  # no fifth bit, low nibbles 0: the extreme -16
    blocks["qs"][0, 1] = 0
    theirs = gguf.quants.dequantize(blocks.view(np.uint8).reshape(rows, -1), gguf.GGMLQuantizationType.Q5_0)
    np.testing.assert_array_equal(q5.dequantize_ref(blocks), theirs)

    x = rng.standard_normal(nb * 32).astype(np.float32)
    act = k.quantize_act(x)
    y = k.qmatvec(k.pack(name, blocks), act)
    ref, mag = qmatvec_ref(q5.scale_ref(blocks), q5.unpack_ref(blocks).reshape(rows, -1), k.act_values(act), act.d,
                           k.manifest["constants"]["ACT_ZERO"], 32)
    assert np.all(np.abs(y - ref) <= 1e-5 * mag + 1e-30)
    d = k.qdot(k.pack(name, blocks[:1]), act)
    assert abs(d - ref[0]) <= 1e-5 * mag[0] + 1e-30


def test_walkthrough_takes_a_free_name_when_the_doc_name_is_declared() -> None:
    """Another engineer declaring the doc's type in kernels.dsl must not break the walkthrough."""
    name, decl = doc_declaration()
    library = LIBRARY + "\n" + decl
    again, decl2 = doc_declaration(library)
    assert again != name and f"quant {again} {{" in decl2
    check(parse(library + "\n" + decl2))
