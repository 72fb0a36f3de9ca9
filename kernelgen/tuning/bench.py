"""`kernelgen bench`: the library's speed on this machine, as a table a reader can check.

The bench is three small tables of data, read by one loop:

- `CASES`: the rows. Each case is timed on each benched target (or once, for a numpy baseline)
  by one protocol, `timing.measure_together`: repetitions inside wasm (or a Python loop for numpy)
  grown until a batch lasts 20 ms, a warm-up batch, the median of 5 batches. The rows a ratio
  compares (joined through the ratios: `_groups`) are prepared together and their batches timed in
  turn, each round one batch of each, so the drift of a shared host falls on both sides alike;
  cases on more than one core, or on a pool, are timed alone (`Case.alone`).
- `RATIOS`: how many times faster one printed row is than another printed row (their rates, work
  per second: rows of one shape compare by time, a matrix product against mat-vec or a roofline
  by what each does per second), with the goal the project set for it, if any.
- `LIMITS`: goals on one row's value (seconds per call) or on a figure of the build (seconds to
  build, wasm bytes).

`--repeat N` runs the whole table N times; every cell then shows min/median/max over the runs, and
a goal is judged on the median. Adding a row or a goal is one entry in these tables.

`--engine node` (or `both`) runs the mat-vec and GEMM cases again in Node (V8) through the JS
runtime (`bench_rows.mjs`), as rows on the targets "simd128 node" and "relaxed-simd node";
`--engine chromium` (or `all`) runs them in a page of headless Chromium, whose V8 is the one
browsers ship (rows "<target> chromium"). A case names its timing there with `node`. `plot` draws
the mat-vec rows as a roofline chart.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..host.api import Kernels, padded_rows
from ..compiler.build import TARGET_NAMES, Built, compile_source, from_built
from ..errors import KernelgenError
from ..compiler.check import check
from ..compiler.parse import parse
from ..host.pool import Pool, job_call
from .. import library
from ..names import variant_name
from .store import Record, caches, host, last_level
from .v8 import NODE_FLAGS, chromium_path, node_path, run_group
from .peer import SeedPeer
from .budget import CODE_BUDGET, dropped_text
from .size import BROTLI, GZIP, OTHER_CODE, QUANT_CODE, WASM, sizes
from .peer import wasm as peer_wasm
from .timing import (ENGINES as ENGINE_SETS, COMPUTE_SOURCE, POOL_REPEAT, ROOF_ACCS, ROOF_ITERS,
                     ROOF_OPS, STREAM_ALIGN, STREAM_CHUNK, STREAM_SOURCE, STREAM_WAYS, CASE_MAX_BYTES,
                     check_case_bytes, measure_together, open_job, repeat_name, repeat_source, roof_name, stopwatch,
                     stream_name)

NUMPY = "numpy"  # the target column of a numpy baseline
EVERY = "*"  # a ratio or limit that applies on every benched target
SAME = "="  # a ratio's versus row on the same target as its row
NODE = " node"  # suffix of a target run in Node (V8) through the JS runtime
CHROMIUM = " chromium"  # suffix of a target run in a page of headless Chromium through the JS runtime
# The engines beside wasmtime that run the cases naming a `node` timing: the target suffix of their
# rows, and the script that times them (bench_rows.mjs in Node, or in Chromium's page)
JS_ENGINES = {"node": (NODE, Path(__file__).with_name("node_bench.mjs")),
              "chromium": (CHROMIUM, Path(__file__).with_name("chromium_bench.mjs"))}
ENGINES = ENGINE_SETS["all"]


class Bench:
    """The modules the cases run on: one per target, built once with timing wrappers."""

    def __init__(self, source: str, targets: tuple[str, ...], records: list[Record] | None) -> None:
        self.source, self.records = source, records
        self.built = {b.target: b for b in bench_built(source, targets, records)}
        self.kernels = {t: from_built(b) for t, b in self.built.items()}


def bench_built(source: str, targets: tuple[str, ...], records: list[Record] | None) -> list[Built]:
    """The library plus the bench's wrappers: repeat loops, the streaming read and its pool job, the
    compute rooflines. Without the byte budget: each type's kernels are the store's picks, as a build
    of that type alone (`kernelgen build --quant TYPE`) makes them (a function's body follows from its
    name); what the all-types build gives up to its budget is in the report (Report.budget)."""
    checked = check(parse(source))
    extra = STREAM_SOURCE + COMPUTE_SOURCE + POOL_REPEAT + "".join(
        repeat_source(checked, k) for k in ("qmatvec", "qmatmul", "matmul_f32_nt", "matmul_f32_nn",
                                            "exp_f32", "softmax_f32"))
    return compile_source(source + extra, targets=targets, records=records, code_budget=None)


# (kernel, quant, shape, threads): how node_bench.mjs names a timing. Mat-vec kernels (MATVEC_KERNELS)
# have shape (rows, cols), the GEMMs (qmatmul, matmul_f32_nt, matmul_f32_nn; quant "" for f32) (m, n, k);
# a kernel name ending in " pool" is its job through the pool on `threads` threads, else the API call
# on the calling thread (threads 1).
NodeKey = tuple[str, str, tuple[int, ...], int]
MATVEC_KERNELS = ("qmatvec", "qmatvec pool", "seed", "stream")
POOL = " pool"
ROOFLINE = "roofline"  # (ROOFLINE, op, (iters,), 1): a compute roofline's loops (timing.ROOF_ACCS), the fastest


@dataclass(frozen=True)
class Case:
    """One row per benched target (or one numpy row): `prepare(kernels, stack)` makes its inputs
    and gives its Timer (the batches `run` times), `work` what one call does, in `unit`s (the rate
    column)."""

    name: str
    shape: str
    work: float
    unit: str
    prepare: Callable[[Kernels | None, ExitStack], "Timer"]
    numpy: bool = False  # a baseline: timed once, in Python, on no module
    node: NodeKey | None = None  # its timing in node_bench.mjs's output, for --engine node
    weights: tuple[str, int, int] | None = None  # (quant, rows, cols) a mat-vec case reads: the chart's x
    # Timed by itself, never in turn with other cases: it runs a pool (one per module), or on every
    # core (numpy's BLAS). Batches on every core slowed the one-thread batches timed in turn with
    # them by 1.1-1.3x (Zen 5, wasmtime, 4096x4096 Q8_0 qmatvec), which would flatter any ratio of
    # threads.
    alone: bool = False

    @property
    def key(self) -> str:
        return f"{self.name} {self.shape}".strip()


@dataclass(frozen=True)
class Ratio:
    """`row` (on `target`) is this many times faster than `versus` (on `versus_target`); both
    are printed rows. `at_least` is the project's goal for it."""

    row: str
    versus: str
    target: str = EVERY
    versus_target: str = SAME
    at_least: float | None = None


@dataclass(frozen=True)
class Limit:
    """A goal on a row's seconds per call, or on a figure of the build (`FIGURES`)."""

    of: str
    at_most: float
    target: str = EVERY


