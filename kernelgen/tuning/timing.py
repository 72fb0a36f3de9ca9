"""Timing kernels inside wasm, where a Python call's 30-60 us does not drown them.

For any exported kernel, `repeat_source` writes a DSL wrapper that calls it `reps` times in a loop
(generated from the kernel's own declaration, so it can never disagree with it), and
`STREAM_SOURCE` a streaming read of a buffer (the fastest of STREAM_WAYS interleaved streams): the
memory roofline the kernels are measured against. `measure` grows the repetitions until a batch
lasts `min_batch` seconds, runs a warm-up batch, then takes the median of `samples` batches.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..compiler import ast as A
from ..compiler.check import Checked
from ..host.pool import Pool, job_call

STREAM_CHUNK = 1 << 16  # bytes per item of the threaded streaming read
# --engine of kernelgen tune and bench: the engines each choice runs (Node's V8, or Chromium's: the
# one browsers ship; tune's pool jobs run in wasmtime whatever the choice)
ENGINES = {"wasmtime": ("wasmtime",), "node": ("node",), "chromium": ("chromium",), "both": ("wasmtime", "node"),
           "all": ("wasmtime", "node", "chromium")}
ENGINE_CHOICES = tuple(ENGINES)

# The streaming read runs as 1, 2, 4 or 8 interleaved streams (the buffer's parts read side by side,
# as a mat-vec tile reads its rows); the roofline is the fastest. One stream is not the most wasm can
# read: measured on an AVX2 EPYC (2 cores), 8192x8192 Q8_0 bytes read at 7.7-8.4 G weights/s as one
# stream and 10.3-13.4 as four, 4096x4096 at 10-12 and 19-23.
STREAM_WAYS = (1, 2, 4, 8)
STREAM_ALIGN = 32 * max(STREAM_WAYS)  # nbytes of every read is a multiple of this


def stream_name(ways: int, pool: bool = False) -> str:
    return f"bench_stream{ways}_chunks" if pool else f"bench_stream{ways}"


def _stream_source(ways: int) -> str:
    read, chunks = stream_name(ways), stream_name(ways, pool=True)
    return f"""
# nbytes (a multiple of {32 * ways}) read as {ways} interleaved stream(s), XOR-folding so nothing is skipped.
export kernel {read}(p: ptr, nbytes: i32) -> i32 {{
    var acc[{ways}]: i32x4 = i32x4.splat(0);
    let part = nbytes / {ways};
    for i in 0..part step 32 {{
        unroll u in 0..{ways} {{
            acc[u] = acc[u] ^ i32x4.load(p + u * part + i) ^ i32x4.load(p + u * part + i, 16);
        }}
    }}
    unroll u in 1..{ways} {{
        acc[0] = acc[0] ^ acc[u];
    }}
    return extract(acc[0], 0);
}}

export kernel {read}_repeat(reps: i32, p: ptr, nbytes: i32) -> i32 {{
    var x: i32 = 0;
    for rep in 0..reps {{
        x = x ^ {read}(p, nbytes);
    }}
    return x;
}}

# The same read on the thread pool: the nbytes at p in STREAM_CHUNK-byte chunks.
export kernel {chunks}(p: ptr, nbytes: i32) {{
    parallel chunks c0..c1 in 0..nbytes / STREAM_CHUNK;
    let x = {read}(p + c0 * STREAM_CHUNK, (c1 - c0) * STREAM_CHUNK);
}}
"""


STREAM_SOURCE = f"\nconst STREAM_CHUNK: i32 = {STREAM_CHUNK};\n" + "".join(_stream_source(w) for w in STREAM_WAYS)


# The compute rooflines the matrix products are measured against: the target's integer dot as its
# kernels use it (on relaxed SIMD idot7, the relaxed dot; on simd128 two i32x4.dot_i16x8_s per 16
# products on operands already i16 - idot7's simd128 register form adds four sign-extends, which
# Chromium 156 ran at 12 G MACs/s against Node 20's 19-21, below what its GEMMs reached) and the
# f32 multiply-add in registers only, as loops of ROOF_ACCS[u] independent accumulators. The fastest
# count is the roofline: too few leave the operation's latency exposed, too many spill. (Twelve dots
# with their seven operand vectors need 19 of x86-64's 16 vector registers: wasmtime's code then
# stores and reloads accumulators every iteration, and the relaxed dot measured 54 instead of 65 G
# MACs/s on an AVX-512 VNNI EPYC, where 6 accumulators reach one dot per cycle.) The dots' operands
# are a tile of w x a vectors that changes every iteration, as loaded vectors would (constant operands
# let the engine hoist the widening or the multiplies out of the loop); the multiply-adds are
# acc * x + y, nothing to hoist, with seed 1.0 every value stays 1.0. Every loop does ROOF_OPS
# operations per iteration-group, so one call of `iters` groups is the same work whatever the count.
ROOF_ITERS = 1000  # iteration-groups per timed call of a roofline loop
ROOF_OPS = 12  # operations per group: one iteration of 12 accumulators, two of 6, three of 4
ROOF_ACCS = {4: (2, 2), 6: (3, 2), 12: (3, 4)}  # accumulators -> the operand tile (w x a, or x x y)


def roof_name(op: str, accs: int) -> str:
    return f"bench_{op}_roof_{accs}"


def _roof_source(accs: int, nw: int, na: int) -> str:
    groups = ROOF_OPS // accs
    return f"""
