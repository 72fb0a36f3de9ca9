"""Run a built kernelgen wasm module under wasmtime, over one *shared* memory.

The module imports its linear memory as ``(import "env" "memory" (memory MIN MAX shared))``
and has no other imports. The host owns that memory: it allocates buffers in it (from the
manifest's ``heap_base`` up to its ``max_pages``; freed explicitly, by scope, or all at once),
reads/writes them as numpy views without copying, and calls the exported kernels. Because the memory is shared, further
Store+Instance pairs on the same memory (``Module.instantiate_another``) let several Python
threads run kernels over the same data at once: wasmtime-py calls into the runtime through
``ctypes.CDLL``, which releases the GIL for the duration of a wasm call, so the threads run
in parallel. A Store is not thread-safe: give each thread its own. The default Store and the
allocator are shared by every Python thread that uses this Module, so `call` and the allocator hold
`lock` (re-entrant: the API holds it for a whole call sequence, see kernelgen/host/api.py).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import difflib
import functools
import numbers
import os
import threading
from typing import Any, Iterator

import numpy as np
import wasmtime
from wasmtime import _ffi as ffi

from ..errors import UnknownName

__all__ = ["I32_MAX", "PAGE_SIZE", "Module", "as_int", "engine"]

PAGE_SIZE = 65536  # bytes in a wasm page
WASM_BYTES = 65536 * PAGE_SIZE  # the most a wasm32 memory holds: no input larger fits
I32_MAX = 2**31 - 1
# What each wasm value type accepts from Python: i32/i64 in their signed or unsigned range (wasm
# integers have no sign; the bits are the same), floats any real number.
_INT_RANGE = {"i32": (-2**31, 2**32 - 1), "i64": (-2**63, 2**64 - 1)}


def as_int(what: str, value: Any, lo: int, hi: int) -> int:
    """`value` as a Python int in [lo, hi]: an int or numpy integer, never a bool or a float (which
    wasmtime would truncate or wrap silently); TypeError or ValueError naming `what` otherwise."""
    if type(value) is not int:  # the common case first: this runs on every call
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
            raise TypeError(f"{what}: expected an integer, got {type(value).__name__} {value!r}")
        value = int(value)
    if not lo <= value <= hi:
        raise ValueError(f"{what}: {value} is outside {lo}..{hi}")
    return value


def as_real(what: str, value: Any) -> float:
    """`value` as a Python float: an int, float or numpy number, never a bool; TypeError otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.integer, np.floating)):
        raise TypeError(f"{what}: expected a number, got {type(value).__name__} {value!r}")
    return float(value)


@functools.cache
def engine(deterministic: bool = False) -> wasmtime.Engine:
    """The engine every kernel runs on; one per setting of relaxed-SIMD determinism.

    Cached because a module, its shared memory and all its instances must share one engine,
    and compiling an engine config is not free. ``False`` (the default) lets wasmtime pick the
    fastest native lowering; ``True`` emulates the relaxed-SIMD instructions with one fixed result
    on every machine (1.9x slower on a Q8_0 mat-vec here), for checking that a kernel's results do
    not depend on the lowering (the library's kernels keep the 7-bit contract, so they do not).
    """
    cfg = wasmtime.Config()
    cfg.wasm_simd = True
    cfg.wasm_relaxed_simd = True
    cfg.wasm_relaxed_simd_deterministic = deterministic
    cfg.wasm_threads = True
    cfg.shared_memory = True
    cfg.wasm_bulk_memory = True
    cfg.wasm_multi_value = True
    cfg.cranelift_opt_level = "speed"
    return wasmtime.Engine(cfg)


# runtime/features.mjs's probe: lane 0 of the relaxed dot-add of splats a = -128 and b = 0xff (its
# 7-bit operand's top bit set, which no kernel does) tells how the engine lowers it: b read as signed
# gives 4 * 128; read as unsigned, x86's pmaddubsw saturates each pair to -32768, vpdpbusd does not.
_PROBE_WAT = """(module (func (export "dot") (param i32 i32) (result i32)
  (i32x4.extract_lane 0 (i32x4.relaxed_dot_i8x16_i7x16_add_s
    (i8x16.splat (local.get 0)) (i8x16.splat (local.get 1)) (v128.const i32x4 0 0 0 0)))))"""
