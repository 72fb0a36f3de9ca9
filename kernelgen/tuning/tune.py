"""Auto-tuning: generate each variant of a kernel, verify it against numpy once, time it inside
wasm, and append the result to the store (store.py) that `kernelgen build` reads.

A variant is one assignment of a kernel's `tune` parameters that meets its `restrict`s
(check.variants). Results are appended as they arrive, so Ctrl-C keeps them and a rerun resumes
by skipping what is recorded; the best few of each shape are timed again before the pick.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import wasmtime

from .. import reference
from ..errors import KernelgenError
from ..host.api import Act, Kernels
from ..host.pool import Pool
from ..compiler.build import choose_tune, compile_source, from_built
from ..compiler.check import Checked, check, tune_key, variants
from ..names import variant_name
from ..compiler.parse import parse
from .fingerprint import Code
from .store import WASMTIME, Record, append_record, caches, host, kernel_hash, last_level, load_store, usable
from .timing import ENGINES, POOL_REPEAT, check_case_bytes, measure_together, open_job, repeat_name, repeat_source
from .v8 import engine_name, in_browser, measure_v8


# ---- what is tuned: inputs, a numpy check, and the timed call per kernel ---------------------------


@dataclass
class Case:
    """One kernel at one shape: arguments in a module's memory, a check of its outputs, the work done."""

    args: list
    verify: Callable[[object], str | None]  # given the call's result: None when right, else what is wrong
    work: float  # weights (mat-vec) or elements per call
    layers: list[list] | None = None  # a layered shape: each matrix's arguments, called in turn (args: the last's)


