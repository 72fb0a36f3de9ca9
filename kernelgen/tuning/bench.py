"""`kernelgen bench`: the library's speed on this machine, as ratios measured in one run.

Every kernel is timed inside wasm (timing.py) on a module built from the library plus generated
wrappers: a repeat loop per kernel, a streaming read of the same bytes (the roofline mat-vec is
measured against), and a repeat loop around the pool's par_for. numpy baselines are timed in the
same run. Results are plain dicts (`--json` prints them), each with its goal where the project
set one.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from ..host.api import Kernels, padded_rows
from ..compiler.build import TARGET_NAMES, compile_source, from_built
from ..compiler.check import check
from ..names import variant_name
from ..compiler.parse import parse
from ..host.pool import Pool
from .store import Record
from .timing import POOL_REPEAT, STREAM_SOURCE, measure, measure_python, repeat_name, repeat_source




@dataclass
class Row:
    name: str
    target: str
    shape: str
    seconds: float
    rate: float  # per second, in `unit`
    unit: str
    roofline_pct: float | None = None  # of the streaming read of the same bytes
    ratio: float | None = None  # against `versus`
    versus: str | None = None
    goal: str | None = None
    met: bool | None = None


def bench_module(source: str, target: str, records: list[Record] | None) -> Kernels:
    checked = check(parse(source))
    extra = STREAM_SOURCE + POOL_REPEAT + "".join(repeat_source(checked, k) for k in ("qmatvec", "exp_f32", "softmax_f32"))
    (built,) = compile_source(source + extra, targets=(target,), records=records)
    return from_built(built, deterministic=False)


def _blocks(k: Kernels, quant: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    q = k.quants[quant]
    raw = rng.integers(0, 256, (rows, cols // q.block * q.stored_bytes), dtype=np.uint8)
    blocks = raw.view(q.dtype).copy()
    blocks["d"] = np.float16(0.01)
    return blocks


def _qmatvec(k: Kernels, quant: str, rows: int, cols: int, threads_pool: Pool | None = None) -> tuple[float, float]:
    """(seconds per mat-vec, seconds to stream the same bytes)."""
    rng = np.random.default_rng(1)
    w = k.pack(quant, _blocks(k, quant, rows, cols, rng))
    act = k.quantize_act(rng.standard_normal(cols).astype(np.float32))
    aq, ad, y = k.module.put(act.q), k.module.put(act.d), k.module.alloc(4 * rows)
    nbytes = sum(k.quants[quant].planes[p][1] for p in w.planes) * rows * (cols // 32)
    buf = k.module.alloc(nbytes + 64)
    stream = measure(lambda reps: k.call("bench_stream_repeat", reps, buf, nbytes // 64 * 64))
    if threads_pool is None:
        fn = variant_name(repeat_name("qmatvec"), quant, {})
        t = measure(lambda reps: k.call(fn, reps, *w.args, aq, ad, y, rows, cols))
    else:
        job = k.job_name("qmatvec_job", quant)
        threads_pool.run(job, rows, 16, [*w.args, aq, ad, y, cols])  # publishes the arguments
        index = threads_pool.job_index(job)
        t = measure(lambda reps: k.call("bench_par_for", reps, index, rows, 16))
    return t.seconds, stream.seconds


def run(source: str, targets: tuple[str, ...] = TARGET_NAMES, records: list[Record] | None = None,
        progress: Callable[[str], None] = lambda s: None) -> tuple[list[Row], dict]:
    rows: list[Row] = []
    mods = {t: bench_module(source, t, records) for t in targets}
    q8 = {}
    for t, k in mods.items():
        for shape in ((4096, 4096), (256, 4096)):
            progress(f"{t} qmatvec q8_0 {shape}")
            s, stream = _qmatvec(k, "q8_0", *shape)
            q8[(t, shape)] = s
            goal = "relaxed-simd >= 70% of roofline" if shape == (4096, 4096) and t == "relaxed-simd" else None
            pct = 100 * stream / s
            rows.append(Row("qmatvec q8_0", t, f"{shape[0]}x{shape[1]}", s, shape[0] * shape[1] / s / 1e9, "G weights/s",
                            pct, goal=goal, met=pct >= 70 if goal else None))
            k.reset()
    if "simd128" in mods and "relaxed-simd" in mods:
        for shape in ((4096, 4096), (256, 4096)):
            r = q8[("simd128", shape)] / q8[("relaxed-simd", shape)]
            goal = "relaxed >= 1.4x simd128" if shape == (256, 4096) else None
            rows.append(Row("qmatvec q8_0 relaxed vs simd128", "both", f"{shape[0]}x{shape[1]}", q8[("relaxed-simd", shape)],
                            0.0, "", None, r, "simd128", goal, r >= 1.4 if goal else None))
    for t, k in mods.items():
        progress(f"{t} q4_0 vs q8_0 8192x8192")
        s4, _ = _qmatvec(k, "q4_0", 8192, 8192)
        k.reset()
        s8, _ = _qmatvec(k, "q8_0", 8192, 8192)
        k.reset()
        r = s8 / s4
        rows.append(Row("qmatvec q4_0", t, "8192x8192", s4, 8192 * 8192 / s4 / 1e9, "G weights/s", None, r,
                        "q8_0 weights/s", "q4_0 >= 1.6x q8_0", r >= 1.6))
    x = np.random.default_rng(2).standard_normal(1 << 20).astype(np.float32) * 10
    y = np.empty_like(x)
    np_exp = measure_python(lambda: np.exp(x, out=y)).seconds
    xs = padded_rows(np.random.default_rng(3).standard_normal((64, 4096)).astype(np.float32))
    row0 = xs[0].copy()

    def np_softmax() -> None:
        e = np.exp(row0 - row0.max())
        e / e.sum()

    np_sm = measure_python(np_softmax).seconds
    for t, k in mods.items():
        progress(f"{t} exp and softmax")
        px, py = k.module.put(x, pad=16), k.module.alloc(x.nbytes + 16)
        s = measure(lambda reps: k.call(repeat_name("exp_f32"), reps, px, py, x.size)).seconds
        rows.append(Row("exp_f32", t, "2^20", s, x.size / s / 1e9, "G elements/s", None, np_exp / s, "numpy np.exp",
                        "exp4 >= 1.0x numpy", np_exp / s >= 1.0))
        ps = k.module.put(xs)
        s = measure(lambda reps: k.call(repeat_name("softmax_f32"), reps, ps, 64, 4096, 4096)).seconds / 64
        rows.append(Row("softmax_f32 per row", t, "4096", s, 4096 / s / 1e9, "G elements/s", None, np_sm / s,
                        "numpy per row", "softmax >= 1.5x numpy", np_sm / s >= 1.5))
        k.reset()
    for t, k in mods.items():
        progress(f"{t} thread pool")
        with Pool(k, 2) as pool:
            pool.set_threads(1)
            one, _ = _qmatvec(k, "q8_0", 4096, 4096, pool)
            pool.set_threads(2)
            two, _ = _qmatvec(k, "q8_0", 4096, 4096, pool)
            job = pool.job_index(k.job_name("qmatvec_job", "q8_0"))
            empty = measure(lambda reps: k.call("bench_par_for", reps, job, 0, 1)).seconds
        k.reset()
        rows.append(Row("qmatvec q8_0 on 2 threads", t, "4096x4096", two, 4096 * 4096 / two / 1e9, "G weights/s",
                        None, one / two, "1 thread", "2 threads >= 1.8x", one / two >= 1.8))
        rows.append(Row("empty pool job (2 threads)", t, "-", empty, 1 / empty, "jobs/s", None, None, None,
                        "dispatch < 5 us", empty < 5e-6))
    t0 = time.perf_counter()
    built = compile_source(source, records=records)
    build_s = time.perf_counter() - t0
    sizes = {b.target: len(b.wasm) for b in built}
    env = {"build_seconds_all_targets": build_s, "wasm_bytes": sizes,
           "goals": {"build < 3 s": build_s < 3, **{f"{t} wasm <= 16 KB": n <= 16384 for t, n in sizes.items()}}}
    return rows, env


def format_table(rows: list[Row], env: dict) -> str:
    head = f"{'kernel':32} {'target':13} {'shape':10} {'time':>10} {'rate':>22} {'roofline':>8} {'ratio':>16}  goal"
    lines = [head, "-" * len(head)]
    for r in rows:
        rate = f"{r.rate:.2f} {r.unit}" if r.unit else ""
        roof = f"{r.roofline_pct:.0f}%" if r.roofline_pct is not None else ""
        ratio = f"{r.ratio:.2f}x {r.versus}" if r.ratio is not None else ""
        goal = f"{r.goal}: {'met' if r.met else 'NOT met'}" if r.goal else ""
        lines.append(f"{r.name:32} {r.target:13} {r.shape:10} {_time(r.seconds):>10} {rate:>22} {roof:>8} {ratio:>16}  {goal}")
    lines.append("")
    lines.append(f"build --target all: {env['build_seconds_all_targets']:.2f} s; wasm bytes: "
                 + ", ".join(f"{t} {n}" for t, n in env["wasm_bytes"].items()))
    lines.append("goals: " + ", ".join(f"{g}: {'met' if ok else 'NOT met'}" for g, ok in env["goals"].items()))
    return "\n".join(lines)


def _time(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.2f} us"


def as_json(rows: list[Row], env: dict) -> dict:
    return {"rows": [asdict(r) for r in rows], "env": env}