_PROBE_OUTCOMES = {4 * 128: {"sevenBit": "signed", "saturates": False},
                   2 * -32768: {"sevenBit": "unsigned", "saturates": True},
                   4 * -128 * 255: {"sevenBit": "unsigned", "saturates": False}}


@functools.cache
def relaxed_dot_probe(deterministic: bool = False) -> dict[str, Any]:
    """How this wasmtime lowers the relaxed dot (what a manifest's flavors' `when` is matched with):
    {"sevenBit": "signed" | "unsigned" | "unknown", "saturates": bool | None, "topBitLane": int}."""
    store = wasmtime.Store(engine(deterministic))
    lane = wasmtime.Instance(store, wasmtime.Module(engine(deterministic), _PROBE_WAT), []).exports(store)["dot"](
        store, -128, -1)
    return {**_PROBE_OUTCOMES.get(lane, {"sevenBit": "unknown", "saturates": None}), "topBitLane": lane}


def _shared_memory_extern(mem: wasmtime.SharedMemory) -> Any:
    """The ``wasmtime_extern_t`` that imports `mem` into an instance.

    Works around wasmtime-py issue #318: the stock ``SharedMemory._as_extern`` (and
    ``SharedMemory.size``) wrap the pointer twice, ``ctypes.pointer(self.ptr())``, so importing
    a host-made shared memory raises TypeError in every release. The union wants the pointer
    itself. (Use ``data_len()`` instead of the equally broken ``size()``.)
    """
    union = ffi.wasmtime_extern_union(sharedmemory=mem.ptr())
    return ffi.wasmtime_extern_t(ffi.WASMTIME_EXTERN_SHAREDMEMORY, union)


# A wasm value type's tag and field in wasmtime's C value (wasmtime_val_t): the types `_Caller` takes.
_C_VALUES = {"i32": (ffi.WASMTIME_I32, "i32"), "i64": (ffi.WASMTIME_I64, "i64"),
             "f32": (ffi.WASMTIME_F32, "f32"), "f64": (ffi.WASMTIME_F64, "f64")}


class _Caller:
    """An exported function of numbers called through wasmtime's C API (wasmtime_func_call) with its
    types looked up once. wasmtime-py's Func.__call__ asks for the function's type and converts
    every argument through a Val on each call: about 7 us an argument, 60 us for qmatvec's seven
    (wasmtime-py 50), where this takes 4-5 us. The call releases the GIL as Func.__call__ does (a
    ctypes call), so pool threads still run in parallel. A trap raises wasmtime.Trap."""

    def __init__(self, func: wasmtime.Func, params: list[str], results: list[str]) -> None:
        self.func = func
        self.params = [_C_VALUES[t] for t in params]
        self.results = [_C_VALUES[t][1] for t in results]

    def __call__(self, store: wasmtime.Store, values: list[int | float]) -> Any:
        args = (ffi.wasmtime_val_t * len(values))()
        for arg, (kind, field), v in zip(args, self.params, values):
            arg.kind = kind
            setattr(arg.of, field, v)
        out = (ffi.wasmtime_val_t * len(self.results))()
        trap = ctypes.POINTER(ffi.wasm_trap_t)()
        error = ffi.wasmtime_func_call(store._context(), ctypes.byref(self.func._func), args, len(values),
                                       out, len(self.results), ctypes.byref(trap))
        if error:
            raise wasmtime.WasmtimeError._from_ptr(error)
        if trap:
            raise wasmtime.Trap._from_ptr(trap)
        got = [getattr(r.of, field) for r, field in zip(out, self.results)]
        return None if not got else got[0] if len(got) == 1 else got


class _SharedMemory(wasmtime.SharedMemory):
    """A SharedMemory that can be passed to ``Instance(...)`` (fix for wasmtime-py #318)."""

    def _as_extern(self) -> Any:
        return _shared_memory_extern(self)


