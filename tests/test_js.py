"""The JavaScript runtime (runtime/) gives wasmtime's results, bit for bit, in Node and in Chromium.

This file makes the test vectors: inputs from numpy, outputs from kernelgen's Python API under
wasmtime (simd128, and relaxed SIMD with wasmtime's native lowering, the default), written
to a temp dir as raw little-endian .bin files and an index.json that runtime/test/vectors.mjs
reads. It then runs the Node tests (runtime/test/kernels.test.mjs) and the browser test
(runtime/test/browser.test.mjs: playwright-core driving Debian's /usr/bin/chromium) with
KERNELGEN_VECTORS pointing at them. Without node, chromium or node_modules the tests skip, except
under CI (the CI variable set), where .ci/run installs them and a skip would hide a failure.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

import kernelgen
from kernelgen import cli
from kernelgen.host.api import Kernels, padded_rows
from kernelgen.host.manifest import manifest_text
from kernelgen.compiler.build import compile_source, write_outputs

from helpers import SQUARE_ADD, random_blocks, square_add_inputs
from test_gguf_types import gguf_tensors, write_gguf

from helpers import CHROMIUM, NODE, NODE_FLAGS, need

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("simd128", "relaxed-simd")
THREADS = 3
ROWS, K = 37, 320  # 10 blocks a row: two four-block steps and two blocks left over
TOKENS = 5  # prefill tokens: a token tail below every tile
N = 1003  # elementwise length: a partial last vector


def special_f32(rng: np.random.Generator, n: int, scale: float = 3.0) -> np.ndarray:
    """Normal values with the edge cases the kernels treat specially at the front."""
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    edge = [0.0, -0.0, np.inf, -np.inf, np.nan, 88.8, 88.7, -87.0, -103.0, -104.0, -120.0, 1e-30, -1e-30, 30.0]
    x[:len(edge)] = edge
    return x


def quant_blocks(k: Kernels, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """(ROWS, K / 32) stored blocks of every quant type of the build, as bytes, made from each
    type's declaration (so a newly declared type is covered with no change here)."""
    return {name: random_blocks(q, ROWS, k_of(q) // q.block, rng).view(np.uint8).reshape(ROWS, -1)
            for name, q in k.quants.items()}


def k_of(q) -> int:
    """Row length for quant type q: K, or the least multiple of K holding whole (super-)blocks."""
    return int(np.lcm(K, q.block))


class Vectors:
    """Writes arrays and the index that runtime/test/vectors.mjs reads."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.index: dict = {"threads": THREADS, "arrays": {}, "packed": {}, "cases": [], "expected": {}, "builds": {}}

    def array(self, name: str, a: np.ndarray) -> dict:
        a = np.ascontiguousarray(a)
        (self.root / "in").mkdir(exist_ok=True)
        (self.root / "in" / f"{name}.bin").write_bytes(a.tobytes())
        self.index["arrays"][name] = {"file": f"in/{name}.bin", "dtype": a.dtype.name}
        return {"array": name}

    def case(self, name: str, call: str, args: list, opts: dict | None = None, threaded: bool = False,
             held: bool = False) -> None:
        """A call of the JS API; `threaded` runs it again on the pool, `held` (with opts) again with
        its Float32Array arguments held and the result held (vectors.mjs)."""
        case = {"name": name, "call": call, "args": args, "threaded": threaded, "held": held}
        if opts is not None:
            case["opts"] = opts
        self.index["cases"].append(case)

    def expect(self, target: str, name: str, outputs: dict[str, np.ndarray | float]) -> None:
        d = self.root / target
        d.mkdir(exist_ok=True)
        entry = {}
        for key, value in outputs.items():
            a = np.ascontiguousarray(np.atleast_1d(np.asarray(value, np.float32) if isinstance(value, float) else value))
            # NaN matches NaN in the comparison: outputs that were mostly NaN would prove nothing
            assert a.dtype.kind != "f" or np.isfinite(a).mean() > 0.5, f"{target} {name}.{key}: mostly not finite"
            (d / f"{name}.{key}.bin").write_bytes(a.tobytes())
            entry[key] = {"file": f"{target}/{name}.{key}.bin", "dtype": a.dtype.name}
        self.index["expected"].setdefault(target, {})[name] = entry

    def save(self) -> None:
        (self.root / "index.json").write_text(json.dumps(self.index, indent=1), encoding="utf-8")


def write_vectors(root: Path) -> None:
    v = Vectors(root)
    rng = np.random.default_rng(20240607)
    x_act = rng.standard_normal(K).astype(np.float32)
    x_act[32:64] = 0.0  # an all-zero block: scale 0
    x_act[64:96] *= 1e4
    x_special = special_f32(rng, 128)  # quantize_act of infinities and NaN: a case of its own
    x, g = special_f32(rng, N), special_f32(rng, N)
    xn, y = rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)
    wf, xf = rng.standard_normal((13, 70)).astype(np.float32), rng.standard_normal(70).astype(np.float32)
    scores = padded_rows(rng.standard_normal((11, 29)).astype(np.float32) * 4)
    scores[3, 5] = -np.inf
    scores[7, :29] = -np.inf  # a fully masked row
    heads = rng.standard_normal((6, 64)).astype(np.float32)
    wide = special_f32(rng, 9 * 36).reshape(9, 36)  # encoder layers: rows of a multiple of 4 values
    bias, gamma, beta = (rng.standard_normal(36).astype(np.float32) for _ in range(3))
    residual = rng.standard_normal((9, 36)).astype(np.float32)
    tokens = rng.standard_normal((3, 5, 36)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], np.float32)
    qm, kt, vt = (rng.standard_normal(s).astype(np.float32) for s in ((TOKENS, 67), (11, 67), (67, 11)))
    qkv = (rng.standard_normal((12, 3 * 2 * 16)) * 2).astype(np.float32)  # attention: sentences of 5, 1, 6 tokens

    first = kernelgen.load(ROOT / "out", "simd128")
    blocks = quant_blocks(first, rng)
    cos, sin = first.rope_table(5, 64)  # table rows are inputs here: the rope case reads position 3
    args = {"x_act": v.array("x_act", x_act), "x_special": v.array("x_special", x_special), "x": v.array("x", x),
            "xn": v.array("xn", xn), "y": v.array("y", y), "g": v.array("g", g),
            "wf": v.array("wf", wf), "xf": v.array("xf", xf), "scores": v.array("scores", scores),
            "heads": v.array("heads", heads), "cos3": v.array("cos3", cos[3]), "sin3": v.array("sin3", sin[3]),
            "wide": v.array("wide", wide), "bias": v.array("bias", bias), "gamma": v.array("gamma", gamma),
            "beta": v.array("beta", beta), "residual": v.array("residual", residual), "tokens": v.array("tokens", tokens),
            "mask": v.array("mask", mask),
            "qm": v.array("qm", qm), "kt": v.array("kt", kt), "vt": v.array("vt", vt), "qkv": v.array("qkv", qkv)}
    x_acts = {K: x_act}  # an activation per row length (super-blocks need longer rows)
    x_tokens = {}  # prefill: TOKENS rows per row length
    for q, b in blocks.items():
        kq = k_of(first.quants[q])
        if kq not in x_acts:
            x_acts[kq] = rng.standard_normal(kq).astype(np.float32)
            v.array(f"x_act_{kq}", x_acts[kq])
        if kq not in x_tokens:
            x_tokens[kq] = rng.standard_normal((TOKENS, kq)).astype(np.float32)
            x_tokens[kq][1, 64:96] = 0.0  # a token with an all-zero block
            v.array(f"x_tokens_{kq}", x_tokens[kq])
        v.array(f"blocks_{q}", b)
        v.array(f"row_{q}", b[:1])
        v.index["packed"][f"w_{q}"] = {"quant": q, "blocks": f"blocks_{q}", "rows": ROWS, "k": kq}
        v.index["packed"][f"row_{q}"] = {"quant": q, "blocks": f"row_{q}", "rows": 1, "k": kq}
    v.array("blocks36_q8_0", blocks["q8_0"][:36])  # linear with a bias: rows of a multiple of 4
    v.index["packed"]["w36_q8_0"] = {"quant": "q8_0", "blocks": "blocks36_q8_0", "rows": 36, "k": K}

    def act_name(q: str) -> str:
        kq = k_of(first.quants[q])
        return "x_act" if kq == K else f"x_act_{kq}"

    v.case("quantize_act", "quantizeAct", [args["x_act"]])
    v.case("quantize_act_special", "quantizeAct", [args["x_special"]])
    for q in blocks:
        v.case(f"pack_{q}", "packPlanes", [q, {"array": f"blocks_{q}"}, ROWS, k_of(first.quants[q])])
        v.case(f"qdot_{q}", "qdot", [{"packed": f"row_{q}"}, {"act": act_name(q)}])
        v.case(f"qmatvec_{q}", "qmatvec", [{"packed": f"w_{q}"}, {"act": act_name(q)}], {}, threaded=True)
        v.case(f"qmatmul_{q}", "qmatmul", [{"packed": f"w_{q}"}, {"act": f"x_tokens_{k_of(first.quants[q])}",
                                                                  "tokens": TOKENS}], {}, threaded=True)
    v.case("quantize_act_tokens", "quantizeAct", [{"array": f"x_tokens_{K}"}, TOKENS])
    v.case("dot_f32", "dotF32", [args["xn"], args["y"]])
    v.case("matvec_f32", "matvecF32", [args["wf"], args["xf"]], {}, threaded=True)
    v.case("matmul_f32_nt", "matmulF32", [args["qm"], args["kt"], TOKENS, 11], {"bTransposed": True}, threaded=True)
    v.case("matmul_f32_nn", "matmulF32", [args["qm"], args["vt"], TOKENS, 11], {}, threaded=True)
    v.case("exp_f32", "exp", [args["x"]], {}, threaded=True)
    v.case("softmax_f32", "softmax", [args["scores"], 29, scores.shape[1]], {}, threaded=True)
    v.case("rope_halves", "rope", [args["heads"], args["cos3"], args["sin3"]], {"interleaved": False}, threaded=True)
    v.case("rope_pairs", "rope", [args["heads"], args["cos3"], args["sin3"]], {"interleaved": True}, threaded=True)
    v.case("rope_table", "ropeTable", [7, 64, 10000.0, 3])
    v.case("rope_table_1e6", "ropeTable", [5, 128, 1e6, 4000])
    v.case("silu_f32", "silu", [args["x"]], {}, threaded=True)
    v.case("swiglu_f32", "swiglu", [args["x"], args["g"]], {}, threaded=True)
    v.case("erf_f32", "erf", [args["x"]])
    v.case("gelu_f32", "gelu", [args["wide"], args["bias"]], {}, threaded=True, held=True)
    v.case("linear", "linear", [{"packed": "w_q8_0"}, {"array": f"x_tokens_{K}"}, None], {}, threaded=True, held=True)
    v.case("linear_bias", "linear", [{"packed": "w36_q8_0"}, {"array": f"x_tokens_{K}"}, args["bias"]], {}, threaded=True,
           held=True)
    v.case("add_bias_f32", "addBias", [args["wide"], args["bias"]])
    v.case("layernorm_f32", "layerNorm", [args["wide"], args["gamma"], args["beta"], args["residual"], args["bias"], 1e-5],
           {}, threaded=True, held=True)
    v.case("layernorm_f32_plain", "layerNorm", [args["residual"], args["gamma"], args["beta"], None, None, 1e-12], {})
    v.case("mean_pool_f32", "meanPool", [args["tokens"], args["mask"], 3])
    v.case("attention_f32", "attention", [args["qkv"], [5, 1, 6], 2], {}, threaded=True, held=True)
    v.case("l2_normalize_f32", "l2Normalize", [args["residual"], 36])

    # Relaxed SIMD as the engine natively lowers it (the default), as V8 does; the kernels' 7-bit
    # contract makes it equal to the deterministic lowering (tests/test_q8_0.py checks that).
    for target in TARGETS:
        k = kernelgen.load(ROOT / "out", target)
        v.index["builds"][target] = k.manifest["inputs_sha256"]
        act = k.quantize_act(x_act)
        v.expect(target, "quantize_act", {"q": act.q, "d": act.d, "s": act.s})
        special = k.quantize_act(x_special)
        v.expect(target, "quantize_act_special", {"q": special.q, "d": special.d, "s": special.s})
        acts = {kq: k.quantize_act(xa) for kq, xa in x_acts.items()}
        prefill = {kq: k.quantize_act(xt) for kq, xt in x_tokens.items()}
        for q, b in blocks.items():
            act_q = acts[k_of(k.quants[q])]
            v.expect(target, f"pack_{q}", k.quants[q].pack(b))
            v.expect(target, f"qdot_{q}", {"value": k.qdot(k.pack(q, b[:1]), act_q)})
            v.expect(target, f"qmatvec_{q}", {"out": k.qmatvec(k.pack(q, b), act_q)})
            v.expect(target, f"qmatmul_{q}", {"out": k.qmatmul(k.pack(q, b), prefill[k_of(k.quants[q])])})
        v.expect(target, "quantize_act_tokens", {"q": prefill[K].q, "d": prefill[K].d, "s": prefill[K].s})
        v.expect(target, "dot_f32", {"value": k.dot_f32(xn, y)})
        v.expect(target, "matvec_f32", {"out": k.matvec_f32(wf, xf)})
        v.expect(target, "matmul_f32_nt", {"out": k.matmul_f32(qm, kt, b_transposed=True)})
        v.expect(target, "matmul_f32_nn", {"out": k.matmul_f32(qm, vt)})
        v.expect(target, "exp_f32", {"out": k.exp_f32(x)})
        v.expect(target, "softmax_f32", {"out": k.softmax_f32(scores, 29)})
        v.expect(target, "rope_halves", {"out": k.rope(heads, cos[3], sin[3])})
        v.expect(target, "rope_pairs", {"out": k.rope(heads, cos[3], sin[3], interleaved=True)})
        for name, (npos, dim, theta, pos0) in {"rope_table": (7, 64, 10000.0, 3), "rope_table_1e6": (5, 128, 1e6, 4000)}.items():
            c, s = k.rope_table(npos, dim, theta, pos0)
            v.expect(target, name, {"cos": c, "sin": s})
        v.expect(target, "silu_f32", {"out": k.silu_f32(x)})
        v.expect(target, "swiglu_f32", {"out": k.swiglu_f32(x, g)})
        v.expect(target, "erf_f32", {"out": k.erf_f32(x)})
        v.expect(target, "gelu_f32", {"out": k.gelu_f32(wide, bias).ravel()})
        v.expect(target, "linear", {"out": k.linear(k.pack("q8_0", blocks["q8_0"]), x_tokens[K]).ravel()})
        v.expect(target, "linear_bias", {"out": k.linear(k.pack("q8_0", blocks["q8_0"][:36]), x_tokens[K], bias).ravel()})
        v.expect(target, "add_bias_f32", {"out": k.add_bias_f32(wide, bias).ravel()})
        v.expect(target, "layernorm_f32", {"out": k.layernorm_f32(wide, gamma, beta, 1e-5, residual, bias).ravel()})
        v.expect(target, "layernorm_f32_plain", {"out": k.layernorm_f32(residual, gamma, beta, 1e-12).ravel()})
        v.expect(target, "mean_pool_f32", {"out": k.mean_pool_f32(tokens, mask).ravel()})
        v.expect(target, "attention_f32", {"out": k.attention_f32(qkv, [5, 1, 6], 2).ravel()})
        v.expect(target, "l2_normalize_f32", {"out": k.l2_normalize_f32(residual).ravel()})
        k.reset()
    write_gguf(root / "model.gguf", gguf_tensors(rng, 3, 256))  # the demo's pick in browser.test.mjs
    v.save()


@pytest.fixture(scope="module")
def vectors(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("js-vectors")
    write_vectors(root)
    return root


def run_node_tests(test_file: str, env: dict[str, str], timeout: float) -> None:
    """Run one node:test file; fail with its report unless every test passed and none skipped
    (a skip here would mean a prerequisite this file already checked went missing)."""
    proc = subprocess.run([NODE, *NODE_FLAGS, "--test", "--test-reporter=tap", test_file], cwd=ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    report = proc.stdout + proc.stderr
    counts = {k: int(n) for k, n in re.findall(r"^# (pass|fail|skipped|todo|cancelled) (\d+)$", report, re.M)}
    ok = proc.returncode == 0 and counts.get("pass", 0) > 0 and not any(counts.get(k) for k in ("fail", "skipped", "cancelled"))
    assert ok, f"node --test {test_file}: exit {proc.returncode}, {counts}\n{report[-6000:]}"


def test_node_runtime_matches_wasmtime(vectors: Path) -> None:
    need(NODE, "node is not installed")
    run_node_tests("runtime/test/kernels.test.mjs", {"KERNELGEN_VECTORS": str(vectors)}, timeout=120)


def test_chromium_runs_the_demo_and_matches_wasmtime(vectors: Path) -> None:
    need(NODE, "node is not installed")
    need(CHROMIUM.is_file(), f"{CHROMIUM} is missing (apt-get install chromium)")
    need((ROOT / "node_modules" / "playwright-core").is_dir(), "node_modules/playwright-core is missing (npm ci)")
    shot = vectors / "demo.png"
    run_node_tests("runtime/test/browser.test.mjs", {"KERNELGEN_VECTORS": str(vectors), "KERNELGEN_SCREENSHOT": str(shot)},
                   timeout=180)
    assert shot.stat().st_size > 0, "the browser test saved no screenshot"


def test_node_frees_packed_weights_and_honours_the_built_memory_maximum(tmp_path: Path) -> None:
    """A build with --max-memory 1MiB (fourteen 64x1024 Q8_0 matrices): 1,000 matrices packed and freed
    in a changing order fit in it; a freed matrix is refused; packing without freeing stops at the
    maximum with the error that says what was asked, what is free and what to do."""
    need(NODE, "node is not installed")
    out = tmp_path / "out"
    assert cli.main(["build", "--target", "simd128", "--no-store", "--out", str(out), "--max-memory", "1MiB",
                     "--dsl", str(ROOT / "kernels.dsl")]) == 0
    script = f"""
import {{ loadKernels }} from {json.dumps((ROOT / "runtime" / "kernelgen.mjs").as_uri())};
const k = await loadKernels({{ dir: {json.dumps(str(out))}, target: 'simd128', threads: 1 }});
const blocks = new Uint8Array(64 * 32 * 34);  // zero Q8_0 blocks: 64 rows of 1024
const act = await k.quantizeAct(new Float32Array(1024).fill(1));
const live = [];
for (let i = 0; i < 1000; i++) {{
  live.push(await k.pack('q8_0', blocks, 64, 1024));
  if (live.length === 3) await k.free(live.splice(i % 3, 1)[0]);
}}
const freed = live.pop();
await k.free(freed);
await k.free(freed);  // again: nothing happens
let refused = '';
try {{ await k.qmatvec(freed, act); }} catch (e) {{ refused = e.message; }}
let n = 0;
try {{ for (;;) {{ await k.pack('q8_0', blocks, 64, 1024); n++; }} }}
catch (e) {{ console.log(JSON.stringify({{ n, refused, name: e.name, message: e.message }})); }}
await k.terminate();
"""
    proc = subprocess.run([NODE, *NODE_FLAGS, "--input-type=module", "-e", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["refused"] == "qmatvec: these weights were freed (free()); pack them again"
    assert got["name"] == "RangeError" and 10 <= got["n"] < 14, got  # 72 KiB each in 1 MiB, one still packed
    assert re.fullmatch(r"out of memory: pack\('q8_0'\) of 64 rows, plane '\w+', needs \d+ bytes, and \d+ of the "
                        r"module's 1048576 bytes are free \(\d+ in use\); free\(packed\) or reset\(\) frees packed "
                        r"weights, or rebuild with a larger maximum \(kernelgen build --max-memory; this build allows "
                        r"16 pages of 64 KiB\)", got["message"]), got["message"]


def _drop_granules(q: dict) -> None:
    del q["planes"]["q"]["granules"]


def _unknown_encoding(q: dict) -> None:
    q["encoding"]["kind"] = "trit"


@pytest.mark.parametrize("quant, stored, edit, message", [
    ("q6_k", 210, _drop_granules, "pack(q6_k): plane 'q' of the grouped layout: its granules must cover its 36 bytes "
                                  "per record, got undefined; rebuild with `kernelgen build`"),
    ("q2_k", 84, _unknown_encoding, 'pack(q2_k): this runtime cannot pack codes encoded as "trit" (it knows crumb, nib, byte):'
                                    " use the runtime of the kernelgen that built the library")])
def test_node_refuses_a_packed_layout_it_does_not_know(tmp_path: Path, quant, stored, edit, message) -> None:
    """A manifest whose grouped Q6_K plane lacks the granules this runtime packs by (one from before
    they were recorded), or whose codes take an encoding this runtime does not know (one from a
    newer kernelgen), is refused at pack with what to do, not packed into a layout the kernels
    would misread."""
    need(NODE, "node is not installed")
    out = tmp_path / "out"
    assert cli.main(["build", "--target", "relaxed-simd", "--no-store", "--out", str(out), "--quant", quant,
                     "--dsl", str(ROOT / "kernels.dsl")]) == 0
    path = out / "relaxed-simd" / "kernels.json"
    m = json.loads(path.read_text())
    edit(m["quants"][quant])
    path.write_bytes(manifest_text(m))
    script = f"""
import {{ loadKernels }} from {json.dumps((ROOT / "runtime" / "kernelgen.mjs").as_uri())};
const k = await loadKernels({{ dir: {json.dumps(str(out))}, target: 'relaxed-simd', threads: 1 }});
try {{ await k.pack('{quant}', new Uint8Array(4 * {stored}), 4, 256); console.log('packed'); }}
catch (e) {{ console.log(e.message); }}
await k.terminate();
"""
    proc = subprocess.run([NODE, *NODE_FLAGS, "--input-type=module", "-e", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == message, proc.stdout


def test_node_runs_a_build_of_some_quant_types_and_refuses_the_others(tmp_path: Path) -> None:
    """`kernelgen build --quant q4_k --quant q6_k` (a Q4_K_M model's types): the JS runtime packs and
    runs them, on one thread and through the pool, to wasmtime's bits on the same build, and refuses
    a type the build left out by name."""
    need(NODE, "node is not installed")
    out = tmp_path / "out"
    assert cli.main(["build", "--no-store", "--out", str(out), "--quant", "q4_k", "--quant", "q6_k",
                     "--dsl", str(ROOT / "kernels.dsl")]) == 0
    rng = np.random.default_rng(5)
    rows, kdim = 7, 512
    x = rng.standard_normal(kdim).astype(np.float32)
    for target in ("simd128", "relaxed-simd"):
        k = kernelgen.load(out, target)
        assert list(k.quants) == ["q4_k", "q6_k"]
        blocks = random_blocks(k.quants["q6_k"], rows, kdim // 256, rng)
        want = k.qmatvec(k.pack("q6_k", blocks), k.quantize_act(x))
        data = tmp_path / f"{target}.json"
        data.write_text(json.dumps({"blocks": blocks.view(np.uint8).reshape(-1).tolist(), "x": x.tolist()}))
        script = tmp_path / f"{target}.mjs"
        script.write_text(f"""
import {{ readFileSync }} from 'node:fs';
import {{ loadKernels }} from {json.dumps((ROOT / "runtime" / "kernelgen.mjs").as_uri())};
const data = JSON.parse(readFileSync({json.dumps(str(data))}, 'utf8'));
const k = await loadKernels({{ dir: {json.dumps(str(out))}, target: {json.dumps(target)}, threads: 2 }});
const w = await k.pack('q6_k', Uint8Array.from(data.blocks), {rows}, {kdim});
const act = await k.quantizeAct(Float32Array.from(data.x));
const one = await k.qmatvec(w, act), two = await k.qmatvec(w, act, {{ threads: true, chunk: 3 }});
let refused = '';
try {{ await k.pack('q8_0', new Uint8Array(34), 1, 32); }} catch (e) {{ refused = e.message; }}
console.log(JSON.stringify({{ one: Array.from(one), two: Array.from(two), refused }}));
await k.terminate();
""")
        proc = subprocess.run([NODE, *NODE_FLAGS, str(script)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout)
        assert np.array_equal(np.array(got["one"], np.float32), want), target
        assert np.array_equal(np.array(got["two"], np.float32), want), target
        assert got["refused"] == "unknown quant type q8_0; this build has q4_k, q6_k", got["refused"]


# Runs square_add (tests/helpers.py) from a build of its own through the runtime's generic `run`:
# on one thread, then through the pool at several chunk sizes; prints every output as JSON.
NODE_SQUARE_ADD = """
import { loadKernels } from '%s';
const { dir, target, x, c } = JSON.parse(process.env.SQUARE_ADD);
const k = await loadKernels({ dir, target, threads: 3 });
const run = async (opts) => (await k.run('square_add', null, [Float32Array.from(x), new Float32Array(x.length), x.length, c], opts)).arrays[1];
const out = [await run()];
for (const chunk of [undefined, 1, 7]) out.push(await run({ threads: true, chunk }));
await k.terminate();
console.log(JSON.stringify({ threads: k.info.threads, out: out.map((a) => Array.from(a)) }));
"""


def test_a_new_parallel_kernel_runs_threaded_from_node(tmp_path: Path) -> None:
    need(NODE, "node is not installed")
    write_outputs(compile_source(kernelgen_dsl() + SQUARE_ADD), tmp_path)
    x, c, want = square_add_inputs()
    script = tmp_path / "square_add.mjs"  # a file: the pool's workers inherit node's flags, and --input-type breaks them
    script.write_text(NODE_SQUARE_ADD % (ROOT / "runtime" / "kernelgen.mjs").as_uri(), encoding="utf-8")
    for target in TARGETS:
        env = {**os.environ, "SQUARE_ADD": json.dumps({"dir": str(tmp_path), "target": target, "x": x.tolist(), "c": c})}
        proc = subprocess.run([NODE, *NODE_FLAGS, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout)
        assert result["threads"] == 3
        for i, out in enumerate(result["out"]):
            assert np.array(out, np.float32).tobytes() == want.tobytes(), (target, i)


def kernelgen_dsl() -> str:
    return (ROOT / "kernels.dsl").read_text(encoding="utf-8")


# Formulas where numpy and JavaScript part ways unless both packers take care (found by a
# differential fuzz of random declarations): an array read at a constant index in a super-block's
# per-sub-block formula, a select between an integer and a float, integers past 2^24 meeting a
# float (rounded to float32 first), and a u32 field in float arithmetic (its unsigned value).
EDGE_TYPES = """
quant edge_k {
    block 256;
    sub 32;
    field d: f16;
    field z: u32;
    field scales: u8[8];
    field qs: u8[128];
    unpack (qs[i / 64 * 32 + i % 32] >> (i / 32 % 2 * 4)) & 15;
    dequant d * select(s < 4, scales[0], 0.5) * q - (d * 16777217) * z;
}
quant edge_f {
    block 32;
    field d: f16;
    field e: i32;
    field qs: u8[16];
    unpack nib(qs, i) - 8;
    dequant (d * e) * q;
}
"""


@pytest.mark.parametrize("target", TARGETS)
def test_js_packer_matches_python_across_chunks_and_parts(tmp_path: Path, target: str, any_module) -> None:
    """runtime/pack.mjs evaluates the formulas for 256 blocks at a time (pack.mjs CHUNK), and packs a
    grouped type's rows in parts of whole groups (pack.mjs PACK_VALUES: here 4 rows): every library
    type packs byte for byte as QuantFormat.pack does over 11 rows of 19200 values (three parts, the
    last padded), with a zero, a NaN and an infinite scale among them; and a block pack refuses is
    named by its index in the matrix, in the third part, its values before its zero point."""
    need(NODE, "node is not installed")
    k = any_module(target)
    manifest = tmp_path / "kernels.json"
    manifest.write_text(json.dumps(k.manifest))
    rng = np.random.default_rng(11)
    jobs = {}
    for name, q in k.quants.items():
        b = random_blocks(q, 11, 19200 // q.block, rng)
        floats = [f for f in q.dtype.names if q.dtype[f].kind == "f"]
        for at, value in zip(((0, 0), (1, 70), (10, 50)), (0.0, np.nan, np.inf)):
            for f in floats:
                b[f][at] = value
        path = tmp_path / f"{name}.bin"
        path.write_bytes(b.tobytes())
        jobs[name] = (b.shape[0], b.shape[1] * q.block, path, q.pack(b))
    onnx = k.quants["q4_onnx"]  # block (9, 300) of one matrix has a zero point past 127; (9, 301) of
    bad = {}  # another one too, and values outside int8 (0 - 255), which are named first
    for first, (z, qs) in {300: (130, 0xFF), 301: (255, 0)}.items():  # 0xFF: 15 - 130 is an int8
        b = random_blocks(onnx, 11, 600, rng)
        b["z"][9, first], b["qs"][9, first] = z, qs
        bad[first] = tmp_path / f"bad{first}.bin"
        bad[first].write_bytes(b.tobytes())
    script = (f"import {{ readFileSync }} from 'node:fs';\nimport {{ packPlanes }} from {json.dumps((ROOT / 'runtime' / 'pack.mjs').as_uri())};\n"
              f"const m = JSON.parse(readFileSync({json.dumps(str(manifest))}, 'utf8'));\nconst out = {{}};\n"
              "const read = (p) => { const raw = readFileSync(p); return new Uint8Array(raw.buffer, raw.byteOffset, raw.byteLength); };\n"
              "const hex = (p) => Object.fromEntries(Object.entries(p).map(([n, a]) => [n, Buffer.from(a.buffer, a.byteOffset, a.byteLength).toString('hex')]));\n")
    for name, (rows, kk, path, _) in jobs.items():
        script += f"out.{name} = hex(packPlanes(m.quants.{name}, read({json.dumps(str(path))}), {rows}, {kk}));\n"
    for first, path in bad.items():
        script += f"try {{ packPlanes(m.quants.q4_onnx, read({json.dumps(str(path))}), 11, 19200); }} catch (e) {{ out.error{first} = e.message; }}\n"
    script += "console.log(JSON.stringify(out));\n"
    proc = subprocess.run([NODE, "--input-type=module", "-e", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    for name, (_, _, _, planes) in jobs.items():
        assert set(got[name]) == set(planes), name
        for plane, arr in planes.items():
            assert got[name][plane] == np.ascontiguousarray(arr).tobytes().hex(), f"{name} plane {plane} on {target}"
    assert got["error300"].startswith("block 5700 has z = 130, outside 0..127"), got["error300"]
    assert got["error301"].startswith("block 5701 unpacks to -255 at element 0, outside int8"), got["error301"]


@pytest.mark.parametrize("target", TARGETS)
def test_python_and_js_packers_agree_where_numpy_and_javascript_part_ways(tmp_path: Path, target: str) -> None:
    need(NODE, "node is not installed")
    source = (ROOT / "kernels.dsl").read_text(encoding="utf-8") + EDGE_TYPES
    (built,) = compile_source(source, targets=(target,), quants=("edge_k", "edge_f"))
    manifest = tmp_path / "kernels.json"
    manifest.write_text(json.dumps(built.manifest))
    rng = np.random.default_rng(7)
    jobs = []
    for name, rows, nblocks in (("edge_k", 3, 2), ("edge_f", 5, 4)):
        qf = kernelgen.quantformat.QuantFormat.from_json(name, built.manifest["quants"][name])
        b = qf.as_blocks(rng.integers(0, 256, (rows, nblocks * qf.stored_bytes), dtype=np.uint8))
        b["d"] = rng.uniform(-2, 2, b.shape).astype(np.float16)
        if name == "edge_k":
            b["z"] = rng.integers(2**31, 2**32, b.shape, dtype=np.uint64)  # past int32
        else:
            b["e"] = rng.integers(2**24, 2**31, b.shape) * rng.choice([-1, 1], b.shape)  # past float32's integers
        blocks = tmp_path / f"{name}.bin"
        blocks.write_bytes(b.tobytes())
        jobs.append((name, rows, nblocks * qf.block, blocks, qf.pack(b)))
    script = (f"import {{ readFileSync }} from 'node:fs';\nimport {{ packPlanes }} from {json.dumps((ROOT / 'runtime' / 'pack.mjs').as_uri())};\n"
              f"const m = JSON.parse(readFileSync({json.dumps(str(manifest))}, 'utf8'));\nconst out = {{}};\n")
    for name, rows, k, blocks, _ in jobs:
        script += (f"{{ const raw = readFileSync({json.dumps(str(blocks))});\n"
                   f"  const p = packPlanes(m.quants.{name}, new Uint8Array(raw.buffer, raw.byteOffset, raw.byteLength), {rows}, {k});\n"
                   f"  out.{name} = Object.fromEntries(Object.entries(p).map(([n, a]) => [n, Buffer.from(a.buffer, a.byteOffset, a.byteLength).toString('hex')])); }}\n")
    script += "console.log(JSON.stringify(out));\n"
    proc = subprocess.run([NODE, "--input-type=module", "-e", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    for name, _, _, _, planes in jobs:
        assert set(got[name]) == set(planes), name
        for plane, arr in planes.items():
            assert got[name][plane] == np.ascontiguousarray(arr).tobytes().hex(), f"{name} plane {plane} on {target}"
