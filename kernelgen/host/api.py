"""The Python API: load a built target, put numpy data in its memory, run kernels, get numpy back.

    import kernelgen
    k = kernelgen.load(target="relaxed-simd")           # the packaged build; or load(out_dir, target)
    w = k.pack("q8_0", blocks)                           # GGUF Q8_0 blocks, (rows, k // 32 * 34) uint8
    a = k.quantize_act(x)                                # f32[k] -> quantized activations
    y = k.qmatvec(w, a)                                  # f32[rows]

Every method checks shapes, dtypes and integer arguments (ints or numpy integers, in range) before
touching memory and raises ValueError/TypeError saying what it expected. Inputs are copied into the
module's shared memory; per-call buffers are freed when the call returns, packed weights when they
are freed (`Packed.free()`, a `with` block, `Kernels.scope()`) or at `reset()`. A Kernels may be
used from several Python threads: each call holds the module's lock, so calls take turns (threads
that want parallel work share a `pool` instead).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from . import module as host
from .manifest import check_arguments, check_exports, check_manifest, check_signature
from .module import I32_MAX, PAGE_SIZE, WASM_BYTES, as_int, as_real
from .. import library
from ..errors import KernelgenError, UnknownName
from ..names import parse_variant
from ..quantformat import QuantFormat
from .pool import POOL_EXPORTS, Pool


@dataclass(eq=False, frozen=True)
class Packed:
    """A quantized matrix in the kernels' layout, living in a module's memory until `free()` (or
    the end of its `with` block, or of the `Kernels.scope()` it was packed in, or `reset()`)."""

    quant: str
    rows: int
    k: int
    planes: dict[str, int]  # plane name -> address
    # The Kernels whose memory holds the planes, its reset() count when they were packed and the
    # planes' allocation serials: a handle from another Kernels, from before a reset() or whose
    # memory was freed (and perhaps reused: addresses are, serials are not) names memory not its own.
    owner: Any = field(default=None, repr=False, compare=False)
    generation: int = 0
    serials: tuple[int, ...] = ()
    freed: bool = False

    @property
    def args(self) -> list[int]:
        return list(self.planes.values())

    @property
    def live(self) -> bool:
        m = self.owner.module
        return (not self.freed and self.generation == m.generation
                and [m.serial(a) for a in self.args] == list(self.serials))

    def free(self) -> None:
        """Give the matrix's memory back to the module (again: nothing happens)."""
        with self.owner.module.lock:
            if self.live:
                for addr in self.args:
                    self.owner.module.free(addr)
            object.__setattr__(self, "freed", True)  # the one field that changes: frozen against mistakes

    def __enter__(self) -> Packed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()


@dataclass(frozen=True)
class Act:
    """Activations quantized by the module's own quantize_act: q (int8 values, stored as int16 on
    simd128, int8 on relaxed SIMD, in the target's order: Kernels.act_values gives them in order),
    one f32 scale per 32 values (d) and the sum of each 32 values (s, int32: the kernels remove a
    weight type's zero or minimum with it); q[k], d[k / 32], s[k / 32] for one token, q[m, k],
    d[m, k / 32], s[m, k / 32] for m tokens."""

    q: np.ndarray
    d: np.ndarray
    s: np.ndarray
    def _made_here(self) -> Act:
        """Mark an Act quantize_act or act_from_values made, whose sums and range hold: the
        kernels' checks of a hand-made Act (Kernels._act_args, 5% of a 256x4096 qmatvec) skip it.
        An attribute, not a field: dataclasses.replace() of one gives an Act that is checked, and
        astuple() gives the arrays alone. Its arrays (its own copies) become read-only, so that the
        checks it skips still hold: a value or sum changed in place computed wrong dots silently."""
        for v in (self.q, self.d, self.s):
            v.setflags(write=False)
        object.__setattr__(self, "_made_by_kernels", True)
        return self

    @property
    def made_here(self) -> bool:
        return getattr(self, "_made_by_kernels", False)

    @property
    def n(self) -> int:
        """Values per token."""
        return self.q.shape[-1]

    @property
    def tokens(self) -> int | None:
        """Token count of an [m, k] array, None for one token's vector."""
        return self.q.shape[0] if self.q.ndim == 2 else None


def _f32(name: str, x: Any, ndim: int) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy float32 array, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise TypeError(f"{name}: expected dtype float32, got {x.dtype} (convert with .astype(np.float32))")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim}-D, got shape {x.shape}")
    if x.nbytes > WASM_BYTES:  # before the copy below (of a broadcast view, say)
        raise ValueError(f"{name}: {x.nbytes} bytes of float32 {x.shape} exceed a wasm memory's {WASM_BYTES}")
    return np.ascontiguousarray(x)


def _flag(what: str, value: Any) -> bool:
    """A yes/no argument: a bool (a string such as "no" would be true)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what}: expected True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def _name(what: str, name: Any, optional: bool = False) -> None:
    """A kernel's, quant type's or export's name is a str (None too where `optional`)."""
    if not (isinstance(name, str) or optional and name is None):
        raise TypeError(f"{what}: expected a name (str{' or None' if optional else ''}), got {type(name).__name__}")


def _each_call_locked(cls: type) -> type:
    """Every public method of `cls` holds the module's (re-entrant) lock for the whole call: the
    buffers a call allocates and frees, the default Store and the pool words are shared by every
    thread using one Kernels. Done once for the class, so a method added later cannot forget it.
    Private methods (a leading _) run only inside public ones, so under the lock already."""
    def locked(method: Any) -> Any:
        @functools.wraps(method)
        def call(self: Kernels, *args: Any, **kwargs: Any) -> Any:
            with self.module.lock:
                return method(self, *args, **kwargs)
        return call
    for name, f in list(vars(cls).items()):
        if inspect.isfunction(f) and not name.startswith("_"):
            setattr(cls, name, locked(f))
    return cls


