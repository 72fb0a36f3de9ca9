"""Nothing hangs, nothing crashes, nothing is silently wrong (issue 10): the host, the pool, the
build, the CLI and the JS runtime under bad input and concurrency.

Each case that once hung or aborted the interpreter runs in a subprocess with a generous timeout,
so a regression fails its test instead of hanging CI. The property test at the end drives the
Python API with adversarial arguments: every call ends in a correct result or a ValueError/TypeError,
and the next valid call still gives the same bits.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kernelgen
from kernelgen import reference as R
from kernelgen.cli import main
from kernelgen.compiler import build as B
from kernelgen.compiler.build import compile_source, write_outputs
from kernelgen.compiler.parse import MAX_NESTING
from kernelgen.errors import DslError, KernelgenError
from kernelgen.host.formats import load_gguf
from kernelgen.host.manifest import manifest_text
from kernelgen.tuning import store as S
from kernelgen.compiler.check import check
from kernelgen.compiler.parse import parse

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "out"
TIMEOUT = 120  # seconds; generous, the machine is shared. A hang fails the test after this.
NODE = shutil.which("node")
NODE_FLAGS = ("--experimental-wasm-relaxed-simd", "--no-liftoff")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT, **kw)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung: no result after {TIMEOUT} s: {' '.join(cmd)[:200]}")


# Loaded by every Python case: a module, weights, activations and the one-thread result.
PRELUDE = """
import sys, threading
import numpy as np
import kernelgen
from kernelgen import reference as R
k = kernelgen.load("out", "simd128")
rng = np.random.default_rng(0)
w = R.quantize_q8_0(rng.standard_normal((67, 256)).astype(np.float32))
packed = k.pack("q8_0", w)
act = k.quantize_act(rng.standard_normal(256).astype(np.float32))
want = k.qmatvec(packed, act)

def refused(f, *args, **kwargs):
    try:
        f(*args, **kwargs)
    except (ValueError, TypeError) as e:
        return str(e)
    raise SystemExit(f"accepted {args} {kwargs}")
"""


def py(code: str) -> str:
    """Run PRELUDE + code in a fresh interpreter; its stdout, or a test failure with its stderr."""
    r = run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)])
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


# ---- the pool: chunk and count ---------------------------------------------------------------------


def test_huge_or_bad_chunk_is_refused_and_large_ones_give_the_same_bits() -> None:
    out = py("""
        with k.pool(3) as pool:
            for bad in (2**32, 2**40, 2**31, 0, -5, 1.5, True, np.float64(8.0)):
                print(refused(k.qmatvec, packed, act, pool, chunk=bad))
            for good in (2**31 - 1, 2**30 + 7, 2**30, np.int64(3), np.uint16(5), 1):
                assert k.qmatvec(packed, act, pool, chunk=good).tobytes() == want.tobytes(), good
            name = k.manifest["exports"][k.export_name("qmatvec", "q8_0")]["parallel"]["job"]
            print(refused(pool.run, name, 2**31, 1, [0] * len(k.manifest["jobs"][name]["args"])))
            print(refused(pool.run, name, -1, 1, [0] * len(k.manifest["jobs"][name]["args"])))
        print("done")
    """)
    assert out.strip().endswith("done")
    assert "qmatvec chunk: 4294967296 is outside 1..2147483647" in out, out
    assert "expected an integer, got float" in out and "expected an integer, got bool" in out


def test_manifest_with_a_bad_tuned_chunk_is_refused(tmp_path: Path) -> None:
    for tuned in ({"threads": 2, "chunk": 2**32}, {"threads": 2, "chunk": -5}, {"threads": 1000, "chunk": 8}):
        out = copy_out(tmp_path / str(len(list(tmp_path.iterdir()))))
        edit_manifest(out, "simd128", lambda m: m["jobs"][next(iter(m["jobs"]))].update(tuned=tuned))
        with pytest.raises(KernelgenError, match=r"kernels.json: jobs\..*\.tuned must give threads in 1..256 and chunk"):
            kernelgen.load(out, "simd128")


# ---- the reserved region below heap_base ------------------------------------------------------------


def test_kernels_call_refuses_addresses_below_heap_base_and_the_pool_survives() -> None:
    out = py("""
        name = k.export_name("qmatvec", "q8_0")
        with k.module.scope():
            aq, ad = k.put_act(act)
            print(refused(k.call, name, *packed.args, aq, ad, 0, 67, 256))       # y at address 0
            print(refused(k.call, name, *packed.args, aq, ad, 1024, 67, 256))    # y on the job arguments
            print(refused(k.call, name, 64, *packed.args[1:], aq, ad, 4096, 67, 256))
            print(refused(k.call, name, *packed.args, aq, ad, 2**32 - 64, 67, 256))     # y wrapping onto them
            with k.pool(2) as pool:
                print(refused(pool.call, name, [*packed.args, aq, ad, 128, 67, 256], 8))   # y on the pool words
            print(refused(k.call, "par_for", 0, 10, 2**31 - 1))                         # the pool's own
            print(refused(k.call, "pool_helper", 0, 0, 0))
        with k.pool(2) as pool:
            assert k.qmatvec(packed, act, pool).tobytes() == want.tobytes()
        print("done")
    """)
    assert out.count("is below the heap") == 4 and out.count("the thread pool's own") == 2
    assert out.count("is past the memory's end") == 1
    assert out.strip().endswith("done")


def test_raw_calls_are_held_to_the_extents_and_multiples_the_docs_declare() -> None:
    out = py("""
        end = k.module.memory.data_len()
        dot = k.export_name("dot_f32")
        x = end - 64                                      # the memory's last 16 floats
        k.module.view(x, np.float32, 16)[:] = 1.0
        print(k.call(dot, x, x, 16))                      # to the last byte: computed
        print(refused(k.call, dot, x, x, 17))             # one float past it: refused, not a trap
        name = k.export_name("qmatvec", "q8_0")
        with k.module.scope():
            aq, ad = k.put_act(act)
            y = k.module.alloc(4 * 67)
            k.call(name, *packed.args, aq, ad, y, 67, 256)
            print(k.module.view(y, np.float32, 67).tobytes() == want.tobytes())
            print(refused(k.call, name, *packed.args, aq, ad, y, 67, 250))             # k no multiple of 32
            print(refused(k.call, name, *packed.args, aq, ad, y, 67, 256 * 2**12))     # rows longer than memory
            with k.pool(2) as pool:
                print(refused(pool.call, name, [*packed.args, aq, ad, y, 2**24, 256]))  # n rows past the end
        k4 = k.export_name("qmatvec", "q4_k")
        print(refused(k.call, k4, *[x] * 5, 1, 32))       # a Q4_K row is whole super-blocks of 256
        soft = k.export_name("softmax_f32")
        print(refused(k.call, soft, x, 2, 24, 4))         # stride >= t: 24 scores a row wrote the next row
        print(refused(k.call, soft, x, 2, 4, -16))        # a negative stride wrote below x
        mv = k.export_name("matvec_f32")
        with k.pool(2) as pool:
            pool.call(mv, [x, x, x, -1, 4])               # no rows, as the export itself takes it
        print("done")
    """).splitlines()
    assert out[0] == "16.0" and out[2] == "True"
    assert out[1].startswith("dot_f32__unroll4 x (f32[n]): 68 bytes from address ") and "run past the memory's end" in out[1]
    assert out[3] == "qmatvec_q8_0__rows2_accs1 k: must be a multiple of 32, got 250"
    assert all("run past the memory's end" in line and "(packed[n, k])" in line for line in out[4:6]), out
    assert out[6] == "qmatvec_q4_k__rows4_accs1 k: must be a multiple of 256, got 32"
    assert out[7:] == ["softmax_f32 stride: must be at least 24 (t), got 4", "softmax_f32 stride: must be at least 4 (t), got -16",
                       "done"]


def test_attention_traps_on_a_sentence_longer_than_its_scratch_row() -> None:
    """Sentence lengths are data (starts, in memory), so the kernel checks them itself: a raw call
    whose stride is shorter than a sentence traps before it writes, one thread or the pool."""
    out = py("""
        import wasmtime
        from kernelgen.host.pool import JobError
        L, d = 40, 16
        qkv = k.module.put(np.ones((L, 3 * d), np.float32))
        y = k.module.alloc(4 * L * d)
        scratch = k.module.alloc(4 * 4)                    # f32[seqs * heads, stride]: one row of 4
        after = k.module.put(np.full(16, 7.0, np.float32))
        name = k.export_name("attention_f32")
        for starts in ([0, L], [8, 0]):                    # longer than the row; out of order
            ps = k.module.put(np.array(starts, np.int32))
            try:
                k.call(name, qkv, ps, scratch, y, 1, 1, d, 4)
            except wasmtime.Trap:
                print("trap")
            with k.pool(2) as pool:
                try:
                    pool.call(name, [qkv, ps, scratch, y, 1, 1, d, 4])
                except JobError:
                    print("job error")
        print(k.module.get(after, np.float32, 16).tolist() == [7.0] * 16)
        ps = k.module.put(np.array([0, L + 1], np.int32))  # one row more than qkv holds: read from starts
        end = k.module.memory.data_len()
        tail = end - 4 * L * 3 * d                         # qkv's L rows end at the memory's end
        k.module.view(tail, np.float32, L * 3 * d)[:] = 1.0
        print(refused(k.call, name, tail, ps, scratch, y, 1, 1, d, 44))
    """).splitlines()
    assert out[:5] == ["trap", "job error", "trap", "job error", "True"], out
    assert out[5].startswith("attention_f32 qkv (f32[starts[seqs], 3 * heads * d]): 7872 bytes from address "), out


def test_an_extent_is_its_docs_shape_in_bytes_and_a_question_mark_leaves_it_unchecked() -> None:
    source = """
