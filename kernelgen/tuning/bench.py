"""`kernelgen bench`: the library's speed on this machine, as a table a reader can check.

The bench is three small tables of data, read by one loop:

- `CASES`: the rows. Each case is timed on each benched target (or once, for a numpy baseline)
  by one protocol, `timing.measure`: repetitions inside wasm (or a Python loop for numpy) grown
  until a batch lasts 20 ms, a warm-up batch, the median of 5 batches.
- `RATIOS`: how many times faster one printed row is than another printed row, with the goal the
  project set for it, if any.
- `LIMITS`: goals on one row's value (seconds per call) or on a figure of the build (seconds to
  build, wasm bytes).

`--repeat N` runs the whole table N times; every cell then shows min/median/max over the runs, and
a goal is judged on the median. Adding a row or a goal is one entry in these tables.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from ..host.api import Kernels, padded_rows
from ..compiler.build import TARGET_NAMES, compile_source, from_built
from ..compiler.check import check
from ..compiler.parse import parse
from ..host.pool import Pool
from ..names import variant_name
from .store import Record
from .timing import POOL_REPEAT, STREAM_SOURCE, measure, measure_python, repeat_name, repeat_source

NUMPY = "numpy"  # the target column of a numpy baseline
EVERY = "*"  # a ratio or limit that applies on every benched target
SAME = "="  # a ratio's versus row on the same target as its row


class Bench:
    """The modules the cases run on: one per target, built once with timing wrappers."""

    def __init__(self, source: str, targets: tuple[str, ...], records: list[Record] | None) -> None:
        self.source, self.records = source, records
        checked = check(parse(source))
        extra = STREAM_SOURCE + POOL_REPEAT + "".join(
            repeat_source(checked, k) for k in ("qmatvec", "exp_f32", "softmax_f32"))
        self.kernels = {b.target: from_built(b) for b in compile_source(source + extra, targets=targets,
                                                                         records=records)}


@dataclass(frozen=True)
class Case:
    """One row per benched target (or one numpy row): `time(kernels)` gives seconds per call,
    `work` what one call does, in `unit`s (the rate column)."""

    name: str
    shape: str
    work: float
    unit: str
    time: Callable[[Kernels | None], float]
    numpy: bool = False  # a baseline: timed once, in Python, on no module

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


def _blocks(k: Kernels, quant: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    q = k.quants[quant]
    raw = rng.integers(0, 256, (rows, cols // q.block * q.stored_bytes), dtype=np.uint8)
    blocks = raw.view(q.dtype).copy()
    blocks["d"] = np.float16(0.01)
    return blocks


def _packed_bytes(k: Kernels, quant: str, rows: int, cols: int) -> int:
    return sum(size for _, size in k.quants[quant].planes.values()) * rows * (cols // k.quants[quant].block)


def stream(quant: str, rows: int, cols: int) -> Callable[[Kernels], float]:
    """A streaming read of as many bytes as `quant`'s packed rows x cols: the memory roofline."""
    def run(k: Kernels) -> float:
        nbytes = _packed_bytes(k, quant, rows, cols) // 64 * 64
        buf = k.module.alloc(nbytes + 64)
        k.module.view(buf, np.uint8, nbytes)[:] = 1  # touched: untouched pages all read one zero page
        return measure(lambda reps: k.call("bench_stream_repeat", reps, buf, nbytes)).seconds
    return run


def qmatvec(quant: str, rows: int, cols: int, threads: int = 0) -> Callable[[Kernels], float]:
    """One mat-vec: the exported kernel, or (`threads` > 0) its job through the pool's par_for."""
    def run(k: Kernels) -> float:
        rng = np.random.default_rng(1)
        w = k.pack(quant, _blocks(k, quant, rows, cols, rng))
        act = k.quantize_act(rng.standard_normal(cols).astype(np.float32))
        aq, ad, y = k.module.put(act.q), k.module.put(act.d), k.module.alloc(4 * rows)
        if not threads:
            fn = variant_name(repeat_name("qmatvec"), quant, {})
            return measure(lambda reps: k.call(fn, reps, *w.args, aq, ad, y, rows, cols)).seconds
        with Pool(k, threads) as pool:
            job = k.job_name("qmatvec_job", quant)
            pool.run(job, rows, 16, [*w.args, aq, ad, y, cols])  # publishes the arguments
            index = pool.job_index(job)
            return measure(lambda reps: k.call("bench_par_for", reps, index, rows, 16)).seconds
    return run


def empty_job(threads: int) -> Callable[[Kernels], float]:
    """par_for over no items: the pool's dispatch cost."""
    def run(k: Kernels) -> float:
        with Pool(k, threads) as pool:
            index = pool.job_index(k.job_name("qmatvec_job", "q8_0"))
            return measure(lambda reps: k.call("bench_par_for", reps, index, 0, 1)).seconds
    return run