@_each_call_locked
class Kernels:
    """One built target under wasmtime. `deterministic` sets wasmtime's relaxed_simd_deterministic
    (off by default: the native lowering, which gives the library's kernels the same bits); `where`
    names the manifest in errors."""

    def __init__(self, wasm: bytes, manifest: dict, deterministic: bool = False, where: str = "kernels.json") -> None:
        check_manifest(manifest, bytes(wasm), where)
        self.manifest = manifest
        self.target: str = manifest["target"]
        self.flavor: str | None = manifest.get("flavor")  # None: the target's base build
        self.module = host.Module(wasm, manifest, deterministic)
        check_exports(manifest, self.module.signatures, where)
        try:  # QuantFormat re-derives each type's planes from its formulas: a manifest's must match them
            self.quants: dict[str, QuantFormat] = {name: QuantFormat.from_json(name, q)
                                                    for name, q in manifest["quants"].items()}
        except ValueError as e:
            raise KernelgenError(f"{where}: {e}") from None
        # How quantize_act stores activations on this target (int16 on simd128, int8 on relaxed
        # SIMD): the manifest says.
        self._act_dtype = np.dtype(manifest["activation"]["dtype"])
        self._act_split: bool = manifest["activation"]["split"]
        self._act_sums = np.dtype(manifest["activation"]["sums"])
        self._exports: dict[tuple[str, str | None], str] = {}
        for name, e in manifest["exports"].items():
            self._exports[(e["kernel"], e["quant"])] = name

    # ---- generic access
    def export_name(self, kernel: str, quant: str | None = None) -> str:
        """The exported variant of `kernel` (for `quant`), e.g. qmatvec_q8_0__rows4."""
        _name("export_name kernel", kernel)
        _name("export_name quant", quant, optional=True)
        try:
            return self._exports[(kernel, quant)]
        except KeyError:
            have = sorted({k for k, _ in self._exports})
            raise UnknownName(f"no export for kernel {kernel!r}{f' and quant {quant!r}' if quant else ''};"
                              f" kernels: {', '.join(have)}") from None

    def pool(self, threads: int = 2) -> Pool:
        """Start a thread pool on this module (close it, or use it in a `with` block)."""
        return Pool(self, threads)

    def run(self, kernel: str, quant: str | None, args: list[int | float], pool: Pool | None = None,
            chunk: int | None = None) -> Any:
        """Run `kernel`'s export with raw arguments in this thread, or, for a kernel declared
        `parallel`, on `pool`'s threads, `chunk` items per claim (same results, bit for bit: every
        output element is computed by one thread in a fixed order)."""
        name = self.export_name(kernel, quant)
        if pool is not None and not isinstance(pool, Pool):
            raise TypeError(f"{kernel}: pool must be a Pool from Kernels.pool(), got {type(pool).__name__}")
        if chunk is not None:  # checked with or without a pool: a mistake is one either way
            as_int(f"{kernel} chunk", chunk, 1, I32_MAX)
        if pool is None:
            return self.call(name, *args)
        if pool.kernels is not self:
            raise ValueError("this pool belongs to another module")
        pool.call(name, args, chunk)
        return None

    def tune_of(self, kernel: str, quant: str | None = None) -> dict[str, int]:
        return parse_variant(self.export_name(kernel, quant)).tune

    def call(self, name: str, *args: int | float) -> Any:
        """Run an exported function with raw arguments (addresses and scalars), checked as
        check_call says. An address (a parameter of DSL type ptr) must lie in the heap, from heap_base
        to the memory's end: below it are the pool's words, which a stray write would corrupt, and
        past the end an i32 address wraps onto them. The pool's own exports are run by `pool()` only."""
        spec = self.manifest["exports"].get(name)
        if spec is not None and spec["kernel"] in POOL_EXPORTS:
            raise ValueError(f"{name} is the thread pool's own (it waits for helpers or runs a loop): use Kernels.pool()")
        if spec is not None and len(args) == len(spec["params"]):
            self.check_call(name, args)
        return self.module.call(name, *args)

    def check_call(self, name: str, args: Sequence[int | float]) -> None:
        """Refuse raw arguments `args` of export `name` (ValueError) that it cannot honour: an address
        outside the heap, or one whose extent the kernel's doc declares runs past the memory's end, or
        an i32 argument that is not the multiple it needs (manifest.check_arguments)."""
        spec = self.manifest["exports"][name]
        for a, p in zip(args, spec["params"]):
            if p["dsl_type"] == "ptr" and not (type(a) is int and self.module.in_heap(a)):
                self.module.check_address(f"{name} {p['name']}", a)  # raises, or takes a numpy integer
        check_arguments(name, spec, args, self.module.memory.data_len(),
                        lambda addr: int(self.module.view(addr, np.int32, 1)[0]))

    def reset(self) -> None:
        """Free all memory the module holds for this host, packed weights included."""
        self.module.reset()

    def scope(self) -> contextlib.AbstractContextManager[None]:
        """`with k.scope():` frees what is packed inside the block when it ends."""
        return self.module.scope()

    def _quant(self, name: str) -> QuantFormat:
        _name("quant type", name)
        if name not in self.quants:
            raise UnknownName(f"unknown quant type {name!r}; this build has {', '.join(self.quants)}")
        return self.quants[name]

    # ---- weights and activations
    def pack(self, quant: str, blocks: np.ndarray) -> Packed:
        """Pack stored blocks of shape (rows, n_blocks * stored_bytes) uint8, or the quant's structured
        dtype (rows, n_blocks), into the module's memory."""
        q = self._quant(quant)
        if not isinstance(blocks, np.ndarray) or blocks.ndim != 2:
            raise ValueError(f"pack({quant}): expected a 2-D array of blocks per row, got "
                             f"{getattr(blocks, 'shape', type(blocks).__name__)}")
        b = q.as_blocks(blocks)
        if b.shape[0] == 0 or b.shape[1] == 0:
            raise ValueError(f"pack({quant}): expected at least one row of at least one block, got {b.shape[0]} rows"
                             f" of {b.shape[1]} blocks")
        planes = q.pack(b)
        addrs: dict[str, int] = {}
        try:
            for name, arr in planes.items():
                addrs[name] = self.module.put(arr, what=f"pack({quant!r}) of {b.shape[0]} rows, plane {name!r},")
        except MemoryError:
            for addr in addrs.values():
                self.module.free(addr)
            raise
        return Packed(quant, b.shape[0], b.shape[1] * q.block, addrs, self, self.module.generation,
                      tuple(self.module.serial(a) for a in addrs.values()))

    def quantize_act(self, x: np.ndarray, pool: Pool | None = None, chunk: int | None = None) -> Act:
        """f32[k] (one token) or f32[m, k] (m tokens, for qmatmul), k a multiple of 32 -> activations
        in this target's form (see ACT_MAX/ACT_BYTES). Blocks never cross rows, so m tokens are one
        call over m * k values."""
        if isinstance(x, np.ndarray) and x.ndim == 2:
            x = _f32("quantize_act x", x, 2)
        else:
            x = _f32("quantize_act x", x, 1)
        k = x.shape[-1]
        if x.size == 0 or k % 32:
            raise ValueError(f"quantize_act: rows must be a positive multiple of 32 long, got shape {x.shape}")
        nb = x.size // 32
        with self.module.scope():
            px = self.module.put(x)
            pq, pd = self._act_buffers(x.size)
            self.run("quantize_act", None, [px, x.size, pq, pd], pool, chunk)
            return Act(self.module.get(pq, self._act_dtype, x.size).reshape(x.shape),
                       self.module.get(pd, np.float32, nb).reshape(*x.shape[:-1], k // 32),
                       self.module.get(pd + nb * 4, self._act_sums, nb).reshape(*x.shape[:-1], k // 32))._made_here()

    def _act_buffers(self, n: int) -> tuple[int, int]:
        """Fresh buffers for quantize_act of n values, sized as the manifest's activation entry says:
        the stored values, and the scales followed by the sums."""
        return (self.module.alloc(n * self._act_dtype.itemsize),
                self.module.alloc(n // 32 * (4 + self._act_sums.itemsize)))

    def act_values(self, act: Act) -> np.ndarray:
        """act.q's values in order. The kernels read act.q as stored (the manifest's activation
        "split": each 16 as the 8 at even positions, then the 8 at odd ones), so hosts pass it on
        as it is and only a reader of the values reorders them."""
        self._check_act_values(act, "act_values")
        return self._act_order(act.q, (2, 8))

    def _check_act_values(self, act: Any, what: str) -> None:
        """act is an Act whose values are stored as this target stores them (another target's, say
        simd128's int16 in its split order on relaxed SIMD, would be misread)."""
        if not isinstance(act, Act):
            raise TypeError(f"{what}: activations must come from quantize_act or act_from_values, got {type(act).__name__}")
        if not isinstance(act.q, np.ndarray) or act.q.dtype != self._act_dtype:
            got = act.q.dtype if isinstance(act.q, np.ndarray) else type(act.q).__name__
            raise TypeError(f"{what}: activation values must be {np.dtype(self._act_dtype)} on {self.target}, got {got}"
                            " (activations of another target?)")
        if act.q.ndim not in (1, 2) or act.q.shape[-1] == 0 or act.q.shape[-1] % 32:
            raise ValueError(f"{what}: activation values must be [k] or [m, k] with k a positive multiple of 32,"
                             f" got shape {act.q.shape}")

    def act_from_values(self, q: np.ndarray, d: np.ndarray) -> Act:
        """Activations of int8 values q in order (any integer dtype, [..., k]) and their scales d,
        stored as quantize_act stores them (with each block's sum): the inverse of act_values."""
        q = np.asarray(q)
        if q.dtype.kind not in "iu":
            raise TypeError(f"act_from_values q: expected integer values, got dtype {q.dtype}")
        if q.ndim not in (1, 2) or q.shape[-1] == 0 or q.shape[-1] % 32:
            raise ValueError(f"act_from_values q: expected [k] or [m, k] values with k a positive multiple of 32"
                             f" (activations come in blocks of 32), got shape {q.shape}")
        d = _f32("act_from_values d", d, q.ndim)
        if d.shape != (*q.shape[:-1], q.shape[-1] // 32):
            raise ValueError(f"act_from_values d: expected one scale per 32 values, shape"
                             f" {(*q.shape[:-1], q.shape[-1] // 32)}, got {d.shape}")
        act_max = self.manifest["activation"]["max"]
        if q.size and (q.min() < -act_max or q.max() > act_max):  # (relaxed SIMD's idots reads |a| in 7 bits)
            raise ValueError(f"activation values must lie in [-{act_max}, {act_max}] (quantize_act's range),"
                             f" got {q.min()} .. {q.max()}")
        sums = q.astype(np.int64).reshape(*q.shape[:-1], -1, 32).sum(-1).astype(self._act_sums)
        return Act(self._act_order(q.astype(self._act_dtype), (8, 2)), d.copy(), sums)._made_here()

    def _act_order(self, q: np.ndarray, groups: tuple[int, int]) -> np.ndarray:
        """q with each 16 values read as `groups` rows and transposed: (8, 2) splits them into even
        then odd positions, (2, 8) undoes it; q itself where activations are stored in order."""
        if not self._act_split:
            return q
        if q.shape[-1] % 16:
            raise ValueError(f"activations come in blocks of 32, got {q.shape[-1]} values per token")
        return np.ascontiguousarray(q.reshape(-1, *groups).swapaxes(1, 2).reshape(q.shape))

    # ---- kernels
    def _act_args(self, act: Act, k: int, what: str, tokens: bool = False) -> list[int]:
        """Addresses of act's values and scales, checked: one token's f32[k] quantized, or with
        `tokens` an [m, k] array's."""
        self._check_act_values(act, what)
        if act.q.ndim != (2 if tokens else 1):
            want = "of an [m, k] array (quantize_act of m tokens)" if tokens else "of one token (quantize_act of f32[k])"
            raise ValueError(f"{what}: expected activations {want}, got values of shape {act.q.shape}")
        if act.n != k:
            raise ValueError(f"{what}: activations have {act.n} values per token, the weights' rows have {k}")
        want_d = (*act.q.shape[:-1], k // 32)
        for name, v, dtype in (("scales", act.d, np.dtype(np.float32)), ("sums", act.s, self._act_sums)):
            if not isinstance(v, np.ndarray) or v.dtype != dtype or v.shape != want_d:
                got = f"{v.dtype}{list(v.shape)}" if isinstance(v, np.ndarray) else type(v).__name__
                raise ValueError(f"{what}: activation {name} must be {dtype}{list(want_d)}, got {got}")
        addrs = self.put_act(act)
        if act.made_here:  # its (read-only) arrays hold what quantize_act made
            return addrs
        # The kernels trust the values' range (relaxed SIMD reads |a| in 7 bits) and each block's
        # sum (the zero or minimum of a weight type comes off with it): a hand-made Act is checked,
        # in wasm (act_check, as the JS runtime checks every one), its first bad block named here.
        bad = self.call(self.export_name("act_check"), *addrs, act.q.size)
        if bad >= 0:
            q = act.q.reshape(-1, 32)[bad].astype(np.int32)
            at = np.unravel_index(bad, want_d)
            act_max = self.manifest["activation"]["max"]
            if q.min() < -act_max or q.max() > act_max:
                raise ValueError(f"{what}: activation values must lie in [-{act_max}, {act_max}] (quantize_act's"
                                 f" range), got {q.min()} .. {q.max()} in block {tuple(map(int, at))}")
            raise ValueError(f"{what}: activation sums do not match the values (block {tuple(map(int, at))}:"
                             f" {act.s[at]}, the values sum to {q.sum()}); make activations with quantize_act or"
                             " act_from_values")
        return addrs

    def put_act(self, act: Act) -> list[int]:
        """Put act in memory as the kernels take it: the address of its values, and of its scales
        followed by its sums (the manifest's activation "sums"). Checked for its target's storage
        only: the methods check the rest first."""
        self._check_act_values(act, "put_act")
        scales_sums = np.concatenate([np.ascontiguousarray(act.d, np.float32).reshape(-1).view(np.uint8),
                                      np.ascontiguousarray(act.s, self._act_sums).reshape(-1).view(np.uint8)])
        return [self.module.put(act.q), self.module.put(scales_sums)]

    def _check_packed(self, w: Any, what: str) -> Packed:
        if not isinstance(w, Packed):
            raise TypeError(f"{what}: weights must come from pack(), got {type(w).__name__}")
        if w.owner is not self:
            raise ValueError(f"{what}: these weights were packed by another Kernels"
                             f"{f' (target {w.owner.target})' if isinstance(w.owner, Kernels) else ''}; pack them with this one")
        if w.generation != self.module.generation:
            raise ValueError(f"{what}: these weights were packed before reset(), which freed them; pack them again")
        if not w.live:
            raise ValueError(f"{what}: these weights were freed ({'free()' if w.freed else 'at the end of their scope'});"
                             " pack them again")
        return w

    def qdot(self, w: Packed, act: Act) -> float:
        """Dot of a one-row packed matrix with quantized activations: qmatvec of that row (the
        library holds one row sum per quant type, not a second copy for a dot export)."""
        w = self._check_packed(w, "qdot")
        if w.rows != 1:
            raise ValueError(f"qdot: expected one packed row, got {w.rows} (use qmatvec)")
        with self.module.scope():
            a = self._act_args(act, w.k, "qdot")
            py = self.module.alloc(4)
            self.run("qmatvec", w.quant, [*w.args, *a, py, 1, w.k])
            return float(self.module.get(py, np.float32, 1)[0])

    def qmatvec(self, w: Packed, act: Act, pool: Pool | None = None, chunk: int | None = None) -> np.ndarray:
        """y = W a, f32[rows]; on `pool`'s threads if given, `chunk` rows per claim."""
        w = self._check_packed(w, "qmatvec")
        with self.module.scope():
            a = self._act_args(act, w.k, "qmatvec")
            py = self.module.alloc(4 * w.rows)
            self.run("qmatvec", w.quant, [*w.args, *a, py, w.rows, w.k], pool, chunk)
            return self.module.get(py, np.float32, w.rows)

    def qmatmul(self, w: Packed, act: Act, pool: Pool | None = None, chunk: int | None = None) -> np.ndarray:
        """Y = A W^T, f32[m, rows], for activations of m tokens (quantize_act of an [m, k] array).
        Row t is qmatvec(w, token t) bit for bit. On `pool` the rows of W are split, `chunk` per claim."""
        w = self._check_packed(w, "qmatmul")
        with self.module.scope():
            a = self._act_args(act, w.k, "qmatmul", tokens=True)
            tokens = act.tokens
            py = self.module.alloc(4 * tokens * w.rows)
            self.run("qmatmul", w.quant, [*w.args, *a, py, tokens, w.rows, w.k], pool, chunk)
            return self.module.get(py, np.float32, tokens * w.rows).reshape(tokens, w.rows)

    def linear(self, w: Packed, x: np.ndarray, bias: np.ndarray | None = None, pool: Pool | None = None,
               chunk: int | None = None) -> np.ndarray:
        """x W^T + bias, f32[m, rows], for x[m, k]: quantize_act, qmatmul and add_bias_f32 (with a
        bias) in one scope, the activations never leaving the module's memory; bit for bit
        add_bias_f32(qmatmul(w, quantize_act(x)), bias). On `pool` the quantization's blocks and then
        W's rows are split (`chunk` is qmatmul's)."""
        w = self._check_packed(w, "linear")
        x = _f32("linear x", x, 2)
        if x.shape[1] != w.k or x.shape[0] == 0:
            raise ValueError(f"linear: x must be [m >= 1, {w.k}] (the weights' rows), got shape {x.shape}")
        if bias is not None and w.rows % 4:
            raise ValueError(f"linear: a bias needs rows of a multiple of 4 values; the weights have {w.rows}")
        m = x.shape[0]
        with self.module.scope():
            pb = None if bias is None else self._put_row_vector("linear bias", bias, w.rows)
            px = self.module.put(x)
            pq, pd = self._act_buffers(x.size)
            self.run("quantize_act", None, [px, x.size, pq, pd], pool)
            py = self.module.alloc(4 * m * w.rows)
            self.run("qmatmul", w.quant, [*w.args, pq, pd, py, m, w.rows, w.k], pool, chunk)
            if pb is not None:
                self.call(self.export_name("add_bias_f32"), py, pb, py, m, w.rows)
            return self.module.get(py, np.float32, m * w.rows).reshape(m, w.rows)

    def matmul_f32(self, a: np.ndarray, b: np.ndarray, b_transposed: bool = False, pool: Pool | None = None,
                   chunk: int | None = None) -> np.ndarray:
        """a[m, k] times b[k, n] (out = P V), or with `b_transposed` times b[n, k]^T (scores = Q K^T);
        f32[m, n]. Error bounds: see matmul_f32_nt / matmul_f32_nn in kernels.dsl. On `pool` the
        rows of a are split, `chunk` per claim."""
        a, b = _f32("matmul_f32 a", a, 2), _f32("matmul_f32 b", b, 2)
        b_transposed = _flag("matmul_f32 b_transposed", b_transposed)
        k = a.shape[1]
        n, kb = (b.shape if b_transposed else b.shape[::-1])
        if kb != k:
            form = "b[n, k] (b_transposed)" if b_transposed else "b[k, n]"
            raise ValueError(f"matmul_f32: a is {a.shape}, expected {form} with k = {k}, got b {b.shape}")
        kernel = "matmul_f32_nt" if b_transposed else "matmul_f32_nn"
        with self.module.scope():
            pa, pb, py = self.module.put(a), self.module.put(b), self.module.alloc(4 * a.shape[0] * n)
            self.run(kernel, None, [pa, pb, py, a.shape[0], n, k], pool, chunk)
            return self.module.get(py, np.float32, a.shape[0] * n).reshape(a.shape[0], n)

    def dot_f32(self, x: np.ndarray, y: np.ndarray) -> float:
        x, y = _f32("dot_f32 x", x, 1), _f32("dot_f32 y", y, 1)
        if x.shape != y.shape:
            raise ValueError(f"dot_f32: shapes differ, {x.shape} and {y.shape}")
        with self.module.scope():
            return float(self.call(self.export_name("dot_f32"), self.module.put(x), self.module.put(y), x.size))

    def matvec_f32(self, w: np.ndarray, x: np.ndarray, pool: Pool | None = None, chunk: int | None = None) -> np.ndarray:
        w, x = _f32("matvec_f32 w", w, 2), _f32("matvec_f32 x", x, 1)
        if w.shape[1] != x.size:
            raise ValueError(f"matvec_f32: w is {w.shape}, x has {x.size} values")
        with self.module.scope():
            py = self.module.alloc(4 * w.shape[0])
            pw, px = self.module.put(w), self.module.put(x)
            self.run("matvec_f32", None, [pw, px, py, *w.shape], pool, chunk)
            return self.module.get(py, np.float32, w.shape[0])


    # ---- elementwise, softmax, RoPE
    def _map(self, kernel: str, dtype: type, *arrays: np.ndarray, pool: Pool | None = None,
             chunk: int | None = None) -> np.ndarray:
        """Run an elementwise kernel `kernel(in..., out, n)` over 1-D arrays of one length (on `pool`
        if given)."""
        n = arrays[0].size
        for a in arrays:
            if a.shape != arrays[0].shape:
                raise ValueError(f"{kernel}: shapes differ, {[x.shape for x in arrays]}")
        with self.module.scope():
            ins = [self.module.put(a) for a in arrays]  # the kernels touch nothing past n (load_last): no padding
            out = self.module.alloc(n * np.dtype(dtype).itemsize)
            self.run(kernel, None, [*ins, out, n], pool, chunk)
            return self.module.get(out, dtype, n)

    def exp_f32(self, x: np.ndarray, pool: Pool | None = None, chunk: int | None = None) -> np.ndarray:
        return self._map("exp_f32", np.float32, _f32("exp_f32 x", x, 1), pool=pool, chunk=chunk)

    def silu_f32(self, x: np.ndarray, pool: Pool | None = None, chunk: int | None = None) -> np.ndarray:
        return self._map("silu_f32", np.float32, _f32("silu_f32 x", x, 1), pool=pool, chunk=chunk)

    def swiglu_f32(self, x: np.ndarray, g: np.ndarray, pool: Pool | None = None, chunk: int | None = None) -> np.ndarray:
        """silu(x) * g."""
        return self._map("swiglu_f32", np.float32, _f32("swiglu_f32 x", x, 1), _f32("swiglu_f32 g", g, 1),
                         pool=pool, chunk=chunk)

    # ---- encoder layers (BERT)
    def erf_f32(self, x: np.ndarray) -> np.ndarray:
        return self._map("erf_f32", np.float32, _f32("erf_f32 x", x, 1))

    def _rows(self, what: str, x: np.ndarray) -> np.ndarray:
        """f32[rows, n] with n a positive multiple of 4 (rows are whole vectors)."""
        x = _f32(what, x, 2)
        if x.shape[1] == 0 or x.shape[1] % 4:
            raise ValueError(f"{what}: rows must hold a positive multiple of 4 values, got shape {x.shape}")
        return x

    def _put_row_vector(self, what: str, v: np.ndarray | None, n: int, optional: bool = False) -> int:
        """Address of f32[n] `v` in memory (zeros for an `optional` one left None: the kernels always
        add a bias)."""
        if v is None and optional:
            v = np.zeros(n, np.float32)
        v = _f32(what, v, 1)
        if v.size != n:
            raise ValueError(f"{what}: expected {n} values (the row length), got {v.size}")
        return self.module.put(v)

    def gelu_f32(self, x: np.ndarray, bias: np.ndarray | None = None, pool: Pool | None = None,
                 chunk: int | None = None) -> np.ndarray:
        """gelu(x + bias) in BERT's erf form, per row of x[rows, n]."""
        x = self._rows("gelu_f32 x", x)
        rows, n = x.shape
        with self.module.scope():
            pb = self._put_row_vector("gelu_f32 bias", bias, n, optional=True)
            px = self.module.put(x)
            self.run("gelu_f32", None, [px, pb, px, rows, n], pool, chunk)
            return self.module.get(px, np.float32, x.size).reshape(x.shape)

    def add_bias_f32(self, x: np.ndarray, bias: np.ndarray) -> np.ndarray:
        """x[rows, n] + bias[n] per row."""
        x = self._rows("add_bias_f32 x", x)
        with self.module.scope():
            pb = self._put_row_vector("add_bias_f32 bias", bias, x.shape[1])
            px = self.module.put(x)
            self.call(self.export_name("add_bias_f32"), px, pb, px, *x.shape)
            return self.module.get(px, np.float32, x.size).reshape(x.shape)

    def layernorm_f32(self, x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float = 1e-12,
                      residual: np.ndarray | None = None, bias: np.ndarray | None = None,
                      pool: Pool | None = None, chunk: int | None = None) -> np.ndarray:
        """LayerNorm of each row of x + residual + bias (each optional), times gamma plus beta."""
        x = self._rows("layernorm_f32 x", x)
        rows, n = x.shape
        if residual is not None and _f32("layernorm_f32 residual", residual, 2).shape != x.shape:
            raise ValueError(f"layernorm_f32: residual has shape {residual.shape}, x {x.shape}")
        eps = as_real("layernorm_f32 eps", eps)
        if not 0 <= eps < float("inf"):
            raise ValueError(f"layernorm_f32: eps must be finite and >= 0, got {eps}")
        with self.module.scope():
            pg = self._put_row_vector("layernorm_f32 gamma", gamma, n)
            pbeta = self._put_row_vector("layernorm_f32 beta", beta, n)
            pb = self._put_row_vector("layernorm_f32 bias", bias, n, optional=True)
            pr = self.module.put(np.zeros_like(x) if residual is None else np.ascontiguousarray(residual))
            px = self.module.put(x)
            args = [px, pr, pb, pg, pbeta, px]
            self.run("layernorm_f32", None, [*args, rows, n, float(eps)], pool, chunk)
            return self.module.get(px, np.float32, x.size).reshape(x.shape)

    def attention_f32(self, qkv: np.ndarray, lengths: Any, heads: int, pool: Pool | None = None,
                      chunk: int | None = None) -> np.ndarray:
        """Multi-head self-attention of sentences whose tokens are the rows of qkv[rows, 3 * n]
        (q | k | v per token, n = heads * d, queries scaled by 1 / sqrt(d)), `lengths` tokens per
        sentence in row order: each query sees only its own sentence's keys. f32[rows, n]. On
        `pool` the (sentence, head) pairs are split, `chunk` per claim."""
        qkv = _f32("attention_f32 qkv", qkv, 2)
        heads = as_int("attention_f32 heads", heads, 1, I32_MAX)
        rows, width = qkv.shape
        if width % (3 * heads) or (width // (3 * heads)) % 16:
            raise ValueError(f"attention_f32: qkv rows must hold 3 * heads * d values with d a multiple of 16; "
                             f"got {width} for heads={heads}")
        lengths = np.asarray(lengths)
        if lengths.ndim != 1 or lengths.size == 0 or lengths.dtype.kind not in "iu" or (lengths < 1).any() \
                or (lengths > rows).any() or int(lengths.sum()) != rows:  # (each <= rows: the sum cannot wrap)
            raise ValueError(f"attention_f32: lengths must be positive integers, one per sentence, summing to the "
                             f"{rows} rows of qkv; got {lengths.tolist() if lengths.ndim == 1 else lengths}")
        seqs, d = lengths.size, width // (3 * heads)
        stride = -(-int(lengths.max()) // 4) * 4
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        with self.module.scope():
            pq, ps = self.module.put(qkv), self.module.put(starts)
            scratch = self.module.alloc(4 * seqs * heads * stride)
            py = self.module.alloc(4 * rows * heads * d)
            self.run("attention_f32", None, [pq, ps, scratch, py, seqs, heads, d, stride], pool, chunk)
            return self.module.get(py, np.float32, rows * heads * d).reshape(rows, heads * d)

    def mean_pool_f32(self, x: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Mean of x[seqs, t, n] over the tokens whose mask[seqs, t] is nonzero (weighted by it)."""
        x = _f32("mean_pool_f32 x", x, 3)
        if not isinstance(mask, np.ndarray) or mask.shape != x.shape[:2] or mask.dtype.kind not in "biuf":
            raise ValueError(f"mean_pool_f32: mask must be a numeric array of shape {x.shape[:2]}, got "
                             f"{getattr(mask, 'dtype', type(mask).__name__)}{list(getattr(mask, 'shape', []))}")
        seqs, t, n = x.shape
        if n == 0 or n % 4:
            raise ValueError(f"mean_pool_f32: vectors must hold a positive multiple of 4 values, got shape {x.shape}")
        with np.errstate(over="ignore"):  # a weight past float32's range is refused below, not warned of
            weights = np.ascontiguousarray(mask, np.float32)
        if mask.dtype.kind == "f" and (((weights == 0) & (mask != 0)) | (np.isinf(weights) & np.isfinite(mask))).any():
            raise ValueError("mean_pool_f32: mask weights must be within float32's range (a nonzero weight below"
                             f" {np.finfo(np.float32).smallest_subnormal:.3g} or beyond"
                             f" {np.finfo(np.float32).max:.3g} in magnitude would become 0 or inf)")
        with self.module.scope():
            px, pm = self.module.put(x), self.module.put(weights)
            py = self.module.alloc(4 * seqs * n)
            self.call(self.export_name("mean_pool_f32"), px, pm, py, seqs, t, n)
            return self.module.get(py, np.float32, seqs * n).reshape(seqs, n)

    def l2_normalize_f32(self, x: np.ndarray) -> np.ndarray:
        """Each row of x[rows, n] at unit length (a zero row stays zero)."""
        x = self._rows("l2_normalize_f32 x", x)
        with self.module.scope():
            px = self.module.put(x)
            self.call(self.export_name("l2_normalize_f32"), px, px, *x.shape)
            return self.module.get(px, np.float32, x.size).reshape(x.shape)

    def _f64_map(self, kernel: str, x: np.ndarray) -> np.ndarray:
        if not isinstance(x, np.ndarray) or x.dtype != np.float64 or x.ndim != 1:
            raise TypeError(f"{kernel}: expected a 1-D float64 array, got {getattr(x, 'dtype', type(x).__name__)}")
        return self._map(kernel, np.float64, np.ascontiguousarray(x))

    def _reduced(self, kernel: str, x: np.ndarray) -> np.ndarray:
        """sin/cos reduce x exactly by n pi/2 only for |n| < 2^20 (kernels.dsl): beyond that their
        error grows without bound (measured: 6.6e-10 at 1e7, 1e29 at 1e20), so such x are refused.
        Infinities and NaNs give NaN, as they should."""
        big = np.isfinite(x) & (np.abs(x) > SINCOS_MAX) if isinstance(x, np.ndarray) and x.dtype == np.float64 else None
        if big is not None and big.any():
            raise ValueError(f"{kernel}: |x| must be at most {SINCOS_MAX:.4g} (the argument reduction's exact range); "
                             f"x[{int(np.argmax(big))}] = {float(x[np.argmax(big)])!r}")
        return self._f64_map(kernel, x)

    def sin_f64(self, x: np.ndarray) -> np.ndarray:
        return self._reduced("sin_f64", x)

    def cos_f64(self, x: np.ndarray) -> np.ndarray:
        return self._reduced("cos_f64", x)

    def exp_f64(self, x: np.ndarray) -> np.ndarray:
        return self._f64_map("exp_f64", x)

    def log_f64(self, x: np.ndarray) -> np.ndarray:
        return self._f64_map("log_f64", x)

    def softmax_f32(self, x: np.ndarray, t: int | None = None, pool: Pool | None = None,
                    chunk: int | None = None) -> np.ndarray:
        """Softmax over the first `t` columns of each row of x[rows, stride] (stride a multiple of 4,
        the padding after column t kept as it is); returns the whole array as the kernel left it."""
        x = _f32("softmax_f32 x", x, 2)
        rows, stride = x.shape
        t = stride if t is None else as_int("softmax_f32 t", t, 1, I32_MAX)
        if stride % 4 or not 1 <= t <= stride:
            raise ValueError(f"softmax_f32: need 1 <= t <= stride and stride a multiple of 4, got t={t}, "
                             f"shape {x.shape} (pad rows with kernelgen.padded_rows)")
        with self.module.scope():
            p = self.module.put(x)
            self.run("softmax_f32", None, [p, rows, t, stride], pool, chunk)
            return self.module.get(p, np.float32, x.size).reshape(x.shape)

    def rope_table(self, npos: int, dim: int, theta: float = 10000.0, pos0: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin tables, f32[npos, dim / 2], of angles (pos0 + p) * theta^(-2i / dim).

        theta >= 1 keeps every angle at most the position (below 2^31): measured, the tables are
        then within 2.4e-7 of numpy's (a few f32 ulps) at any position; theta < 1 would give angles
        beyond the sin/cos argument reduction's range."""
        npos, dim = as_int("rope_table npos", npos, 0, I32_MAX), as_int("rope_table dim", dim, 1, I32_MAX)
        pos0, theta = as_int("rope_table pos0", pos0, 0, I32_MAX - npos), as_real("rope_table theta", theta)
        if dim % 2 or not 1 <= theta < float("inf"):
            raise ValueError(f"rope_table: need an even dim > 0 and a finite theta >= 1; got dim={dim}, theta={theta}")
        if 2 * 4 * npos * (dim // 2) > self.module.max_pages * PAGE_SIZE:
            raise ValueError(f"rope_table: two tables of npos={npos} x dim/2={dim // 2} f32 exceed the module's"
                             f" {self.module.max_pages * PAGE_SIZE} bytes of memory")
        with self.module.scope():
            n = npos * (dim // 2)
            pc, ps = self.module.alloc(4 * n), self.module.alloc(4 * n)
            self.call(self.export_name("rope_table"), pc, ps, pos0, npos, dim, float(theta))
            shape = (npos, dim // 2)
            return (self.module.get(pc, np.float32, n).reshape(shape), self.module.get(ps, np.float32, n).reshape(shape))

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool = False,
             pool: Pool | None = None, chunk: int | None = None) -> np.ndarray:
        """Rotate x[heads, dim] by one position's table rows (cos, sin: f32[dim / 2]); `interleaved`
        pairs (x[2i], x[2i+1]), else (x[i], x[i + dim/2]). Returns the rotated copy."""
        x = _f32("rope x", x, 2)
        cos, sin = _f32("rope cos", cos, 1), _f32("rope sin", sin, 1)
        interleaved = _flag("rope interleaved", interleaved)
        heads, dim = x.shape
        if dim % 8 or cos.size != dim // 2 or sin.size != dim // 2:
            raise ValueError(f"rope: dim must be a multiple of 8 and cos/sin hold dim / 2 values; got x {x.shape},"
                             f" cos {cos.shape}, sin {sin.shape}")
        with self.module.scope():
            p = self.module.put(x)
            kind = "pairs" if interleaved else "halves"
            pc, ps = self.module.put(cos), self.module.put(sin)
            self.run(f"rope_{kind}_f32", None, [p, pc, ps, heads, dim], pool, chunk)
            return self.module.get(p, np.float32, x.size).reshape(x.shape)


SINCOS_MAX = 2**20 * np.pi / 2  # sin_f64/cos_f64 reduce exactly by n pi/2 for |n| < 2^20 (kernels.dsl)


def padded_rows(x: np.ndarray, fill: float = 0.0) -> np.ndarray:
    """x[rows, t] -> f32[rows, stride] with stride rounded up to a multiple of 4 (the vector width):
    the layout softmax_f32 needs, so a row's last vector never reaches into the next row."""
    if not isinstance(x, np.ndarray) or x.ndim != 2 or x.dtype.kind not in "fiu":
        raise TypeError(f"padded_rows x: expected a 2-D numpy array of real numbers, got "
                        f"{f'{x.dtype} {x.shape}' if isinstance(x, np.ndarray) else type(x).__name__}")
    fill = as_real("padded_rows fill", fill)
    if x.nbytes > WASM_BYTES:
        raise ValueError(f"padded_rows x: {x.shape} is larger than a wasm memory holds")
    rows, t = x.shape
    out = np.full((rows, -(-t // 4) * 4), fill, np.float32)
    out[:, :t] = x
    return out


def load(out_dir: str | Path | None = None, target: str = "relaxed-simd", deterministic: bool = False,
         flavor: str = "auto") -> Kernels:
    """Load out_dir/<target>/kernels.wasm with its manifest; with no out_dir, the library's build that
    ships with kernelgen (kernelgen/library.py). `flavor`: "auto" loads the build the manifest's
    flavors name for this engine's lowering of the relaxed dot (wasmtime's is the base build's),
    "base" the base build, a flavor's name that flavor (same results, bit for bit)."""
    if not isinstance(target, str):
        raise TypeError(f"load target: expected a target name (str), got {type(target).__name__}")
    if not isinstance(flavor, str):
        raise TypeError(f"load flavor: expected 'auto', 'base' or a flavor's name (str), got {type(flavor).__name__}")
    deterministic = _flag("load deterministic", deterministic)
    if not (out_dir is None or isinstance(out_dir, (str, Path))):
        raise TypeError(f"load out_dir: expected a path (str or Path) or None, got {type(out_dir).__name__}")
    base = Path(library.out() if out_dir is None else out_dir)
    if target in ("", ".", "..") or Path(target).name != target:  # a path would load another build as this one
        raise ValueError(f"load target: expected a target name such as 'relaxed-simd' or 'simd128', got {target!r}")
    d = base / target
    built = sorted(p.name for p in base.iterdir() if (p / "kernels.json").is_file()) if base.is_dir() else []
    if built and target not in built:
        raise UnknownName(f"load target {target!r}: {base} holds builds for {', '.join(built)}")
    wasm, manifest = _read_build(d, target)
    if manifest["target"] != target:
        raise KernelgenError(f"{d / 'kernels.json'}: a build for target {manifest['target']!r}, not {target!r}; rebuild")
    flavors = manifest.get("flavors") or {}
    if flavor == "auto":
        probe = host.relaxed_dot_probe(deterministic)
        flavor = next((name for name, f in flavors.items() if all(probe.get(k) == v for k, v in f["when"].items())),
                      "base")
        there = d / flavors[flavor]["dir"] if flavor != "base" else d
        if not all((there / f).is_file() for f in ("kernels.json", "kernels.wasm")):
            # chosen by the probe but not deployed beside its base build: that gives the same results
            warnings.warn(f"{d}: the {flavor} flavor suits this engine but {there} holds no "
                          "build; loading the base build", RuntimeWarning, stacklevel=2)
            flavor = "base"
    if flavor == "base":
        return Kernels(wasm, manifest, deterministic, str(d / "kernels.json"))
    if flavor not in flavors:
        raise ValueError(f"load flavor: expected 'auto', 'base' or one of this build's flavors "
                         f"({', '.join(flavors) or 'it has none'}), got {flavor!r}")
    d = d / flavors[flavor]["dir"]
    wasm, manifest = _read_build(d, target)
    if manifest.get("flavor") != flavor:
        raise KernelgenError(f"{d / 'kernels.json'}: not the {flavor} flavor's manifest")
    return Kernels(wasm, manifest, deterministic, str(d / "kernels.json"))


def _read_build(d: Path, target: str) -> tuple[bytes, dict]:
    """kernels.wasm and kernels.json of the build in `d`, checked (check_manifest) before load reads its flavors."""
    try:
        text = (d / "kernels.json").read_bytes()
        check_signature(text, str(d / "kernels.json"))
        manifest = json.loads(text.decode("utf-8"))
        wasm = (d / "kernels.wasm").read_bytes()
    except FileNotFoundError as e:
        raise KernelgenError(f"{d}: no build for target {target!r} ({e.filename} is missing); run kernelgen build") from None
    except OSError as e:  # a file where a directory should be, a directory where a file, no permission
        raise KernelgenError(f"{d}: cannot read the build for target {target!r} ({e})") from None
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested too deep, an integer too long
        raise KernelgenError(f"{d / 'kernels.json'}: not a valid manifest ({e})") from None
    check_manifest(manifest, wasm, str(d / "kernels.json"))
    return wasm, manifest
