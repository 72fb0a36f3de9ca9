"""The tuning store: a JSON-lines file of timings, keyed by what a timing depends on (kernel, a
hash of the DSL the kernel is built from, target, shape, host CPU (model and ISA features) and core
count, wasmtime and wabt versions), and the rule that picks a variant from it for `kernelgen build`.

A line that is not a record of this format (corrupt, foreign, from a future format) is skipped with
a StoreWarning naming its file and line, never a crash; so is a record whose tune values the kernel
it names could not take (`usable`), since a build would otherwise fail on it or copy it into a manifest.
"""
from __future__ import annotations

import functools
import gc
import hashlib
import json
import math
import os
import platform
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..compiler import ast as A
from ..compiler.assemble import wabt_version
from ..compiler.check import Checked, resolve_tune
from ..errors import DslError, KernelgenError
from ..host.manifest import MAX_THREADS
from ..host.module import I32_MAX
from .fingerprint import Code

STORE = Path("tuning") / "store.jsonl"
FORMAT = 1
WASMTIME = "wasmtime"  # a record's engine when wasmtime timed it (every record before V8 timings)
# A pool job's tuned values (threads taking part, items per claim) and the ranges a manifest may
# hold (kernelgen/host/manifest.py checks them when it loads).
JOB_TUNE = {"threads": (1, MAX_THREADS), "chunk": (1, I32_MAX)}


class StoreWarning(UserWarning):
    """A store line that was skipped; the message is `file:line: why`."""


# ---- keys ----------------------------------------------------------------------------------------


# The CPU features that change how wasm engines lower SIMD128 and relaxed SIMD (V8 and cranelift
# pick pmaddubsw, vpdpbusd or vpdpbssd for the relaxed dot, AVX or SSE encodings, FMA for relaxed
# madd; ARM's sdot and i8mm). A model name alone does not tell them apart: this project's machines
# have all reported "AMD EPYC", once with AVX2 only and once with AVX-512 VNNI, and timings from one
# must not pick the other's variants.
ISA_FLAGS = ("sse4_1", "ssse3", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
             "avx_vnni_int8", "asimd", "asimddp", "i8mm")


def host() -> dict[str, object]:
    """The machine a timing belongs to: CPU model, the ISA_FLAGS it has, cores, engine versions."""
    info: dict[str, str] = {}  # the first processor's lines of /proc/cpuinfo (Linux)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            info.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    model = info.get("model name") or platform.processor() or platform.machine()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return {"cpu": model, "isa": [f for f in ISA_FLAGS if f in flags], "cores": os.cpu_count() or 1,
            "wasmtime": wasmtime_version(), "wabt": wabt_version()}


def caches(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> dict[str, int]:
    """The first core's data caches by level ("L1", "L2", "L3"), in bytes, as Linux's sysfs gives
    them; empty where it does not. Not part of host() (a timing's key, which names the CPU model
    already): they decide whether the shapes bench and tune mean to read DRAM do so."""
    out: dict[str, int] = {}
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for d in sorted(root.glob("index*")):
        try:
            kind, level, size = ((d / f).read_text().strip() for f in ("type", "level", "size"))
            if kind != "Instruction":
                out[f"L{int(level)}"] = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError):
            continue
    return out


def last_level(levels: dict[str, int]) -> tuple[str, int] | None:
    """The last-level cache of caches()' result, (level, bytes); None when none is known."""
    return max(levels.items(), default=None)


def wasmtime_version() -> str:
    from importlib.metadata import version
    return version("wasmtime")


_HASHES: dict[tuple[str, str, str | None], str] = {}  # kernel_hash by (source, kernel, quant)


def kernel_hash(checked: Checked, kernel: str, quant: str | None = None) -> str:
    """sha256 of the source a kernel is built from: its declaration, every kernel it calls, the
    consts and quant types it can reach. Editing an unrelated kernel keeps its tunings valid. A pool
    job is built from its exported kernel, so it has that kernel's hash. A generic kernel's code for
    one quant type reads that type's declaration only: with `quant`, the hash leaves the other types
    out, so declaring a new type (or editing one) keeps every other type's tunings. Remembered per
    source text (it is a function of it): a build asks for it once per tuning record it weighs."""
    key = (checked.source, kernel, quant)
    if (known := _HASHES.get(key)) is None:
        if len(_HASHES) >= 4096:
            _HASHES.clear()
        known = _HASHES[key] = _kernel_hash(checked, kernel, quant)
    return known


