"""runtime/gguf.mjs reads GGUF files as llama.cpp's own reader (the `gguf` package) does.

This file writes .gguf files with gguf.GGUFWriter and, from gguf.GGUFReader, what a reader must see
in them: every metadata key, type and value, every tensor's type, dimensions and data offset. From
kernelgen.formats.load_gguf under wasmtime (which reads through gguf.GGUFReader) it writes each
quantized tensor's mat-vec and each float tensor's values. runtime/test/gguf.test.mjs then loads the
same files in Node through every kind of source (a path, bytes, a Blob, a URL served with and without
range requests) and in a page of headless Chromium (by range requests and from a Blob), compares bit
for bit, and checks that damaged files and misuse are refused with nothing left packed.
"""
from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as G
from gguf import GGUFWriter  # (metadata's writer)

import kernelgen
from kernelgen import reference
from kernelgen.host import formats

from helpers import CHROMIUM, NODE, need, rng_for
from test_gguf_types import gguf_tensors, write_gguf
from test_js import ROOT, TARGETS, run_node_tests

ROWS, K = 5, 512  # an odd row count; two Q4_K super-blocks a row


def metadata(w: GGUFWriter) -> None:
    """One key of every GGUF value type, arrays of numbers, strings and arrays, and values at the
    ends of their ranges (a u64 past 2^53, NaN, a string that is not ASCII). (GGUFWriter leaves out
    empty strings and arrays; gguf.test.mjs writes those itself.)"""
    w.add_uint8("test.u8", 255)
    w.add_int8("test.i8", -128)
    w.add_uint16("test.u16", 65535)
    w.add_int16("test.i16", -32768)
    w.add_uint32("test.u32", 2**32 - 1)
    w.add_int32("test.i32", -2**31)
    w.add_float32("test.f32", np.float32(-1.5e-40))  # a subnormal
    w.add_float32("test.nan", np.float32(np.nan))
    w.add_bool("test.true", True)
    w.add_bool("test.false", False)
    w.add_string("test.text", "naïve ∑ 😀")
    w.add_uint64("test.u64", 2**64 - 1)
    w.add_int64("test.i64", -2**63)
    w.add_float64("test.f64", 1 / 3)
    w.add_array("test.strings", ["<s>", "</s>", "▁the", ""])
    w.add_array("test.scores", [0.5, -1.25, 3e38])
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.nested", [[1, 2], [3]])


def field_json(field) -> dict:
    """A metadata field as gguf.GGUFReader reads it: its GGUF value type(s) and value, 64-bit
    integers as decimal strings (BigInt in JS), floats as JSON numbers (exact for f32 and f64),
    NaN as the string "NaN". The reader gives an array of arrays flattened."""
    def plain(v, types):
        if isinstance(v, list):
            return [plain(x, types[1:]) for x in v]
        if types[0] in (gguf.GGUFValueType.UINT64, gguf.GGUFValueType.INT64):
            return str(int(v))
        if isinstance(v, (float, np.floating)):
            return "NaN" if np.isnan(v) else float(v)
        return v.item() if isinstance(v, np.generic) else v

    types = [t.name for t in field.types]
    return {"types": types, "value": plain(field.contents(), field.types)}