# ---- what is timed -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timer:
    """A case made ready to time: `calls`, each call(reps) running its kernel reps times (inside
    wasm where it can); the case's time is the fastest call's per-run median times `scale`. Several
    calls: alternatives of which the fastest counts (the streaming read's stream counts, a
    roofline's accumulator counts). `timed`: the calls return their batch's seconds themselves."""

    calls: tuple[Callable[[int], Any], ...]
    scale: float = 1.0
    timed: bool = False


def _job(k: Kernels, stack: ExitStack, export: str, args: list, threads: int, chunk: int | None = None) -> Callable[[int], Any]:
    """The batch of parallel `export` on a pool of `threads` (timing.open_job), the pool closed with `stack`."""
    pool, batch = open_job(k, export, args, threads, chunk)
    stack.enter_context(pool)
    return batch


def _python(fn: Callable[[], Any]) -> Callable[[int], Any]:
    """A batch of a Python callable (numpy baselines, one wasm call per layer): reps calls."""
    return lambda reps: [fn() for _ in range(reps)]


def _blocks(k: Kernels, quant: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random codes, every f16 field 0.01 and every byte field of the scale (an e8m0 exponent:
    MXFP4) the value whose scale is nearest 0.01 (node_bench.mjs's blocksOf makes the same). Random
    exponent bytes would make a scale of 2^-128 .. 2^127 per block: subnormal and infinite products,
    which x86 handles in microcode (MXFP4's rate was 0.67x Q4_0's with them, 0.87x without)."""
    q = k.quants[quant]
    raw = rng.integers(0, 256, (rows, cols // q.block * q.stored_bytes), dtype=np.uint8)
    blocks = raw.view(q.dtype).copy()
    for f in q.fields:
        if f.type == "f16":
            blocks[f.name] = np.float16(0.01)
    q.set_scale_bytes(blocks, 0.01)
    return blocks


def _packed_bytes(k: Kernels, quant: str, rows: int, cols: int) -> int:
    return k.quants[quant].packed_bytes(rows, cols)


def _filled(k: Kernels, nbytes: int) -> int:
    """A buffer written once: untouched pages all read one zero page, from cache."""
    addr = k.module.alloc(nbytes)
    k.module.view(addr, np.uint8, nbytes)[:] = 1
    return addr


# A case's timing, made ready: prepare(kernels, stack) makes its inputs and gives its Timer; what it
# opens (a pool) it enters in `stack`, which closes once its group is timed.
Prepare = Callable[[Kernels, ExitStack], Timer]


def stream(quant: str, rows: int, cols: int, layers: int = 1) -> Prepare:
    """A streaming read of as many bytes as `quant`'s packed rows x cols, the fastest of
    STREAM_WAYS interleaved streams: the memory roofline. `layers` > 1: as many buffers, read in
    turn with one call each, as qmatvec's layers are."""
    def prepare(k: Kernels, stack: ExitStack) -> Timer:
        nbytes = _packed_bytes(k, quant, rows, cols) // STREAM_ALIGN * STREAM_ALIGN
        if layers > 1:
            bufs = [_filled(k, nbytes) for _ in range(layers)]
            return Timer(tuple(_python(lambda w=ways: [k.call(stream_name(w), b, nbytes) for b in bufs]) for ways in STREAM_WAYS))
        buf = _filled(k, nbytes)
        return Timer(tuple((lambda reps, w=ways: k.call(stream_name(w) + "_repeat", reps, buf, nbytes)) for ways in STREAM_WAYS))
    return prepare


def qmatvec(quant: str, rows: int, cols: int, threads: int = 0, layers: int = 1) -> Prepare:
    """One mat-vec: the exported kernel, or (`threads` > 0) its job through the pool's par_for.
    `layers` > 1: as many distinct matrices, each mat-vec'd in turn (one call each), as decoding
    reads a model's layers: once they pass the last-level cache together, every matrix comes from
    DRAM, with its rows as near each other as one matrix's are (a single matrix that size puts a
    tile's row streams hundreds of MB apart)."""
    def prepare(k: Kernels, stack: ExitStack) -> Timer:
        rng = np.random.default_rng(1)
        if layers > 1:
            ws = [k.pack(quant, _blocks(k, quant, rows, cols, rng)) for _ in range(layers)]
            act = k.put_act(k.quantize_act(rng.standard_normal(cols).astype(np.float32)))
            y, fn = k.module.alloc(4 * rows), k.export_name("qmatvec", quant)
            calls = [[*w.args, *act, y, rows, cols] for w in ws]
            return Timer((_python(lambda: [k.call(fn, *a) for a in calls]),))
        w = k.pack(quant, _blocks(k, quant, rows, cols, rng))
        act = k.quantize_act(rng.standard_normal(cols).astype(np.float32))
        args = [*w.args, *k.put_act(act), k.module.alloc(4 * rows), rows, cols]
        if not threads:
            fn = variant_name(repeat_name("qmatvec"), quant, {})
            return Timer((lambda reps: k.call(fn, reps, *args),))
        return Timer((_job(k, stack, k.export_name("qmatvec", quant), args, threads, 16),))
    return prepare


def stream_pool(quant: str, rows: int, cols: int, threads: int) -> Prepare:
    """The streaming read of `quant`'s packed bytes on the pool on `threads`, the fastest of
    STREAM_WAYS streams per chunk."""
    def prepare(k: Kernels, stack: ExitStack) -> Timer:
        nbytes = _packed_bytes(k, quant, rows, cols)
        chunks = max(1, nbytes // STREAM_CHUNK)
        args = [_filled(k, chunks * STREAM_CHUNK), chunks * STREAM_CHUNK]
        pool = stack.enter_context(Pool(k, threads))
        batches = []
        for ways in STREAM_WAYS:  # every way's job reads the same two argument words
            export = stream_name(ways, pool=True)
            call = job_call(k.manifest, export, args)
            pool.call(export, args, 1)
            batches.append(lambda reps, i=pool.job_index(call.job), n=call.count: k.call("bench_par_for", reps, i, n, 1))
        return Timer(tuple(batches), scale=nbytes / (chunks * STREAM_CHUNK))
    return prepare


def seed(rows: int, cols: int) -> Prepare:
    """The seed-style hand-written Q8_0 kernel (peer.py) on the planes qmatvec q8_0 reads, checked
    against numpy before it is timed."""
    def prepare(k: Kernels, stack: ExitStack) -> Timer:
        rng = np.random.default_rng(1)
        w = k.pack("q8_0", _blocks(k, "q8_0", rows, cols, rng))
        x = rng.standard_normal(cols).astype(np.float32)
        peer = SeedPeer.on(k)
        args, ref = peer.prepare(w, x)
        peer.check(args, ref)
        return Timer((peer.repeat(args),))
    return prepare


def roofline(op: str) -> Prepare:
    """The register-only loops of `op` ("idot" or "madd"): seconds per ROOF_ITERS x ROOF_OPS ops of
    the fastest accumulator count (timing.ROOF_ACCS)."""
    seed = 1 if op == "idot" else 1.0

    def prepare(k: Kernels, stack: ExitStack) -> Timer:
        return Timer(tuple((lambda reps, a=accs: k.call(roof_name(op, a), reps * ROOF_ITERS, seed)) for accs in ROOF_ACCS))
    return prepare


def qmatmul(quant: str, m: int, n: int, kk: int, threads: int = 0) -> Prepare:
    """Y[m, n] = A[m, kk] W[n, kk]^T: the exported kernel, or (`threads` > 0) its job."""
    def prepare(k: Kernels, stack: ExitStack) -> Timer:
        rng = np.random.default_rng(4)
        w = k.pack(quant, _blocks(k, quant, n, kk, rng))
        act = k.quantize_act(rng.standard_normal((m, kk)).astype(np.float32))
        args = [*w.args, *k.put_act(act), k.module.alloc(4 * m * n), m, n, kk]
        if threads:
            return Timer((_job(k, stack, k.export_name("qmatmul", quant), args, threads),))
        fn = variant_name(repeat_name("qmatmul"), quant, {})
        return Timer((lambda reps: k.call(fn, reps, *args),))
    return prepare


def _f32_operands(form: str, m: int, n: int, kk: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    a = rng.standard_normal((m, kk)).astype(np.float32)
    return a, rng.standard_normal((n, kk) if form == "nt" else (kk, n)).astype(np.float32)


def matmul_f32(form: str, m: int, n: int, kk: int, threads: int = 0) -> Prepare:
    """y[m, n] = a b^T (form "nt", scores) or a b ("nn", P V)."""
    def prepare(k: Kernels, stack: ExitStack) -> Timer:
        a, b = _f32_operands(form, m, n, kk)
        args = [k.module.put(a), k.module.put(b), k.module.alloc(4 * m * n), m, n, kk]
        if threads:
            return Timer((_job(k, stack, k.export_name(f"matmul_f32_{form}"), args, threads),))
        return Timer((lambda reps: k.call(repeat_name(f"matmul_f32_{form}"), reps, *args),))
    return prepare


def numpy_matmul(form: str, m: int, n: int, kk: int) -> Prepare:
    """numpy's float32 matmul (its BLAS, on every core it uses) on the same shape."""
    def prepare(_: None, stack: ExitStack) -> Timer:
        a, b = _f32_operands(form, m, n, kk)
        bt = b.T if form == "nt" else b
        y = np.empty((m, n), np.float32)
        return Timer((_python(lambda: np.matmul(a, bt, out=y)),))
    return prepare


def empty_job(threads: int) -> Prepare:
    """par_for over no items: the pool's dispatch cost."""
    def prepare(k: Kernels, stack: ExitStack) -> Timer:
        pool = stack.enter_context(Pool(k, threads))
        index = pool.job_index(k.manifest["exports"][k.export_name("qmatvec", "q8_0")]["parallel"]["job"])
        return Timer((lambda reps: k.call("bench_par_for", reps, index, 0, 1),))
    return prepare


EXP_N = 1 << 20
SOFTMAX_ROWS, SOFTMAX_COLS = 64, 4096


def _exp_input() -> np.ndarray:
    return np.random.default_rng(2).standard_normal(EXP_N).astype(np.float32) * 10


def _softmax_input() -> np.ndarray:
    return padded_rows(np.random.default_rng(3).standard_normal((SOFTMAX_ROWS, SOFTMAX_COLS)).astype(np.float32))


def exp_f32(k: Kernels, stack: ExitStack) -> Timer:
    x = _exp_input()
    px, py = k.module.put(x, pad=16), k.module.alloc(x.nbytes + 16)
    return Timer((lambda reps: k.call(repeat_name("exp_f32"), reps, px, py, x.size),))


def numpy_exp(_: None, stack: ExitStack) -> Timer:
    x = _exp_input()
    y = np.empty_like(x)
    return Timer((_python(lambda: np.exp(x, out=y)),))


def softmax_f32(k: Kernels, stack: ExitStack) -> Timer:
    ps = k.module.put(_softmax_input())
    return Timer((lambda reps: k.call(repeat_name("softmax_f32"), reps, ps, SOFTMAX_ROWS, SOFTMAX_COLS, SOFTMAX_COLS),))


def numpy_softmax(_: None, stack: ExitStack) -> Timer:
    """Row by row, as a caller with one row at a time would."""
    xs = _softmax_input()[:, :SOFTMAX_COLS]

    def rows() -> None:
        for row in xs:
            e = np.exp(row - row.max())
            e / e.sum()
    return Timer((_python(rows),))


# ---- the tables ----------------------------------------------------------------------------------

MATVEC_SHAPES = ((256, 4096), (4096, 4096), (8192, 8192))  # the last one's weights come from DRAM (see caches)
BIG = (8192, 8192)
# issue 13's types (and Q5_0, Q4_K_M's fallback for Q4_K; Q3_K, Q2_K and IQ4_XS, declared since), each against Q4_0's
# time per weight at an L2-resident shape (goal: within 1.3x) and the K-quants against Q8_0's
# weights/s at BIG, where they move fewer bytes (goals 1.7x, 1.25x)
GGUF_TYPES = ("q5_0", "q5_1", "iq4_nl", "mxfp4", "q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "iq4_xs")
TYPES_SHAPE = (256, 4096)
K_QUANT_GOAL = {"q4_k": 1.7, "q6_k": 1.25}


def _matvec_cases() -> list[Case]:
    """For each shape: the streaming read of q8_0's packed bytes, the seed-style peer, qmatvec q8_0;
    q4_0 and the pool on one and two threads at BIG."""
    out = []
    for r, c in MATVEC_SHAPES:
        shape, n = f"{r}x{c}", r * c
        out += [Case("stream of q8_0's packed bytes", shape, n, "weights", stream("q8_0", r, c), node=("stream", "q8_0", (r, c), 1), weights=("q8_0", r, c)),
                Case("seed-style q8_0 (hand-written)", shape, n, "weights", seed(r, c), node=("seed", "q8_0", (r, c), 1), weights=("q8_0", r, c)),
                Case("qmatvec q8_0", shape, n, "weights", qmatvec("q8_0", r, c), node=("qmatvec", "q8_0", (r, c), 1), weights=("q8_0", r, c))]
    r, c = BIG
    shape, n = f"{r}x{c}", r * c
    out += [Case("stream of q4_0's packed bytes", shape, n, "weights", stream("q4_0", r, c), node=("stream", "q4_0", BIG, 1), weights=("q4_0", r, c)),
            Case("qmatvec q4_0", shape, n, "weights", qmatvec("q4_0", r, c), node=("qmatvec", "q4_0", BIG, 1), weights=("q4_0", r, c))]
    # (no Node rows at BIG: the JS pack of 64M values is the slow part of such a row)
    out += [Case(f"qmatvec {q}", shape, n, "weights", qmatvec(q, r, c), weights=(q, r, c)) for q in K_QUANT_GOAL]
    r, c = TYPES_SHAPE
    out += [Case(f"qmatvec {q}", f"{r}x{c}", r * c, "weights", qmatvec(q, r, c), node=("qmatvec", q, TYPES_SHAPE, 1),
                 weights=(q, r, c)) for q in ("q4_0", *GGUF_TYPES)]
    r, c = BIG
    for threads in (1, 2):
        t = f"{threads} thread{'s' if threads > 1 else ''}"
        out += [Case(f"qmatvec q8_0 pool, {t}", shape, n, "weights", qmatvec("q8_0", r, c, threads),
                     node=("qmatvec pool", "q8_0", BIG, threads), weights=("q8_0", r, c), alone=True),
                Case(f"stream pool, {t}", shape, n, "weights", stream_pool("q8_0", r, c, threads),
                     node=("stream", "q8_0", BIG, threads), weights=("q8_0", r, c), alone=True)]
    return out


# the goals' types, Q5_K, Q3_K and Q2_K (the types of Q5_K_M, Q3_K_* and Q2_K files, no goal)
DRAM_TYPES = ("q8_0", "q4_0", *K_QUANT_GOAL, "q5_k", "q3_k", "q2_k")
Q8_0_PACKED = 36 / 32  # bytes per weight of packed Q8_0: 32 int8 codes and an f32 scale per block


def dram_table(rows: int, cols: int, layers: int = 1, cores: int | None = None) -> tuple[list[Case], list[Ratio]]:
    """The decode goals that assume weights from DRAM, at a shape of the caller's choosing
    (`kernelgen bench --dram [LAYERSx]RxC`): where a last-level cache holds BIG's weights (the
    report's note), a shape beyond it measures what a model's mat-vecs read at every token. The
    streaming read of Q8_0's bytes and qmatvec of DRAM_TYPES, in wasmtime (the weights are packed in
    numpy: packing a few hundred MB in JS would take minutes a row). With `layers`, as many
    matrices of RxC are read in turn (qmatvec's `layers`), one call each, the streaming read too.
    With `cores` > 1 (default: this machine's), the same reads on the pool on every core, as a
    model decodes, against Q8_0's (no goals: issue 13's are one thread's), over one matrix of the
    layers' rows (the same bytes; each thread's tiles stream within SLAB_ROWS windows, as in one
    layer): the more of DRAM's rate the cores use together, the more a type's rate follows its
    packed bytes per weight."""
    if cores is not None and not (isinstance(cores, int) and not isinstance(cores, bool) and cores > 0):
        raise ValueError(f"dram_table: cores must be a positive int, not {cores!r}")
    if not all(isinstance(x, int) and x > 0 for x in (rows, cols, layers)) or cols % 256:
        raise ValueError(f"--dram {layers}x{rows}x{cols}: layers, rows and columns must be positive, the columns a "
                         f"multiple of 256 (a K-quant super-block)")
    shape = f"{rows}x{cols}" if layers == 1 else f"{layers} layers of {rows}x{cols}"
    n = layers * rows * cols
    check_case_bytes(f"--dram {shape}", n * Q8_0_PACKED, "packed Q8_0")
    stream_row, row = f"stream of q8_0's packed bytes {shape}", lambda q: f"qmatvec {q} {shape}"
    cases = [Case("stream of q8_0's packed bytes", shape, n, "weights", stream("q8_0", rows, cols, layers),
                  weights=("q8_0", layers * rows, cols)),
             *(Case(f"qmatvec {q}", shape, n, "weights", qmatvec(q, rows, cols, layers=layers),
                    weights=(q, layers * rows, cols)) for q in DRAM_TYPES)]

    def versus_q8_0(row: Callable[[str], str], goals: bool) -> list[Ratio]:
        return [Ratio(row(q), row("q8_0"), at_least=(Q4_0_GOAL if q == "q4_0" else K_QUANT_GOAL.get(q)) if goals else None)
                for q in DRAM_TYPES if q != "q8_0"]

    ratios = [*(Ratio(row("q8_0"), stream_row, t, at_least=DRAM_ROOFLINE_GOAL if t == "relaxed-simd" else None)
                for t in TARGET_NAMES), *versus_q8_0(row, goals=True)]
    if cores is None:
        cores = os.cpu_count() or 1
    if cores > 1:
        pool = f"pool, {cores} threads"
        stream_pool_row, pool_row = f"stream {pool} {shape}", lambda q: f"qmatvec {q} {pool} {shape}"
        cases += [Case(f"stream {pool}", shape, n, "weights", stream_pool("q8_0", layers * rows, cols, cores),
                       weights=("q8_0", layers * rows, cols), alone=True),
                  *(Case(f"qmatvec {q} {pool}", shape, n, "weights", qmatvec(q, layers * rows, cols, cores),
                         weights=(q, layers * rows, cols), alone=True) for q in DRAM_TYPES)]
        ratios += [Ratio(pool_row("q8_0"), stream_pool_row), *versus_q8_0(pool_row, goals=False)]
    return cases, ratios


# Prefill and attention shapes, m x n x k: qmatmul's m tokens, n rows of W, row length k (Y = A W^T),
# and attention at T = 128 tokens with head size 32 and 64: scores Q K^T (form "nt") is
# 128 x 128 x head, out P V ("nn") is 128 x head x 128.
# The work of a matrix product is its multiply-adds (MACs); a roofline call does ROOF_ITERS x
# ROOF_OPS vector operations of 16 (integer dot) or 4 (f32 madd) MACs each.
PREFILL = ((64, 4096, 4096), (64, 1536, 384))
T = 128
ATTENTION = {(form, head): (T, T, head) if form == "nt" else (T, head, T) for form in ("nt", "nn") for head in (32, 64)}


def _mnk(m: int, n: int, kk: int) -> str:
    return f"{m}x{n}x{kk}"


PREFILL_CASES: list[Case] = [
    Case("integer dot roofline (registers)", "", ROOF_ITERS * ROOF_OPS * 16, "MACs", roofline("idot"),
         node=(ROOFLINE, "idot", (ROOF_ITERS,), 1)),
    Case("f32 madd roofline (registers)", "", ROOF_ITERS * ROOF_OPS * 4, "MACs", roofline("madd"),
         node=(ROOFLINE, "madd", (ROOF_ITERS,), 1)),
    *(Case(f"qmatmul {q}{label}", _mnk(m, n, kk), m * n * kk, "MACs", qmatmul(q, m, n, kk, threads),
           node=("qmatmul" + (POOL if threads else ""), q, (m, n, kk), max(threads, 1)), alone=threads > 0)
      for q in ("q8_0", "q4_0") for m, n, kk in PREFILL
      for label, threads in (("", 0), (" pool, 1 thread", 1), (" pool, 2 threads", 2))),
    *(Case("numpy f32 matmul A W^T", _mnk(m, n, kk), m * n * kk, "MACs", numpy_matmul("nt", m, n, kk), numpy=True,
         alone=True)
      for m, n, kk in PREFILL),
    *(Case(f"matmul_f32_{form}{label}", _mnk(m, n, kk), m * n * kk, "MACs", matmul_f32(form, m, n, kk, threads),
           node=(f"matmul_f32_{form}" + (POOL if threads else ""), "", (m, n, kk), max(threads, 1)), alone=threads > 0)
      for (form, _), (m, n, kk) in ATTENTION.items() for label, threads in (("", 0), (" pool, 2 threads", 2))),
    *(Case(f"numpy f32 matmul {form}", _mnk(m, n, kk), m * n * kk, "MACs", numpy_matmul(form, m, n, kk), numpy=True,
         alone=True)
      for (form, _), (m, n, kk) in ATTENTION.items()),
]

CASES: list[Case] = [
    *_matvec_cases(),
    Case("empty pool job, 2 threads", "", 1, "jobs", empty_job(2), alone=True),
    *PREFILL_CASES,
    Case("exp_f32", "2^20", EXP_N, "elements", exp_f32),
    Case("np.exp", "2^20", EXP_N, "elements", numpy_exp, numpy=True),
    Case("softmax_f32", f"{SOFTMAX_ROWS}x{SOFTMAX_COLS}", SOFTMAX_ROWS * SOFTMAX_COLS, "elements", softmax_f32),
    Case("numpy softmax by row", f"{SOFTMAX_ROWS}x{SOFTMAX_COLS}", SOFTMAX_ROWS * SOFTMAX_COLS, "elements",
         numpy_softmax, numpy=True),
]

# issue 12's goals, each on wasmtime and in Node: qmatvec q8_0 against the seed-style kernel, and
# against the streaming read of its bytes (relaxed SIMD)
PEER_GOAL = {"simd128": 1.15, "relaxed-simd": 1.2}
DRAM_ROOFLINE_GOAL = 0.80  # relaxed Q8_0 qmatvec against the streaming read, weights from DRAM
ROOFLINE_GOAL = {"4096x4096": 0.60, f"{BIG[0]}x{BIG[1]}": DRAM_ROOFLINE_GOAL}
Q4_0_GOAL = 1.6  # qmatvec q4_0 against q8_0 weights/s, weights from DRAM (it moves 0.53x the bytes)


def _on_each_engine(ratio: Ratio) -> list[Ratio]:
    """A ratio of named targets on wasmtime's and on each JS engine's (both its rows in one engine)."""
    return [replace(ratio, target=ratio.target + e,
                    versus_target=ratio.versus_target if ratio.versus_target in (SAME, NUMPY) else ratio.versus_target + e)
            for e in ("", *(suffix for suffix, _ in JS_ENGINES.values()))]


def _matvec_ratios() -> list[Ratio]:
    out = []
    for r, c in MATVEC_SHAPES:
        shape = f"{r}x{c}"
        for t in TARGET_NAMES:
            out.append(Ratio(f"qmatvec q8_0 {shape}", f"seed-style q8_0 (hand-written) {shape}", t,
                             at_least=PEER_GOAL[t] if (r, c) != BIG else None))
            out.append(Ratio(f"qmatvec q8_0 {shape}", f"stream of q8_0's packed bytes {shape}", t,
                             at_least=ROOFLINE_GOAL.get(shape) if t == "relaxed-simd" else None))
    return [on[i] for i in range(1 + len(JS_ENGINES)) for on in map(_on_each_engine, out)]  # by engine


_BIG = _mnk(*PREFILL[0])
PREFILL_RATIOS: list[Ratio] = [
    *(e for r in (Ratio(f"qmatmul q8_0 {_BIG}", "integer dot roofline (registers)", "simd128"),
                  Ratio(f"qmatmul q8_0 {_BIG}", "integer dot roofline (registers)", "relaxed-simd", at_least=0.60),
                  Ratio(f"qmatmul q8_0 {_BIG}", "qmatvec q8_0 4096x4096", "simd128"),
                  Ratio(f"qmatmul q8_0 {_BIG}", "qmatvec q8_0 4096x4096", "relaxed-simd", at_least=4.0),
                  Ratio(f"qmatmul q8_0 {_BIG}", f"qmatmul q8_0 {_BIG}", "relaxed-simd", "simd128", at_least=1.5))
      for e in _on_each_engine(r)),
    Ratio(f"qmatmul q4_0 {_BIG}", f"qmatmul q8_0 {_BIG}"),
    *(Ratio(f"qmatmul {q} pool, 2 threads {_mnk(*s)}", f"qmatmul {q} pool, 1 thread {_mnk(*s)}",
            at_least=1.8 if (q, s) == ("q8_0", PREFILL[0]) else None) for q in ("q8_0", "q4_0") for s in PREFILL),
    *(Ratio(f"qmatmul q8_0 {_mnk(*s)}", f"numpy f32 matmul A W^T {_mnk(*s)}", versus_target=NUMPY) for s in PREFILL),
    *(Ratio(f"matmul_f32_{form} {_mnk(*s)}", "f32 madd roofline (registers)", at_least=0.50 if head == 64 else None)
      for (form, head), s in ATTENTION.items()),
    *(Ratio(f"matmul_f32_{form} pool, 2 threads {_mnk(*s)}", f"matmul_f32_{form} {_mnk(*s)}")
      for (form, _), s in ATTENTION.items()),
    *(Ratio(f"matmul_f32_{form} {_mnk(*s)}", f"numpy f32 matmul {form} {_mnk(*s)}", versus_target=NUMPY)
      for (form, _), s in ATTENTION.items()),
]

RATIOS: list[Ratio] = [
    *_matvec_ratios(),
    *_on_each_engine(Ratio("qmatvec q8_0 4096x4096", "qmatvec q8_0 4096x4096", "relaxed-simd", "simd128")),
    *_on_each_engine(Ratio("qmatvec q8_0 256x4096", "qmatvec q8_0 256x4096", "relaxed-simd", "simd128", at_least=1.4)),
    Ratio("qmatvec q4_0 8192x8192", "qmatvec q8_0 8192x8192", at_least=Q4_0_GOAL),
    *(Ratio(f"qmatvec {q} 8192x8192", "qmatvec q8_0 8192x8192", at_least=goal) for q, goal in K_QUANT_GOAL.items()),
    *(Ratio(f"qmatvec {q} 256x4096", "qmatvec q4_0 256x4096", at_least=1 / 1.3) for q in GGUF_TYPES),
    Ratio("qmatvec q8_0 pool, 2 threads 8192x8192", "qmatvec q8_0 pool, 1 thread 8192x8192", at_least=1.8),
    Ratio("stream pool, 2 threads 8192x8192", "stream pool, 1 thread 8192x8192"),
    *PREFILL_RATIOS,
    Ratio("exp_f32 2^20", "np.exp 2^20", versus_target=NUMPY, at_least=1.0),
    Ratio("softmax_f32 64x4096", "numpy softmax by row 64x4096", versus_target=NUMPY, at_least=1.5),
]

# Figures of the build, measured once per run: (name, unit). The module's size, raw and compressed,
# and the bytes of its function bodies split by feature (size.py): the instances of kernels generic
# over a quant type (mat-vec and GEMM tiles for every declared type), each quant type's share, and
# everything else (f32, activations, pool). The per-type rows are added for the types the DSL declares.
FIGURES = {"build all targets": "s", WASM: "bytes", GZIP: "bytes", BROTLI: "bytes", QUANT_CODE: "bytes",
           OTHER_CODE: "bytes"}

LIMITS: list[Limit] = [
    Limit("empty pool job, 2 threads", 5e-6),
    Limit("build all targets", 3.0, "-"),
    Limit(QUANT_CODE, CODE_BUDGET),  # issue 13: ten quant types' kernels in 32 KB (the build keeps to it)
    Limit(OTHER_CODE, 16384),  # the library's first limit, for what it held then and has since gained
    Limit(WASM, CODE_BUDGET + 16384 + 2048),  # both, and 2 KB of types, exports and globals
]


# ---- running and reporting -----------------------------------------------------------------------


@dataclass
class Cell:
    """One figure over the runs: every sample, and the summary the table prints."""

    samples: list[float] = field(default_factory=list)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)


@dataclass
class Row:
    """A printed row: `value` is seconds per call (cases) or the figure's unit (figures)."""

    key: str
    target: str
    value: Cell
    work: float = 0.0
    unit: str = ""
    figure: bool = False
    nbytes: int = 0  # bytes of weights one call reads (mat-vec rows): the roofline chart's x


@dataclass
class RatioRow:
    """A ratio per run: row's rate (work per second) over versus's."""

    row: Row
    versus: Row
    value: Cell
    at_least: float | None

    @property
    def met(self) -> bool | None:
        return None if self.at_least is None else self.value.median >= self.at_least


@dataclass
class LimitRow:
    row: Row
    at_most: float

    @property
    def met(self) -> bool:
        return self.row.value.median <= self.at_most


@dataclass
class Report:
    rows: list[Row]
    ratios: list[RatioRow]
    limits: list[LimitRow]
    repeat: int
    # What ran it (store.host(): CPU model and ISA features, cores, versions; "node" and "chromium":
    # the version of each that ran) and the 1-minute load average before and after: on a shared
    # machine whose CPU changes between sessions, a figure means nothing without them.
    machine: dict = field(default_factory=dict)
    # Per target, the picks the default all-types build leaves out for its byte budget (the manifest's
    # tune.budget.dropped: variant left out and its speedup); the rows time them as single-type builds do.
    budget: dict[str, dict] = field(default_factory=dict)


def _targets_of(case: Case, targets: tuple[str, ...]) -> tuple[str, ...]:
    return (NUMPY,) if case.numpy else targets


def run(source: str, targets: tuple[str, ...] = TARGET_NAMES, records: list[Record] | None = None,
        repeat: int = 1, progress: Callable[[str], None] = lambda s: None,
        cases: list[Case] | None = None, ratios: list[Ratio] | None = None,
        limits: list[Limit] | None = None, engines: tuple[str, ...] = ("wasmtime",)) -> Report:
    """Time every case on every target `repeat` times (the whole table per run), then the ratios
    and limits from the same runs. `engines`: some of ENGINES (wasmtime, and node or chromium: the
    cases that name a `node` timing, on the targets "<target> node" or "<target> chromium")."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if not engines or set(engines) - set(ENGINES):
        raise ValueError(f"engines must be some of {', '.join(ENGINES)}, got {engines}")
    cases = CASES if cases is None else cases
    ratios = RATIOS if ratios is None else ratios
    limits = LIMITS if limits is None else limits
    machine = {**host(), "caches": caches(), "load": [round(os.getloadavg()[0], 2)]}
    budget: dict[str, dict] = {}
    bench = Bench(source, targets, records)
    wasm_targets = targets if "wasmtime" in engines else ()
    js_targets = {t + JS_ENGINES[e][0]: (e, t) for e in ENGINES[1:] if e in engines for t in targets}
    node_targets = tuple(js_targets)
    node_cases = [c for c in cases if c.node is not None]
    rows: dict[tuple[str, str], Row] = {}
    for c in cases:
        on = [*_targets_of(c, wasm_targets), *(node_targets if c.node is not None else ())]
        for t in on:
            nbytes = _packed_bytes(bench.kernels[js_targets.get(t, (0, t))[1]], *c.weights) if c.weights else 0
            rows[(c.key, t)] = Row(c.key, t, Cell(), c.work, c.unit, nbytes=nbytes)
    for name, unit in FIGURES.items():  # (each quant type's row is added by the first run's build)
        for t in (("-",) if unit == "s" else targets):
            rows[(name, t)] = Row(name, t, Cell(), unit=unit, figure=True)
    timed = [(c, t) for c in cases for t in _targets_of(c, wasm_targets)]
    groups = _groups(timed, ratios, {*wasm_targets, NUMPY}, bench)
    for i in range(repeat):
        for group in groups:
            more = f" and {len(group) - 1} more in turn" if len(group) > 1 else ""
            progress(f"run {i + 1}/{repeat}: {group[0][0].key} {group[0][1]}{more}")
            for (c, t), seconds in zip(group, _time_group(group, bench)):
                rows[(c.key, t)].value.samples.append(seconds)
        for t, (engine, target) in js_targets.items():
            progress(f"run {i + 1}/{repeat}: the mat-vec and GEMM cases in {t}")
            named, times = js_timings(bench.built[target], [c.node for c in node_cases], engine=engine)
            machine[engine] = max(named, machine.get(engine, ""), key=len)  # the one naming a flavor, if any
            for c in node_cases:
                rows[(c.key, t)].value.samples.append(times[c.node])
        progress(f"run {i + 1}/{repeat}: build")
        t0 = time.perf_counter()
        built = compile_source(source, records=records)
        rows[("build all targets", "-")].value.samples.append(time.perf_counter() - t0)
        for b in built:
            if b.target not in targets:
                continue
            budget[b.target] = b.manifest["tune"].get("budget", {}).get("dropped", {})
            for name, size in sizes(b).figures().items():
                row = rows.setdefault((name, b.target), Row(name, b.target, Cell(), unit="bytes", figure=True))
                row.value.samples.append(float(size))
    benched = {*wasm_targets, *node_targets, NUMPY, "-"}
    out_ratios = []
    for r in ratios:
        for t in ((*wasm_targets, *node_targets) if r.target == EVERY else (r.target,)):
            vt = t if r.versus_target == SAME else r.versus_target
            if not {t, vt} <= benched:
                continue  # a target not benched in this run
            if t in node_targets and not {(r.row, t), (r.versus, vt)} <= rows.keys():
                continue  # Node and Chromium run the mat-vec and GEMM cases only
            a, b = _row(rows, r.row, t), _row(rows, r.versus, vt)
            cell = Cell([(a.work / x) / (b.work / y) for x, y in zip(a.value.samples, b.value.samples)])
            out_ratios.append(RatioRow(a, b, cell, r.at_least))
    out_limits = []
    for lim in limits:
        for t in (sorted({t for key, t in rows if key == lim.of}) if lim.target == EVERY else (lim.target,)):
            if t in benched:
                out_limits.append(LimitRow(_row(rows, lim.of, t), lim.at_most))
    machine["load"].append(round(os.getloadavg()[0], 2))
    return Report(list(rows.values()), out_ratios, out_limits, repeat, machine, budget)


GROUP_BYTES = CASE_MAX_BYTES  # a group's weights in one module at most: larger groups are timed in parts


def _groups(timed: list[tuple[Case, str]], ratios: list[Ratio], targets: set[str], bench: Bench) -> list[list[tuple[Case, str]]]:
    """The (case, target)s of `timed` in groups whose batches are timed in turn: the rows each
    ratio compares (on the benched `targets`) end in one group, so the drift of a shared host over
    minutes falls on both alike. In the order of `timed`; a group whose weights pass GROUP_BYTES
    in one module is timed in parts of at most that (its ratios across parts: one after another)."""
    index = {(c.key, t): i for i, (c, t) in enumerate(timed)}
    parent = list(range(len(timed)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    for r in ratios:
        for t in (sorted(targets - {NUMPY}) if r.target == EVERY else (r.target,)):
            a, b = index.get((r.row, t)), index.get((r.versus, t if r.versus_target == SAME else r.versus_target))
            if a is not None and b is not None:
                parent[root(a)] = root(b)
    whole: dict[int | tuple[int], list[tuple[Case, str]]] = {}
    for i, member in enumerate(timed):
        whole.setdefault((i,) if member[0].alone else root(i), []).append(member)
    out = []
    for members in whole.values():
        used: dict[str, int] = {}
        out.append([])
        for c, t in members:
            nbytes = _packed_bytes(bench.kernels[t], *c.weights) if c.weights and t != NUMPY else 0
            if out[-1] and used.get(t, 0) + nbytes > GROUP_BYTES:
                out.append([])
                used = {}
            used[t] = used.get(t, 0) + nbytes
            out[-1].append((c, t))
    return out


def _time_group(group: list[tuple[Case, str]], bench: Bench) -> list[float]:
    """Seconds per call of each (case, target) of `group`: every case prepared, then all their
    batches timed in turn (timing.measure_together); the modules reset after."""
    used = {bench.kernels[t] for c, t in group if not c.numpy}
    try:
        with ExitStack() as stack:
            timers = [c.prepare(None if c.numpy else bench.kernels[t], stack) for c, t in group]
            calls = [call if timer.timed else stopwatch(call) for timer in timers for call in timer.calls]
            timings = iter(measure_together(calls, timed_by_call=True))
            return [min(next(timings).seconds for _ in timer.calls) * timer.scale for timer in timers]
    finally:
        for k in used:
            k.reset()


def js_timings(built: Built, keys: list[NodeKey], min_ms: float = 300,
               engine: str = "node") -> tuple[str, dict[NodeKey, float]]:
    """Time `keys` through the JS runtime on `built` (a bench module) in `engine` (JS_ENGINES: V8 in
    Node, or in a page of headless Chromium): (engine and version, and the flavor of `built` the
    runtime chose, if any; seconds per call by key). A q8_0 mat-vec shape times the seed-style peer
    too, checked against qmatvec first; a "qmatvec pool" key
    runs its shape on the pool's one and two threads. A GEMM key's case is timed on the calling
    thread and on the pool's thread counts its keys name."""
    if engine not in JS_ENGINES:
        raise ValueError(f"engine {engine!r}: one of {', '.join(JS_ENGINES)}")
    node = node_path()
    chromium = str(chromium_path()) if engine == "chromium" else None
    matvec = [key for key in keys if key[0] in MATVEC_KERNELS]
    roofs = sorted({(op, shape[0]) for kernel, op, shape, _ in keys if kernel == ROOFLINE})
    shapes = list(dict.fromkeys((q, shape) for _, q, shape, _ in matvec))
    pooled = {(q, shape) for kernel, q, shape, _ in matvec if kernel == "qmatvec pool"}
    gemms: dict[tuple[str, str, tuple[int, ...]], set[int]] = {}
    for kernel, q, shape, threads in keys:
        if kernel not in (*MATVEC_KERNELS, ROOFLINE):
            pool = gemms.setdefault((kernel.removesuffix(POOL), q, shape), set())
            if kernel.endswith(POOL):
                pool.add(threads)
    with tempfile.TemporaryDirectory(prefix="kernelgen-bench-") as tmp:
        for path, data in built.files().items():  # and its flavors: the runtime loads the one that suits
            Path(tmp, path).parent.mkdir(parents=True, exist_ok=True)
            Path(tmp, path).write_bytes(data)
        Path(tmp, "seed.wasm").write_bytes(peer_wasm())
        config = {"out": Path(tmp).as_uri() + "/", "target": built.target, "seed": Path(tmp, "seed.wasm").as_uri(),
                  "minMs": min_ms, "streams": [stream_name(ways, pool=True) for ways in STREAM_WAYS],
                  "runtime": (library.runtime() / "kernelgen.mjs").as_uri(), "chromium": chromium,
                  "cases": [{"quant": q, "shape": list(shape), "twoThreads": (q, shape) in pooled} for q, shape in shapes],
                  "gemms": [{"kernel": kernel, "quant": q, "shape": list(shape), "pool": sorted(pool)}
                            for (kernel, q, shape), pool in gemms.items()],
                  "rooflines": [{"op": op, "iters": iters, "seed": 1, "exports": [roof_name(op, a) for a in ROOF_ACCS]}
                                for op, iters in roofs]}
        flags = NODE_FLAGS if engine == "node" else ()  # (Chromium gets its V8 flags from chromium_bench.mjs)
        code, stdout, stderr = run_group([node, *flags, str(JS_ENGINES[engine][1]), json.dumps(config)], JS_SECONDS)
    if code is None:
        raise KernelgenError(f"{engine} bench did not finish within {JS_SECONDS} s; stopped it")
    if code != 0:
        raise KernelgenError(f"{engine} bench failed: {stderr.strip()[-2000:]}")
    data = json.loads(stdout.strip().splitlines()[-1])
    times = {(r["kernel"], r["quant"], tuple(int(v) for v in r["shape"].split("x")), r["threads"]): r["seconds"]
             for r in data["rows"]}
    missing = [k for k in keys if k not in times]
    if missing:
        raise KernelgenError(f"{engine} bench did not time {missing}")
    flavor = f" running {built.target}'s {data['flavor']} flavor" if data.get("flavor") else ""
    return data["engine"] + flavor, times


JS_SECONDS = 3600  # one engine's run of every case: minutes in practice


def _row(rows: dict[tuple[str, str], Row], key: str, target: str) -> Row:
    """The row a ratio or limit names; a name that is not a row is a mistake in the tables."""
    try:
        return rows[(key, target)]
    except KeyError:
        raise KeyError(f"the bench has no row {key!r} on {target}; rows: "
                       f"{sorted({k for k, _ in rows})}") from None


def _rate(x: float, unit: str) -> str:
    """Per second, with an SI prefix: "21.33 k weights/s", "2.00 jobs/s"."""
    for scale, prefix in ((1e9, "G "), (1e6, "M "), (1e3, "k ")):
        if x >= scale:
            return f"{x / scale:.2f} {prefix}{unit}/s"
    return f"{x:.2f} {unit}/s"


def _time(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.2f} us"


def _value(row: Row, x: float) -> str:
    if not row.figure:
        return _time(x)
    return f"{x:.2f} s" if row.unit == "s" else f"{x:.0f} {row.unit}"


def _spread(cell: Cell, fmt: Callable[[float], str]) -> str:
    return "" if len(cell.samples) < 2 else f"[{fmt(cell.min)} .. {fmt(cell.max)}]"


def format_table(report: Report) -> str:
    """The rows, then the ratios (each naming two printed rows), then the limits."""
    n = report.repeat
    med = "median of " + str(n) + " runs [min .. max]" if n > 1 else "one run"
    w = max(len(r.key) for r in report.rows) + 2 if report.rows else 20
    lines = [*_machine_lines(report.machine), f"rows: time per call ({med})", f"  {'row':{w}}{'target':14}{'value':>12}  {'spread':28}{'rate':>18}"]
    for r in report.rows:
        rate = "" if r.figure else _rate(r.work / r.value.median, r.unit)
        lines.append(f"  {r.key:{w}}{r.target:14}{_value(r, r.value.median):>12}  "
                     f"{_spread(r.value, lambda x, r=r: _value(r, x)):28}{rate:>18}")
    lines += _cache_note(report)
    lines += ["", "ratios: how many times faster the row is than the versus row (both above)"]
    for q in report.ratios:
        goal = "" if q.at_least is None else f"  goal >= {q.at_least:.2f}x: {'met' if q.met else 'NOT met'}"
        lines.append(f"  {_name(q.row)} vs {_name(q.versus)}: {_ratio(q.value.median, q.at_least)}"
                     f" {_spread(q.value, _ratio)}".rstrip() + goal)
    lines += ["", "limits (on the median)"]
    for lim in report.limits:
        r = lim.row
        lines.append(f"  {_name(r)}: {_value(r, r.value.median)} <= {_value(r, lim.at_most)}: "
                     f"{'met' if lim.met else 'NOT met'}")
    if any(report.budget.values()):
        lines += ["", f"the rows time each type's picks (as `kernelgen build --quant TYPE` builds them); the default "
                      f"all-types build keeps to {CODE_BUDGET} bytes of quant code with the smallest variant of:"]
        lines += [f"  {t}: {dropped_text(dropped)}" for t, dropped in report.budget.items() if dropped]
    return "\n".join(lines)


def _mb(n: float) -> str:
    return f"{n / (1 << 20):.0f} MB" if n >= 1 << 20 else f"{n / (1 << 10):.0f} KB"


def _cache_note(report: Report) -> list[str]:
    """A warning when the shape meant to read DRAM (BIG) fits this machine's last-level cache: its
    rows then measure that cache, and its goals (issue 13: weights that do not fit it) are not tested."""
    llc = last_level(report.machine.get("caches", {}))
    big = f"{BIG[0]}x{BIG[1]}"
    fit = sorted({(r.nbytes, r.key.split()[1]) for r in report.rows if r.nbytes and r.key.endswith(big)
                  and r.key.startswith("qmatvec")})
    if llc is None or not fit or fit[-1][0] > llc[1]:
        return []
    return ["", f"note: the {big} rows are meant to read DRAM, but this machine's {llc[0]} cache ({_mb(llc[1])}) holds "
                f"every type's packed weights there (at most {_mb(fit[-1][0])}, {fit[-1][1]}): they measure that cache "
                f"(--dram ROWSxCOLS times the DRAM goals at a shape beyond it)"]


def _machine_lines(m: dict) -> list[str]:
    """One line naming the machine, its caches and its load, and a blank one, when the report knows them."""
    if not m:
        return []
    what = f"{m['cpu']} [{' '.join(m['isa']) or 'no SIMD flags read'}], {m['cores']} cores, wasmtime {m['wasmtime']}"
    if m.get("caches"):
        what += ", caches " + " ".join(f"{level} {_mb(n)}" for level, n in sorted(m["caches"].items()))
    # js_timings' engines: "node <version> (V8 <version>)", "chromium <version>"
    node = "".join(f", {m[e]}" for e in JS_ENGINES if e in m)
    load = " -> ".join(f"{x:.2f}" for x in m.get("load", []))
    return [f"machine: {what}{node}; load average {load}", ""]


def _name(row: Row) -> str:
    return f"{row.key} [{row.target}]"


def _ratio(x: float, goal: float | None = None) -> str:
    """x to two decimals; to as many more as tell it from `goal` when it falls short of it but would
    print as it (1.797 is "1.797x", not "1.80x", beside "goal >= 1.80x: NOT met")."""
    digits = 2
    while goal is not None and x < goal and f"{x:.{digits}f}" == f"{goal:.{digits}f}" and digits < 6:
        digits += 1
    return f"{x:.{digits}f}x"


def as_json(report: Report) -> dict:
    """Every sample and summary, for scripts: plain data."""
    def cell(c: Cell) -> dict:
        return {"samples": c.samples, "min": c.min, "median": c.median, "max": c.max}
    return {
        "repeat": report.repeat,
        "machine": report.machine,
        "budget": report.budget,
        "rows": [{**{k: v for k, v in asdict(r).items() if k != "value"}, **cell(r.value)} for r in report.rows],
        "ratios": [{"row": q.row.key, "target": q.row.target, "versus": q.versus.key,
                    "versus_target": q.versus.target, **cell(q.value), "at_least": q.at_least, "met": q.met}
                   for q in report.ratios],
        "limits": [{"of": lim.row.key, "target": lim.row.target, "median": lim.row.value.median,
                    "at_most": lim.at_most, "met": lim.met} for lim in report.limits],
    }


def plot(report: Report, path: Path) -> None:
    """The roofline chart of the mat-vec rows, one panel per target (and engine): each kernel a point
    at (ops per byte of weights, G ops/s), 2 ops per weight, under the ceilings measured in the same
    run: each streaming read as a line of slope bytes/s, and the panel's best mat-vec rate as the
    compute ceiling. Medians over the runs. Needs matplotlib (`pip install 'kernelgen[plot]'`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [r for r in report.rows if r.nbytes and r.value.samples]
    if not points:
        raise ValueError("no mat-vec rows to plot")
    panels = list(dict.fromkeys(r.target for r in points))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5.5), squeeze=False, sharey=True)
    intensity = {id(r): 2 * r.work / r.nbytes for r in points}
    lo, hi = min(intensity.values()) / 1.6, max(intensity.values()) * 1.6
    for ax, target in zip(axes[0], panels):
        mine = [r for r in points if r.target == target]
        for r in mine:
            if r.key.startswith("stream"):
                gbs = r.nbytes / r.value.median / 1e9
                ax.plot([lo, hi], [gbs * lo, gbs * hi], ":", linewidth=1,
                        label=f"{r.key.replace('stream of ', 'stream ')}: {gbs:.0f} GB/s")
        kernels = [r for r in mine if not r.key.startswith("stream")]
        best = max(2 * r.work / r.value.median / 1e9 for r in kernels)
        ax.axhline(best, linestyle="--", linewidth=1, color="grey", label=f"compute: best mat-vec, {best:.0f} G ops/s")
        for r in kernels:
            x, y = intensity[id(r)], 2 * r.work / r.value.median / 1e9
            peer = r.key.startswith("seed")
            ax.plot([x], [y], "s" if peer else "o", color="tab:grey" if peer else "tab:red", markersize=5)
            short = r.key.replace("qmatvec ", "").replace("seed-style q8_0 (hand-written)", "seed").replace(" pool,", "")
            ax.annotate(short, (x, y), textcoords="offset points", xytext=(4, 0), fontsize=6, va="center")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_title(target, fontsize=10)
        ax.set_xlabel("ops per byte of weights (2 per weight)")
        ax.legend(fontsize=6, loc="upper left")
    axes[0][0].set_ylabel("G ops/s")
    fig.suptitle("kernelgen mat-vec roofline (kernelgen bench; squares: the seed-style hand-written kernel)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