#   x: f32[?, n], rows only the data knows
#   y: f32[n / 4] then i32[2 * n + 1], written
#   s: i32[n + 1]
#   z: f32[s[n], n]
#   n: count, a multiple of 4, >= 8
export kernel f(x: ptr, y: ptr, s: ptr, z: ptr, n: i32) {
}
"""
    (built,) = compile_source(source, targets=("simd128",))
    params = {p["name"]: p for p in built.manifest["exports"]["f"]["params"]}
    assert params["x"]["extent"] is None
    assert params["y"]["extent"] == ["+", ["*", 4, ["/", "n", 4]], ["*", 4, ["+", ["*", 2, "n"], 1]]]
    assert params["z"]["extent"] == ["*", ["*", 4, ["i32", "s", "n"]], "n"]
    assert (params["n"]["multiple"], params["n"]["minimum"]) == (4, 8)


def test_every_pointer_of_the_library_declares_its_extent() -> None:
    """Each exported pointer's doc starts with its shape, so both hosts check raw calls against it
    (attention's token rows read from its starts array: f32[starts[seqs], ...])."""
    for target in ("simd128", "relaxed-simd"):
        m = json.loads((OUT / target / "kernels.json").read_text())
        unknown = {(e["kernel"], p["name"]) for e in m["exports"].values() for p in e["params"]
                   if p["dsl_type"] == "ptr" and p.get("extent") is None}
        assert not unknown, unknown


def test_manifest_with_a_bad_extent_is_refused(tmp_path: Path) -> None:
    def edit(m: dict) -> None:
        m["exports"][next(n for n in m["exports"] if n.startswith("dot_f32"))]["params"][0]["extent"] = ["*", 4, "x"]
    out = copy_out(tmp_path / "out")
    edit_manifest(out, "simd128", edit)
    with pytest.raises(KernelgenError, match=r"dot_f32__unroll4\.x: an extent \(of a pointer\) or minimum \(of an i32\)"):
        kernelgen.load(out, "simd128")


def _swap_exports(m: dict, a: str, b: str) -> None:
    """Swap two exports' entries under their names (`a` then runs what `b` was)."""
    e = m["exports"]
    e[a], e[b] = e[b], e[a]


TAMPERED = {  # manifests edited after their build (the wasm's sha256 still matches): what each host says
    "entries swapped": (lambda m: _swap_exports(m, "exp_f32", "silu_f32"),
                        "exports.exp_f32 names kernel 'silu_f32', quant None and tune {}, whose export is not 'exp_f32'"),
    "planes gone": (lambda m: m["quants"]["q4_0"].update(planes=None), "quants.q4_0 must give a block, a group"),
    "a job of another kernel": (lambda m: m["exports"]["matvec_f32__unroll4"]["parallel"].update(
                                    job=next(n for n, j in m["jobs"].items() if j["kernel"] == "silu_f32_job")),
                                "exports.matvec_f32__unroll4.parallel must give its items and name a job of matvec_f32"),
    "a minimum on a pointer": (lambda m: m["exports"]["exp_f32"]["params"][0].update(minimum=0),
                               "exports.exp_f32.x: an extent (of a pointer) or minimum (of an i32) must be a formula"),
    "a plane's size": (lambda m: m["quants"]["q8_0"]["planes"]["q"].update(bytes_per_block=33),
                        "manifest quant 'q8_0': its kernels read planes"),
    "an allocator alignment": (lambda m: m["memory"].update(align=24), "memory.align must be a power of two of at least 16"),
    "a parameter's type": (lambda m: m["exports"]["rope_table"]["params"][-1].update(type="f32"),
                           "exports.rope_table gives parameters (i32, i32, i32, i32, i32, f32), the wasm parameters "
                           "(i32, i32, i32, i32, i32, f64)"),
    "a parameter dropped": (lambda m: m["exports"]["exp_f32"]["params"].pop(0), "exports.exp_f32 gives parameters (i32, i32), "
                            "the wasm parameters (i32, i32, i32)"),
}


@pytest.mark.parametrize("case", TAMPERED, ids=list(TAMPERED))
def test_a_manifest_edited_after_its_build_is_refused(tmp_path: Path, case: str) -> None:
    edit, message = TAMPERED[case]
    out = copy_out(tmp_path / "out")
    edit_manifest(out, "simd128", edit)
    with pytest.raises(KernelgenError, match=re.escape(message)):
        kernelgen.load(out, "simd128")


def test_manifest_with_heap_base_zero_or_overlapping_words_is_refused(tmp_path: Path) -> None:
    cases = {
        "heap_base 0": (lambda m: m["memory"].update(heap_base=0), "overlaps heap_base at 0"),
        "word on JOB_ARGS": (lambda m: m["memory"]["fixed"].update(POOL_STOP=1024), "overlaps"),
        "no pool word": (lambda m: m["memory"]["fixed"].pop("POOL_NEXT"), "no address for POOL_NEXT"),
        "min > max": (lambda m: m["memory"].update(min_pages=5, max_pages=2), "min_pages <= max_pages"),
        "no memory": (lambda m: m.pop("memory"), "no memory"),
        "no jobs": (lambda m: m.pop("jobs"), "no jobs"),
    }
    for i, (what, (change, message)) in enumerate(cases.items()):
        out = copy_out(tmp_path / str(i))
        edit_manifest(out, "simd128", change)
        with pytest.raises(KernelgenError, match=message) as e:
            kernelgen.load(out, "simd128")
        assert "simd128/kernels.json" in str(e.value) and "rebuild" in str(e.value), what


# ---- threads -------------------------------------------------------------------------------------


def test_python_threads_sharing_kernels_and_a_pool_get_right_results() -> None:
    out = py("""
        x = rng.standard_normal(1000).astype(np.float32)
        want_exp = k.exp_f32(x)
        wrong = []
        def work(pool):
            for _ in range(150):
                if k.qmatvec(packed, act, pool).tobytes() != want.tobytes():
                    wrong.append("qmatvec")
                if k.exp_f32(x).tobytes() != want_exp.tobytes():
                    wrong.append("exp")
        with k.pool(2) as pool:
            threads = [threading.Thread(target=work, args=(p,)) for p in (pool, pool, None, None)]
            for t in threads: t.start()
            for t in threads: t.join()
        print(len(wrong), "wrong")
    """)
    assert out.strip() == "0 wrong"


def test_pool_dropped_without_close_stops_its_threads_and_frees_the_module() -> None:
    out = py("""
        before = threading.active_count()
        p = k.pool(3)
        assert threading.active_count() == before + 2
        assert k.qmatvec(packed, act, p).tobytes() == want.tobytes()
        del p                                    # no close(): the finalizer stops the helpers
        assert threading.active_count() == before, threading.active_count()
        with k.pool(3) as p2:                    # and the next pool starts
            assert k.qmatvec(packed, act, p2).tobytes() == want.tobytes()
        print("done")
    """)
    assert out.strip() == "done"


# ---- handles and integer arguments ---------------------------------------------------------------------


def test_packed_from_another_kernels_or_before_reset_is_refused() -> None:
    out = py("""
        other = kernelgen.load("out", "simd128")
        relaxed = kernelgen.load("out", "relaxed-simd")
        print(refused(other.qmatvec, packed, other.quantize_act(np.ones(256, np.float32))))
        print(refused(relaxed.qmatvec, packed, relaxed.quantize_act(np.ones(256, np.float32))))
        k.reset()
        print(refused(k.qmatvec, packed, act))
        again = k.pack("q8_0", w)
        assert k.qmatvec(again, act).tobytes() == want.tobytes()
        print("done")
    """)
    assert out.count("packed by another Kernels (target simd128)") == 2
    assert "packed before reset()" in out and out.strip().endswith("done")


def test_integer_arguments_are_checked_and_numpy_integers_accepted() -> None:
    out = py("""
        print(refused(k.rope_table, 4, 8, 10000.0, 2**32))
        print(refused(k.rope_table, 4, 8, 10000.0, 2**31 - 2))     # pos0 + npos beyond i32
        print(refused(k.rope_table, 4.0, 8))
        print(refused(k.rope_table, True, 8))
        a = k.rope_table(np.int64(4), np.uint8(8), np.float32(500.0), np.int16(3))
        b = k.rope_table(4, 8, 500.0, 3)
        assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b))
        name = k.export_name("dot_f32")
        x = k.module.put(np.ones(8, np.float32))
        print(refused(k.call, name, x, x, 2**40))
        print(refused(k.call, name, x, x, 8.0))
        print(refused(k.call, name, x, x))
        assert k.call(name, x, x, np.int64(8)) == 8.0
        top = k.module.in_use()
        print(refused(k.module.alloc, 10.5))
        print(refused(k.module.alloc, -1))
        assert k.module.in_use() == top
        print(refused(k.softmax_f32, np.ones((2, 8), np.float32), 2.5))
        assert k.qmatvec(packed, act).tobytes() == want.tobytes()
        print("done")
    """)
    assert "rope_table pos0: 4294967296 is outside 0..2147483643" in out
    assert re.search(r"dot_f32__unroll\d n: 1099511627776 is outside", out) and "takes 3 arguments" in out  # (the tuned variant)
    assert "alloc nbytes: expected an integer, got float 10.5" in out
    assert out.strip().endswith("done")


def test_sin_cos_refuse_arguments_beyond_their_exact_reduction() -> None:
    k = kernelgen.load(OUT, "simd128")
    for f in (k.sin_f64, k.cos_f64):
        with pytest.raises(ValueError, match=r"\|x\| must be at most 1.647e\+06.*x\[1\] = -10000000.0"):
            f(np.array([0.5, -1e7]))
    x = np.array([np.inf, -np.inf, np.nan, 1.6e6, -1.6e6, 0.25])
    got = k.sin_f64(x)
    assert np.isnan(got[:3]).all()
    np.testing.assert_array_max_ulp(got[3:], np.sin(x[3:]), maxulp=1)
    for theta in (0.5, 0.0, float("inf")):
        with pytest.raises(ValueError, match="finite theta >= 1"):
            k.rope_table(2, 8, theta)


def test_wasm_of_another_build_is_refused(tmp_path: Path) -> None:
    out = copy_out(tmp_path / "out")
    shutil.copy(out / "simd128" / "kernels.wasm", out / "relaxed-simd" / "kernels.wasm")
    with pytest.raises(KernelgenError, match="relaxed-simd/kernels.json: the wasm does not match this manifest .* rebuild"):
        kernelgen.load(out, "relaxed-simd")


# ---- the build and out/ --------------------------------------------------------------------------------

TINY = "export kernel f(x: i32) -> i32 {\n    return x + 1;\n}\n"


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_build_switches_out_as_a_whole_and_keeps_unchanged_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    both = compile_source(TINY, targets=B.TARGET_NAMES)
    write_outputs(both, out)
    before = snapshot(out)
    (edited,) = compile_source(TINY.replace("x + 1", "x + 2"), targets=("simd128",))
    changed = write_outputs([edited], out)
    after = snapshot(out)
    assert {p.relative_to(out).as_posix() for p in changed} == {"simd128/kernels.wat", "simd128/kernels.wasm",
                                                                  "simd128/kernels.json"}
    assert {p: v for p, v in after.items() if p.startswith("relaxed-simd/")} == \
        {p: v for p, v in before.items() if p.startswith("relaxed-simd/")}  # bytes and mtimes
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary directory left


def test_failed_switch_leaves_out_as_it_was_and_no_temporary_files(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "out"
    write_outputs(compile_source(TINY, targets=B.TARGET_NAMES), out)
    before = snapshot(out)

    def broken(a: Path, b: Path) -> bool:
        raise OSError(5, "Input/output error", str(b))
    monkeypatch.setattr(B, "_exchange", broken)
    with pytest.raises(KernelgenError, match="cannot write the build there"):
        write_outputs(compile_source(TINY.replace("x + 1", "x + 2"), targets=B.TARGET_NAMES), out)
    assert snapshot(out) == before and sorted(os.listdir(tmp_path)) == ["out"]


def test_stale_temporary_tree_of_a_killed_build_is_removed(tmp_path: Path) -> None:
    (tmp_path / ".out.new-999999" / "simd128").mkdir(parents=True)
    (tmp_path / ".out.old-999999").mkdir()
    write_outputs(compile_source(TINY, targets=("simd128",)), tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_second_build_waits_for_the_lock_and_says_why_it_gave_up(tmp_path: Path) -> None:
    built = compile_source(TINY, targets=("simd128",))
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another build is writing
        with pytest.raises(KernelgenError, match="another kernelgen build is writing it"):
            write_outputs(built, tmp_path / "out", lock_timeout=0.2)
    finally:
        os.close(fd)
    assert write_outputs(built, tmp_path / "out")  # the lock released: it builds


def test_a_build_killed_at_any_moment_leaves_one_whole_build(tmp_path: Path) -> None:
    """kill -9 a build at spread-out moments: out/ is always one build's, every target of it."""
    out = tmp_path / "out"
    dsl = [tmp_path / "a.dsl", tmp_path / "b.dsl"]
    dsl[0].write_text(TINY)
    dsl[1].write_text(TINY.replace("x + 1", "x + 2"))
    write_outputs(compile_source(TINY, targets=B.TARGET_NAMES), out)
    rng = np.random.default_rng(7)
    for i in range(6):
        p = subprocess.Popen([sys.executable, "-m", "kernelgen.cli", "build", "--no-store", "--dsl", str(dsl[i % 2]),
                              "--out", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            p.wait(timeout=float(rng.uniform(0.2, 2.5)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=TIMEOUT)
        results = {t: kernelgen.load(out, t).call("f", 1) for t in B.TARGET_NAMES}  # load checks wasm vs manifest
        assert len(set(results.values())) == 1 and set(results.values()) <= {2, 3}, results
    write_outputs(compile_source(TINY, targets=B.TARGET_NAMES), out)  # a later build cleans up after the kills
    assert sorted(os.listdir(tmp_path)) == ["a.dsl", "b.dsl", "out"]


def _state(pid: int) -> tuple[str, int] | None:
    """(state, parent) of a live process from Linux /proc; None once it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else (fields[0], int(fields[1]))


def _children(pid: int) -> set[int]:
    return {int(d.name) for d in Path("/proc").glob("[0-9]*") if (st := _state(int(d.name))) and st[1] == pid}


@pytest.mark.skipif(not Path("/proc/self/stat").exists() or not B._fork_targets(B.TARGET_NAMES),
                    reason="the build forks its targets only where it can (Linux here)")
def test_a_build_killed_while_its_targets_compile_leaves_no_process_behind(tmp_path: Path) -> None:
    """kill -9 a build once it has forked its targets' processes: each ends by itself (after its own
    target, its result finding no reader) instead of waiting for work for ever."""
    p = subprocess.Popen([sys.executable, "-m", "kernelgen.cli", "build", "--out", str(tmp_path / "out")],
                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (kids := _children(p.pid)) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert kids, "the build forked no target process"
    finally:
        p.kill()
        p.wait(timeout=TIMEOUT)
    deadline = time.monotonic() + TIMEOUT
    while (left := {k for k in kids if _state(k)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"target processes {sorted(left)} outlived their build"
    assert not (tmp_path / "out").exists()


def test_concurrent_builds_leave_a_consistent_out(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmds = [[sys.executable, "-m", "kernelgen.cli", "build", "--no-store", "--out", str(out), "--tune", f"dot_f32.unroll={u}"]
            for u in (1, 4)]
    procs = [subprocess.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
    try:
        results = [p.communicate(timeout=TIMEOUT) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("concurrent builds hung")
    assert [p.returncode for p in procs] == [0, 0], results
    unrolls = set()
    for t in B.TARGET_NAMES:  # every target from one build: each manifest names its wasm, all one tune
        k = kernelgen.load(out, t)
        unrolls.add(k.tune_of("dot_f32")["unroll"])
    assert len(unrolls) == 1


# ---- the tuning store ---------------------------------------------------------------------------------


def test_store_records_outside_the_domain_are_skipped_with_one_line_warnings(tmp_path: Path, capsys) -> None:
    source = (ROOT / "kernels.dsl").read_text(encoding="utf-8")
    checked = check(parse(source))
    me = S.host()

    def rec(kernel: str, tune: dict, when: float) -> str:
        quant = "q8_0" if kernel == "qmatvec" else None
        r = S.Record(kernel, quant, "simd128", "64x64", S.kernel_hash(checked, kernel, quant), me, tune, 1e-6, "ok",
                     when=when)
        return json.dumps(r.stored())
    store = tmp_path / "store.jsonl"
    store.write_text("\n".join([
        rec("qmatvec", {"rows": 3, "accs": 1}, 1.0),                 # 1: outside the domain
        rec("qmatvec", {"rows": 4, "accs": 2}, 2.0),                 # 2: breaks the restrict rows * accs <= 4
        rec("qmatvec_job", {"threads": 1000, "chunk": 8}, 3.0),      # 3
        rec("qmatvec_job", {"threads": 2, "chunk": 2**32}, 4.0),     # 4
        rec("qmatvec_job", {"threads": 2, "chunk": -5}, 5.0),        # 5
        rec("qmatvec_job", {"threads": 2, "chunk": 32}, 6.0),        # 6: good
        '{"a":' * 100_000 + "1" + "}" * 100_000,                     # 7: nested too deep for the parser
    ]) + "\n")
    out = tmp_path / "out"
    assert main(["build", "--target", "simd128", "--store", str(store), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if line.startswith("kernelgen: warning: ")]
    assert [w.split(": ")[2] for w in warned] == [f"{store}:{n}" for n in (7, 1, 2, 3, 4, 5)], err
    assert "UserWarning" not in err and len(err.splitlines()) == 6
    manifest = json.loads((out / "simd128" / "kernels.json").read_text())
    job = manifest["exports"]["qmatvec_q8_0__rows2_accs1"]["parallel"]["job"]
    assert manifest["jobs"][job]["tuned"] == {"threads": 2, "chunk": 32}
    assert manifest["tune"]["source"]["qmatvec"] == "default"


# ---- the CLI never says "internal error" ----------------------------------------------------------------


def nested(kind: str, n: int) -> str:
    body = {
        "sum": "return x + " + " + ".join(["1"] * n) + ";",
        "negations": "return x + " + "-" * n + "1;",
        "calls": "return x + " + "min(" * n + "1" + ", 1)" * n + ";",
        "ifs": "var y: i32 = x; " + "if x > 0 { " * n + "y = 1;" + " }" * n + " return y;",
        "long literal": "return x + " + "9" * 5000 + ";",
        "big literal": "return x + 99999999999999999999999;",
    }[kind]
    return f"export kernel f(x: i32) -> i32 {{ {body} }}\n"


@pytest.mark.parametrize("kind, n, message", [
    ("sum", 5000, "nested more than"), ("negations", 5000, "nested more than"), ("calls", 1000, "nested more than"),
    ("ifs", 1000, "nested more than"), ("long literal", 0, "number literal of 5000 characters"),
    ("big literal", 0, "is out of range: no integer type holds it"),
])
def test_limits_are_located_dsl_errors(tmp_path: Path, capsys, kind: str, n: int, message: str) -> None:
    dsl = tmp_path / "k.dsl"
    dsl.write_text(nested(kind, n))
    assert main(["check", "--dsl", str(dsl)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{dsl}:1:") and message in err and "internal error" not in err


def test_nesting_within_the_limit_compiles() -> None:
    for kind, n in (("sum", MAX_NESTING - 10), ("ifs", MAX_NESTING // 2 - 5), ("calls", MAX_NESTING * 2 // 3 - 5)):
        (built,) = compile_source(nested(kind, n), targets=("simd128",))
        assert built.wasm


@pytest.mark.parametrize("literal, message", [
    ("1e999", "float literal 1e999 is out of range"), ("1e39", "does not fit in f32"), ("3.5e38", "does not fit in f32"),
])
def test_float_literals_out_of_range(tmp_path: Path, capsys, literal: str, message: str) -> None:
    dsl = tmp_path / "k.dsl"
    dsl.write_text(f"export kernel f(x: f32) -> f32 {{\n    return x + {literal};\n}}\n")
    assert main(["build", "--dsl", str(dsl), "--no-store", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{dsl}:2:") and message in err


@pytest.mark.parametrize("source, where, message", [
    ("const C: i32 = 4294967296;\nexport kernel f(x: i32) -> i32 {\n    return x + C;\n}\n", "1:16", "i32 cannot hold 4294967296"),
    ("const C: f32 = 1e39;\nexport kernel f(x: f32) -> f32 {\n    return x + C;\n}\n", "1:16", r"f32 cannot hold 1e\+39"),
    ("export kernel f(x: i32) -> i32 {\n    var y: i32 = 4294967296;\n    return x + y;\n}\n", "2:5", "does not fit in i32"),
    ("export kernel f(x: i32) -> i32 {\n    tune r: i32 in {1, 4294967296} = 1;\n    return x + r;\n}\n", "2:5",
     "a value does not fit in i32"),
    ("export kernel f(x: i64) -> i64 {\n    return x + 18446744073709551616;\n}\n", "2:16", "no integer type holds it"),
])
def test_literals_out_of_their_types_range_are_located_errors(source: str, where: str, message: str) -> None:
    with pytest.raises(DslError, match=message) as e:
        compile_source(source, "k.dsl", ("simd128",))
    assert str(e.value).startswith(f"k.dsl:{where}:")


def test_nested_unrolls_without_end_are_a_located_error(tmp_path: Path) -> None:
    dsl = tmp_path / "u.dsl"
    dsl.write_text("export kernel f(x: i32) -> i32 {\n    var y: i32 = x;\n    unroll a in 0..200 {\n"
                   "        unroll b in 0..200 {\n            unroll c in 0..200 {\n                y = y + 1;\n"
                   "            }\n        }\n    }\n    return y;\n}\n")
    r = run([sys.executable, "-m", "kernelgen.cli", "check", "--dsl", str(dsl)])
    assert r.returncode == 2 and r.stderr.startswith(f"{dsl}:4:9: unroll of 200 copies (40000 with the unrolls around it)"), r.stderr


def test_instantiation_without_end_is_a_located_error(tmp_path: Path) -> None:
    dsl = tmp_path / "g.dsl"
    dsl.write_text("kernel g[N: i32](x: i32) -> i32 {\n    return g[N + 1](x);\n}\n"
                   "export kernel f(x: i32) -> i32 {\n    return g[0](x);\n}\n")
    r = run([sys.executable, "-m", "kernelgen.cli", "check", "--dsl", str(dsl)])
    assert r.returncode == 2 and r.stderr.startswith(f"{dsl}:2:12: instantiating g__n32: 33 nested instantiations"), r.stderr


@pytest.mark.parametrize("case", ["out file", "out device", "out under a file", "out empty", "out not ours",
                                  "shape too large", "store directory", "store under a file", "budget nan",
                                  "budget inf"])
def test_cli_refuses_bad_options_with_exit_2(tmp_path: Path, capsys, case: str) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    args, message = {
        "out file": (["build", "--out", str(tmp_path / "file")], "not a directory"),
        "out device": (["build", "--out", "/dev/null"], "not a directory"),
        "out under a file": (["build", "--out", str(tmp_path / "file" / "out")], "is not a directory"),
        "out empty": (["build", "--out", ""], "needs a directory name"),
        "out not ours": (["build", "--out", str(tmp_path / "mine")], "holds files that are not kernelgen's (notes.txt)"),
        "shape too large": (["tune", "--kernel", "dot_f32", "--shape", "100000x100000"], "at most 268435456"),
        "store directory": (["tune", "--kernel", "dot_f32", "--store", str(tmp_path)], "not a file"),
        "store under a file": (["tune", "--kernel", "dot_f32", "--store", str(tmp_path / "file" / "s.jsonl")],
                               "cannot write it"),
        "budget nan": (["tune", "--budget", "nan"], "need a finite number of seconds >= 0"),
        "budget inf": (["tune", "--budget", "inf"], "need a finite number of seconds >= 0"),
    }[case]
    assert exit_code(args) == 2
    err = capsys.readouterr().err
    assert message in err and "internal error" not in err, err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine"


def exit_code(args: list[str]) -> int:
    """main's exit code, also when argparse refuses an option (it raises SystemExit)."""
    try:
        return main(args)
    except SystemExit as e:
        return int(e.code or 0)


# ---- the JS runtime --------------------------------------------------------------------------------------


def copy_out(dest: Path) -> Path:
    shutil.copytree(OUT, dest)
    return dest


def edit_manifest(out: Path, target: str, change) -> None:
    """Edit a build's manifest and sign it again (manifest_text), so that the host's own checks of
    the edited field are what refuse it."""
    path = out / target / "kernels.json"
    m = json.loads(path.read_text())
    change(m)
    path.write_bytes(manifest_text(m))


JS = """
import { loadKernels } from %(runtime)s;
const results = {};
async function attempt(name, fn) {
  try { await fn(); results[name] = 'accepted'; } catch (e) { results[name] = `${e.constructor.name}: ${e.message}`; }
}
for (const [name, dir] of Object.entries(%(broken)s)) await attempt(name, () => loadKernels({ dir, target: 'simd128', threads: 1 }));
const k = await loadKernels({ dir: %(out)s, target: 'simd128', threads: 3 });
const x = Float32Array.from({ length: 64 }, (_, i) => Math.sin(i));
const w = Float32Array.from({ length: 64 * 37 }, (_, i) => Math.cos(i));
const want = await k.matvecF32(w, x);
const same = (a) => Buffer.from(a.buffer).equals(Buffer.from(want.buffer));
for (const chunk of [2 ** 32, 2 ** 31, 0, -5, 1.5]) await attempt(`chunk ${chunk}`, () => k.matvecF32(w, x, { threads: true, chunk }));
for (const chunk of [2 ** 31 - 1, 2 ** 30, 7]) results[`chunk ${chunk} same`] = same(await k.matvecF32(w, x, { threads: true, chunk }));
const matvecJob = Object.keys(k.manifest.jobs).find((n) => k.manifest.jobs[n].kernel === 'matvec_f32_job');
await attempt('job writing the pool words', () => k.runJob(matvecJob, 4, 1, [8192, 8192, 64, 1]));
await attempt('pos0 2^32', () => k.ropeTable(4, 8, 10000, 2 ** 32));
await attempt('pos0 1.5', () => k.ropeTable(4, 8, 10000, 1.5));
const block = new Uint8Array(34); block[1] = 0x3c; block.fill(3, 2);
const a = await k.quantizeAct(new Float32Array(32).fill(1));
const p = await k.pack('q8_0', block, 1, 32);
results.qdot = await k.qdot(p, a);
const other = await loadKernels({ dir: %(out)s, target: 'simd128', threads: 1 });
await attempt('foreign packed', () => other.qdot(p, a));
await k.reset();
await attempt('packed before reset', () => k.qdot(p, a));
results['after'] = same(await k.matvecF32(w, x, { threads: true }));
await k.terminate();
await other.terminate();
console.log(JSON.stringify(results));
"""


def test_js_runtime_refuses_bad_builds_and_arguments(tmp_path: Path) -> None:
    if not NODE or not (ROOT / "node_modules").is_dir():
        if os.environ.get("CI"):
            pytest.fail("node is missing (CI must have it)")
        pytest.skip("no node")
    broken = {}
    changes = {
        "no memory": lambda m: m.pop("memory"),
        "no jobs": lambda m: m.pop("jobs"),
        "min > max": lambda m: m["memory"].update(min_pages=5, max_pages=2),
        "heap_base 0": lambda m: m["memory"].update(heap_base=0),
        "fixed overlap": lambda m: m["memory"]["fixed"].update(POOL_GEN=1030),
        "tuned chunk": lambda m: m["jobs"][next(iter(m["jobs"]))].update(tuned={"threads": 2, "chunk": 2**32}),
    }
    for i, (name, change) in enumerate(changes.items()):
        broken[name] = str(copy_out(tmp_path / f"b{i}"))
        edit_manifest(Path(broken[name]), "simd128", change)
    broken["missing manifest"] = str(copy_out(tmp_path / "missing"))
    (tmp_path / "missing" / "simd128" / "kernels.json").unlink()
    broken["corrupt manifest"] = str(copy_out(tmp_path / "corrupt"))
    (tmp_path / "corrupt" / "simd128" / "kernels.json").write_text('{"target": ')
    broken["other wasm"] = str(copy_out(tmp_path / "other"))
    shutil.copy(OUT / "relaxed-simd" / "kernels.wasm", tmp_path / "other" / "simd128" / "kernels.wasm")
    script = JS % {"runtime": json.dumps((ROOT / "runtime" / "kernelgen.mjs").as_uri()), "broken": json.dumps(broken),
                   "out": json.dumps(str(OUT))}
    (tmp_path / "check.mjs").write_text(script)  # a file, not -e: the pool's workers inherit node's flags
    r = run([NODE, *NODE_FLAGS, str(tmp_path / "check.mjs")])
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    expect = {
        "no memory": "no memory", "no jobs": "no jobs", "min > max": "min_pages <= max_pages",
        "heap_base 0": "overlaps heap_base at 0", "fixed overlap": "overlaps", "tuned chunk": "chunk in 1..2147483647",
        "missing manifest": "cannot read it", "corrupt manifest": "not signed by its build",
        "other wasm": "the wasm does not match this manifest",
    }
    for name, message in expect.items():
        assert message in res[name] and "simd128/kernels.json" in res[name], (name, res[name])
    for chunk in ("4294967296", "2147483648", "0", "-5", "1.5"):
        assert res[f"chunk {chunk}"].startswith("RangeError"), res[f"chunk {chunk}"]
    assert all(res[f"chunk {c} same"] for c in (2**31 - 1, 2**30, 7))
    assert res["job writing the pool words"].startswith("RangeError") and "outside the heap" in res["job writing the pool words"]
    assert res["pos0 2^32"].startswith("RangeError") and res["pos0 1.5"].startswith("RangeError")
    assert res["qdot"] == 32 * 3 * 1.0  # d = 1.0, codes 3, activations 1 -> quantized to ACT_MAX with scale 1 / ACT_MAX
    assert "packed by other kernels" in res["foreign packed"] and "before reset()" in res["packed before reset"]
    assert res["after"] is True


# ---- property: the Python API's argument checks -----------------------------------------------------------


@pytest.fixture(scope="module")
def loaded():
    k = kernelgen.load(OUT, "simd128")
    rng = np.random.default_rng(1)
    w = R.quantize_q8_0(rng.standard_normal((21, 64)).astype(np.float32))
    packed = k.pack("q8_0", w)
    act = k.quantize_act(rng.standard_normal(64).astype(np.float32))
    pool = k.pool(2)
    yield k, packed, act, pool, k.qmatvec(packed, act)
    pool.close()


INT_TYPES = (int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)


def _ints(lo: int, hi: int) -> st.SearchStrategy:
    """Integers of every Python/numpy integer type that can hold them, around and beyond [lo, hi]."""
    values = st.one_of(st.integers(lo - 3, min(hi, lo + 40)), st.integers(hi - 3, hi + 3),
                       st.sampled_from([-1, 0, 2**31 - 1, 2**31, 2**32, 2**40, -(2**63), 2**64]))
    return st.tuples(values, st.sampled_from(INT_TYPES)).map(_as_type)


def _as_type(pair: tuple[int, type]):
    v, t = pair
    if t is int:
        return v
    info = np.iinfo(t)
    return t(v) if info.min <= v <= info.max else v


NOT_INTS = st.sampled_from([1.5, 2.0, np.float32(3.0), True, np.bool_(True), "3", None, float("nan")])


def _is_int(v: object, lo: int, hi: int) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and lo <= int(v) <= hi


SMALL_OR_INVALID = st.one_of(  # valid sizes stay small: a valid huge one would only exhaust the memory
    st.tuples(st.integers(-3, 40), st.sampled_from(INT_TYPES)).map(_as_type),
    st.sampled_from([-(2**31), 2**31, 2**32, 2**40, 2**64]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(npos=st.one_of(SMALL_OR_INVALID, NOT_INTS), dim=st.one_of(SMALL_OR_INVALID, NOT_INTS),
       pos0=st.one_of(_ints(0, 2**31 - 1), NOT_INTS),
       theta=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0.5, 1e7),
                      st.sampled_from([10000, 1, True, np.float32(500.0)])))
@example(npos=True, dim=8, pos0=0, theta=10000)
@example(npos=4, dim=8.0, pos0=0, theta=10000)
@example(npos=4, dim=8, pos0=2**32, theta=10000)
@example(npos=np.int64(4), dim=np.uint8(8), pos0=np.int32(7), theta=np.float32(500.0))
@example(npos=4, dim=8, pos0=0, theta=True)
def test_property_rope_table_arguments(loaded, npos, dim, pos0, theta) -> None:
    k, packed, act, pool, want = loaded
    valid = (_is_int(npos, 0, 2**31 - 1) and _is_int(dim, 1, 2**31 - 1) and int(dim) % 2 == 0
             and _is_int(pos0, 0, 2**31 - 1 - int(npos))
             and not isinstance(theta, (bool, np.bool_)) and 1 <= float(theta) < float("inf"))
    try:
        cos, sin = k.rope_table(npos, dim, theta, pos0)
    except (ValueError, TypeError):
        assert not valid
    else:
        assert valid
        p = np.arange(int(npos), dtype=np.float64)[:, None] + int(pos0)
        angle = p * float(theta) ** (-2.0 * np.arange(int(dim) // 2) / int(dim))
        np.testing.assert_allclose(cos, np.cos(angle), rtol=0, atol=3e-7)  # measured <= 2.4e-7 at 2^31
        np.testing.assert_allclose(sin, np.sin(angle), rtol=0, atol=3e-7)
        assert cos.shape == sin.shape == (int(npos), int(dim) // 2)
    assert k.qmatvec(packed, act, pool).tobytes() == want.tobytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunk=st.one_of(st.none(), _ints(1, 2**31 - 1), NOT_INTS), threaded=st.booleans(),
       t=st.one_of(st.none(), _ints(1, 12), NOT_INTS), n=st.one_of(_ints(0, 100), NOT_INTS))
@example(chunk=True, threaded=True, t=True, n=True)
@example(chunk=2**32, threaded=True, t=2.0, n=2**40)
@example(chunk=2**31 - 1, threaded=True, t=np.int64(5), n=np.uint8(7))
@example(chunk=np.float32(4.0), threaded=True, t=12, n=1.5)
def test_property_chunks_softmax_and_raw_calls(loaded, chunk, threaded, t, n) -> None:
    k, packed, act, pool, want = loaded
    try:
        y = k.qmatvec(packed, act, pool if threaded else None, chunk)
    except (ValueError, TypeError):  # a bad chunk is refused with or without a pool
        assert not (chunk is None or _is_int(chunk, 1, 2**31 - 1))
    else:
        assert y.tobytes() == want.tobytes()
        assert chunk is None or _is_int(chunk, 1, 2**31 - 1)
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 12)
    try:
        s = k.softmax_f32(x, t, pool if threaded else None)
    except (ValueError, TypeError):
        assert not (t is None or _is_int(t, 1, 12))
    else:
        tt = 12 if t is None else int(t)
        e = np.exp(x[:, :tt] - x[:, :tt].max(axis=1, keepdims=True))
        np.testing.assert_allclose(s[:, :tt], e / e.sum(axis=1, keepdims=True), rtol=1e-5)
    with k.module.scope():
        px = k.module.put(np.ones(128, np.float32))
        # its doc: x: f32[n], n any value >= 0
        fits = _is_int(n, 0, 2**32 - 1) and px + 4 * int(n) <= k.module.memory.data_len()
        try:
            r = k.call(k.export_name("dot_f32"), px, px, n)
        except (ValueError, TypeError):
            assert not fits
        else:
            assert fits
            if _is_int(n, 0, 128):
                assert r == float(int(n))
    assert k.qmatvec(packed, act, pool).tobytes() == want.tobytes()


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    """An array of any dtype and rank up to 2, sometimes a strided view (not contiguous)."""
    dtype = draw(st.sampled_from([np.float32, np.float32, np.float32, np.float64, np.float16, np.int32]))
    shape = draw(st.sampled_from([(0,), (1,), (7,), (33,), (64,), (3, 8), (2, 33)]))
    step = draw(st.sampled_from([1, 1, 2]))
    base = np.linspace(-9, 9, int(np.prod(shape)) * step).astype(dtype)
    return base[::step].reshape(shape) if step > 1 else base.reshape(shape)


def _f32_vector(a: object) -> bool:
    return isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(x=arrays(), g=arrays(), alias=st.booleans(), threaded=st.booleans())
def test_property_array_arguments_and_aliasing(loaded, x, g, alias, threaded) -> None:
    k, packed, act, pool, want = loaded
    g = x if alias else g  # the same array as both operands
    p = pool if threaded else None
    with np.errstate(over="ignore"):
        cases = {
            "silu_f32": (lambda: k.silu_f32(x, p), _f32_vector(x), lambda: x / (1 + np.exp(-x.astype(np.float64)))),
            "swiglu_f32": (lambda: k.swiglu_f32(x, g, p), _f32_vector(x) and _f32_vector(g) and x.shape == g.shape,
                           lambda: x / (1 + np.exp(-x.astype(np.float64))) * g),
            "dot_f32": (lambda: k.dot_f32(x, g), _f32_vector(x) and _f32_vector(g) and x.shape == g.shape,
                        lambda: np.dot(x.astype(np.float64), g)),
            "matvec_f32": (lambda: k.matvec_f32(g, x, p), _f32_vector(x) and isinstance(g, np.ndarray) and g.dtype == np.float32
                           and g.ndim == 2 and g.shape[1] == x.size, lambda: g.astype(np.float64) @ x),
        }
        for name, (call, valid, reference) in cases.items():
            try:
                got = call()
            except (ValueError, TypeError):
                assert not valid, name
            else:
                assert valid, name
                np.testing.assert_allclose(got, reference(), rtol=2e-5, atol=2e-4, err_msg=name)
    assert k.qmatvec(packed, act, pool).tobytes() == want.tobytes()


# ---- API misuse found by fuzzing the Python API: each is refused with the error the rule asks for
# (ValueError or TypeError naming what was expected; KernelgenError for a damaged build)


@pytest.fixture(scope="module")
def relaxed():
    return kernelgen.load(OUT, "relaxed-simd")


def _hand_made_acts(k, act):
    import dataclasses
    return {"sums zeroed": dataclasses.replace(act, s=np.zeros_like(act.s)), "scales a list": dataclasses.replace(act, d=act.d.tolist()),
            "a value past the range": dataclasses.replace(act, q=np.where(np.arange(act.q.size) == 3, np.int16(-128), act.q)
                                                          .astype(act.q.dtype), s=act.s - act.q[3] - 128)}


MISUSE = [  # (what, call(k, packed, act, pool, relaxed), exception, message)
    ("an Act of the other target", lambda k, w, a, p, r: k.act_values(r.quantize_act(np.ones(64, np.float32))),
     TypeError, "activation values must be int16 on simd128, got int8"),
    ("an Act whose sums do not match its values", lambda k, w, a, p, r: k.qmatvec(w, _hand_made_acts(k, a)["sums zeroed"]),
     ValueError, "activation sums do not match the values"),
    ("an Act with a value outside +-127", lambda k, w, a, p, r: k.qmatvec(w, _hand_made_acts(k, a)["a value past the range"]),
     ValueError, "activation values must lie in [-127, 127]"),
    ("an Act whose scales are a list", lambda k, w, a, p, r: k.qmatvec(w, _hand_made_acts(k, a)["scales a list"]),
     ValueError, "activation scales must be float32[2], got list"),
    ("act_from_values of floats", lambda k, w, a, p, r: k.act_from_values(np.full(32, 1.7), np.ones(1, np.float32)),
     TypeError, "expected integer values, got dtype float64"),
    ("act_from_values without scales", lambda k, w, a, p, r: k.act_from_values(np.ones(32, np.int8), None),
     TypeError, "act_from_values d: expected a numpy float32 array"),
    ("act_from_values of a 0-d array", lambda k, w, a, p, r: k.act_from_values(np.array(3), np.ones(1, np.float32)),
     ValueError, "expected [k] or [m, k] values"),
    ("a pool that is no Pool", lambda k, w, a, p, r: k.exp_f32(np.ones(8, np.float32), pool=2),
     TypeError, "pool must be a Pool from Kernels.pool(), got int"),
    ("a chunk that is no integer, without a pool", lambda k, w, a, p, r: k.exp_f32(np.ones(8, np.float32), chunk="zz"),
     TypeError, "exp_f32 chunk: expected an integer"),
    ("layernorm without gamma", lambda k, w, a, p, r: k.layernorm_f32(np.ones((2, 8), np.float32), None, None),
     TypeError, "layernorm_f32 gamma: expected a numpy float32 array, got NoneType"),
    ("add_bias without a bias", lambda k, w, a, p, r: k.add_bias_f32(np.ones((1, 4), np.float32), None),
     TypeError, "add_bias_f32 bias: expected a numpy float32 array"),
    ("an unknown kernel", lambda k, w, a, p, r: k.export_name("nope"), ValueError, "no export for kernel 'nope'"),
    ("an unknown quant type", lambda k, w, a, p, r: k.pack("Q8_0", np.zeros((1, 34), np.uint8)),
     ValueError, "unknown quant type 'Q8_0'; this build has q8_0"),
    ("a quant type that is no str", lambda k, w, a, p, r: k.pack(["q8_0"], np.zeros((1, 34), np.uint8)),
     TypeError, "quant type: expected a name (str), got list"),
    ("an unknown export", lambda k, w, a, p, r: k.call("nope"), ValueError, "no exported function 'nope'"),
    ("a broadcast view larger than any wasm memory", lambda k, w, a, p, r: k.exp_f32(np.broadcast_to(np.float32(1), (2**34,))),
     ValueError, "exceed a wasm memory's 4294967296"),
    ("no rows to pack", lambda k, w, a, p, r: k.pack("q4_0", np.zeros((0, 18), np.uint8)),
     ValueError, "expected at least one row of at least one block, got 0 rows"),
    ("rope tables larger than the memory", lambda k, w, a, p, r: k.rope_table(2**31 - 1, 2),
     ValueError, "rope_table: two tables of npos=2147483647"),
    ("sentence lengths whose sum wraps", lambda k, w, a, p, r: k.attention_f32(np.ones((1, 48), np.float32),
                                                                             np.array([2**62] * 4 + [1]), 1),
     ValueError, "lengths must be positive integers, one per sentence, summing to the 1 rows"),
    ("a string for a yes/no flag", lambda k, w, a, p, r: k.matmul_f32(np.ones((2, 4), np.float32), np.ones((3, 4), np.float32),
                                                                    b_transposed="no"),
     TypeError, "b_transposed: expected True or False, got str"),
    ("padded_rows of a list", lambda k, w, a, p, r: kernelgen.padded_rows([[1.0]]), TypeError, "expected a 2-D numpy array"),
    ("load of no target", lambda k, w, a, p, r: kernelgen.load(OUT, None), TypeError, "load target: expected a target name"),
    ("load from a file", lambda k, w, a, p, r: kernelgen.load("/dev/null", "simd128"), KernelgenError,
     "cannot read the build for target 'simd128'"),
    ("a path for a target", lambda k, w, a, p, r: kernelgen.load(OUT, "relaxed-simd/vnni"), ValueError,
     "load target: expected a target name such as 'relaxed-simd' or 'simd128', got 'relaxed-simd/vnni'"),
    ("a target the build does not have", lambda k, w, a, p, r: kernelgen.load(OUT, "wasm64"), ValueError,
     f"load target 'wasm64': {OUT} holds builds for relaxed-simd, simd128"),
    ("an Act's sums edited in place", lambda k, w, a, p, r: _edit_in_place(k), ValueError, "read-only"),
    ("put_act of the other target's Act", lambda k, w, a, p, r: r.put_act(k.quantize_act(np.ones(64, np.float32))),
     TypeError, "put_act: activation values must be int8 on relaxed-simd, got int16"),
    ("put_act of no Act", lambda k, w, a, p, r: k.put_act(None), TypeError,
     "put_act: activations must come from quantize_act or act_from_values, got NoneType"),
    ("load_gguf into no Kernels", lambda k, w, a, p, r: load_gguf("simd128", "model.gguf"), TypeError,
     "load_gguf kernels: expected a Kernels from kernelgen.load(), got str"),
    ("load_gguf of no path", lambda k, w, a, p, r: load_gguf(k, 3), TypeError,
     "load_gguf path: expected a path (str or Path), got int"),
    ("mask weights beyond float32", lambda k, w, a, p, r: k.mean_pool_f32(np.ones((1, 2, 4), np.float32),
                                                                          np.array([[1e300, 1.0]])),
     ValueError, "mask weights must be within float32's range"),
    ("mask weights below float32", lambda k, w, a, p, r: k.mean_pool_f32(np.ones((1, 2, 4), np.float32),
                                                                         np.array([[1e-300, 0.0]])),
     ValueError, "mask weights must be within float32's range"),
]


@pytest.mark.parametrize("target", ["simd128", "relaxed-simd"])
def test_act_check_finds_the_first_block_numpy_finds(target: str) -> None:
    """act_check (the wasm check both hosts run on activations they did not make) names the first
    block whose values leave +-ACT_MAX or whose stored sum is off, as numpy does: the int8 and int16
    extremes, a sum off by one, a bad last block, several bad blocks, none."""
    k = kernelgen.load(OUT, target)
    rng = np.random.default_rng(3)
    act = k.quantize_act(rng.standard_normal(4096).astype(np.float32))
    low = np.iinfo(act.q.dtype).min  # -128 or -32768: |low| wraps in its lanes
    cases = {"as made": (act.q, act.s)}
    for name, (i, v) in {"low at 100": (100, low), "128 at 4095": (4095, 128 if low < -128 else None),
                         "127 at 0": (0, 127), "-127 at 31": (31, -127)}.items():
        if v is not None:
            q = act.q.copy()
            q[i] = v
            cases[name] = (q, q.astype(np.int64).reshape(-1, 32).sum(1).astype(np.int32))  # sums that match
    s = act.s.copy()
    s[[7, 90]] += [1, -1]
    cases["sums 7 and 90 off by one"] = (act.q, s)
    s = act.s.copy()
    s[-1] += 1
    cases["last sum off"] = (act.q, s)
    for name, (q, s) in cases.items():
        vals = q.astype(np.int64).reshape(-1, 32)
        bad = (np.abs(vals) > 127).any(1) | (vals.sum(1) != s)
        want = int(np.argmax(bad)) if bad.any() else -1
        with k.module.scope():
            got = k.call(k.export_name("act_check"), k.module.put(q), k.module.put(np.concatenate(
                [act.d.view(np.uint8), s.view(np.uint8)])), q.size)
        assert got == want, (name, got, want)


def _edit_in_place(k) -> None:
    """An Act the module made skips the checks of a hand-made one, so it cannot be edited: a zeroed
    sum computed a Q4_0 dot of 512 against all-zero weights."""
    act = k.quantize_act(np.ones(64, np.float32))
    act.s[:] = 0


def test_act_from_values_leaves_the_callers_arrays_as_they_were(loaded) -> None:
    k = loaded[0]
    q, d = np.ones(64, np.int8), np.ones(2, np.float32)
    act = k.act_from_values(q, d)
    assert q.flags.writeable and d.flags.writeable and not act.d.flags.writeable
    d[0] = 5  # the caller's array is not the Act's
    assert act.d[0] == 1


@pytest.mark.parametrize("what, call, exc, message", MISUSE, ids=[m[0] for m in MISUSE])
def test_api_misuse_is_refused_saying_what_was_expected(loaded, relaxed, what, call, exc, message) -> None:
    k, packed, act, pool, want = loaded
    with pytest.raises(exc, match=re.escape(message)):
        call(k, packed, act, pool, relaxed)
    assert k.qmatvec(packed, act).tobytes() == want.tobytes()  # and the module works on


def test_packed_handles_cannot_be_edited(loaded) -> None:
    k, packed, act, pool, want = loaded
    import dataclasses
    with pytest.raises(dataclasses.FrozenInstanceError):
        packed.rows = 6  # type: ignore[misc]  (would read past the planes)


def test_a_manifest_of_another_shape_or_target_is_refused(tmp_path: Path) -> None:
    """load reads a manifest's flavors and target before the Kernels checks the rest: they are
    checked first (a JSON list once raised AttributeError), and a build is the target asked for."""
    out = copy_out(tmp_path / "out")
    path = out / "relaxed-simd" / "kernels.json"
    good = path.read_text()
    for text, says in ((b"[]\n", "not signed by its build"), (good.replace("127", "126", 1).encode(), "edited after its build"),
                       (manifest_text({**json.loads(good), "flavors": ["vnni"]}), "flavors must map names")):
        path.write_bytes(text)
        with pytest.raises(KernelgenError, match=re.escape(says)):
            kernelgen.load(out, "relaxed-simd")
    path.write_text(good)
    for f in ("kernels.json", "kernels.wasm"):
        shutil.copy(out / "relaxed-simd" / f, out / "simd128" / f)
    with pytest.raises(KernelgenError, match=re.escape("a build for target 'relaxed-simd', not 'simd128'")):
        kernelgen.load(out, "simd128", flavor="base")


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(exports=[]), "exports and quants must be objects"),
    (lambda m: m.pop("activation"), "not a kernelgen manifest of this version (no activation)"),
    (lambda m: m["activation"].pop("sums"), "activation must give dtype (int8 or int16), sums (int32), split and max"),
    (lambda m: m["exports"][next(iter(m["exports"]))].update(kernel=3), "needs a kernel name"),
])
def test_damaged_manifest_is_refused_by_both_hosts(tmp_path: Path, edit, message) -> None:
    out = copy_out(tmp_path / "out")
    edit_manifest(out, "simd128", edit)
    with pytest.raises(KernelgenError, match=re.escape(message)):
        kernelgen.load(out, "simd128")
    js = tmp_path / "load.mjs"
    js.write_text(f"import {{ loadBuild }} from {json.dumps((ROOT / 'runtime' / 'manifest.mjs').as_uri())};\n"
                  f"try {{ await loadBuild(new URL({json.dumps((out / 'simd128').as_uri() + '/')})); console.log('loaded'); }}\n"
                  "catch (e) { console.log(e.message); }\n")
    proc = subprocess.run(["node", str(js)], capture_output=True, text=True, timeout=60)
    assert message in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("quantize", [R.quantize_q8_0, R.quantize_q4_0, R.quantize_q5_1, R.quantize_iq4_nl, R.quantize_q6_k],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad", [None, np.ones(256, complex), np.ones(255, np.float32), np.ma.masked_array(np.ones(256))],
                         ids=["None", "complex", "a short row", "masked"])
def test_reference_quantizers_refuse_what_they_cannot_quantize(quantize, bad) -> None:
    with pytest.raises(ValueError, match="expected real values"):
        quantize(bad)