def write_files(root: Path) -> None:
    rng = rng_for("js-gguf")
    tensors = gguf_tensors(rng, ROWS, K)
    files = {"model.gguf": tensors,
             "aligned.gguf": {n: tensors[n] for n in ("norm.f16", "ffn_up.q4_k", "attn_q.q8_0")},
             "iq2_xxs.gguf": {**tensors, "output.iq2_xxs": (rng.integers(0, 256, (ROWS, K // 256 * 66), dtype=np.uint8),
                                                           G.IQ2_XXS)}}
    files["large.gguf"] = {"attn_q.q8_0": tensors["attn_q.q8_0"],  # past a header of more than the first MiB read
                           "ffn_up.q4_k": (reference.quantize_k(rng.standard_normal((64, 4096)).astype(np.float32), 4)
                                           .view(np.uint8).reshape(64, -1), G.Q4_K)}

    def vocabulary(w: GGUFWriter) -> None:  # what makes a real model's header long: 1.6 MB here
        w.add_array("tokenizer.ggml.tokens", [f"▁token-{i:06d}-{'ab' * 16}" for i in range(30_000)])
        w.add_array("tokenizer.ggml.scores", rng.standard_normal(30_000).astype(np.float32).tolist())

    setups = {"model.gguf": metadata, "aligned.gguf": lambda w: w.add_custom_alignment(256), "large.gguf": vocabulary}
    for name, ts in files.items():
        write_gguf(root / name, ts, setups.get(name, lambda w: None))
    x = rng.standard_normal(4096).astype(np.float32)  # a tensor of rows of n values takes x[:n]
    (root / "x.bin").write_bytes(x.tobytes())
    index: dict = {"types": {t.name: t.value for t in G}, "files": {}, "x": "x.bin"}
    for name in ("model.gguf", "aligned.gguf", "large.gguf"):
        reader = gguf.GGUFReader(root / name)
        entry = {"metadata": {k: field_json(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")},
                 "tensors": [{"name": t.name, "type": t.tensor_type.name, "dims": [int(d) for d in t.shape],
                              "offset": int(t.data_offset)} for t in reader.tensors],
                 "expected": {}}
        for target in TARGETS:
            k = kernelgen.load(ROOT / "out", target)
            acts = {n: k.quantize_act(x[:n]) for n in (K, 4096)}
            out = {}
            for tname, v in formats.load_gguf(k, root / name).items():
                a = v if isinstance(v, np.ndarray) else k.qmatvec(v, acts[v.k])
                file = f"{target}.{name}.{tname}.bin"
                (root / file).write_bytes(np.ascontiguousarray(a, np.float32).tobytes())
                out[tname] = file
            entry["expected"][target] = out
            k.reset()
        index["files"][name] = entry
    index["files"]["iq2_xxs.gguf"] = {"supported": "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, "
                                                "MXFP4"}
    (root / "index.json").write_text(json.dumps(index, indent=1), encoding="utf-8")


def test_node_reads_gguf_files_as_the_gguf_package_does(tmp_path: Path) -> None:
    need(NODE, "node is not installed")
    need(CHROMIUM.is_file(), f"{CHROMIUM} is missing (apt-get install chromium)")
    need((ROOT / "node_modules" / "playwright-core").is_dir(), "node_modules/playwright-core is missing (npm ci)")
    write_files(tmp_path)
    run_node_tests("runtime/test/gguf.test.mjs", {"KERNELGEN_GGUF": str(tmp_path)}, timeout=300)


def _raw_gguf(path: Path, tensors: list[tuple[str, int, list[int], int]], alignment: tuple[int, bytes] | None = None,
              data: int = 256) -> None:
    """A GGUF v3 file written byte by byte (GGUFWriter refuses what these files hold): tensors as
    (name, GGML type id, dims in GGML's order, offset in the data section), `data` zero bytes of data,
    and general.alignment as (value type id, packed value) when given."""
    def text(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()
    kv = [text("general.alignment") + struct.pack("<I", alignment[0]) + alignment[1]] if alignment else []
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)) + b"".join(kv)
    for name, kind, dims, offset in tensors:
        head += text(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", kind, offset)
    path.write_bytes(head + bytes(-len(head) % 32 + data))


def test_both_hosts_refuse_the_files_llama_cpp_refuses(tmp_path: Path) -> None:
    """Files the gguf package's reader takes but llama.cpp refuses are refused by both hosts alike,
    each naming the tensor or the key (the Python host once read a 5-D tensor as 2-D and loaded
    tensors whose bytes overlap, where the JS runtime refused them; the JS runtime took an
    alignment stored as i32 or f32)."""
    need(NODE, "node is not installed")
    q8, f32 = G.Q8_0.value, G.F32.value
    files = {"five_dims.gguf": ([("a", q8, [32, 1, 1, 1, 2], 0)], None, "dimensions"),
             "a_zero_dim.gguf": ([("a", f32, [4, 0], 0)], None, "dimensions [4, 0]"),
             "overlap.gguf": ([("a", q8, [64], 0), ("b", q8, [32], 32)], None, "overlap"),
             "unaligned.gguf": ([("a", q8, [32], 0), ("b", q8, [32], 36)], None, "alignment"),
             "alignment_i32.gguf": ([("a", q8, [32], 0)], (5, struct.pack("<i", 64)), "alignment"),
             "alignment_f32.gguf": ([("a", q8, [32], 0)], (6, struct.pack("<f", 64.0)), "alignment")}
    k = kernelgen.load(ROOT / "out", "simd128")
    for name, (tensors, alignment, says) in files.items():
        _raw_gguf(tmp_path / name, tensors, alignment)
        try:
            formats.load_gguf(k, tmp_path / name)
        except ValueError as e:
            assert says.lower() in str(e).lower(), (name, str(e))
        else:
            raise AssertionError(f"{name}: the Python host loaded it")
    script = tmp_path / "refuse.mjs"
    script.write_text(
        f"import {{ loadKernels, loadGguf }} from {json.dumps((ROOT / 'runtime' / 'kernelgen.mjs').as_uri())};\n"
        f"const k = await loadKernels({{ dir: {json.dumps(str(ROOT / 'out'))}, target: 'simd128', threads: 1 }});\n"
        "const seen = {};\n"
        f"for (const name of {json.dumps(list(files))}) {{\n"
        f"  try {{ await loadGguf(k, {json.dumps(str(tmp_path))} + '/' + name); seen[name] = 'loaded'; }}\n"
        "  catch (e) { seen[name] = `${e.name}: ${e.message}`; }\n"
        "}\nawait k.terminate();\nconsole.log(JSON.stringify(seen));\n", encoding="utf-8")
    r = subprocess.run([NODE, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    for name, (_, _, says) in files.items():
        assert seen[name].startswith("GgufError") and says.lower() in seen[name].lower(), (name, seen[name])