EXP_N = 1 << 20
SOFTMAX_ROWS, SOFTMAX_COLS = 64, 4096


def _exp_input() -> np.ndarray:
    return np.random.default_rng(2).standard_normal(EXP_N).astype(np.float32) * 10


def _softmax_input() -> np.ndarray:
    return padded_rows(np.random.default_rng(3).standard_normal((SOFTMAX_ROWS, SOFTMAX_COLS)).astype(np.float32))


def exp_f32(k: Kernels) -> float:
    x = _exp_input()
    px, py = k.module.put(x, pad=16), k.module.alloc(x.nbytes + 16)
    return measure(lambda reps: k.call(repeat_name("exp_f32"), reps, px, py, x.size)).seconds


def numpy_exp(_: None) -> float:
    x = _exp_input()
    y = np.empty_like(x)
    return measure_python(lambda: np.exp(x, out=y)).seconds


def softmax_f32(k: Kernels) -> float:
    ps = k.module.put(_softmax_input())
    return measure(lambda reps: k.call(repeat_name("softmax_f32"), reps, ps, SOFTMAX_ROWS, SOFTMAX_COLS,
                                        SOFTMAX_COLS)).seconds


def numpy_softmax(_: None) -> float:
    """Row by row, as a caller with one row at a time would."""
    xs = _softmax_input()[:, :SOFTMAX_COLS]

    def rows() -> None:
        for row in xs:
            e = np.exp(row - row.max())
            e / e.sum()
    return measure_python(rows).seconds


# ---- the tables ----------------------------------------------------------------------------------

CASES: list[Case] = [
    Case("stream of q8_0's packed bytes", "4096x4096", 4096 * 4096, "weights", stream("q8_0", 4096, 4096)),
    Case("qmatvec q8_0", "4096x4096", 4096 * 4096, "weights", qmatvec("q8_0", 4096, 4096)),
    Case("qmatvec q8_0", "256x4096", 256 * 4096, "weights", qmatvec("q8_0", 256, 4096)),
    Case("qmatvec q8_0", "8192x8192", 8192 * 8192, "weights", qmatvec("q8_0", 8192, 8192)),
    Case("qmatvec q4_0", "8192x8192", 8192 * 8192, "weights", qmatvec("q4_0", 8192, 8192)),
    Case("qmatvec q8_0 pool, 1 thread", "4096x4096", 4096 * 4096, "weights", qmatvec("q8_0", 4096, 4096, 1)),
    Case("qmatvec q8_0 pool, 2 threads", "4096x4096", 4096 * 4096, "weights", qmatvec("q8_0", 4096, 4096, 2)),
    Case("empty pool job, 2 threads", "", 1, "jobs", empty_job(2)),
    Case("exp_f32", "2^20", EXP_N, "elements", exp_f32),
    Case("np.exp", "2^20", EXP_N, "elements", numpy_exp, numpy=True),
    Case("softmax_f32", f"{SOFTMAX_ROWS}x{SOFTMAX_COLS}", SOFTMAX_ROWS * SOFTMAX_COLS, "elements", softmax_f32),
    Case("numpy softmax by row", f"{SOFTMAX_ROWS}x{SOFTMAX_COLS}", SOFTMAX_ROWS * SOFTMAX_COLS, "elements",
         numpy_softmax, numpy=True),
]

RATIOS: list[Ratio] = [
    Ratio("qmatvec q8_0 4096x4096", "stream of q8_0's packed bytes 4096x4096", "simd128"),
    Ratio("qmatvec q8_0 4096x4096", "stream of q8_0's packed bytes 4096x4096", "relaxed-simd", at_least=0.70),
    Ratio("qmatvec q8_0 4096x4096", "qmatvec q8_0 4096x4096", "relaxed-simd", "simd128"),
    Ratio("qmatvec q8_0 256x4096", "qmatvec q8_0 256x4096", "relaxed-simd", "simd128", at_least=1.4),
    Ratio("qmatvec q4_0 8192x8192", "qmatvec q8_0 8192x8192", at_least=1.6),
    Ratio("qmatvec q8_0 pool, 2 threads 4096x4096", "qmatvec q8_0 pool, 1 thread 4096x4096", at_least=1.8),
    Ratio("exp_f32 2^20", "np.exp 2^20", versus_target=NUMPY, at_least=1.0),
    Ratio("softmax_f32 64x4096", "numpy softmax by row 64x4096", versus_target=NUMPY, at_least=1.5),
]

# Figures of the build, measured once per run: (name, unit).
FIGURES = {"build all targets": "s", "wasm size": "bytes"}