def declares(checked: Checked, r: Record) -> bool:
    """Whether `checked` declares r's kernel (or pool job) and quant type: the records of anything
    else time code it no longer has (prune drops them, carry cannot key them to it)."""
    return (r.kernel in checked.kernels or r.kernel in checked.jobs) and (r.quant is None or r.quant in checked.quants)


def _kernel_hash(checked: Checked, kernel: str, quant: str | None) -> str:
    lines = checked.source.splitlines()
    seen: set[str] = set()
    todo = [checked.jobs[kernel].name if kernel in checked.jobs else kernel]
    texts: list[str] = []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        node = checked.kernels[name].ast if name in checked.kernels else None
        decl = node or next((q for q in checked.program.quants if q.name == name), None) \
            or next((c for c in checked.program.consts if c.name == name), None) \
            or next((t for t in checked.program.tables if t.name == name), None)
        if decl is None:
            continue
        texts.append("\n".join(lines[decl.span.line - 1:decl.span.end_line]))
        todo.extend(A.names_in(decl))  # a kernel's callees and consts, a const's own consts
        if node is not None and any(g.kind == "quant" for g in node.generics):
            todo.extend(q.name for q in checked.program.quants if quant in (None, q.name))
    return hashlib.sha256("\n\0".join(sorted(texts)).encode()).hexdigest()


# ---- records -----------------------------------------------------------------------------------


@dataclass
class Record:
    kernel: str
    quant: str | None
    target: str
    shape: str
    dsl_hash: str
    host: dict
    tune: dict[str, int]
    seconds: float | None  # median seconds per call; None when the variant failed
    status: str  # "ok" or "failed: <why>"
    retimed: bool = False
    when: float = field(default_factory=time.time)
    engine: str = WASMTIME  # what ran it: wasmtime (its version is in host), or "v8 <version>" (tuning/v8.py)
    threads: int = 1  # 1: the kernel called on one thread; more: its pool job on that many (tune.threaded)
    code: str | None = None  # the fingerprint of the code it ran (fingerprint.Code); None: a timing from before them
    origin: str = field(default="", compare=False, repr=False)  # file:line it was read from; not stored

    def stored(self) -> dict:
        """The record as a store line holds it."""
        return {"format": FORMAT, **{k: v for k, v in self.__dict__.items() if k != "origin"}}

    def key(self) -> tuple:
        return (self.kernel, self.quant, self.target, self.shape, self.dsl_hash, json.dumps(self.host, sort_keys=True),
                self.engine, self.threads)


# Each stored field's types, exactly (a bool is no int here); _check_record adds the checks on values.
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "kernel": (str,), "quant": (str, type(None)), "target": (str,), "shape": (str,), "dsl_hash": (str,),
    "host": (dict,), "tune": (dict,), "seconds": (float, int, type(None)), "status": (str,), "retimed": (bool,),
    "when": (float, int), "engine": (str,), "threads": (int,), "code": (str, type(None)),
}