def _weights(k: Kernels, quant: str, n: int, kk: int, rng: np.random.Generator) -> np.ndarray:
    """n random rows of `quant` blocks (small scales and zero points)."""
    q = k.quants[quant]
    if kk % q.block:
        raise ValueError(f"{quant}: rows of {kk} values are not whole {q.block}-value blocks")
    raw = rng.integers(0, 256, (n, kk // q.block * q.stored_bytes), dtype=np.uint8)
    blocks = raw.view(q.dtype).copy()
    for f in q.fields:
        if f.type in ("f16", "f32") and f.count is None:
            blocks[f.name] = rng.uniform(-0.05, 0.05, blocks.shape).astype(blocks[f.name].dtype)
        elif f.count is None and f.name in q.value_fields:  # a per-block offset such as a zero point:
            blocks[f.name] = rng.integers(0, 16, blocks.shape)  # small, so values stay in int8
    q.set_scale_bytes(blocks, 0.01)  # an exponent byte: scales near the f16 ones, no overflow to inf
    return blocks


def _qcheck(k: Kernels, quant: str, blocks: np.ndarray, act: Act, y: int, m: int, n: int) -> Callable[[object], str | None]:
    """A check of y[m, n] = A W^T on a sample of rows and tokens against reference.qmatvec (the
    sample keeps verification fast for big shapes)."""
    q = k.quants[quant]
    rows = np.unique(np.linspace(0, n - 1, min(n, 64)).astype(int))
    tokens = np.unique(np.linspace(0, m - 1, min(m, 4)).astype(int))
    sub = blocks[rows]
    kb = q.block // q.subs  # values per scale: a super-block's sub-block (16 or 32), else the block
    q_act, d_act = k.act_values(act).reshape(m, -1), act.d.reshape(m, -1)
    d_act = np.repeat(d_act, q_act.shape[1] // kb // d_act.shape[1], axis=1)  # an activation scale per weight scale
    refs = [reference.qmatvec(q.scale_ref(sub), q.unpack_ref(sub).reshape(len(rows), -1), q_act[t], d_act[t],
                              k.manifest["constants"]["ACT_ZERO"], kb,
                              q.offset_ref(sub) if q.offset is not None else None) for t in tokens]

    def verify(_: object) -> str | None:
        got = k.module.get(y, np.float32, m * n).reshape(m, n)
        for t, (ref, mag) in zip(tokens, refs):
            bad = np.abs(got[t, rows] - ref) > 1e-5 * mag + 1e-30
            if bad.any():
                return f"token {t}, rows {rows[bad][:4].tolist()} differ from numpy"
        return None

    return verify


def _case_qmatvec(k: Kernels, quant: str, shape: tuple[int, ...], rng: np.random.Generator) -> Case:
    """Shape n x k, or layers x n x k: as many matrices, each mat-vec'd in turn (_layered)."""
    if len(shape) == 3:
        return _layered(k, quant, shape, rng)
    n, kk = shape
    blocks = _weights(k, quant, n, kk, rng)
    w = k.pack(quant, blocks)
    act = k.quantize_act(rng.standard_normal(kk).astype(np.float32))
    aq, ad, y = *k.put_act(act), k.module.alloc(4 * n)
    return Case([*w.args, aq, ad, y, n, kk], _qcheck(k, quant, blocks, act, y, 1, n), float(n * kk))


_LAYERS: dict[tuple, tuple[list[dict[str, np.ndarray]], np.ndarray]] = {}  # the last layered case's planes (a tune run)


def _layered(k: Kernels, quant: str, shape: tuple[int, ...], rng: np.random.Generator) -> Case:
    """`layers` matrices of n x k, mat-vec'd in turn with one call each, as decoding reads a model's
    layers: together they pass the last-level cache, so every matrix comes from DRAM (bench's
    `--dram LxNxK` form). Their packed planes are kept for the next variant of the same type, shape
    and layout (making and packing a GB of blocks takes seconds; a variant's timing about one); the
    check is of the last matrix."""
    layers, n, kk = shape
    q = k.quants[quant]
    key = (quant, shape, json.dumps(k.manifest["quants"][quant], sort_keys=True))
    if key not in _LAYERS:
        _LAYERS.clear()  # one case at a time: each holds up to CASE_MAX_BYTES
        made = [_weights(k, quant, n, kk, rng) for _ in range(layers)]
        _LAYERS[key] = ([q.pack(q.as_blocks(b)) for b in made], made[-1])
    planes, last = _LAYERS[key]
    act = k.quantize_act(rng.standard_normal(kk).astype(np.float32))
    aq, ad, y = *k.put_act(act), k.module.alloc(4 * n)
    calls = [[*(k.module.put(a) for a in p.values()), aq, ad, y, n, kk] for p in planes]
    return Case(calls[-1], _qcheck(k, quant, last, act, y, 1, n), float(layers * n * kk), calls)


def _case_qmatmul(k: Kernels, quant: str, shape: tuple[int, ...], rng: np.random.Generator) -> Case:
    """Shape m x n x k: m tokens, n rows of W of length k."""
    m, n, kk = shape
    blocks = _weights(k, quant, n, kk, rng)
    w = k.pack(quant, blocks)
    act = k.quantize_act(rng.standard_normal((m, kk)).astype(np.float32))
    aq, ad, y = *k.put_act(act), k.module.alloc(4 * m * n)
    return Case([*w.args, aq, ad, y, m, n, kk], _qcheck(k, quant, blocks, act, y, m, n), float(m * n * kk))


def _case_matmul_f32(form: str) -> Callable:
    """Shape m x n x k: y[m, n] = a[m, k] b[n, k]^T (form nt) or a[m, k] b[k, n] (nn), checked
    within the bound kernels.dsl states."""
    def make(k: Kernels, quant: str | None, shape: tuple[int, ...], rng: np.random.Generator) -> Case:
        m, n, kk = shape
        a = rng.standard_normal((m, kk)).astype(np.float32)
        b = rng.standard_normal((n, kk) if form == "nt" else (kk, n)).astype(np.float32)
        bt = (b.T if form == "nt" else b).astype(np.float64)
        ref, mag = a.astype(np.float64) @ bt, np.abs(a.astype(np.float64)) @ np.abs(bt)
        bound = (kk / 4 + 6 if form == "nt" else kk + 1) * 2.0 ** -24
        pa, pb, y = k.module.put(a), k.module.put(b), k.module.alloc(4 * m * n)

        def verify(_: object) -> str | None:
            bad = np.abs(k.module.get(y, np.float32, m * n).reshape(m, n) - ref) > bound * mag
            return f"{bad.sum()} outputs outside the stated bound" if bad.any() else None

        return Case([pa, pb, y, m, n, kk], verify, float(m * n * kk))

    return make


def _case_f32(kernel: str) -> Callable:
    def make(k: Kernels, quant: str | None, shape: tuple[int, ...], rng: np.random.Generator) -> Case:
        rows, n = (1, shape[0]) if kernel == "dot_f32" else shape
        w = rng.standard_normal((rows, n)).astype(np.float32)
        x = rng.standard_normal(n).astype(np.float32)
        pw, px = k.module.put(w), k.module.put(x)
        y = k.module.alloc(4 * rows)
        ref = w.astype(np.float64) @ x
        mag = np.abs(w.astype(np.float64) * x).sum(axis=1)

        def verify(returned: object) -> str | None:
            got = np.array([returned]) if kernel == "dot_f32" else k.module.get(y, np.float32, rows)
            bad = np.abs(got - ref) > 1e-5 * mag + 1e-30
            return f"{bad.sum()} outputs differ from numpy" if bad.any() else None

        args = [pw, px, n] if kernel == "dot_f32" else [pw, px, y, rows, n]
        return Case(args, verify, float(rows * n))

    return make


# Prefill shapes m x n x k: batches of 4, 16 and 64 tokens, rows and row lengths from 384 to 4096.
PREFILL_SHAPES = [(4, 1536, 384), (16, 1024, 4096), (64, 4096, 4096)]
# Attention at T = 128, head size 32 and 64: scores (nt) 128 x 128 x head, out (nn) 128 x head x 128.
ATTENTION_SHAPES = {"nt": [(128, 128, 32), (128, 128, 64)], "nn": [(128, 32, 128), (128, 64, 128)]}

# Decode reads every weight once per token, from DRAM for any real model, so mat-vec is tuned at a
# DRAM shape too, not only at shapes a cache holds: QMATVEC_DRAM matrices of 4096x4096 read in turn
# (_layered), 952 MiB of Q8_0 and 294 MiB of Q2_K (the smallest type: about the size of the largest
# last-level cache seen here, a Xeon's 300 MiB L3, which held the 8192x8192 this shape replaces, so
# that the picks made on it were of weights in cache). From DRAM more rows at once (more concurrent
# streams) win: at 16384x32768, beyond a 480 MB L3, rows 4 ran 1.82x (Q4_0), 2.25x (Q4_K), 1.09x
# (Q8_0) and 1.05x (Q6_K) rows 2 on relaxed SIMD and 1.08-1.16x on SIMD128, where at 4096x4096 the
# same pair read 0.86-1.25x (Intel Xeon with AVX-512 VNNI, wasmtime). The layered shape is timed in
# wasmtime only (V8 would be handed a copy of a GB of memory per variant; how V8 ranks the variants
# from DRAM is not measured).
QMATVEC_DRAM = (56, 4096, 4096)
QMATVEC_SHAPES = [(4096, 4096), (256, 4096), QMATVEC_DRAM]
LAYERED = ("qmatvec", "qmatvec_job")  # kernels whose 3-dimension shapes are layers x rows x columns


def layered(kernel: str, shape: tuple[int, ...]) -> bool:
    return kernel in LAYERED and len(shape) == 3


def shape_forms(kernel: str) -> tuple[str, ...]:
    """The shapes `kernel` takes, as --shape writes them."""
    if kernel in LAYERED:
        return ("NxK", "LxNxK")
    return ({1: "N", 2: "NxK", 3: "MxNxK"}[len(SPECS[kernel][1][0])],)


# kernel -> (case maker, default shapes); shapes are "N", "NxK", (matrix products) "MxNxK" or
# (mat-vec over layers) "LxNxK".
SPECS: dict[str, tuple[Callable, list[tuple[int, ...]]]] = {
    "qmatvec": (_case_qmatvec, QMATVEC_SHAPES),
    "qmatmul": (_case_qmatmul, PREFILL_SHAPES),
    "matmul_f32_nt": (_case_matmul_f32("nt"), ATTENTION_SHAPES["nt"]),
    "matmul_f32_nn": (_case_matmul_f32("nn"), ATTENTION_SHAPES["nn"]),
    "dot_f32": (_case_f32("dot_f32"), [(4096,)]),
    "matvec_f32": (_case_f32("matvec_f32"), [(1024, 1024)]),
    "qmatvec_job": (_case_qmatvec, [(4096, 4096)]),
    "qmatmul_job": (_case_qmatmul, [(64, 4096, 4096)]),
    "matmul_f32_nt_job": (_case_matmul_f32("nt"), ATTENTION_SHAPES["nt"][1:]),
    "matmul_f32_nn_job": (_case_matmul_f32("nn"), ATTENTION_SHAPES["nn"][1:]),
}
# Pool jobs (Checked.jobs) are tuned at run time: threads taking part and items per claim. Each
# job reuses its kernel's case and is called as the hosts call it (pool.job_call).
CHUNKS = (8, 32, 128, 512)


def job_variants() -> list[dict[str, int]]:
    """threads 1 .. this machine's cores x CHUNKS, the pool API's default (all threads) first."""
    cores = os.cpu_count() or 1
    return [{"threads": t, "chunk": c} for t in range(cores, 0, -1) for c in CHUNKS]


def threaded(checked: Checked, kernel: str) -> int:
    """The thread count `kernel`'s variants are also timed at, on its pool job in wasmtime: every
    core, as pages and the Pool run it; 0 on one core or for a kernel with no job. Why: a tile's
    speed on one thread does not rank it on two (relaxed Q8_0 qmatmul 2 x 1 ran 1.29-1.60x faster
    on two threads than on one, 2 x 2 1.83-2.07x, Zen 4, 64 and 256 x 1536 x 384), and the
    single-thread picks left relaxed SIMD's Q8_0 GEMM on 2 x 1 (all types) and 4 x 1 (MiniLM's
    Q8_0-only build), which pages run on two threads."""
    cores = os.cpu_count() or 1
    return cores if cores > 1 and any(j.name == kernel for j in checked.jobs.values()) else 0


MAX_SHAPE_VALUES = 2**28  # a tuning case's f32 weights fill 1 GiB at this size


def shape_values(dims: tuple[int, ...]) -> int:
    """Values a case of this shape holds: n (a vector), n x k (a matrix), and for a matrix product
    m x n x k its operands and result, m k + n k + m n (not the m n k multiply-adds)."""
    if len(dims) == 3:
        m, n, k = dims
        return m * k + n * k + m * n
    return math.prod(dims)


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"shape {text!r}: write N, NxK or MxNxK, e.g. 4096x4096") from None
    if not dims or any(d <= 0 for d in dims):
        raise ValueError(f"shape {text!r}: dimensions must be positive")
    if shape_values(dims) > MAX_SHAPE_VALUES:
        raise ValueError(f"shape {text!r}: {shape_values(dims)} values; at most {MAX_SHAPE_VALUES} "
                         "(the module's memory holds at most 2 GiB)")
    return dims


# ---- the tuner -------------------------------------------------------------------------------------


@dataclass
class Plan:
    kernel: str
    quant: str | None
    shape: tuple[int, ...]
    tune: dict[str, int]
    engine: str = WASMTIME
    threads: int = 1  # more: timed on the kernel's pool job on that many threads (threaded)


def variant_table(checked: Checked, target: str, kernel: str, tune: dict[str, int], records: list[Record] | None,
                  tune_host: dict | None = None) -> dict[str, dict[str, int]]:
    """The tune table a variant is built with: `tune` for `kernel` in every quant type (a pool job:
    none of its own), every other kernel at what the build would pick from `records` for
    `tune_host` (build.choose_tune; declared defaults without records). Why: a kernel can read
    another's tune value (qmatmul's tiles take qmatvec.accs, its summation order), so a variant
    is timed as the build would run it, not with the other kernel's declared default."""
    values, _ = choose_tune(checked, target, None, records, tune_host)
    mine = {kernel, *(tune_key(kernel, q) for q in checked.quants)}
    table = {name: v for name, v in values.items() if name not in mine}
    if kernel not in checked.jobs:
        table[kernel] = tune
    return table


def run_case(source: str, checked: Checked, target: str, kernel: str, quant: str | None, shape: tuple[int, ...],
             tune: dict[str, int], min_batch: float = 0.02, samples: int = 5,
             engine: str = WASMTIME, records: list[Record] | None = None, threads: int = 1) -> tuple[float | None, str]:
    """run_cases for one variant: (seconds per call, status)."""
    return run_cases(source, checked, target, kernel, quant, shape, [tune], min_batch, samples, engine, records,
                     threads)[0]


# The most memory the variants timed in turn hold together (a layered case: about 1 GB each); more
# are timed in as many turns, each within it.
TOGETHER_BYTES = 4 << 30


@dataclass
class _Ready:
    """A variant built and verified in wasmtime, waiting for its turn: `batch(reps)` runs it reps
    times, on this thread (timed by its CPU time) or on `pool` (by the wall clock; run_cases
    closes it after the last turn)."""
    batch: Callable[[int], object]
    nbytes: int
    pool: Pool | None = None


def run_cases(source: str, checked: Checked, target: str, kernel: str, quant: str | None, shape: tuple[int, ...],
              tunes: list[dict[str, int]], min_batch: float = 0.02, samples: int = 5, engine: str = WASMTIME,
              records: list[Record] | None = None, threads: int = 1) -> list[tuple[float | None, str]]:
    """Build each variant of `tunes` (variant_table: the other kernels as the build picks them from
    `records`), verify it once under wasmtime, then time it inside wasm on `engine` (wasmtime, or
    V8 on a copy of the verified memory: not pool jobs), or with `threads` > 1 its pool job in
    wasmtime on that many threads: (seconds per call, status) each. The variants of one call in
    wasmtime on one thread are loaded together and timed in turn (timing.measure_together), up to
    TOGETHER_BYTES of memory at a time, and so are those on a pool, each with its own pool; V8's
    one after another."""
    if layered(kernel, shape) and engine != WASMTIME:
        raise ValueError(f"{kernel} at {'x'.join(map(str, shape))}: a layered shape is timed in wasmtime only,"
                         f" not {engine}")
    if threads > 1 and engine != WASMTIME:
        raise ValueError(f"{kernel} on {threads} threads: timed in wasmtime only, not {engine}")
    results: dict[int, tuple[float | None, str]] = {}
    waiting: list[tuple[int, _Ready]] = []
    try:
        for i, tune in enumerate(tunes):
            got = _prepare(source, checked, target, kernel, quant, shape, tune, min_batch, samples, engine, records,
                           threads)
            if isinstance(got, tuple):
                results[i] = got
                continue
            if waiting and sum(r.nbytes for _, r in waiting) + got.nbytes > TOGETHER_BYTES:
                results.update(_in_turn(waiting, min_batch, samples))
                _close(waiting)
                waiting = []
            waiting.append((i, got))
        results.update(_in_turn(waiting, min_batch, samples))
    finally:
        _close(waiting)
    return [results[i] for i in range(len(tunes))]


def _close(waiting: list[tuple[int, _Ready]]) -> None:
    for _, r in waiting:
        if r.pool is not None:
            r.pool.close()


def _prepare(source: str, checked: Checked, target: str, kernel: str, quant: str | None, shape: tuple[int, ...],
             tune: dict[str, int], min_batch: float, samples: int, engine: str, records: list[Record] | None,
             threads: int) -> _Ready | tuple[float | None, str]:
    """One variant of run_cases built and verified: ready for its turn in wasmtime (on its pool
    with `threads` > 1 or for a pool job: `tune`'s threads and chunk), or its result (a failure; a
    V8 timing, which runs where it is made)."""
    maker, _ = SPECS[kernel]
    # Only the type timed is built (a kernel of no type: the first declared, the least a build holds):
    # the other types' code is most of a build's time and none of the timed call's. Their picks
    # (another kernel's, from `records`) leave the table with them: a build refuses tune values of a
    # type it leaves out.
    one = quant or next(iter(checked.quants))
    others = {tune_key(k, q) for k in [*checked.kernels, *checked.jobs] for q in checked.quants if q != one}
    table = {k: v for k, v in variant_table(checked, target, kernel, tune, records).items() if k not in others}
    (built,) = compile_source(source + (POOL_REPEAT if threads > 1 or kernel in checked.jobs
                                        else repeat_source(checked, kernel)),
                              targets=(target,), tune=table, flavors=False, quants=(one,))
    k = from_built(built)
    case = maker(k, quant, shape, np.random.default_rng(0))
    try:
        if threads > 1 or kernel in checked.jobs:
            job = kernel if threads > 1 else checked.jobs[kernel].name
            pooled = {"threads": threads} if threads > 1 else tune
            pool, batch = open_job(k, k.export_name(job, quant), case.args, pooled["threads"], pooled.get("chunk"),
                                   case.layers)
            with contextlib.ExitStack() as unless_ready:  # the pool is closed here unless it is handed on
                unless_ready.callback(pool.close)
                problem = case.verify(None)
                if problem:
                    return None, f"failed: wrong results ({problem})"
                unless_ready.pop_all()
            return _Ready(batch, k.module.memory.data_len(), pool)
        export = k.export_name(kernel, quant)
        problem = case.verify([k.call(export, *a) for a in case.layers or [case.args]][-1])
        if problem:
            return None, f"failed: wrong results ({problem})"
        bench = variant_name(repeat_name(kernel), quant, {})
        if engine != WASMTIME:
            try:
                timing = measure_v8(built.wasm, k, bench, list(case.args), min_batch, samples, in_browser(engine))
            except KernelgenError as e:  # Node or Chromium stopped or hung on this variant: the others still count
                return None, f"failed: in {engine} ({e})"
            return _result(timing.seconds, timing.reps)
    except (wasmtime.Trap, wasmtime.WasmtimeError) as e:
        return None, _trapped(e)
    if case.layers:  # one call per matrix, from Python: 30-60 us against a matrix's milliseconds
        layers = case.layers
        return _Ready(lambda reps: [k.call(export, *a) for _ in range(reps) for a in layers], k.module.memory.data_len())
    args = case.args
    return _Ready(lambda reps: k.call(bench, reps, *args), k.module.memory.data_len())


def _in_turn(waiting: list[tuple[int, _Ready]], min_batch: float, samples: int) -> dict[int, tuple[float | None, str]]:
    """Time the ready variants in turn; if one traps, each alone, so that only its own result fails."""
    if not waiting:
        return {}
    try:
        timings = measure_together([r.batch for _, r in waiting], min_batch, samples,  # one case: all on pools or none
                                   thread_time=waiting[0][1].pool is None)
    except (wasmtime.Trap, wasmtime.WasmtimeError) as e:
        if len(waiting) == 1:
            return {waiting[0][0]: (None, _trapped(e))}
        return {i: v for one in waiting for i, v in _in_turn([one], min_batch, samples).items()}
    return {i: _result(t.seconds, t.reps) for (i, _), t in zip(waiting, timings)}


def _trapped(e: Exception) -> str:
    return f"failed: trapped ({str(e).splitlines()[0]})"


def _result(seconds: float, reps: int) -> tuple[float | None, str]:
    if not seconds > 0:  # a store keeps positive times only (store.Record), and a pick divides by them
        return None, f"failed: {reps} calls per batch timed at {seconds} s (the clock did not advance)"
    return seconds, "ok"


def engine_names(engine: str) -> list[str]:
    """The engines (Record.engine) --engine names (timing.ENGINES): wasmtime, V8 through Node, V8 in
    Chromium, or a set of them."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: one of {', '.join(ENGINES)}")
    return [WASMTIME if e == "wasmtime" else engine_name(browser=e == "chromium") for e in ENGINES[engine]]


def _fits(checked: Checked, quant: str | None, shape: tuple[int, ...]) -> bool:
    """Whether rows of `shape` (K, the last dimension) are whole blocks of `quant`."""
    return quant is None or shape[-1] % checked.quants[quant].block == 0


def cache_note(checked: Checked, plans: list[Plan], llc: dict[str, int] | None = None) -> str | None:
    """A note when the mat-vec shape meant to read DRAM (QMATVEC_SHAPES' last) fits this machine's
    last-level cache (`llc`: caches() by level) for every type planned at it: the picks are then
    made on cache-resident weights, while decoding reads them from DRAM, where more rows at once
    can win (relaxed SIMD Q4_K, Q5_K, Q6_K qmatvec rows 4 ran 1.05-1.14x their rows 2 picks on 48
    matrices of 4096x4096, a Xeon with a 300 MB L3 that held 8192x8192)."""
    big = QMATVEC_SHAPES[-1]
    quants = {p.quant for p in plans if p.kernel == "qmatvec" and p.shape == big}
    last = last_level(caches() if llc is None else llc)
    if not quants or last is None:
        return None
    level, size = last
    most = max(math.prod(big) * checked.quants[q].stored_bytes // checked.quants[q].block for q in quants)
    if most > size:
        return None
    return (f"note: {'x'.join(map(str, big))} (at most {most / 2**20:.0f} MB of weights) fits this machine's {level}"
            f" cache ({size / 2**20:.0f} MB): qmatvec's picks here are made on weights in cache; decoding reads"
            f" them from DRAM, where more rows at once can win (--shape LAYERSx4096x4096 with more layers times that)")


def unfit_cases(checked: Checked, kernels: list[str], shapes: dict[str, list[tuple[int, ...]]],
                quants: list[str] | None) -> list[str]:
    """The "kernel type shape" cases asked for whose rows are not whole blocks of the type (the
    default qmatmul shape with K = 384 holds no 256-value super-block): tune leaves them out. A
    ValueError if no case is left, before anything is timed."""
    unfit, left = [], False
    for kernel in kernels:
        generic = (checked.jobs.get(kernel) or checked.kernels[kernel]).ast.generics
        for q in (quants or list(checked.quants)) if generic else [None]:
            for shape in shapes.get(kernel) or SPECS[kernel][1]:
                if layered(kernel, shape):
                    qf = checked.quants[q]
                    check_case_bytes(f"{kernel} {q} {'x'.join(map(str, shape))}",
                                     math.prod(shape) // qf.block * qf.stored_bytes, "weights")
                if _fits(checked, q, shape):
                    left = True
                else:
                    unfit.append(f"{kernel} {q} {'x'.join(map(str, shape))}")
    if unfit and not left:
        raise ValueError(f"no shape asked for fits the quant types asked for: K (the last dimension) must be a"
                         f" multiple of the type's block ({', '.join(unfit)})")
    return unfit


def tune(source: str, targets: Iterable[str], kernels: list[str], shapes: dict[str, list[tuple[int, ...]]],
         quants: list[str] | None, store: Path, budget: float, strategy: str = "exhaustive", seed: int = 0,
         retime: int = 3, out=sys.stderr, remeasure: bool = False, engine: str = "wasmtime") -> list[Record]:
    """Tune `kernels` on `targets`, timed on `engine` (timing.ENGINES; pool jobs in wasmtime only: their
    threads are the Python host's); every result is appended to `store` as it comes. What `store`
    already holds for this host and DSL is skipped, unless `remeasure` or its timing is of code the
    compiler no longer emits (fingerprint)."""
    checked = check(parse(source))
    me = host()
    engines = engine_names(engine)
    stored = load_store(store)
    hash_of = functools.cache(functools.partial(kernel_hash, checked))  # 1-2 ms each: once per kernel and type
    done: dict[tuple, set[str | None]] = {}  # what the store times for this host and source -> the code it ran
    for r in [] if remeasure else stored:
        if r.host == me and r.dsl_hash == hash_of(r.kernel, r.quant):
            done.setdefault((r.kernel, r.quant, r.target, r.shape, json.dumps(r.tune, sort_keys=True), r.engine,
                             r.threads), set()).add(r.code)
    # The shapes beyond the defaults that this host's timings of the current source hold, per kernel,
    # type and target, each with the (engine, threads) it was timed in: a pick compares only variants
    # timed on every shape (store.compare), so where some variants were timed on one (an old default,
    # a run cut short) the others are timed there too, in those engines, or they stay out of the pick
    # (simd128 Q4_0 and five other types were left on rows 1 by rows 1's 8192x8192 timings).
    elsewhere: dict[tuple, dict[tuple[int, ...], set[tuple[str, int]]]] = {}
    for r in stored:
        if r.host == me and r.dsl_hash == hash_of(r.kernel, r.quant) and r.kernel in kernels and r.kernel not in shapes:
            try:
                shape = parse_shape(r.shape)
            except ValueError:  # a line another version wrote: it cannot be timed again
                continue
            if shape not in SPECS[r.kernel][1]:
                at = elsewhere.setdefault((r.kernel, r.quant, r.target), {})
                at.setdefault(shape, set()).add((r.engine, r.threads))
    stored = usable(stored, checked)  # what the build would read: the other kernels' picks (variant_table)
    unfit = unfit_cases(checked, kernels, shapes, quants)
    plans: list[tuple[str, Plan]] = []
    extras: set[tuple] = set()  # (target, kernel, quant, shape) of those shapes
    for target in targets:
        for kernel in kernels:
            kinfo = checked.jobs.get(kernel) or checked.kernels[kernel]
            qs = (quants or list(checked.quants)) if kinfo.ast.generics else [None]
            for q in qs:
                extra = elsewhere.get((kernel, q, target), {})
                extras.update((target, kernel, q, s) for s in extra)
                for shape in shapes.get(kernel) or SPECS[kernel][1] + sorted(extra):
                    if not _fits(checked, q, shape):
                        continue
                    if shape in extra:
                        runs = sorted(extra[shape])
                    else:
                        alone = kernel in checked.jobs or layered(kernel, shape)  # wasmtime only
                        runs = [(e, 1) for e in ([WASMTIME] if alone else engines)]
                        if WASMTIME in dict(runs) and threaded(checked, kernel):
                            runs.append((WASMTIME, threaded(checked, kernel)))
                    for e, n in runs:  # a case's variants next to each other: run_cases times them in turn
                        plans += [(target, Plan(kernel, q, shape, t, e, n))
                                  for t in (job_variants() if kernel in checked.jobs else variants(checked, kernel))]
    if unfit:
        print(f"not timed, their rows not whole blocks of the type: {', '.join(unfit)}", file=out)
    if note := cache_note(checked, [p for _, p in plans]):
        print(note, file=out)

    def key(target: str, p: Plan) -> tuple:
        return (p.kernel, p.quant, target, "x".join(map(str, p.shape)), json.dumps(p.tune, sort_keys=True), p.engine,
                p.threads)

    code = Code(checked)  # each timing's fingerprint: what `kernelgen prune` tells stale timings by

    def timed(target: str, p: Plan) -> bool:
        """Whether the store times p's code already (a timing from before fingerprints counts; one of
        code the compiler no longer emits does not)."""
        codes = done.get(key(target, p))
        return bool(codes) and (None in codes or code.fingerprint(target, p.kernel, p.quant, p.tune, p.threads) in codes)

    completed = dict.fromkeys(f"{t} {p.kernel}{' ' + p.quant if p.quant else ''} {'x'.join(map(str, p.shape))}"
                              for t, p in plans if (t, p.kernel, p.quant, p.shape) in extras and not timed(t, p))
    if completed:
        print(f"also timed where the store times other variants (a pick compares those timed on every shape):"
              f" {', '.join(completed)}", file=out)
    if all(timed(t, p) for t, p in plans):
        print(f"nothing to do: all {len(plans)} variant(s) asked for are already recorded in {store} for this"
              f" host and kernel source; pass --remeasure to time them again", file=out)
        return []
    def case(tp: tuple[str, Plan]) -> tuple:
        target, p = tp
        return target, p.kernel, p.quant, p.shape, p.engine, p.threads

    cases = [list(group) for _, group in itertools.groupby(plans, key=case)]
    if strategy == "random":  # the cases in a random order, and each one's variants
        rng = random.Random(seed)
        rng.shuffle(cases)
        for c in cases:
            rng.shuffle(c)
    elif strategy != "exhaustive":
        raise ValueError(f"unknown strategy {strategy!r}: exhaustive or random")
    new: list[Record] = []
    start, begun = time.monotonic(), 0
    try:
        for c in cases:
            target, p0 = c[0]
            todo = [p for _, p in c if not timed(target, p)]
            begun += len(c)
            if not todo:
                continue
            if time.monotonic() - start > budget:
                print(f"\ntime budget of {budget:.0f} s used; {len(plans) - begun + len(c)} variant(s) left", file=out)
                break
            shape = "x".join(map(str, p0.shape))
            name = variant_name(p0.kernel, p0.quant, {})
            where = (f" in {p0.engine}" if p0.engine != WASMTIME else "") + (f" on {p0.threads} threads" if p0.threads > 1 else "")
            print(f"\r[{begun}/{len(plans)}] {target} {name} {shape}{where}: {len(todo)} variant(s) ...".ljust(79), end="",
                  file=out, flush=True)
            results = run_cases(source, checked, target, p0.kernel, p0.quant, p0.shape, [p.tune for p in todo],
                                engine=p0.engine, records=stored + new, threads=p0.threads)
            for p, (seconds, status) in zip(todo, results):
                rec = Record(p.kernel, p.quant, target, shape, hash_of(p.kernel, p.quant), me, p.tune, seconds, status,
                             engine=p.engine, threads=p.threads,
                             code=code.fingerprint(target, p.kernel, p.quant, p.tune, p.threads))
                append_record(store, rec)
                new.append(rec)
        new += _retime_best(source, checked, new, store, retime, out, stored)
    except KeyboardInterrupt:
        print(f"\ninterrupted: {len(new)} result(s) kept in {store}", file=out)
    finally:
        _LAYERS.clear()  # a layered case's planes (up to CASE_MAX_BYTES) outlive no run
    print(file=out)
    return new


def _retime_best(source: str, checked: Checked, recs: list[Record], store: Path, n: int, out,
                 stored: list[Record]) -> list[Record]:
    """Time the best few of each (kernel, quant, target, shape, engine, threads) again before the pick."""
    groups: dict[tuple, list[Record]] = {}
    for r in recs:
        if r.seconds is not None:
            groups.setdefault((r.kernel, r.quant, r.target, r.shape, r.engine, r.threads), []).append(r)
    again = []
    for (kernel, quant, target, shape, engine, threads), rs in groups.items():
        best = sorted(rs, key=lambda r: r.seconds)[:n]
        if not best:
            continue
        print(f"\rre-timing {target} {variant_name(kernel, quant, {})} {shape} {engine} x{threads}: {len(best)} variant(s)"
              .ljust(79), end="", file=out, flush=True)
        results = run_cases(source, checked, target, kernel, quant, parse_shape(shape), [r.tune for r in best],
                            engine=engine, records=stored + recs, threads=threads)
        for r, (seconds, status) in zip(best, results):
            rec = Record(kernel, quant, target, shape, r.dsl_hash, r.host, r.tune, seconds, status, retimed=True,
                         engine=engine, threads=threads, code=r.code)
            append_record(store, rec)
            again.append(rec)
    return again


def plot(records: list[Record], path: Path) -> None:
    """Bar charts of a tuning run: per (target, kernel, quant, shape), each variant's latest time,
    failed variants marked. Needs matplotlib (`pip install 'kernelgen[plot]'`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, dict[str, float | None]] = {}
    for r in sorted(records, key=lambda r: r.when):
        name = "_".join(f"{k}{v}" for k, v in r.tune.items()) or "default"
        groups.setdefault((r.target, r.kernel, r.quant, r.shape), {})[name] = r.seconds
    fig, axes = plt.subplots(len(groups), 1, figsize=(8, 2.2 * max(1, len(groups))), squeeze=False)
    for ax, ((target, kernel, quant, shape), times) in zip(axes[:, 0], groups.items()):
        names = list(times)
        values = [(times[n] or 0) * 1e6 for n in names]
        bars = ax.barh(names, values, color=["tab:blue" if times[n] else "tab:red" for n in names])
        best = min((v for v in values if v > 0), default=0)
        for bar, v in zip(bars, values):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                    f" {v:.1f} us" + (" (best)" if v == best else "") if v else " failed", va="center", fontsize=8)
        ax.set_title(f"{kernel}{'_' + quant if quant else ''} {shape} on {target}", fontsize=9)
        ax.set_xlabel("us per call (median)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