LIMITS: list[Limit] = [
    Limit("empty pool job, 2 threads", 5e-6),
    Limit("build all targets", 3.0, "-"),
    Limit("wasm size", 16384),
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


@dataclass
class RatioRow:
    """A ratio per run: versus's seconds over row's (row / versus speed)."""

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


def _targets_of(case: Case, targets: tuple[str, ...]) -> tuple[str, ...]:
    return (NUMPY,) if case.numpy else targets


def run(source: str, targets: tuple[str, ...] = TARGET_NAMES, records: list[Record] | None = None,
        repeat: int = 1, progress: Callable[[str], None] = lambda s: None,
        cases: list[Case] | None = None, ratios: list[Ratio] | None = None,
        limits: list[Limit] | None = None) -> Report:
    """Time every case on every target `repeat` times (the whole table per run), then the ratios
    and limits from the same runs."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    cases = CASES if cases is None else cases
    ratios = RATIOS if ratios is None else ratios
    limits = LIMITS if limits is None else limits
    bench = Bench(source, targets, records)
    rows: dict[tuple[str, str], Row] = {}
    for c in cases:
        for t in _targets_of(c, targets):
            rows[(c.key, t)] = Row(c.key, t, Cell(), c.work, c.unit)
    for name, unit in FIGURES.items():
        for t in (("-",) if unit == "s" else targets):
            rows[(name, t)] = Row(name, t, Cell(), unit=unit, figure=True)
    for i in range(repeat):
        for c in cases:
            for t in _targets_of(c, targets):
                progress(f"run {i + 1}/{repeat}: {c.key} {t}")
                k = None if c.numpy else bench.kernels[t]
                rows[(c.key, t)].value.samples.append(c.time(k))
                if k is not None:
                    k.reset()
        progress(f"run {i + 1}/{repeat}: build")
        t0 = time.perf_counter()
        built = compile_source(source, records=records)
        rows[("build all targets", "-")].value.samples.append(time.perf_counter() - t0)
        for b in built:
            if (("wasm size", b.target)) in rows:
                rows[("wasm size", b.target)].value.samples.append(float(len(b.wasm)))
    benched = {*targets, NUMPY, "-"}
    out_ratios = []
    for r in ratios:
        for t in (targets if r.target == EVERY else (r.target,)):
            vt = t if r.versus_target == SAME else r.versus_target
            if not {t, vt} <= benched:
                continue  # a target not benched in this run
            a, b = _row(rows, r.row, t), _row(rows, r.versus, vt)
            cell = Cell([y / x for x, y in zip(a.value.samples, b.value.samples)])
            out_ratios.append(RatioRow(a, b, cell, r.at_least))
    out_limits = []
    for lim in limits:
        for t in (sorted({t for key, t in rows if key == lim.of}) if lim.target == EVERY else (lim.target,)):
            if t in benched:
                out_limits.append(LimitRow(_row(rows, lim.of, t), lim.at_most))
    return Report(list(rows.values()), out_ratios, out_limits, repeat)


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
    lines = [f"rows: time per call ({med})", f"  {'row':{w}}{'target':14}{'value':>12}  {'spread':28}{'rate':>18}"]
    for r in report.rows:
        rate = "" if r.figure else _rate(r.work / r.value.median, r.unit)
        lines.append(f"  {r.key:{w}}{r.target:14}{_value(r, r.value.median):>12}  "
                     f"{_spread(r.value, lambda x, r=r: _value(r, x)):28}{rate:>18}")
    lines += ["", "ratios: how many times faster the row is than the versus row (both above)"]
    for q in report.ratios:
        goal = "" if q.at_least is None else f"  goal >= {q.at_least:.2f}x: {'met' if q.met else 'NOT met'}"
        lines.append(f"  {_name(q.row)} vs {_name(q.versus)}: {_ratio(q.value.median)}"
                     f" {_spread(q.value, _ratio)}".rstrip() + goal)
    lines += ["", "limits (on the median)"]
    for lim in report.limits:
        r = lim.row
        lines.append(f"  {_name(r)}: {_value(r, r.value.median)} <= {_value(r, lim.at_most)}: "
                     f"{'met' if lim.met else 'NOT met'}")
    return "\n".join(lines)


def _name(row: Row) -> str:
    return f"{row.key} [{row.target}]"


def _ratio(x: float) -> str:
    return f"{x:.2f}x"


def as_json(report: Report) -> dict:
    """Every sample and summary, for scripts: plain data."""
    def cell(c: Cell) -> dict:
        return {"samples": c.samples, "min": c.min, "median": c.median, "max": c.max}
    return {
        "repeat": report.repeat,
        "rows": [{**{k: v for k, v in asdict(r).items() if k != "value"}, **cell(r.value)} for r in report.rows],
        "ratios": [{"row": q.row.key, "target": q.row.target, "versus": q.versus.key,
                    "versus_target": q.versus.target, **cell(q.value), "at_least": q.at_least, "met": q.met}
                   for q in report.ratios],
        "limits": [{"of": lim.row.key, "target": lim.row.target, "median": lim.row.value.median,
                    "at_most": lim.at_most, "met": lim.met} for lim in report.limits],
    }
