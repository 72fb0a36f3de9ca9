"""Lowering: checked AST -> WAT functions for one target and one assignment of tune values.

Kernels are monomorphized: a generic kernel becomes one function per quant type (exported) or per
distinct compile-time arguments (internal); `inline` kernels are expanded at each call. Names bound
to compile-time values (consts, tune parameters, unroll indices, generic integers, target
constants, lets of constant expressions) are folded, so unrolled and specialized code is straight
WAT. Types are computed here as the code is built; the rules for ops live in ops.py per target.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

from . import ast as A
from . import layout
from . import types as T
from .check import EXTENT_TYPES, Checked, KernelInfo, tune_for
from ..errors import DslError
from ..host.manifest import evaluate
from ..names import variant_name
from .ops import TARGETS, Op, Target, Val, fold, is_zero_vector, wrap
from ..quantformat import SUB_SCALES, Call, Int, Lookup, QuantFormat
from .quant import lower_scales, unpack_lanes
from .wat import (Block, Comment, Func, I, If, Instr, Stmt, drop_dead_stores, forward_copies, locals_named, number,
                  share_vector_constants, untee_unread, walk as _walk)

_QUALIFIABLE = {"load", "load8x8", "store", "splat", "convert", "trunc_sat", "narrow", "extend_low", "extend_high", "bits",
                "shuffle", "iota"}
_ALL_OPS = set().union(*(t.ops for t in TARGETS.values()))
# Q.<op>(w, blk): lower_scales's what, lanes and form, and whether the op reads the grouped layout
# (the rows' values of one block) or rows one by one (four blocks', or one block's)
_SCALE_OPS = {"scale4": ("scale", 4, "f32", False), "scale1": ("scale", 1, "f32", False),
              "offset4": ("offset", 4, "f32", False), "offset1": ("offset", 1, "f32", False),
              "rowscale": ("scale", 4, "f32", True), "rowoffset": ("offset", 4, "f32", True),
              # a super-block record's factors apart (Q.int_scales): F of the rows' super-block, I
              # of their block as i16 pairs (pairsum's multipliers), the record's address
              "rowscale_f": ("scale", 4, "f", True), "rowoffset_f": ("offset", 4, "f", True),
              "rowscale_pairs": ("scale", 4, "pairs", True), "rowrecord": ("scale", 4, "record", True),
              # rows one by one, the address of the row's record of block blk (Q.sub_offsets' integers)
              "record": ("scale", 1, "record", False)}
_SCALE_TYPES = {"f32": "f32x4", "f": "f32x4", "pairs": "i16x8", "record": "i32"}
# the ops that may take the record's address (Q.rowrecord of blk) as a third argument, formed once
# per super-block by the kernel rather than from blk at every call
_AT_RECORD = {"rowscale_f", "rowoffset_f", "rowscale_pairs"}


@dataclass(frozen=True)
class Local:
    name: str  # the wasm local
    type: str
    mutable: bool


@dataclass(frozen=True)
class Array:
    """A register array: one wasm local per element, indexed by compile-time integers only."""

    names: tuple[str, ...]
    type: str


@dataclass(frozen=True)
class Packed:
    """A packed quantized matrix parameter: one pointer local per plane of its quant type."""

    quant: QuantFormat
    planes: dict[str, str]


Binding = Val | Local | Array | Packed | QuantFormat


@dataclass(frozen=True)
class Export:
    """A function the hosts call: an exported kernel, or a parallel kernel's pool job (called
    through the job table). build.py describes it in the manifest."""

    name: str
    kernel: KernelInfo
    quant: QuantFormat | None
    tune: dict[str, int]
    params: tuple[A.Param, ...]  # a job's: the parameters it reads from JOB_ARGS words
    contract: Contract | None = None  # an export's (a job's is its export's)
    job: str | None = None  # a parallel export's pool job


Tree = int | str | list  # a formula over an export's i32 arguments, as the manifest writes it (_count_tree)


@dataclass
class Contract:
    """What hosts compute and check from an export's arguments, as manifest formulas: its pool
    job's item count, each pointer's extent in bytes (check.Extent; a packed matrix's per plane,
    None where a dimension is `?`), each i32 parameter's required multiple ("a multiple of N") and
    least value (">= EXPR")."""

    count: Tree | None = None
    extents: dict[str, Tree | None] = field(default_factory=dict)
    multiples: dict[str, int] = field(default_factory=dict)
    minimums: dict[str, Tree] = field(default_factory=dict)


MAX_INSTANTIATION_DEPTH = 32  # internal kernels instantiating one another, e.g. g[N] -> g[N + 1]
MAX_INSTANCES = 4096  # distinct instances of internal kernels in one module
MAX_UNROLL = 256  # copies one `unroll` makes
MAX_COPIES = 4096  # copies nested unrolls make of their innermost body


class _Return(Exception):
    """Raised past a non-inline `return` to skip dead code after it in the same block."""


@dataclass
class Reused:
    """A function lowered for one build, reusable by another build of the same checked program and
    target (lower's `memo`: within_budget builds up to nine variants of one program): what its
    body read that its name does not say, checked before reuse, and the internal instances it
    asked for, asked for again in the same order so the module is the one lowering would give."""

    func: Func | None = None
    contract: Contract | None = None
    # what the body took from the target, which its flavors may give otherwise (ops.Flavor): ops by
    # name, constants and quant types' properties with their values
    ops: dict[str, Op | None] = field(default_factory=dict)
    consts: dict[str, int] = field(default_factory=dict)
    props: dict[tuple[str, str], tuple[QuantFormat, int]] = field(default_factory=dict)  # (type, name): value
    reads: list[tuple[str, str | None, str, int]] = field(default_factory=list)  # other kernels' tune values
    exports: list[tuple[KernelInfo, QuantFormat | None, str]] = field(default_factory=list)  # exports it calls
    internals: list[tuple[KernelInfo, dict[str, Binding]]] = field(default_factory=list)


class Instances:
    """The functions kernels become, named by one scheme (names.variant_name: the kernel, its
    quant type, then name-value pairs that parse back): an export carries its tune values
    (`qmatvec_q8_0__rows1_accs1`), its pool job the same (`qmatvec_job_q8_0__rows1_accs1`), an
    internal kernel its compile-time integers, lowercase without '_' (`qrows_q8_0__n4_a1`), one
    function per distinct compile-time arguments, lowered after the exports."""

    def __init__(self, tune: dict[str, dict[str, int]]) -> None:
        self.tune = tune
        self._names: dict[tuple, str] = {}
        # Internal kernels still to lower, each with its instantiation chain (the instances that
        # led to it): `g[N]` calling `g[N + 1]` would otherwise instantiate for ever.
        self._pending: list[tuple[KernelInfo, dict[str, Binding], str, tuple[str, ...]]] = []
        self._chain: tuple[str, ...] = ()  # that of the instance being lowered

    def export(self, k: KernelInfo, quant: QuantFormat | None) -> str:
        return variant_name(k.name, quant.name if quant else None, self.values(k, quant))

    def job(self, k: KernelInfo, quant: QuantFormat | None) -> str:
        assert k.job is not None
        return variant_name(k.job, quant.name if quant else None, self.values(k, quant))

    def values(self, k: KernelInfo, quant: QuantFormat | None) -> dict[str, int]:
        """Exported kernel `k`'s tune values for `quant` (check.tune_for)."""
        return tune_for(self.tune, k.name, quant.name if quant else None)

    def internal(self, k: KernelInfo, generics: dict[str, Binding], error: Callable[[str], DslError],
                 record: Reused | None = None) -> str:
        """The function of internal kernel `k` for these compile-time arguments (queued for
        lowering the first time it is asked for; `error` makes the DslError of a limit broken;
        `record`: the asking function's, which notes it)."""
        if record is not None:
            record.internals.append((k, generics))
        key = (k.name, tuple(_show(v) for v in generics.values()))
        if key not in self._names:
            quants = "_".join(v.name for v in generics.values() if isinstance(v, QuantFormat))
            values = {g.lower().replace("_", ""): v.const for g, v in generics.items() if isinstance(v, Val)}
            name = variant_name(k.name, quants or None, values)
            chain = (*self._chain, name)
            if len(chain) > MAX_INSTANTIATION_DEPTH:
                shown = " -> ".join(chain[:2] + ("...",) + chain[-2:])
                raise error(f"instantiating {name}: {len(chain)} nested instantiations ({shown}), at most "
                            f"{MAX_INSTANTIATION_DEPTH}; do its compile-time arguments grow without end?")
            if len(self._names) >= MAX_INSTANCES:
                raise error(f"instantiating {name}: more than {MAX_INSTANCES} instances of internal kernels")
            self._names[key] = name
            self._pending.append((k, generics, name, chain))
        return self._names[key]

    def take(self) -> Iterator[tuple[KernelInfo, dict[str, Binding], str]]:
        """Each queued instance once, including those queued while lowering earlier ones."""
        while self._pending:
            k, generics, name, self._chain = self._pending.pop(0)
            yield k, generics, name


@dataclass
class Frame:
    """The wasm function being emitted: its locals (parameters first) and which are in scope, its
    labels, the temporaries of the current statement, and the list code is emitted into."""

    result: str | None = None
    locals: list[tuple[str, str]] = field(default_factory=list)
    live: set[str] = field(default_factory=set)
    labels: set[str] = field(default_factory=set)
    temps: list[str] = field(default_factory=list)
    body: list[Stmt] = field(default_factory=list)
    # shared loads (Lowerer.load_once): (op, offset, address) -> the local holding the value, for
    # the statements emitted so far in `body` since the last control flow, store or call; and loads
    # handed out as a `local.tee` not yet emitted
    loads: dict[tuple[str, int, Instr], str] = field(default_factory=dict)
    pending: list[tuple[tuple[str, int, Instr], str]] = field(default_factory=list)
    shared: set[str] = field(default_factory=set)  # the locals of load_once: each set once, never changed

    def params(self, params: list[tuple[str, str]]) -> None:
        """Declare the parameters (in scope for the whole function; params and locals share one namespace)."""
        self.locals = list(params)
        self.live = {n for n, _ in params}

    def new_local(self, name: str, wasm_type: str) -> str:
        """A wasm local for a new binding: reuse one of the same name and type that is out of scope."""
        for k in range(len(self.locals) + 1):
            cand = name if k == 0 else f"{name}_{k}"
            entry = next((t for n, t in self.locals if n == cand), None)
            if entry is None:
                self.locals.append((cand, wasm_type))
                break
            if entry == wasm_type and cand not in self.live:
                break
        self.live.add(cand)
        return cand

    def label(self, base: str) -> str:
        k = 0
        while (label := base if k == 0 else f"{base}_{k}") in self.labels:
            k += 1
        self.labels.add(label)
        return label

    @contextmanager
    def into(self, body: list[Stmt]) -> Iterator[None]:
        """Emit into `body` (a loop's or an if arm's) for the duration."""
        saved, self.body = self.body, body
        self.forget_loads()
        try:
            yield
        finally:
            self.body = saved
            self.forget_loads()

    def forget_loads(self) -> None:
        """No shared load is reused past this point (its local stays allocated: code built before
        may still read it)."""
        self.loads.clear()
        self.pending.clear()

    def emitted(self, s: Stmt) -> None:
        """Keep the shared loads valid after `s`: a `local.set` of plain operations makes the loads
        it tees reusable and forgets those from the local it sets; anything else but a comment
        (control flow, stores, calls) forgets them all."""
        if isinstance(s, Comment):
            return
        if not (isinstance(s, Instr) and s.op == "local.set") or _writes_memory(s):
            self.forget_loads()
            return
        teed = {x.imms[0] for x in _walk(s) if x.op == "local.tee"} | {s.imms[0]}
        for entry in [e for e in self.pending if f"${e[1]}" in teed]:
            self.pending.remove(entry)
            self.loads[entry[0]] = entry[1]
        set_local = s.imms[0]
        for key in [k for k in self.loads if set_local in _locals_read(k[2])]:
            del self.loads[key]


def _locals_read(code: Instr) -> set[str]:
    """The locals an expression reads ("$name")."""
    return {x.imms[0] for x in _walk(code) if x.op == "local.get"}


def _known(v: Val) -> bool:
    """A compile-time integer."""
    return v.const is not None and v.code is None


# Scalar integer operators without effects or traps: an operand made only of these (and local
# reads) may be dropped when its value cannot matter (x * 0).
_PURE_INT = {f"{t}.{op}" for t in ("i32", "i64") for op in ("const", "add", "sub", "mul", "and", "or", "xor", "shl",
                                                          "shr_s", "shr_u")}


def _i16_units(q: QuantFormat, act_max: int) -> int:
    """Q.u16: how many lane groups' products hdot7 may add in one i16 lane (two products each,
    |activation| <= act_max), a power of two up to a block's lane groups, or a sub-block's where
    each has its own integer scale (pairsum multiplies a sub-block's sums by it): the codes' largest
    where the zero comes off with the activations' sums (Q.block_zero's types), else the largest
    |code - zero| (hdot7z's difference; Q6_K's -32..31). 0 for a type without codes."""
    if q.codes is None:
        return 0
    lo, hi = q.value_range
    largest = max(-lo, hi) if q.sub_scales is not None or not isinstance(q.codes[1], Int) else q.code_max
    n = max(1, 32767 // (2 * max(largest, 1) * act_max))
    span = q.group * (q.sub if q.sub_scales is not None else q.kernel.block) // 16
    return min(1 << (n.bit_length() - 1), span)


def _nib16(q: QuantFormat, subs: bool = False, act_max: int = 127) -> bool:
    """Q.nib16: a block of 32 whose codes (QuantFormat.codes) are nib() of the bytes at the start of
    its packed values, less a constant zero, with no sub-block scales between: Q4_0, Q4_1, Q4_K.
    `subs`: Q.nibss, the same codes under sub-block scales of 16 (SIMD128's Q2_K, and Q3_K's with
    their zero of 4), whose lanes of four products of codes and of the zero (idotns, idotnsz) stay
    within i16: 4 * (15 + zero) * act_max at most."""
    codes = q.codes
    return (codes is not None and q.group == 1 and (q.sub_scales is not None) == subs and q.kernel.block == 32
            and isinstance(codes[0], Call) and codes[0].func == "nib" and isinstance(codes[1], Int)
            and (not subs or (q.sub == 16 and 4 * (15 + codes[1].value) * act_max <= 32767))
            and q.kernel.value_offset(codes[0].field) == 0)


def _int_scales(q: QuantFormat) -> bool:
    """Q.int_scales: the grouped layout of a super-block record whose kernel blocks scale by an
    unsigned byte I under the super-block's F (Q4_K, Q5_K; the offset too, if any), so the kernels
    may take I into the integer dot (pairsum) and F once per super-block: the rowscale_f,
    rowoffset_f, rowscale_pairs and rowrecord operations."""
    rec = q.record
    return (q.group > 1 and rec is not None and "scale" in rec.factors
            and all(x.i is not None and not x.signed for x in rec.factors.values()))


def _simplified(tree: list) -> int | str | list:
    """An item count's [op, left, right] without the identities a quant type's constants leave
    ((n + Q.group - 1) / Q.group with a group of 1: n), so the manifest says what hosts compute."""
    op, a, b = tree
    if op in ("+", "-") and b == 0 or op in ("*", "/") and b == 1:
        return a
    if op == "-" and isinstance(b, int) and isinstance(a, list) and a[0] == "+" and isinstance(a[2], int):
        return _simplified(["+", a[1], a[2] - b])  # (x + c) - d
    return tree


def _arith(op: str, a: Tree | None, b: Tree | None) -> Tree | None:
    """[op, a, b] of two formulas (+ - * / on i32 arguments, trees of _count_tree), folded where
    both are numbers; None (unknown: a `?` dimension) if either is."""
    if a is None or b is None:
        return None
    if isinstance(a, int) and isinstance(b, int):
        return evaluate([op, a, b], {}, exact=True)  # as the hosts will
    if op in ("+", "*") and isinstance(a, int) and a == (0 if op == "+" else 1):
        return b
    return _simplified([op, a, b])


def _int_identity(op: str, a: Val, b: Val) -> Val | None:
    """x * 1, 1 * x, 0 + x and x * 0 on scalar integers (unrolled indices make them: `r * k * 4`
    with r = 0 or 1), so the WAT reads as written by hand and no engine need fold them. None if
    no identity applies; x * 0 only where x has no effect to keep."""
    if not T.is_int(a.type) or T.is_vector(a.type) or b.type != a.type:
        return None
    if op == "*":
        for one, x in ((a, b), (b, a)):
            if _known(one) and one.const == 1:
                return x
            if _known(one) and one.const == 0 and (x.code is None or all(
                    i.op == "local.get" or i.op in _PURE_INT for i in _walk(x.code))):
                return Val(None, a.type, 0)
    if op == "+" and _known(a) and a.const == 0:
        return b
    return None


def _writes_memory(code: Instr) -> bool:
    """A store, call, atomic or memory operation anywhere in `code`."""
    return any(x.op.startswith(("call", "memory.")) or ".store" in x.op or ".atomic" in x.op for x in _walk(code))


class Lowerer:
    """Lowers every exported kernel of a checked program for one target."""

    def __init__(self, checked: Checked, target: Target, tune: dict[str, dict[str, int]],
                 memo: dict[tuple[str, str, str], Reused] | None = None) -> None:
        self.c = checked
        self.target = target
        self.tune = tune
        self.memo = memo if memo is not None else {}  # (target, role, name) -> its lowering
        self._record: Reused | None = None  # that of the function being lowered
        self._quant_props: dict[str, dict[str, int]] = {}  # _props by quant type
        self.funcs: list[Func] = []
        self.exports: list[Export] = []
        self.jobs: list[Export] = []  # the job table, in index order
        self.instances = Instances(tune)
        self._inlining: list[str] = []  # inline kernels being expanded, outermost first
        self._inline_locals: list[set[str]] = []  # locals each expansion declared
        self._copies = 1  # copies the enclosing unrolls (inline expansions included) make of this statement
        self._span: A.Span | None = None
        self._quant: str | None = None  # the quant type of the function being lowered, if any
        self._frame = Frame()
        self._scopes: list[dict[str, Binding]] = []
        self._source_lines = checked.source.splitlines()  # for the comments (split once, not per comment)

    # ---- module ----------------------------------------------------------------------------------
    def run(self) -> list[Func]:
        for k in self.c.kernels.values():
            if not k.ast.exported:
                continue
            for quant in self._quant_instances(k):
                generics: dict[str, Binding] = {}
                if quant is not None:
                    generics[k.ast.generics[0].name] = quant
                tune = self.instances.values(k, quant)
                generics.update({n: Val(None, "i32", v) for n, v in tune.items()})
                name = self.instances.export(k, quant)
                contract = self._lower_func(k, generics, name, "export")
                job = None
                if k.job:
                    job = self.instances.job(k, quant)
                    self._lower_func(k, generics, job, "job")
                    self.jobs.append(Export(job, k, quant, tune, k.job_params))
                self.exports.append(Export(name, k, quant, tune, k.ast.params, contract, job))
        for k, generics, name in self.instances.take():
            self._lower_func(k, generics, name, "internal")
        return self.funcs

    def _quant_instances(self, k: KernelInfo) -> list[QuantFormat | None]:
        if not k.ast.generics:
            return [None]
        return list(self.c.quants.values())

    # ---- scopes and locals -----------------------------------------------------------------------
    def error(self, message: str) -> DslError:
        return DslError(self._span, message)

    def _lookup(self, name: str) -> Binding | None:
        for scope in reversed(self._scopes):
            if name in scope:
                return scope[name]
        if name in self.c.consts:
            return self.c.consts[name]
        if name in self.target.constants:  # untyped: adapts to the operand it meets, like a literal
            if self._record is not None:
                self._record.consts[name] = self.target.constants[name]
            return Val(None, T.INT_LIT, self.target.constants[name])
        if name in layout.FIXED:  # a named global in the WAT, as hand-written engines name their state
            return Val(I("global.get", f"${name}"), "i32")
        return None

    def _new_local(self, name: str, type_: str) -> str:
        local = self._frame.new_local(name, T.wasm_type(type_))
        if self._inline_locals:
            self._inline_locals[-1].add(local)
        return local

    def _bind(self, name: str, b: Binding) -> None:
        self._scopes[-1][name] = b

    @contextmanager
    def _scope(self) -> Iterator[None]:
        """A block's bindings: its locals go out of scope (reusable) when it ends."""
        self._scopes.append({})
        try:
            yield
        finally:
            for b in self._scopes.pop().values():
                for n in (b.names if isinstance(b, Array) else (b.name,) if isinstance(b, Local) else ()):
                    if n not in self._frame.shared:  # a shared load's local outlives a name for it
                        self._frame.live.discard(n)

    @contextmanager
    def _context(self, frame: Frame | None, scopes: list[dict[str, Binding]], span: A.Span | None) -> Iterator[None]:
        """Lower a function (a new frame) or an inline expansion (the caller's frame, new scopes)."""
        saved = (self._frame, self._scopes, self._span)
        self._frame, self._scopes, self._span = frame or self._frame, scopes, span
        try:
            yield
        finally:
            self._frame, self._scopes, self._span = saved

    def emit(self, s: Stmt) -> None:
        self._frame.body.append(s)
        self._frame.emitted(s)

    # ---- ops.Ctx ---------------------------------------------------------------------------------
    def materialize(self, v: Val, type_: str | None = None) -> Instr:
        """The code of `v` as a value of `type_` (a literal takes the type it is given)."""
        t = type_ or v.type
        if v.type in (T.INT_LIT, T.FLOAT_LIT) or (v.code is None and v.const is not None):
            if t in (T.INT_LIT, "void"):
                t = "i32"
            if t == T.FLOAT_LIT:
                t = "f32"
            if T.is_vector(t):
                return self._target_op("splat")(self, t, [v]).code
            if T.is_int(t) and not isinstance(v.const, int):
                raise self.error(f"a float constant cannot be used as {t}")
            if not T.fits(v.const, t):
                raise self.error(f"{v.const} does not fit in {t}")
            return I(f"{t}.const", number(float(v.const) if T.is_float(t) else v.const))
        if type_ and v.type != type_:
            raise self.error(f"expected {type_}, got {v.type}")
        assert v.code is not None
        return v.code

    def load_once(self, op: str, offset: int, addr: Instr, shl: int = 0) -> Instr:
        """`op` (a v128 load) at `addr` + `offset`, loaded once for the statements that follow while
        nothing can change it (Frame.emitted): a later load of the same address (integer arithmetic
        of locals and constants) + offset reads the value from a local, which is dropped where no
        later load reads it (wat.untee_unread). Engines need not merge equal loads: V8 (TurboFan in
        Node 20) loads every one, so a GEMM tile's rows each loaded the activations they share again
        (a mat-vec tile of two rows: 12 loads per block pass where 8 differ, and vectors spilled),
        and the grouped layout's kernels loaded a block's codes once per nibble and its activations
        once per lane group (relaxed qmatvec at 256x4096 in Node 20: Q4_0 1.13x, Q4_K 1.11x, Q6_K
        1.13x, Q5_K 1.02x with them merged; wasmtime and Chromium 156 merge them already: 0.98-1.02x).
        DSL vector loads go through here too. `shl` > 0: the loaded i16 lanes shifted left by it,
        shared so (SIMD128's scaled activations for idotn: one shift per block for a tile's rows)."""
        load = Instr(op, (f"offset={offset}",) if offset else (), (addr,))
        if shl:
            load = I("i16x8.shl", load, I("i32.const", str(shl)))
            op = f"{op} << {shl}"
        if (any(x.op != "local.get" and x.op not in _PURE_INT for x in _walk(addr))
                or any(name.removeprefix("$") in self._frame.temps for name in _locals_read(addr))):
            return load
        key = (op, offset, addr)
        if key in self._frame.loads:
            return I("local.get", f"${self._frame.loads[key]}")
        tmp = self._frame.new_local("loaded", "v128")  # never freed: code built earlier may read it
        self._frame.shared.add(tmp)
        self._frame.pending.append((key, tmp))
        return I("local.tee", f"${tmp}", load)

    def _shared_load(self, code: Instr, t: str) -> Local | None:
        """A load_once local as the binding of a name given `code` that reads it (its first read, a
        `local.tee`, emitted as the local's set): no copy of it under the name."""
        if code.op not in ("local.get", "local.tee") or code.imms[0][1:] not in self._frame.shared:
            return None
        if code.op == "local.tee":
            self.emit(I("local.set", code.imms[0], code.args[0]))
        return Local(code.imms[0][1:], t, False)

    def reuse(self, v: Val) -> tuple[Instr, Instr]:
        """Code for `v` twice: a constant or local read repeats, anything else goes through a temp."""
        code = self.materialize(v)
        if code.op in ("local.get",) or code.op.endswith(".const"):
            return code, code
        tmp = self._new_local("t", v.type)
        self._frame.temps.append(tmp)  # live until the end of the current statement
        return I("local.tee", f"${tmp}", code), I("local.get", f"${tmp}")

    # ---- functions -------------------------------------------------------------------------------
    def _lower_func(self, k: KernelInfo, generics: dict[str, Binding], name: str, role: str) -> Contract | None:
        """Lower one instance of `k` as an "export", an "internal" function or, for a parallel kernel,
        its pool "job" (or reuse its lowering from another build: self.memo). Returns an export's
        Contract."""
        key = (self.target.name, role, name)
        if (done := self.memo.get(key)) is not None and self._still_holds(done):
            for callee, args in done.internals:
                self.instances.internal(callee, args, self.error)
            self.funcs.append(done.func)
            return done.contract
        self._record = record = Reused()
        try:
            record.contract = self._lower_body(k, generics, name, role)
        finally:
            self._record = None
        record.func = self.funcs[-1]
        self.memo[key] = record
        return record.contract

    def _still_holds(self, done: Reused) -> bool:
        """Whether what `done`'s body read beyond its name is the same in this build: its tune
        values, the exports it calls, and what it took from the target (another flavor's build
        reuses a function unless one of its ops, constants or quant properties differs there)."""
        return all(tune_for(self.tune, kernel, quant).get(param) == value for kernel, quant, param, value in done.reads) \
            and all(self.instances.export(k, q) == name for k, q, name in done.exports) \
            and all(self.target.ops.get(name) is op for name, op in done.ops.items()) \
            and all(self.target.constants.get(name) == value for name, value in done.consts.items()) \
            and all(self._props(q)[prop] == value for (_, prop), (q, value) in done.props.items())

    def _lower_body(self, k: KernelInfo, generics: dict[str, Binding], name: str, role: str) -> Contract | None:
        frame = Frame(result=T.resolve(k.ast.ret) if k.ast.ret else None)
        self._quant = next((v.name for v in generics.values() if isinstance(v, QuantFormat)), None)
        with self._context(frame, [dict(generics)], k.ast.span), self._scope():
            params: list[tuple[str, str]] = []
            for p in k.job_params if role == "job" else k.ast.params:
                self._span = p.span
                if p.packed:
                    quant = self._quant_of(p)
                    planes = {plane: f"{p.name}_{plane}" for plane in quant.planes}
                    params += [(n, "i32") for n in planes.values()]
                    self._bind(p.name, Packed(quant, planes))
                else:
                    t = T.resolve(p.type)
                    params.append((p.name, T.wasm_type(t)))
                    self._bind(p.name, Local(p.name, t, False))
            par, contract = k.ast.parallel, None
            if role == "job":  # the chunk [begin, end) comes from the pool; the rest from JOB_ARGS words
                params = self._job_args(par, params)
            else:
                frame.params(params)
                if par is not None:  # called directly: one chunk of every item
                    self._span = par.span
                    self._bind(par.begin, Val(None, "i32", 0))
                    self._bind(par.end, self._coerce(self._expr(par.count), "i32"))
                if role == "export":
                    contract = self._contract(k)
            try:
                self._block(k.ast.body)
                returned = False
            except _Return:
                returned = True
            if frame.result and not returned and not _ends_in_return(k.ast.body):
                raise DslError(k.ast.span, f"{k.name} returns {frame.result} but its end can be reached"
                                           " without 'return'")
        where = f"{Path(k.ast.span.file).name}:{k.ast.span.line}"
        shown = f"{k.ast.name}{'[' + ', '.join(_show(v) for v in generics.values()) + ']' if generics else ''}"
        if role == "job":
            shown = f"{shown} on the thread pool: its {par.items} {par.begin}..{par.end}"
        doc = [f"{shown} -- {where}"] + [f"  {d}" for d in k.doc]
        result = T.wasm_type(frame.result) if frame.result else None  # f32x4 -> v128
        body = untee_unread(drop_dead_stores(forward_copies(frame.body, {n for n, _ in params}), {n for n, _ in params}))
        body, consts = share_vector_constants(body, {n for n, _ in frame.locals})
        named = locals_named(body)
        local_vars = [(n, t) for n, t in frame.locals[len(params):] if f"${n}" in named]
        self.funcs.append(Func(name, params, result, local_vars + consts, body,
                               export=name if role == "export" else None, doc=doc, span=k.ast.span))
        return contract

    def _job_args(self, par: A.ParallelDecl, words: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """A job's parameters are its chunk's bounds; its other arguments are loaded from the
        JOB_ARGS words into locals of their own names."""
        params = [(par.begin, "i32"), (par.end, "i32")]
        self._frame.params(params + words)
        for n, _ in params:
            self._bind(n, Local(n, "i32", False))
        self.emit(Comment("arguments from the JOB_ARGS words, one 4-byte word each"))
        for i, (name, wt) in enumerate(words):
            load = Instr(f"{wt}.load", (f"offset={4 * i}",) if i else (), (I("global.get", "$JOB_ARGS"),))
            self.emit(I("local.set", f"${name}", load))
        return params

    def _contract(self, k: KernelInfo) -> Contract:
        """The export's Contract, its parameters bound (formulas from check.Extent and the doc's
        multiples, with constants, tune values and Q's properties folded)."""
        out = Contract(self._count_tree(k.ast.parallel.count) if k.ast.parallel else None)
        for p in k.ast.params:
            if (e := k.extents.get(p.name)) is None:
                continue
            if p.packed:  # each plane: its bytes per kernel block, rows padded to whole groups
                q = self._quant_of(p)
                rows, cols = (None if d is None else self._count_tree(d) for d in e.parts[0][1])
                padded = _arith("*", _arith("/", _arith("+", rows, q.group - 1), q.group), q.group)
                blocks = _arith("*", padded, _arith("/", cols, q.kernel.block))
                for plane, (_, per_block) in q.planes.items():
                    out.extents[f"{p.name}_{plane}"] = _arith("*", blocks, per_block)
                continue
            total: Tree | None = 0
            for kind, dims in e.parts:
                part: Tree | None = EXTENT_TYPES[kind]
                for d in dims:
                    part = _arith("*", part, None if d is None else self._count_tree(d))
                total = _arith("+", total, part)
            out.extents[p.name] = total
        for name, e in k.multiples.items():
            v = self._expr(e)
            if v.code is not None or not isinstance(v.const, int) or v.const < 1:
                raise DslError(e.span, f"{k.name}: {name}'s 'a multiple of' needs a positive constant")
            out.multiples[name] = v.const
        for name, e in k.minimums.items():
            out.minimums[name] = self._count_tree(e)
        return out

    def _count_tree(self, e: A.Expr) -> int | str | list:
        """The item count as the manifest writes it for hosts: a number, a parameter's name, or
        [op, left, right] with op one of + - * / % on i32 (check.py allows nothing else), or in an
        extent ["i32", p, index]: the i32 at that index of pointer p; constants, tune values and
        Q.block are folded."""
        if isinstance(e, A.Index):
            assert isinstance(e.base, A.Name), e
            return ["i32", e.base.id, self._count_tree(e.indices[0])]
        v = self._expr(e)
        if v.code is None and isinstance(v.const, int):
            return v.const
        if isinstance(e, A.Name):
            return e.id
        assert isinstance(e, A.Binary), e
        return _simplified([e.op, self._count_tree(e.left), self._count_tree(e.right)])

    def _quant_of(self, p: A.Param) -> QuantFormat:
        b = self._lookup(p.type)
        if not isinstance(b, QuantFormat):
            raise DslError(p.span, f"'packed {p.type}': {p.type} is not a quant type parameter")
        return b

    # ---- statements ------------------------------------------------------------------------------
    def _block(self, stmts: tuple[A.Stmt, ...]) -> None:
        with self._scope():
            for s in stmts:
                self._stmt(s)

    def _comment(self, s: A.Node) -> None:
        self._comment_at(s.span)

    def _comment_at(self, span: A.Span) -> None:
        """`;; kernels.dsl:LINE: source text` before the code of the statement at `span`."""
        line = self._source_lines[span.line - 1].strip()
        if len(line) > 90:
            line = line[:87] + "..."
        self.emit(Comment(f"{Path(span.file).name}:{span.line}: {line}", span))

    def _stmt(self, s: A.Stmt) -> None:
        self._span = s.span
        outer_temps = len(self._frame.temps)
        try:
            self._stmt_inner(s)
        finally:
            for t in self._frame.temps[outer_temps:]:
                self._frame.live.discard(t)
            del self._frame.temps[outer_temps:]

    def _stmt_inner(self, s: A.Stmt) -> None:
        if isinstance(s, A.LetStmt):
            v = self._expr(s.value)
            t = self._declared(s.type, v)
            if v.const is not None and v.code is None:
                self._bind(s.name, Val(None, t, v.const))
                return
            self._comment(s)
            code = self.materialize(v, t)
            if (held := self._shared_load(code, t)) is not None:
                self._bind(s.name, held)
                return
            local = self._new_local(s.name, t)
            self.emit(I("local.set", f"${local}", code))
            self._bind(s.name, Local(local, t, False))
        elif isinstance(s, A.VarStmt):
            self._comment(s)
            v = self._expr(s.value)
            t = self._declared(s.type, v)
            if s.size is None:
                local = self._new_local(s.name, t)
                self.emit(I("local.set", f"${local}", self.materialize(v, t)))
                self._bind(s.name, Local(local, t, True))
                return
            n = self._const_int(s.size, "an array size")
            if not 1 <= n <= 64:
                raise self.error(f"array size must be 1..64, got {n}")
            names = tuple(self._new_local(f"{s.name}_{k}", t) for k in range(n))
            code = self.materialize(v, t)
            for local in names:
                self.emit(I("local.set", f"${local}", code))
            self._bind(s.name, Array(names, t))
        elif isinstance(s, A.AssignStmt):
            self._comment(s)
            self._assign(s)
        elif isinstance(s, A.ForStmt):
            self._for(s)
        elif isinstance(s, A.WhileStmt):
            self._while(s)
        elif isinstance(s, A.UnrollStmt):
            start = self._const_int(s.start, "an unroll bound")
            stop = self._const_int(s.stop, "an unroll bound")
            copies = self._copies * max(stop - start, 1)
            if stop - start > MAX_UNROLL or copies > MAX_COPIES:
                raise self.error(f"unroll of {stop - start} copies ({copies} with the unrolls around it); at most "
                                 f"{MAX_UNROLL}, and {MAX_COPIES} nested")
            saved, self._copies = self._copies, copies
            try:
                for k in range(start, stop):
                    with self._scope():
                        self._bind(s.var, Val(None, "i32", k))
                        self._block(s.body)
            finally:
                self._copies = saved
        elif isinstance(s, A.IfStmt):
            self._if(s)
        elif isinstance(s, A.ReturnStmt):
            self._return(s)
        elif isinstance(s, A.ExprStmt):
            self._comment(s)
            v = self._expr(s.expr)
            if v.code is not None:  # none: an inlined kernel that returns nothing has emitted its body
                self.emit(v.code if v.type == "void" else I("drop", v.code))

    def _declared(self, type_name: str | None, v: Val) -> str:
        if type_name is None:
            if v.type == "void":
                raise self.error("this expression has no value")
            return {T.INT_LIT: "i32", T.FLOAT_LIT: "f32"}.get(v.type, v.type)
        t = T.resolve(type_name)
        if t is None:
            raise self.error(f"unknown type {type_name!r}")
        if v.type in (T.INT_LIT, T.FLOAT_LIT):
            if v.type == T.FLOAT_LIT and T.is_int(t):
                raise self.error(f"a float value cannot initialize a {t}")
            return t
        if v.type != t:
            raise self.error(f"type mismatch: declared {t}, value is {v.type}")
        return t

    def _assign(self, s: A.AssignStmt) -> None:
        tgt = s.target
        if isinstance(tgt, A.Name):
            b = self._lookup(tgt.id)
            if not isinstance(b, Local) or not b.mutable:
                raise DslError(tgt.span, f"cannot assign to {tgt.id!r}: only 'var' locals can change")
            local, t = b.name, b.type
        elif isinstance(tgt, A.Index) and isinstance(tgt.base, A.Name):
            b = self._lookup(tgt.base.id)
            if not isinstance(b, Array):
                raise DslError(tgt.span, f"{tgt.base.id!r} is not a register array")
            local, t = b.names[self._array_index(b, tgt)], b.type
        else:
            raise DslError(tgt.span, "can only assign to a var or an element of a register array")
        v = self._expr(s.value)
        if s.op != "=":
            v = self._binop(s.op[0], Val(I("local.get", f"${local}"), t), v)
        self.emit(I("local.set", f"${local}", self.materialize(v, t)))

    def _array_index(self, b: Array, node: A.Index) -> int:
        if len(node.indices) != 1:
            raise DslError(node.span, "a register array takes one index")
        k = self._const_int(node.indices[0], "a register array index")
        if not 0 <= k < len(b.names):
            raise DslError(node.span, f"index {k} out of range 0..{len(b.names) - 1}")
        return k

    def _for(self, s: A.ForStmt) -> None:
        self._comment(s)
        start = self._expr(s.start)
        stop = self._expr(s.stop)
        for v, what in ((start, "start"), (stop, "end")):
            if v.type not in ("i32", T.INT_LIT):
                raise self.error(f"loop {what} must be i32, not {v.type}")
        step = 1 if s.step is None else self._const_int(s.step, "a loop step")
        if step <= 0:
            raise self.error(f"loop step must be a positive constant, got {step}")
        if (isinstance(s.stop, A.Binary) and s.stop.op == "+" and s.stop.left == s.start
                and _known(r := self._expr(s.stop.right)) and r.const == 1):
            self._one_round(s, start)
            return
        with self._scope():
            var = self._new_local(s.var, "i32")
            end = self.materialize(stop, "i32")
            if not (end.op == "local.get" or end.op.endswith(".const")):
                end_local = self._new_local(f"{s.var}_end", "i32")
                self.emit(I("local.set", f"${end_local}", end))
                end = I("local.get", f"${end_local}")
            self.emit(I("local.set", f"${var}", self.materialize(start, "i32")))
            self._bind(s.var, Local(var, "i32", False))
            step_code = I("local.set", f"${var}", I("i32.add", I("local.get", f"${var}"), I("i32.const", step)))
            if _known(start) and _known(stop) and start.const < stop.const:
                self._do_loop(s.var, lambda: I("i32.lt_s", I("local.get", f"${var}"), end), s.body, [step_code])
            else:
                self._loop(s.var, lambda: I("i32.ge_s", I("local.get", f"${var}"), end), s.body, [step_code])

    def _one_round(self, s: A.ForStmt, start: Val) -> None:
        """`for k in x..x + 1`, a loop of one round (qgtile's blocks of a super-block, for a type
        without them): its body once, k bound to x (no loop, no copy when x is a local), so the code
        is what the body alone would give."""
        with self._scope():
            if start.code is not None and start.code.op == "local.get":
                self._bind(s.var, Local(start.code.imms[0][1:], "i32", False))
            else:
                var = self._new_local(s.var, "i32")
                self.emit(I("local.set", f"${var}", self.materialize(start, "i32")))
                self._bind(s.var, Local(var, "i32", False))
            self._block(s.body)

    def _do_loop(self, name: str, again_test: Callable[[], Instr], body: tuple[A.Stmt, ...], after: list[Instr]) -> None:
        """(loop $NAME_loop BODY AFTER (br_if $NAME_loop AGAIN)): a loop known to run at least once
        (constant bounds) tests at its end: one branch a round, not two, and V8 unrolls a short one
        keeping each round's code apart (qtile's four one-block rounds, qmatvec Q8_0 rows = 2 at
        256x4096 on simd128 in V8: 1.20x the seed-style kernel, 1.14x with the test first)."""
        again = self._frame.label(f"{name}_loop")
        inner = Block("loop", again)
        self.emit(inner)
        with self._frame.into(inner.body):
            try:
                self._block(body)
            except _Return:
                pass
        inner.body.extend(after)
        inner.body.append(I("br_if", f"${again}", again_test()))

    def _while(self, s: A.WhileStmt) -> None:
        self._comment(s)

        def exit_test() -> Instr:
            cond = self._expr(s.cond)
            if cond.type not in ("i32", T.INT_LIT):
                raise DslError(s.cond.span, f"a condition must be i32, not {cond.type}")
            return I("i32.eqz", self.materialize(cond, "i32"))

        self._loop("while", exit_test, s.body, [])

    def _loop(self, name: str, exit_test, body: tuple[A.Stmt, ...], after: list[Instr]) -> None:
        """(block $NAME_done (loop $NAME_loop (br_if $NAME_done EXIT) BODY AFTER (br $NAME_loop)));
        the exit test is lowered inside the loop, so it is evaluated on every round."""
        done, again = self._frame.label(f"{name}_done"), self._frame.label(f"{name}_loop")
        outer, inner = Block("block", done), Block("loop", again)
        outer.body.append(inner)
        self.emit(outer)
        with self._frame.into(inner.body):
            inner.body.append(I("br_if", f"${done}", exit_test()))
            try:
                self._block(body)
            except _Return:
                pass
        inner.body.extend(after)
        inner.body.append(I("br", f"${again}"))

    def _if(self, s: A.IfStmt) -> None:
        cond = self._expr(s.cond)
        if cond.type not in ("i32", T.INT_LIT):
            raise DslError(s.cond.span, f"a condition must be i32, not {cond.type}")
        known = cond.const is not None and cond.code is None
        if s.static:
            if not known:
                raise DslError(s.cond.span, "'static if' needs a compile-time condition")
            for stmt in s.then if cond.const else s.orelse:
                self._stmt(stmt)
            return
        if known:  # decided at compile time: emit one arm
            self._block(s.then if cond.const else s.orelse)
            return
        self._comment(s)
        node = If(self.materialize(cond, "i32"), [], [])
        self.emit(node)
        for arm, target in ((s.then, node.then), (s.orelse, node.orelse)):
            with self._frame.into(target):
                try:
                    self._block(arm)
                except _Return:
                    pass

    def _return(self, s: A.ReturnStmt) -> None:
        self._comment(s)
        want = self._frame.result
        if s.value is None:
            if want is not None:
                raise self.error(f"this kernel returns {want}; 'return' needs a value")
            self.emit(I("return"))
        else:
            if want is None:
                raise self.error("this kernel returns nothing; remove the value or declare '-> TYPE'")
            self.emit(I("return", self.materialize(self._coerce(self._expr(s.value), want), want)))
        raise _Return()

    # ---- expressions -----------------------------------------------------------------------------
    def _const_int(self, e: A.Expr, what: str) -> int:
        v = self._expr(e)
        if not isinstance(v.const, int) or v.code is not None:
            raise DslError(e.span, f"{what} must be a compile-time integer")
        return v.const

    def _coerce(self, v: Val, t: str) -> Val:
        if v.type == t:
            return v
        if v.type == T.INT_LIT and (T.is_int(t) or T.is_float(t)) or v.type == T.FLOAT_LIT and T.is_float(t):
            return Val(None, t, v.const) if T.is_scalar(t) else Val(self.materialize(v, t), t, v.const)
        raise self.error(f"expected {t}, got {v.type}")

    def _expr(self, e: A.Expr) -> Val:
        saved = self._span
        self._span = e.span
        try:
            return self._expr_inner(e)
        finally:
            self._span = saved

    def _expr_inner(self, e: A.Expr) -> Val:
        if isinstance(e, A.IntLit):
            return Val(None, T.INT_LIT, e.value)
        if isinstance(e, A.FloatLit):
            return Val(None, T.FLOAT_LIT, e.value)
        if isinstance(e, A.Name):
            b = self._lookup(e.id)
            if isinstance(b, Val):
                return b
            if isinstance(b, Local):
                return Val(I("local.get", f"${b.name}"), b.type)
            if b is None:
                raise self.error(f"unknown name {e.id!r}")
            what = {Array: "a register array (index it)", Packed: "a packed matrix (use a plane, e.g. .q)",
                    QuantFormat: "a quant type"}[type(b)]
            raise self.error(f"{e.id!r} is {what}, not a value")
        if isinstance(e, A.Binary):
            return self._binop(e.op, self._expr(e.left), self._expr(e.right))
        if isinstance(e, A.Unary):
            v = self._expr(e.operand)
            if e.op == "~" and not T.is_int(v.type):
                raise self.error(f"'~' needs an integer, not {v.type}")
            if v.const is not None and v.code is None:
                return Val(None, v.type, wrap(-v.const if e.op == "-" else ~v.const, v.type))
            if e.op == "-":
                if T.is_scalar(v.type) and T.is_int(v.type):
                    return self._binop("-", Val(None, v.type, 0), v)
                return self._target_op("neg")(self, None, [v])
            if T.is_vector(v.type):
                return Val(I("v128.not", self.materialize(v)), v.type)
            return self._binop("^", v, Val(None, v.type, -1))
        if isinstance(e, A.Attr):
            return self._attr(e)
        if isinstance(e, A.Index):
            if isinstance(e.base, A.Name) and isinstance(b := self._lookup(e.base.id), Array):
                return Val(I("local.get", f"${b.names[self._array_index(b, e)]}"), b.type)
            if isinstance(e.base, A.Name) and any(t.name == e.base.id for t in self.c.program.tables):
                raise self.error(f"{e.base.id} is a codebook table: a quant type's unpack reads it, not a kernel")
            if isinstance(e.base, A.Name) and b is None:
                raise self.error(f"unknown name {e.base.id!r}")
            raise self.error("only register arrays can be indexed")
        if isinstance(e, A.Call):
            return self._call(e)
        raise self.error(f"unsupported expression {type(e).__name__}")

    def _binop(self, op: str, a: Val, b: Val) -> Val:
        lits = (T.INT_LIT, T.FLOAT_LIT)
        shift = op in ("<<", ">>")
        if a.type in lits and b.type not in lits and not shift:
            a = self._coerce(a, b.type)
        elif b.type in lits and a.type not in lits and not shift:
            b = self._coerce(b, a.type)
        if a.const is not None and b.const is not None and a.code is None and b.code is None:
            folded = fold(op, a, b)
            if folded is not None:
                return folded
        if a.type in lits:
            a = self._coerce(a, "i32" if a.type == T.INT_LIT else "f32")
        if T.is_int(a.type) and b.const == 0 and b.code is None and op in ("+", "-", "|", "^", "<<", ">>"):
            return a  # x + 0 and friends: common after target constants fold (ACT_ZERO on simd128)
        if (simple := _int_identity(op, a, b)) is not None:
            return simple
        if op == "+" and T.is_int(a.type) and T.is_vector(a.type) and (is_zero_vector(a) or is_zero_vector(b)):
            return b if is_zero_vector(a) else a  # a zero accumulator passed to an inline kernel
        t = a.type
        if "void" in (a.type, b.type):
            raise self.error("an expression without a value cannot be an operand")
        if shift:
            if not T.is_int(t):
                raise self.error(f"shift of a non-integer {t}")
            want = "i32" if T.is_vector(t) else t
            if b.type not in (want, T.INT_LIT):
                raise self.error(f"shift amount must be {want}, not {b.type}")
        elif b.type not in lits and b.type != t:
            raise self.error(f"type mismatch: {t} {op} {b.type}")
        return self._target_op(op)(self, None, [a, b])

    def _props(self, b: QuantFormat) -> dict[str, int]:
        """Quant type b's properties on this target (Q.<name> in kernels.dsl), worked out once."""
        if b.name not in self._quant_props:
            self._quant_props[b.name] = self._work_out_props(b)
        return self._quant_props[b.name]

    def _work_out_props(self, b: QuantFormat) -> dict[str, int]:
        """_props of b, from this target (its dot scheme and constants) and b's packed layout."""
        codes = b.codes
        zero = codes[1] if codes is not None else Int(0)
        dot7 = int(self.target.dot_scheme(codes is not None) == "i7")
        act_max = self.target.constants["ACT_MAX"]
        g = b.group
        has_zero = int(codes is not None and codes[1] != Int(0))
        # a constant zero that multiplies whole kernel blocks (no sub-block scales between),
        # removed per block as zero * sum(a) where that saves work: on the i7 scheme a second
        # relaxed dot per 16 values, else a subtraction (none for a codebook's zero, folded
        # into its table: MXFP4 on simd128 measured 0.97x with the sums)
        block_zero = int(isinstance(zero, Int) and zero.value != 0 and b.sub_scales is None
                         and (dot7 or not isinstance(b.kernel.unpack, Lookup)))
        int_scales = int(_int_scales(b) and bool(dot7) and not block_zero)
        return {"block": b.kernel.block, "bytes": g * b.kernel.bytes, "has_offset": int(b.offset is not None),
                "has_sub_scales": int(b.sub_scales is not None),
                "sub_scales_at": g * b.kernel.value_offset(SUB_SCALES) if b.sub_scales else 0,
                "dot7": dot7,
                # the grouped layout (quantformat): rows per group, 1 for rows one by one;
                # lane groups of a block (unpack's j: 16 values of a row, or 4 of each of
                # the group's rows); and how many of those hdot7 may add in one i16 lane
                "group": g,
                "units": g * b.kernel.block // 16,
                "u16": _i16_units(b, act_max),
                # a 32-block's two halves of code products add in i16 lanes (idot7p): pairs
                # of both halves at most 4 * code_max * ACT_MAX in magnitude
                "pair16": int(bool(dot7) and b.sub_scales is None and b.kernel.block == 32
                              and 4 * b.code_max * act_max <= 32767),
                # a 32-block's codes as nibbles at the start of its bytes (split order:
                # byte j holds codes j and j + 16) with a constant zero: idotn reads them
                # straight from the 16 bytes on SIMD128's split i16 activations
                "nib16": int(bool(self.target.constants["ACT_SPLIT"]) and _nib16(b)),
                # nib16's layout under sub-block scales of 16: idotns on SIMD128 (idotnsz
                # with a zero, less its products with the activations: nibzeros)
                "nibss": int(bool(self.target.constants["ACT_SPLIT"]) and _nib16(b, True, act_max)),
                # a sub-scaled 32-block's two halves under one widening dot (idotss):
                # SIMD128's split i16 activations, values of at most 64 in magnitude
                "sub16": int(b.sub_scales is not None and bool(self.target.constants["ACT_SPLIT"])
                             and b.kernel.block == 32
                             and 4 * max(-b.value_range[0], b.value_range[1]) * act_max <= 32767),
                # where the relaxed dot-add is one instruction (DOT_ADD, the vnni flavor):
                # a 32-block's two halves of i16-scheme values through idots2's two chains
                "dots2": int(bool(self.target.constants["DOT_ADD"]) and not dot7 and b.sub_scales is None
                             and b.kernel.block == 32),
                "has_zero": has_zero,
                "block_zero": block_zero,
                "zero": zero.value if isinstance(zero, Int) else 0,
                # the zeros block_zero leaves in the dots: a constant (Q6_K's 32 under its
                # sub-block scales; 0 for none), or one stored with each block (q4_onnx's
                # zero point byte)
                "const_zero": zero.value if has_zero and not block_zero and isinstance(zero, Int) else 0,
                "own_zeros": int(has_zero and not isinstance(zero, Int)),
                "int_scales": int_scales,
                # the grouped dots of codes without sub-block scales or a zero but a block's,
                # where the relaxed dot-add is one instruction (DOT_ADD): each row's four
                # products straight into its i32 lane, no i16 pairs (qgtile)
                "adds7": int(bool(self.target.constants["DOT_ADD"]) and bool(dot7) and g > 1
                             and b.sub_scales is None and not (has_zero and not block_zero)),
                # the kernel blocks one F scales under Q.int_scales (a super-block's), else 1
                "sb_blocks": b.record.blocks if int_scales else 1,
                # Q.int_scales: where the offset's I lie in a group's record (rowrecord), a
                # byte per row and block, the group's rows side by side
                "offset_ints_at": g * b.record.factors["offset"].i_at
                                  if (int_scales or b.sub_offsets) and b.offset is not None else 0,
                # an offset per sub-block of 16 (Q2_K's minimums): its integers (2 bytes per
                # kernel block and row at offset_ints_at of the record: qmins) weigh each
                # half's activation sum
                "sub_offsets": int(b.sub_offsets),
                # kernel blocks per super-block record (0: no record)
                "record_blocks": b.record.blocks if b.record is not None else 0,
                # values per stored block (a super-block's 256): a packed row's length is whole ones
                "stored_block": b.block}

    def _attr(self, e: A.Attr) -> Val:
        if isinstance(e.base, A.Name):
            b = self._lookup(e.base.id)
            if isinstance(b, QuantFormat):
                props = self._props(b)
                if e.name not in props:
                    raise self.error(f"quant types have {', '.join(props)} and unpack(), codes(), zeros(); not {e.name!r}")
                if self._record is not None:
                    self._record.props[(b.name, e.name)] = (b, props[e.name])
                return Val(None, "i32", props[e.name])
            if isinstance(b, Packed):
                if e.name not in b.planes:
                    raise self.error(f"{b.quant.name} has planes {', '.join(b.planes)}; not {e.name!r}")
                return Val(I("local.get", f"${b.planes[e.name]}"), "i32")
            if T.resolve(e.base.id) is not None and b is None:
                raise self.error(f"{e.base.id}.{e.name} is an operation: call it")
            kernel = self.c.kernels.get(e.base.id) if b is None else None
            if kernel is not None:  # another kernel's tune value in this build: `qmatvec.rows`, for
                values = tune_for(self.tune, kernel.name, self._quant)  # the quant type being lowered
                if e.name not in values:
                    raise self.error(f"kernel {kernel.name} has no tune parameter {e.name!r}"
                                     f" (it has: {', '.join(values) or 'none'})")
                if self._record is not None:
                    self._record.reads.append((kernel.name, self._quant, e.name, values[e.name]))
                return Val(None, "i32", values[e.name])
        raise self.error(f"no attribute {e.name!r} here")

    def _call(self, e: A.Call) -> Val:
        f = e.func
        if isinstance(f, A.Attr) and isinstance(f.base, A.Name) and self._lookup(f.base.id) is None:
            t = T.resolve(f.base.id)
            if t is None:
                raise self.error(f"unknown name {f.base.id!r}")
            if f.name not in _QUALIFIABLE:
                raise self.error(f"{f.base.id}.{f.name} is not an operation (typed ops: {', '.join(sorted(_QUALIFIABLE))})")
            return self._op(f.name, t, e.args)
        if isinstance(f, A.Attr) and isinstance(f.base, A.Name) and isinstance(q := self._lookup(f.base.id), QuantFormat):
            if f.name in _SCALE_OPS:
                return self._scales(q, f.name, e.args)
            if f.name not in ("unpack", "codes", "zeros") or len(e.args) != 2:
                raise self.error(f"{q.name}.{f.name}(...) is not a quant operation; use {f.base.id}.unpack(ptr, j),"
                                 f" {f.base.id}.codes(ptr, j), {f.base.id}.zeros(ptr, j) or"
                                 f" {f.base.id}.scale4(w, blk) (scale1, offset4, offset1; rowscale, rowoffset in"
                                 " the grouped layout)")
            base = self.materialize(self._coerce(self._expr(e.args[0]), "i32"), "i32")
            j = self._const_int(e.args[1], f"the lane group of {f.name}()")
            return Val(unpack_lanes(q, base, j, self.error, f.name, "relaxed-simd" in self.target.features,
                                    self.load_once), "i8x16")
        generic_args: tuple[A.Expr, ...] = ()
        if isinstance(f, A.Index):
            generic_args, f = f.indices, f.base
        if not isinstance(f, A.Name):
            raise self.error("cannot call this expression")
        if f.id in self.c.kernels and self._lookup(f.id) is None:
            return self._call_kernel(self.c.kernels[f.id], generic_args, e)
        if generic_args:
            raise self.error(f"{f.id!r} is not a generic kernel")
        if f.id in _QUALIFIABLE:
            raise self.error(f"{f.id}() needs a type, e.g. f32x4.{f.id}(...)")
        if f.id in _ALL_OPS:
            return self._op(f.id, None, e.args)
        raise self.error(f"unknown function {f.id!r}")

    def _scales(self, q: QuantFormat, name: str, args: tuple[A.Expr, ...]) -> Val:
        """Q.scale4(w, blk) and kin: the f32 scale or offset of block blk of packed matrix w (4: of
        blocks blk .. blk + 3, blk a multiple of 4), whatever plane layout Q's pack gives it."""
        if not 2 <= len(args) <= 2 + (name in _AT_RECORD):
            raise self.error(f"{q.name}.{name}(w, blk[, rec]) takes 2 or 3 arguments (rec: Q.rowrecord(w, blk), the record's"
                             f" address), got {len(args)}" if name in _AT_RECORD else
                             f"{q.name}.{name}(w, blk) takes 2 arguments, got {len(args)}")
        w = self._lookup(args[0].id) if isinstance(args[0], A.Name) else None
        if not isinstance(w, Packed) or w.quant.name != q.name:
            raise self.error(f"{q.name}.{name}(w, blk): w must be a packed {q.name} matrix")
        what, lanes, form, grouped = _SCALE_OPS[name]
        if form != "f32" and not _int_scales(q) and not (form == "record" and q.sub_offsets):
            raise self.error(f"{q.name}.{name}(w, blk) reads a super-block record's factors apart: {q.name} has"
                             " none in this layout (grouped rows, F * I with I an unsigned byte): use rowscale and rowoffset")
        if grouped != (q.group > 1):
            raise self.error(f"{q.name}.{name}(w, blk) reads {'the grouped layout' if grouped else 'rows one by one'};"
                             f" this target packs {q.name} {'in groups of ' + str(q.group) + ' rows' if q.group > 1 else 'by rows'}"
                             f" (Q.group is {q.group}): use {'rowscale and rowoffset' if q.group > 1 else 'scale4, scale1, offset4, offset1'}")
        if what == "offset" and q.offset is None:
            raise self.error(f"{q.name} has no offset (Q.has_offset is 0): {q.name}.{name} reads nothing")
        blk = self.materialize(self._coerce(self._expr(args[1]), "i32"), "i32")
        at = self.materialize(self._coerce(self._expr(args[2]), "i32"), "i32") if len(args) == 3 else None
        planes = {p: I("local.get", f"${n}") for p, n in w.planes.items()}
        code = lower_scales(q, planes, blk, what, lanes, lambda x: self.reuse(Val(x, "i32")), form, at)
        return Val(code, _SCALE_TYPES[form] if lanes == 4 or form == "record" else "f32")

    def _target_op(self, name: str) -> Op | None:
        """The target's lowering of op `name` (noted in the function's memo record), or None."""
        op = self.target.ops.get(name)
        if self._record is not None:
            self._record.ops[name] = op
        return op

    def _op(self, name: str, qualifier: str | None, arg_nodes: tuple[A.Expr, ...]) -> Val:
        op = self._target_op(name)
        if op is None:
            raise self.error(f"op {name!r} is not available on target {self.target.name}")
        args = [self._expr(a) for a in arg_nodes]
        if any(a.type == "void" for a in args):
            raise self.error(f"an argument of {name}() has no value")
        return op(self, qualifier, args)

    def _call_kernel(self, k: KernelInfo, generic_args: tuple[A.Expr, ...], e: A.Call) -> Val:
        if len(generic_args) != len(k.ast.generics):
            raise self.error(f"{k.name} takes {len(k.ast.generics)} compile-time argument(s) in [...],"
                             f" got {len(generic_args)}")
        generics: dict[str, Binding] = {}
        for g, arg in zip(k.ast.generics, generic_args):
            if g.kind == "quant":
                q = self._lookup(arg.id) if isinstance(arg, A.Name) else None
                if not isinstance(q, QuantFormat):
                    raise DslError(arg.span, f"{k.name}: {g.name} must be a quant type")
                generics[g.name] = q
            else:
                generics[g.name] = Val(None, "i32", self._const_int(arg, f"{k.name}'s {g.name}"))
        if len(e.args) != len(k.ast.params):
            raise self.error(f"{k.name} takes {len(k.ast.params)} argument(s), got {len(e.args)}")
        args: list[Binding] = []
        for p, a in zip(k.ast.params, e.args):
            if p.packed:
                b = self._lookup(a.id) if isinstance(a, A.Name) else None
                want = generics.get(p.type)
                if not isinstance(b, Packed) or b.quant is not want:
                    raise DslError(a.span, f"{k.name}: {p.name} must be a packed {_show(want)} matrix")
                args.append(b)
            else:
                args.append(self._coerce(self._expr(a), T.resolve(p.type)))
        if k.inline:
            return self._inline(k, generics, args)
        if k.ast.exported:  # the exported function itself (this build's variant), lowered once by run()
            quant = next(iter(generics.values()), None)
            quant = quant if isinstance(quant, QuantFormat) else None
            name = self.instances.export(k, quant)
            if self._record is not None:
                self._record.exports.append((k, quant, name))
        else:
            name = self.instances.internal(k, generics, self.error, self._record)
        flat: list[Instr] = []
        for p, a in zip(k.ast.params, args):
            if isinstance(a, Packed):
                flat += [I("local.get", f"${n}") for n in a.planes.values()]
            else:
                flat.append(self.materialize(a, T.resolve(p.type)))
        ret = T.resolve(k.ast.ret) if k.ast.ret else "void"
        return Val(I("call", f"${name}", *flat), ret)

    def _inline(self, k: KernelInfo, generics: dict[str, Binding], args: list[Binding]) -> Val:
        """Expand an inline kernel here: its statements go before the current one, its final
        `return` value is the call's value."""
        if k.name in self._inlining:
            raise self.error(f"inline kernel {k.name} calls itself ({' -> '.join([*self._inlining, k.name])});"
                             " inline kernels are expanded, so they cannot recurse")
        self._inlining.append(k.name)
        self._inline_locals.append(set())
        call_span = self._span
        body, last = k.ast.body, None
        result = Val(None, "void")
        try:
            with self._context(None, [dict(generics)], call_span), self._scope():
                for p, a in zip(k.ast.params, args):
                    # a local read or a constant binds as itself: a constant stays visible to the
                    # ops (idot of a zero accumulator adds nothing); anything else is computed once
                    if isinstance(a, Val) and a.code is not None and (held := self._shared_load(a.code, a.type)):
                        a = held
                    elif isinstance(a, Val) and a.code is not None and not _repeatable(a.code):
                        local = self._new_local(p.name, a.type)
                        self.emit(I("local.set", f"${local}", a.code))
                        a = Local(local, a.type, False)
                    self._bind(p.name, a)
                # the value is the final `return`, or that of the taken arm of a final `static if`
                statements = 0
                while body:
                    *init, tail = body
                    for s in init:
                        self._stmt(s)
                    statements, body = statements + len(init), ()
                    if isinstance(tail, A.ReturnStmt):
                        last = tail
                    elif isinstance(tail, A.IfStmt) and tail.static:
                        cond = self._expr(tail.cond)
                        if cond.const is None or cond.code is not None:
                            raise DslError(tail.cond.span, "'static if' needs a compile-time condition")
                        body = tail.then if cond.const else tail.orelse
                    else:
                        self._stmt(tail)
                        statements += 1
                if last is not None and last.value is not None:
                    self._span = last.span
                    ret = T.resolve(k.ast.ret)
                    v = self._coerce(self._expr(last.value), ret)
                    result = Val(self.materialize(v, ret), ret)
        finally:
            self._inlining.pop()
            own = self._inline_locals.pop()
        if result.code is not None and _reads_any(result.code, own):
            # The value reads the expansion's own locals, which a later expansion in the same
            # statement may reuse: keep it in a temporary live until the statement ends.
            tmp = self._new_local("ret", result.type)
            self._frame.temps.append(tmp)
            self.emit(I("local.set", f"${tmp}", result.code))
            result = Val(I("local.get", f"${tmp}"), result.type)
        if statements:
            self._comment_at(call_span)  # the calling statement's own code follows the inlined body
        return result


def _repeatable(code: Instr) -> bool:
    """A local read or a constant: as cheap to repeat as to keep in a local."""
    return code.op == "local.get" or (code.op.endswith(".const") and not code.args)


def _reads_any(code: Instr, names: set[str]) -> bool:
    if code.op in ("local.get", "local.tee") and code.imms and code.imms[0][1:] in names:
        return True
    return any(_reads_any(a, names) for a in code.args)


def _ends_in_return(body: tuple[A.Stmt, ...]) -> bool:
    """Whether every path through `body` ends in a return (a last `return`, or an if/else whose
    arms both do)."""
    if not body:
        return False
    last = body[-1]
    if isinstance(last, A.ReturnStmt):
        return True
    return isinstance(last, A.IfStmt) and _ends_in_return(last.then) and _ends_in_return(last.orelse)


def _show(b: Binding | None) -> str:
    if isinstance(b, QuantFormat):
        return b.name
    if isinstance(b, Val):
        return str(b.const)
    return "?"


@dataclass
class Lowered:
    funcs: list[Func]
    exports: list[Export]
    jobs: list[Export]  # the job table, entry i at index i


def lower(checked: Checked, target_name: str, tune: dict[str, dict[str, int]],
          memo: dict[tuple[str, str, str], Reused] | None = None, flavor: str | None = None) -> Lowered:
    """Lower `checked` for a target (in one of its flavors: Target.flavored) with these tune values.
    `memo` (a dict kept across builds of this one checked program, filled here) lets another build
    reuse each function it has in common: a build in within_budget lowers only the functions its
    values change."""
    target = TARGETS[target_name] if flavor is None else TARGETS[target_name].flavored(flavor)
    lw = Lowerer(replace(checked, quants={n: target.layout(q) for n, q in checked.quants.items()}), target, tune, memo)
    try:
        funcs = lw.run()
    except DslError as e:
        raise e.with_source(checked.source) from None
    return Lowered(funcs, lw.exports, lw.jobs)