def _check_record(data: object) -> Record:
    """A Record from one parsed JSON line, every field of the type it must have; ValueError else.
    Exact types first, then values (a store holds tens of thousands of lines, read by every build)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError("not a kernelgen tuning record of this format")
    # lines from before engines were timed in wasmtime, from before threaded timings on one thread, and
    # from before fingerprints
    fields = {"engine": WASMTIME, "threads": 1, "code": None, **data}
    del fields["format"]
    if fields.keys() != _FIELD_TYPES.keys():
        raise ValueError("not a kernelgen tuning record of this format")
    bad = [k for k, types in _FIELD_TYPES.items() if type(fields[k]) not in types]
    seconds, tune = fields["seconds"], fields["tune"]
    if "seconds" not in bad and seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        bad.append("seconds")
    if "tune" not in bad and not all(type(v) is int for v in tune.values()):
        bad.append("tune")
    if "when" not in bad and not math.isfinite(fields["when"]):
        bad.append("when")
    if "threads" not in bad and not 1 <= fields["threads"] <= MAX_THREADS:
        bad.append("threads")
    if bad:
        raise ValueError(f"bad {', '.join(bad)}")
    return Record(**fields)


def load_store(path: Path | str) -> list[Record]:
    """All well-formed records; anything else is skipped with a warning naming its line."""
    if not isinstance(path, (Path, str)):
        raise TypeError(f"load_store: expected a path (str or Path), got {type(path).__name__}")
    path = Path(path)
    records: list[Record] = []
    if not path.is_file():
        return records
    name = str(path)
    # The cycle collector paused while the store's tens of thousands of records (none of them in a
    # cycle) are made: its passes over the growing heap took a quarter of the load (0.4 of 1.5 s).
    collecting = gc.isenabled()
    gc.disable()
    try:
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = _check_record(json.loads(line))
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                warnings.warn(f"{name}:{n}: skipped ({e})", StoreWarning, stacklevel=2)
            except RecursionError:  # JSON nested deeper than the parser's stack
                warnings.warn(f"{name}:{n}: skipped (nested too deeply to be a record)", StoreWarning, stacklevel=2)
            else:
                rec.origin = f"{name}:{n}"
                records.append(rec)
    finally:
        if collecting:
            gc.enable()
    return records


def usable(records: list[Record], checked: Checked) -> list[Record]:
    """The records whose tune values their kernel could take in `checked`: an exported kernel's
    declared parameters, each in its domain and meeting every restrict; a job's threads and chunk in
    range. Each other record for a kernel as `checked` declares it (same kernel_hash: the records a
    build would use) is skipped with a StoreWarning naming its line."""
    out = []
    hash_of = functools.cache(functools.partial(kernel_hash, checked))  # 1-2 ms each, once per kernel and type
    resolves = functools.cache(lambda kernel, tune: resolve_tune(checked, {kernel: json.loads(tune)}, where="tune record"))
    for r in records:
        job = r.kernel in checked.jobs
        k = checked.jobs.get(r.kernel) or checked.kernels.get(r.kernel)
        if k is not None and r.dsl_hash != hash_of(r.kernel, r.quant):
            k = None  # another version of the kernel: best_tune ignores it anyway
        problem = None
        if k is not None and job:
            bad = [f"{p}={r.tune.get(p)}" for p, (lo, hi) in JOB_TUNE.items() if not lo <= r.tune.get(p, 0) <= hi]
            if bad or set(r.tune) != set(JOB_TUNE):
                problem = f"job tune values {r.tune}: need {', '.join(f'{p} in {lo}..{hi}' for p, (lo, hi) in JOB_TUNE.items())}"
        elif k is not None and k.ast.exported:
            if set(r.tune) != {t.name for t in k.ast.tunes}:
                problem = f"tune values {r.tune}: {r.kernel} takes {', '.join(t.name for t in k.ast.tunes) or 'none'}"
            else:
                try:  # once per kernel and variant: the store holds thousands of records of a few
                    resolves(r.kernel, json.dumps(r.tune, sort_keys=True))
                except DslError as e:
                    problem = e.message
        if problem is None:
            out.append(r)
        else:
            warnings.warn(f"{r.origin or 'tuning store'}: skipped ({problem})", StoreWarning, stacklevel=2)
    return out


def append_record(path: Path, rec: Record) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(rec.stored(), sort_keys=True) + "\n")


def stale(records: list[Record], checked: Checked) -> list[Record]:
    """The records of `checked`'s source (kernel_hash) whose code fingerprint this compiler no longer
    emits for their variant (a change to the lowering, not to the source): their timings are of
    other code. Records from before fingerprints (code None) cannot be told and are not listed."""
    code = Code(checked)
    return [r for r in records if r.code is not None and declares(checked, r)
            and r.dsl_hash == kernel_hash(checked, r.kernel, r.quant)
            and r.code != code.fingerprint(r.target, r.kernel, r.quant, r.tune, r.threads)]


@dataclass
class Pruned:
    """What prune kept and dropped, in lines of the store; `bytes_before` and `bytes_after` its size;
    `stale` of the dropped: timings of the current source whose code the compiler no longer emits."""
    kept: int
    dropped: int
    unreadable: int
    bytes_before: int
    bytes_after: int
    stale: int = 0


def prune(path: Path, checked: Checked, dry_run: bool = False) -> Pruned:
    """Rewrite the store at `path` without the timings of other versions of the source than
    `checked`'s (kernel_hash, as the build weighs them: those of a kernel or quant type it no longer
    declares too), nor those of its version whose code the compiler no longer emits (`stale`). A
    build can pick only from the rest; carry keys timings to an edited source, so the old ones are
    what its history (version control) holds. Lines that are no record of this format stay as they
    are: prune drops only what it can read. The rewrite replaces the file at once, and not at all
    when the store changed meanwhile (a tune appending): KernelgenError."""
    before = path.stat()
    raw = path.read_bytes()
    kept: list[bytes] = []
    dropped = unreadable = 0
    records: dict[int, Record] = {}  # line index -> the record on it (every line that holds one)
    lines = raw.splitlines()
    for n, line in enumerate(lines):
        if line.strip():
            try:
                rec = _check_record(json.loads(line))
            except (ValueError, RecursionError):
                continue
            records[n] = rec
    old = {id(r) for r in stale(list(records.values()), checked)}
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        rec = records.get(n)
        if rec is None:  # undecodable, not JSON, not a record: kept as it is
            unreadable += 1
            kept.append(line)
        elif declares(checked, rec) and rec.dsl_hash == kernel_hash(checked, rec.kernel, rec.quant) and id(rec) not in old:
            kept.append(line)
        else:
            dropped += 1
    out = b"".join(line + b"\n" for line in kept)
    result = Pruned(len(kept) - unreadable, dropped, unreadable, len(raw), len(out), len(old))
    if dry_run or not dropped:
        return result
    tmp = path.with_name(f".{path.name}.prune-{os.getpid()}")
    try:
        tmp.write_bytes(out)
        os.chmod(tmp, before.st_mode & 0o7777)
        now = path.stat()
        if (now.st_size, now.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            raise KernelgenError(f"{path} changed while it was pruned (a tune appending to it?); nothing was dropped")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return result


# A variant larger than the smallest is built only when it is this much faster than the smallest
# (geometric mean of time over the shapes measured). The larger variants are more code in every
# quant type they are built for (relaxed SIMD qmatvec rows 2 accs 2 with qmatmul 2x2: 12 KB per type
# against 2.2 KB for 1x1), and the store's re-timings of one variant differ from its first timing by
# 3.8% (median over 336 pairs): a smaller gain is not told from noise.
SIZE_MARGIN = 1.05
ALL_QUANTS = "*"  # best_tune over the timings of every quant type (a pool job's run-time values)


def smallest(checked: Checked, kernel: str) -> dict[str, int]:
    """The variant with the least code: each tune parameter at the least value of its domain (every
    parameter here counts copies of code: unrolled steps, a tile's tokens and rows, accumulators),
    when that meets the restricts; else the declared defaults."""
    k = checked.kernels[kernel].ast
    least = {t.name: min(t.domain) for t in k.tunes}
    try:
        resolve_tune(checked, {kernel: least}, where="smallest variant")
    except DslError:
        return {t.name: t.default for t in k.tunes}
    return least


@dataclass
class Comparison:
    """What variant_scores compared for one kernel (and type) on one target and host: `scores` (its
    result), the variants with current timings it `left_out` (each with why: a failed latest timing,
    or shapes it was never timed on), and per engine how many current timings of scored variants it
    left `unused` (a shape counts only in the engines that timed every candidate on it). Either of
    the last two means the pick was made blind to some timings: after an edit re-timed in one engine,
    the unchanged variants' timings in the others wait for the changed ones to be timed there too."""
    scores: dict[str, float]
    left_out: dict[str, str]
    unused: dict[str, int]


def compare(records: list[Record], checked: Checked, kernel: str, target: str, want_host: dict,
            quant: str | None = ALL_QUANTS) -> Comparison:
    """Each variant's score for `kernel` (for one `quant` type, or over every type's timings) on
    `target` (keyed by its tune values as sorted JSON): among successful timings on `want_host` for the
    current DSL, the geometric mean of time / best time over the shapes measured (a shape timed in
    wasmtime and in V8 counts once per engine: the pick serves Python hosts and browsers alike),
    counting only variants timed on every shape, each shape in the engines that timed all of them (a
    re-tune in one engine after an edit times some variants anew there only: their other engines'
    timings are stale while an unchanged variant keeps its own, and requiring them put relaxed Q8_0
    mat-vec on rows 1, 1.12x slower than the rows 2 it left out). A variant whose latest timing of a
    shape failed is not scored. Timings on the pool on every core (tune.threaded) weigh as much as
    those on one thread, whatever the count of each: the geometric mean of the two means (pages and
    the Pool run a GEMM on every core; a lone wasmtime timing among three engines' would otherwise
    count a quarter). A (variant, shape) timed more than once counts its fastest
    timing: a shared machine's noise only ever adds time (one two-thread timing of relaxed Q8_0
    mat-vec at 4096 x 4096 ran slower than the same variant on one thread), unless the latest
    failed. 1.0 is the fastest; scores are empty when nothing matches."""
    latest: dict[tuple[str, tuple], float] = {}
    failed: set[tuple[str, tuple]] = set()
    for r, current in sorted(_on_host(records, checked, kernel, target, want_host, quant), key=lambda p: p[0].when):
        if current:
            key = (json.dumps(r.tune, sort_keys=True), (r.threads, r.quant, r.shape, r.engine))
            if r.seconds is not None and r.status == "ok":
                latest[key] = min(r.seconds, latest.get(key, math.inf))
                failed.discard(key)
            else:
                latest.pop(key, None)
                failed.add(key)
    covered: dict[str, set[tuple]] = {}  # variant -> its (threads, quant, shape)s timed in any engine
    for t, s in latest:
        covered.setdefault(t, set()).add(s[:3])
    shapes = set().union(*covered.values())
    left_out = {t: "its latest timing failed" for t, _ in failed}
    left_out.update({t: f"not timed on {len(shapes - c)} of the {len(shapes)} shapes" for t, c in covered.items()
                     if c != shapes and t not in left_out})
    tunes = [t for t in covered if t not in left_out]
    timed = [s for s in {s for _, s in latest} if all((t, s) in latest for t in tunes)]  # each in every engine that timed all
    unused: dict[str, int] = {}
    for t, s in latest:
        if t in tunes and s not in timed:
            unused[s[3]] = unused.get(s[3], 0) + 1
    if not tunes or not timed:  # nothing timed everywhere, or no engine timed all of them on a shape
        return Comparison({}, left_out, unused)
    best_per_shape = {s: min(latest[t, s] for t in tunes) for s in timed}
    scores = {}
    for tune in tunes:
        logs: dict[int, list[float]] = {}  # threads -> log(time / best) of each of its shapes
        for s in timed:
            logs.setdefault(s[0], []).append(math.log(latest[tune, s] / best_per_shape[s]))
        scores[tune] = math.exp(sum(sum(v) / len(v) for v in logs.values()) / len(logs))
    return Comparison(scores, left_out, unused)


def variant_scores(records: list[Record], checked: Checked, kernel: str, target: str, want_host: dict,
                   quant: str | None = ALL_QUANTS) -> dict[str, float]:
    """compare's scores: each variant's geometric mean of time / best time; 1.0 is the fastest."""
    return compare(records, checked, kernel, target, want_host, quant).scores


def other_versions(records: list[Record], checked: Checked, kernel: str, target: str, want_host: dict,
                   quant: str | None = ALL_QUANTS) -> int:
    """How many successful timings of `kernel` (of one `quant` type, or of any) on `target` and
    `want_host` are for another version of its source than `checked`'s (kernel_hash): timings a
    build cannot use. An edit to a tuned kernel or to anything it calls, a comment or a renamed
    local included, leaves its picks to the DSL's defaults until it is timed again; the build says
    so (a rename once put matmul_f32_nt back on its 4 x 2 default, 1.13x slower than simd128's
    timed pick, with nothing printed)."""
    return sum(1 for r, current in _on_host(records, checked, kernel, target, want_host, quant)
               if not current and r.status == "ok")


def other_hosts(records: list[Record], checked: Checked, kernel: str, target: str, want_host: dict,
                quant: str | None = ALL_QUANTS) -> int:
    """How many successful timings of the current version of `kernel` (of one `quant` type, or of
    any) on `target` were taken on hosts other than `want_host`. A build for `want_host` that has no
    timing of its own builds the smallest variant, although another machine timed the others; the
    build says so (tune.untimed), as the committed out/ once held a GEMM tile its host had never
    timed while the store held the other host's timings of it."""
    return sum(1 for r, current in _on_host(records, checked, kernel, target, want_host, quant, here=False)
               if current and r.status == "ok")


def _on_host(records: list[Record], checked: Checked, kernel: str, target: str, want_host: dict,
             quant: str | None, here: bool = True) -> list[tuple[Record, bool]]:
    """The records of `kernel` (of one `quant` type, or of any) on `target` and `want_host` (`here`
    false: on every other host), each with whether it times the current version of its source
    (kernel_hash). Hosts compare as dicts (read from JSON, they are equal when their sorted JSON is):
    a build calls this about a hundred times per target over the store's records, and writing each
    host as JSON took half of its tune choice."""
    hash_of = functools.cache(functools.partial(kernel_hash, checked, kernel))
    return [(r, r.dsl_hash == hash_of(r.quant)) for r in records
            if r.kernel == kernel and r.target == target and quant in (ALL_QUANTS, r.quant)
            and (r.host == want_host) == here]


def best_tune(records: list[Record], checked: Checked, kernel: str, target: str, want_host: dict,
              baseline: dict | None = None, quant: str | None = ALL_QUANTS) -> dict | None:
    """The variant to build for `kernel` (for one `quant` type, or over every type's timings) on
    `target`: the lowest variant_scores; `baseline` (the smallest variant) unless the winner beats it
    by SIZE_MARGIN. None when nothing matches."""
    scores = variant_scores(records, checked, kernel, target, want_host, quant)
    if not scores:
        return None
    best = min(sorted(scores), key=lambda t: scores[t])
    kept = json.dumps(baseline, sort_keys=True) if baseline is not None else None
    if kept in scores and scores[kept] < scores[best] * SIZE_MARGIN:
        return baseline
    return json.loads(best)


def middle_tune(records: list[Record], checked: Checked, kernel: str, target: str, want_host: dict,
                small: dict, fast: dict, quant: str | None = ALL_QUANTS) -> dict | None:
    """The variant between `small` and `fast` (each tune value at most fast's, neither of the two) with
    the lowest variant_scores, when it beats `small` by SIZE_MARGIN: for a byte budget that does not
    fit `fast` (every tune parameter here counts copies of code, so lower values are less code).
    None when the store has no such variant."""
    scores = variant_scores(records, checked, kernel, target, want_host, quant)
    base = scores.get(json.dumps(small, sort_keys=True))
    between = [t for t in scores if (v := json.loads(t)) not in (small, fast) and v.keys() == fast.keys()
               and all(v[p] <= fast[p] for p in v)]
    if base is None or not between:
        return None
    best = min(sorted(between), key=lambda t: scores[t])
    return json.loads(best) if scores[best] * SIZE_MARGIN < base else None


def shared_tune(records: list[Record], checked: Checked, kernel: str, target: str, want_host: dict,
                small: dict, other: dict, quant: str | None = ALL_QUANTS) -> dict | None:
    """`small` with each tune parameter that another kernel's pick `other` names too taken from it
    (qmatmul's rows from qmatvec's pick: the two then call one tile), when the store has timed it
    and it beats `small` by SIZE_MARGIN: for a byte budget, a variant whose code the other kernel's
    pick already holds. None otherwise."""
    shared = {p: other.get(p, v) for p, v in small.items()}
    scores = variant_scores(records, checked, kernel, target, want_host, quant)
    base, mine = scores.get(json.dumps(small, sort_keys=True)), scores.get(json.dumps(shared, sort_keys=True))
    return shared if base is not None and mine is not None and mine * SIZE_MARGIN < base else None


def speedup(records: list[Record], checked: Checked, kernel: str, target: str, want_host: dict,
            fast: dict, slow: dict, quant: str | None = ALL_QUANTS) -> float:
    """How many times faster variant `fast` runs than `slow` by the records (variant_scores); a
    `slow` variant never timed counts SIZE_MARGIN slower (the least gain a pick needs over the
    smallest variant)."""
    scores = variant_scores(records, checked, kernel, target, want_host, quant)
    a, b = scores.get(json.dumps(fast, sort_keys=True)), scores.get(json.dumps(slow, sort_keys=True))
    return b / a if a is not None and b is not None else SIZE_MARGIN