export kernel {roof_name("idot", accs)}(iters: i32, seed: i32) -> i32 {{
    var acc[{accs}]: i32x4 = i32x4.splat(seed);
    var w[{nw}]: i8x16 = i8x16.splat(seed);
    var a[{na}]: i8x16 = i8x16.splat(seed + 1);
    for i in 0..iters * {groups} {{
        unroll u in 0..{accs} {{
            static if ACT_SPLIT == 1 {{
                acc[u] = acc[u] + pairsum(i16x8.bits(w[u % {nw}]), i16x8.bits(a[u / {nw}]))
                    + pairsum(i16x8.bits(w[(u + 1) % {nw}]), i16x8.bits(a[u / {nw}]));
            }} else {{
                acc[u] = idot7(acc[u], w[u % {nw}], a[u / {nw}]);
            }}
        }}
        unroll j in 0..{nw} {{
            w[j] = w[j] + i8x16.splat(1);
        }}
        unroll j in 0..{na} {{
            a[j] = a[j] + i8x16.splat(1);
        }}
    }}
    unroll u in 1..{accs} {{
        acc[0] = acc[0] ^ acc[u];
    }}
    return extract(acc[0], 0);
}}

export kernel {roof_name("madd", accs)}(iters: i32, seed: f32) -> f32 {{
    var acc[{accs}]: f32x4 = f32x4.splat(seed);
    var x[{nw}]: f32x4 = f32x4.splat(seed);
    var y[{na}]: f32x4 = f32x4.splat(seed - 1.0);
    for i in 0..iters * {groups} {{
        unroll u in 0..{accs} {{
            acc[u] = madd(acc[u], x[u % {nw}], y[u / {nw}]);
        }}
    }}
    unroll u in 1..{accs} {{
        acc[0] = acc[0] + acc[u];
    }}
    return hsum(acc[0]);
}}
"""


COMPUTE_SOURCE = "".join(_roof_source(accs, nw, na) for accs, (nw, na) in ROOF_ACCS.items())


MAX_REPS = 1 << 24
CASE_MAX_BYTES = 1 << 30  # weights a timed case puts in a module's memory at most: it holds 2 GiB


def check_case_bytes(subject: str, nbytes: float, what: str) -> None:
    """Refuse a case whose `nbytes` of `what` pass CASE_MAX_BYTES, before anything is made or timed."""
    if nbytes > CASE_MAX_BYTES:
        raise ValueError(f"{subject}: {nbytes / 2**20:.0f} MB of {what}; at most {CASE_MAX_BYTES >> 20} MB"
                         " (the module's memory holds 2 GiB)")

# The pool's par_for called reps times: a threaded job timed inside wasm.
POOL_REPEAT = """
export kernel bench_par_for(reps: i32, job: i32, count: i32, chunk: i32) {
    for rep in 0..reps {
        par_for(job, count, chunk);
    }
}
"""


def repeat_name(kernel: str) -> str:
    return f"bench_{kernel}"


def repeat_source(checked: Checked, kernel: str) -> str:
    """DSL for `export kernel bench_<kernel>[Q](reps: i32, <kernel's params>)` calling it reps times."""
    k: A.KernelDecl = checked.kernels[kernel].ast
    generics = f"[{', '.join(f'{g.name}: {g.kind}' for g in k.generics)}]" if k.generics else ""
    params = ", ".join(f"{p.name}: {'packed ' if p.packed else ''}{p.type}" for p in k.params)
    call_generics = f"[{', '.join(g.name for g in k.generics)}]" if k.generics else ""
    args = ", ".join(p.name for p in k.params)
    call = f"{kernel}{call_generics}({args})"
    body = f"let r = {call};" if k.ret else f"{call};"
    return (f"\nexport kernel {repeat_name(kernel)}{generics}(reps: i32{', ' if params else ''}{params}) {{\n"
            f"    for rep in 0..reps {{\n        {body}\n    }}\n}}\n")


@dataclass(frozen=True)
class Timing:
    seconds: float  # median time of one call
    samples: tuple[float, ...]
    reps: int


def measure(call: Any, min_batch: float = 0.02, samples: int = 5, thread_time: bool = False,
            timed_by_call: bool = False) -> Timing:
    """`call(reps)` runs the kernel reps times inside wasm; returns the median time per run.
    `thread_time`: count the calling thread's CPU time instead of the wall clock, for a call that
    runs only on this thread: on a machine other work shares, the time the thread waits for a core
    is then left out (the tuner's single-thread kernels; a pool job's helpers run on other threads).
    `timed_by_call`: `call` returns the seconds its batch took, measured where it ran (another
    process: v8.measure_v8)."""
    return measure_together([call], min_batch, samples, thread_time, timed_by_call)[0]


def stopwatch(call: Callable[[int], Any], now: Callable[[], float] | None = None) -> Callable[[int], float]:
    """`call` as a batch that returns the seconds it took by `now` (default: the wall clock, read
    when timed), measure_together's timed_by_call form: calls timed by different clocks, or by
    themselves, can then share a turn."""
    def timed(reps: int) -> float:
        clock = now or time.perf_counter
        t0 = clock()
        call(reps)
        return clock() - t0
    return timed


def measure_together(calls: Sequence[Any], min_batch: float = 0.02, samples: int = 5, thread_time: bool = False,
                     timed_by_call: bool = False) -> list[Timing]:
    """measure() for several calls, their batches taken in turn: each round times every call once,
    the next round starting one call later. Why: a shared host's speed drifts by up to 1.3x over
    minutes (Zen 3, stop 63), so variants timed one after another compare the drift as much as the
    code, while variants timed in turn share it (the tuner's variants of one case)."""
    if not timed_by_call:
        calls = [stopwatch(c, time.thread_time if thread_time else time.perf_counter) for c in calls]

    def sized(call: Any, reps: int) -> int:
        while True:
            dt = call(reps)
            if dt >= min_batch or reps >= MAX_REPS:
                return reps
            reps = min(MAX_REPS, max(reps * 2, int(reps * min_batch / max(dt, 1e-9) * 1.2)))

    reps = [sized(c, 1) for c in calls]
    while True:
        for c, n in zip(calls, reps):
            c(n)  # warm-up at the final size
        times: list[list[float]] = [[] for _ in calls]
        for r in range(samples):
            for i in (j % len(calls) for j in range(r, r + len(calls))):
                times[i].append(calls[i](reps[i]))
        # A first batch slowed by what only it pays (V8 compiling the module under load) can end the
        # sizing at batches shorter than the clock resolves: Chromium's page clock read 0 s. Size again.
        short = [i for i, t in enumerate(times) if statistics.median(t) < min_batch / 2 and reps[i] < MAX_REPS]
        if not short:
            break
        for i in short:
            reps[i] = sized(calls[i], min(MAX_REPS, reps[i] * 2))
    per_call = [tuple(t / n for t in ts) for ts, n in zip(times, reps)]
    return [Timing(statistics.median(p), p, n) for p, n in zip(per_call, reps)]


def open_job(k: Any, export: str, args: list, threads: int, chunk: int | None = None,
             layers: list[list] | None = None) -> tuple[Pool, Callable[[int], Any]]:
    """A pool of `threads` threads on k's module with parallel `export` run once on it (each of
    `layers`' argument lists in turn, `args` the last; this publishes the arguments), and
    batch(reps), which runs it reps times: inside wasm through POOL_REPEAT's bench_par_for, or
    with `layers` one call per matrix from Python. `chunk` items per claim (None:
    Pool.default_chunk). The caller closes the pool; helpers of a pool between batches sleep
    after SPIN_ROUNDS, so several pools can wait their turn side by side."""
    call = job_call(k.manifest, export, args)
    pool = Pool(k, threads)
    try:
        chunk = chunk or pool.default_chunk(call)
        for a in layers or [args]:
            pool.call(export, a, chunk)
        index = pool.job_index(call.job)
    except BaseException:
        pool.close()
        raise
    if layers:
        return pool, lambda reps: [pool.call(export, a, chunk) for _ in range(reps) for a in layers]
    return pool, lambda reps: k.call("bench_par_for", reps, index, call.count, chunk)