class Module:
    """One compiled kernel module, its shared memory, and a default Store+Instance.

    ``manifest["memory"]`` gives ``min_pages``/``max_pages`` of the imported memory and
    ``heap_base``, the first byte not used by the module's own static data, from which
    ``alloc`` hands out buffers.
    """

    def __init__(self, wasm: bytes | str | os.PathLike[str], manifest: dict[str, Any],
                 deterministic: bool = False) -> None:
        if not isinstance(wasm, (bytes, bytearray, memoryview)):
            with open(wasm, "rb") as f:
                wasm = f.read()
        mem_info = manifest["memory"]
        self.min_pages = int(mem_info["min_pages"])
        self.max_pages = int(mem_info["max_pages"])
        self.heap_base = int(mem_info["heap_base"])
        if not 0 <= self.heap_base <= self.max_pages * PAGE_SIZE:
            raise ValueError(f"heap_base {self.heap_base} outside memory of {self.max_pages} pages")

        self.engine = engine(deterministic)
        self.wasm_module = wasmtime.Module(self.engine, bytes(wasm))
        self._check_imports()
        self.memory: wasmtime.SharedMemory = _SharedMemory(
            self.engine,
            wasmtime.MemoryType(wasmtime.Limits(self.min_pages, self.max_pages), shared=True))
        self.store, self.instance = self.instantiate_another()
        # where the memory lies (a shared memory never moves) and how large it was when last asked
        self._base = ctypes.addressof(self.memory.data_ptr().contents)
        self._size = self.memory.data_len()
        self._funcs = {name: ext for name, ext in self.instance.exports(self.store).items()
                       if isinstance(ext, wasmtime.Func)}
        types = {name: f.type(self.store) for name, f in self._funcs.items()}
        self._params = {name: [str(p) for p in t.params] for name, t in types.items()}
        self.signatures = {name: list(p) for name, p in self._params.items()}  # export -> its wasm parameter types
        self._callers = {name: _Caller(self._funcs[name], self._params[name], [str(r) for r in t.results])
                         for name, t in types.items()
                         if all(str(v) in _C_VALUES for v in (*t.params, *t.results))}
        self.lock = threading.RLock()
        self._top = self.heap_base  # the end of the highest allocation
        # address -> the range it took and the allocation's serial number: an address is reused,
        # a serial never is, so a holder of (address, serial) can tell its allocation is gone
        self._live: dict[int, tuple[int, int, int]] = {}
        self._serial = 0
        self._holes: list[tuple[int, int]] = []  # freed ranges below _top, sorted and merged
        self._threads = threading.local()  # .scopes: this thread's open scopes, each a list of (address, serial)
        # Counts reset()s: what was allocated before one (e.g. a Packed) carries the old value.
        self.generation = 0
        # The running Pool's claim on this module (pool.Pool): one pool at a time, of any size (a
        # one-thread pool has no helpers, so POOL_READY alone cannot tell it is there).
        self.pool_claim: object | None = None

    def _check_imports(self) -> None:
        """Fail early, with a readable message, on a module that wants more than our memory."""
        imports = [(i.module, i.name, i.type) for i in self.wasm_module.imports]
        ok = (len(imports) == 1 and imports[0][:2] == ("env", "memory")
              and isinstance(imports[0][2], wasmtime.MemoryType) and imports[0][2].is_shared)
        if not ok:
            got = [f"{m}.{n}: {type(t).__name__}" for m, n, t in imports]
            raise ValueError(f"module must import only a shared env.memory; it imports {got}")

    def instantiate_another(self) -> tuple[wasmtime.Store, wasmtime.Instance]:
        """A fresh Store+Instance over the same shared memory, e.g. one per worker thread.

        Stores are not thread-safe, but separate stores are independent, and ctypes releases
        the GIL while wasm runs, so threads calling into their own instances run in parallel.
        """
        store = wasmtime.Store(self.engine)
        return store, wasmtime.Instance(store, self.wasm_module, [self.memory])

    # --- memory -------------------------------------------------------------------------

    def alloc(self, nbytes: int, align: int = 64, what: str = "a buffer") -> int:
        """Reserve `nbytes` at an `align`-aligned address (not zeroed) until ``free``, the end of
        the ``scope`` it was made in, or ``reset``; growing the memory up to the module's maximum.

        First fit in the ranges freed so far, else above everything in use; a range freed at the
        top lowers the top, so allocating and freeing in any order does not grow the memory.
        """
        nbytes = as_int("alloc nbytes", nbytes, 0, self.max_pages * PAGE_SIZE)
        align = as_int("alloc align", align, 1, PAGE_SIZE)
        if align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        with self.lock:
            return self._alloc(nbytes, align, what)

    def _alloc(self, nbytes: int, align: int, what: str) -> int:
        nbytes = max(nbytes, 1)  # every allocation its own address
        for i, (start, end) in enumerate(self._holes):
            addr = -(-start // align) * align
            if addr + nbytes <= end:
                rest = [(start, addr)] if addr > start else []
                self._holes[i:i + 1] = rest + ([(addr + nbytes, end)] if addr + nbytes < end else [])
                return self._keep(addr, addr, addr + nbytes)
        start = self._top
        addr = -(-start // align) * align
        end = addr + nbytes
        if end > self._size:  # (see view)
            self._size = size = self.memory.data_len()
            if end > size:
                need = -(-(end - size) // PAGE_SIZE)
                if size // PAGE_SIZE + need > self.max_pages:
                    raise MemoryError(self._out_of_memory(nbytes, what))
                self.memory.grow(need)
                self._size = self.memory.data_len()
        self._top = end
        return self._keep(addr, start, end)

    def _keep(self, addr: int, start: int, end: int) -> int:
        """Record an allocation: the range it took (alignment padding included) is what free returns."""
        self._serial += 1
        self._live[addr] = (start, end, self._serial)
        scopes = getattr(self._threads, "scopes", None)
        if scopes:
            scopes[-1].append((addr, self._serial))
        return addr

    def _out_of_memory(self, nbytes: int, what: str) -> str:
        limit = self.max_pages * PAGE_SIZE
        free = limit - self.in_use()
        return (f"out of memory: {what} needs {nbytes} bytes, and {free} of the module's {limit} bytes are free"
                f" ({self.in_use() - self.heap_base} in use by live allocations"
                f"{f', the largest free range {self._largest_free()} bytes' if self._holes else ''});"
                f" free packed matrices no longer needed (Packed.free(), `with k.pack(...) as w:`, or"
                f" `with k.scope():`), or rebuild with a larger maximum (kernelgen build --max-memory;"
                f" this build allows {self.max_pages} pages of 64 KiB)")

    def _largest_free(self) -> int:
        above = self.max_pages * PAGE_SIZE - self._top
        return max([above] + [end - start for start, end in self._holes])

    def free(self, addr: int) -> None:
        """Give back the allocation at `addr`."""
        with self.lock:
            self._free(addr)

    def _free(self, addr: int) -> None:
        try:
            start, end, _ = self._live.pop(addr)
        except KeyError:
            raise ValueError(f"free({addr}): not a live allocation of this module (freed already?)") from None
        holes = self._holes
        i = bisect.bisect(holes, (start, end))
        if i < len(holes) and holes[i][0] == end:  # merge with the free range after
            end = holes.pop(i)[1]
        if i > 0 and holes[i - 1][1] == start:  # and the one before
            start = holes.pop(i - 1)[0]
            i -= 1
        if end == self._top:
            self._top = start
        else:
            holes.insert(i, (start, end))

    def serial(self, addr: int) -> int | None:
        """The serial number of the live allocation at `addr` (None: there is none). Equal to the one
        an allocation had when made only while that allocation lives: a later one at the same
        address has another."""
        live = self._live.get(addr)
        return None if live is None else live[2]

    def in_use(self) -> int:
        """Bytes from address 0 to the end of the highest live allocation, less the freed ranges below it."""
        return self._top - sum(end - start for start, end in self._holes)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Everything this thread allocates inside the block is freed when it ends (unless freed
        before, or by a reset())."""
        scopes = self._threads.__dict__.setdefault("scopes", [])
        scopes.append([])
        try:
            yield
        finally:
            with self.lock:
                for addr, serial in reversed(scopes.pop()):
                    if self.serial(addr) == serial:  # not freed already (its address perhaps reused)
                        self._free(addr)

    def reset(self) -> None:
        """Free every allocation at once (the memory keeps its size); what was allocated before is
        invalid from now on (``generation`` counts resets)."""
        with self.lock:
            self._top = self.heap_base
            self._live.clear()
            self._holes.clear()
            self.generation += 1

    def in_heap(self, addr: int) -> bool:
        """Whether int `addr` lies in the heap as far as the memory's last known size tells (the fast
        path of a call's addresses: check_address decides the rest)."""
        return self.heap_base <= addr < self._size

    def check_address(self, what: str, addr: Any) -> int:
        """`addr` as an address in the heap, from heap_base to the memory's end: below it are the
        module's own words (the pool's), which a stray write would corrupt, and an address past the
        end wraps onto them in a kernel's i32 arithmetic (y + 4 r from 2^32 - 64 on: a job hung).
        ValueError otherwise."""
        a = as_int(what, addr, 0, 2**32 - 1)
        if a < self.heap_base:
            raise ValueError(f"{what}: address {a} is below the heap (heap_base {self.heap_base}: the pool's words); "
                             "pass addresses from alloc/put")
        if a >= self._size:  # the memory only grows: ask its size again only past the last answer
            self._size = self.memory.data_len()
        if a >= (end := self._size):
            raise ValueError(f"{what}: address {a} is past the memory's end ({end} bytes: an i32 address past it wraps"
                             " onto the pool's words); pass addresses from alloc/put")
        return a

    def put(self, array: np.ndarray, align: int = 64, pad: int = 0, what: str = "a buffer") -> int:
        """Copy `array` (as C-contiguous bytes) into fresh memory followed by `pad` zero bytes.

        The padding lets SIMD kernels read whole vectors past the end of the data.
        """
        pad = as_int("put pad", pad, 0, self.max_pages * PAGE_SIZE)
        if array.nbytes + pad > self.max_pages * PAGE_SIZE:  # before a copy (of a broadcast view, say)
            raise MemoryError(self._out_of_memory(array.nbytes + pad, what))
        data = np.ascontiguousarray(array)
        addr = self.alloc(data.nbytes + pad, align, what)
        dst = self.view(addr, np.uint8, data.nbytes + pad)
        dst[:data.nbytes] = data.reshape(-1).view(np.uint8)
        dst[data.nbytes:] = 0
        return addr

    def view(self, addr: int, dtype: Any, count: int) -> np.ndarray:
        """A writable numpy array of `count` `dtype` items aliasing memory at `addr` (no copy).

        Stays valid after the memory grows: a shared memory never moves. The view keeps the
        memory alive. Writes by wasm (any instance) are visible through it immediately.
        """
        addr = as_int("view addr", addr, -2**63, 2**63)  # the range is checked below, against the memory
        count = as_int("view count", count, -2**63, 2**63)
        dt = np.dtype(dtype)
        nbytes = count * dt.itemsize
        if addr + nbytes > self._size:  # the memory only grows: ask its size again only past the last answer
            self._size = self.memory.data_len()
        if addr < 0 or count < 0 or addr + nbytes > self._size:
            raise IndexError(f"view of {count} x {dt} at {addr} (bytes {addr}..{addr + nbytes}) "
                             f"is outside memory of {self._size} bytes")
        buf = (ctypes.c_ubyte * nbytes).from_address(self._base + addr)
        buf._owner = self.memory  # type: ignore[attr-defined]  # keep the memory alive
        return np.frombuffer(buf, dtype=dt, count=count)

    def get(self, addr: int, dtype: Any, count: int) -> np.ndarray:
        """A copy of `count` `dtype` items at `addr`, safe to keep after ``reset``."""
        return self.view(addr, dtype, count).copy()

    # --- calls --------------------------------------------------------------------------

    def exports(self) -> list[str]:
        """Names of the exported functions."""
        return list(self._funcs)

    def call(self, name: str, *args: int | float) -> Any:
        """Call exported function `name` on the default instance; a trap raises wasmtime.Trap.

        Each argument is checked against the function's wasm parameter type (integers in range for
        i32/i64, numbers for f32/f64: wasmtime itself wraps 2**40 to 0). Returns None, one value,
        or a list for multi-value results.
        """
        if not isinstance(name, str):
            raise TypeError(f"call: an export's name is a str, got {type(name).__name__}")
        try:
            func = self._funcs[name]
        except KeyError:
            close = difflib.get_close_matches(name, self._funcs, n=5, cutoff=0.5)
            hint = f"; close: {close}" if close else f"; exports: {sorted(self._funcs)}"
            raise UnknownName(f"no exported function {name!r}{hint}") from None
        params = self._params[name]
        if len(args) != len(params):
            raise TypeError(f"{name} takes {len(params)} arguments ({', '.join(params)}), got {len(args)}")
        values = []
        for i, (a, t) in enumerate(zip(args, params)):
            if t in _INT_RANGE:
                lo, hi = _INT_RANGE[t]
                v = as_int(f"{name} argument {i}", a, lo, hi) if type(a) is not int or not lo <= a <= hi else a
                values.append(v + 2 * lo if v > -lo - 1 else v)  # wasmtime-py takes i32/i64 as signed values
            else:
                values.append(a if type(a) is float else as_real(f"{name} argument {i}", a))
        caller = self._callers.get(name)
        with self.lock:
            return caller(self.store, values) if caller else func(self.store, *values)
