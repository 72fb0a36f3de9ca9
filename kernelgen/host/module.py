"""Run a built kernelgen wasm module under wasmtime, over one *shared* memory.

The module imports its linear memory as ``(import "env" "memory" (memory MIN MAX shared))``
and has no other imports. The host owns that memory: it allocates buffers in it (a bump
allocator from the manifest's ``heap_base``), reads/writes them as numpy views without
copying, and calls the exported kernels. Because the memory is shared, further
Store+Instance pairs on the same memory (``Module.instantiate_another``) let several Python
threads run kernels over the same data at once: wasmtime-py calls into the runtime through
``ctypes.CDLL``, which releases the GIL for the duration of a wasm call, so the threads run
in parallel. A Store is not thread-safe: give each thread its own. The default Store and the
allocator are shared by every Python thread that uses this Module, so `call` and the allocator hold
`lock` (re-entrant: the API holds it for a whole call sequence, see kernelgen/host/api.py).
"""

from __future__ import annotations

import ctypes
import difflib
import functools
import numbers
import os
import threading
from typing import Any

import numpy as np
import wasmtime
from wasmtime import _ffi as ffi

__all__ = ["I32_MAX", "PAGE_SIZE", "Module", "as_int", "engine"]

PAGE_SIZE = 65536  # bytes in a wasm page
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


def _shared_memory_extern(mem: wasmtime.SharedMemory) -> Any:
    """The ``wasmtime_extern_t`` that imports `mem` into an instance.

    Works around wasmtime-py issue #318: the stock ``SharedMemory._as_extern`` (and
    ``SharedMemory.size``) wrap the pointer twice, ``ctypes.pointer(self.ptr())``, so importing
    a host-made shared memory raises TypeError in every release. The union wants the pointer
    itself. (Use ``data_len()`` instead of the equally broken ``size()``.)
    """
    union = ffi.wasmtime_extern_union(sharedmemory=mem.ptr())
    return ffi.wasmtime_extern_t(ffi.WASMTIME_EXTERN_SHAREDMEMORY, union)


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
        self._funcs = {name: ext for name, ext in self.instance.exports(self.store).items()
                       if isinstance(ext, wasmtime.Func)}
        self._params = {name: [str(p) for p in f.type(self.store).params] for name, f in self._funcs.items()}
        self._top = self.heap_base
        self.lock = threading.RLock()
        # Counts reset()s: what was allocated before one (e.g. a Packed) carries the old value.
        self.generation = 0

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

    def alloc(self, nbytes: int, align: int = 64) -> int:
        """Reserve `nbytes` at an `align`-aligned address, growing the memory if needed.

        A bump allocator: kernels run on buffers set up once per call batch, freed together
        by ``reset``. The contents are not zeroed.
        """
        nbytes = as_int("alloc nbytes", nbytes, 0, self.max_pages * PAGE_SIZE)
        align = as_int("alloc align", align, 1, PAGE_SIZE)
        if align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        with self.lock:
            return self._alloc(nbytes, align)

    def _alloc(self, nbytes: int, align: int) -> int:
        addr = -(-self._top // align) * align
        end = addr + nbytes
        size = self.memory.data_len()
        if end > size:
            pages = size // PAGE_SIZE
            need = -(-(end - size) // PAGE_SIZE)
            if pages + need > self.max_pages:
                raise MemoryError(
                    f"alloc({nbytes}, align={align}) needs memory up to byte {end} "
                    f"({pages + need} pages) but the module allows at most {self.max_pages} "
                    f"pages ({self.max_pages * PAGE_SIZE} bytes); {addr - self.heap_base} bytes "
                    f"are in use above heap_base={self.heap_base}")
            self.memory.grow(need)
        self._top = end
        return addr

    def reset(self) -> None:
        """Free every allocation at once (the memory keeps its size)."""
        with self.lock:
            self._top = self.heap_base
            self.generation += 1

    def mark(self) -> int:
        """The allocator's position, for `release`: free a call's temporaries, keep what came before."""
        return self._top

    def release(self, mark: int) -> None:
        with self.lock:
            if not isinstance(mark, int) or not self.heap_base <= mark <= self._top:
                raise ValueError(f"release({mark}): not a mark of this allocator (top is {self._top})")
            self._top = mark

    def check_address(self, what: str, addr: Any) -> int:
        """`addr` as an address at or above heap_base: below it are the module's own words (the
        pool's), which a stray write would corrupt (an address past the memory's end only traps).
        ValueError otherwise."""
        a = as_int(what, addr, 0, 2**32 - 1)
        if a < self.heap_base:
            raise ValueError(f"{what}: address {a} is below the heap (heap_base {self.heap_base}: the pool's words); "
                             "pass addresses from alloc/put")
        return a

    def put(self, array: np.ndarray, align: int = 64, pad: int = 0) -> int:
        """Copy `array` (as C-contiguous bytes) into fresh memory followed by `pad` zero bytes.

        The padding lets SIMD kernels read whole vectors past the end of the data.
        """
        pad = as_int("put pad", pad, 0, self.max_pages * PAGE_SIZE)
        data = np.ascontiguousarray(array)
        addr = self.alloc(data.nbytes + pad, align)
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
        size = self.memory.data_len()
        if addr < 0 or count < 0 or addr + nbytes > size:
            raise IndexError(f"view of {count} x {dt} at {addr} (bytes {addr}..{addr + nbytes}) "
                             f"is outside memory of {size} bytes")
        base = ctypes.addressof(self.memory.data_ptr().contents)
        buf = (ctypes.c_ubyte * nbytes).from_address(base + addr)
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
        try:
            func = self._funcs[name]
        except KeyError:
            close = difflib.get_close_matches(name, self._funcs, n=5, cutoff=0.5)
            hint = f"; close: {close}" if close else f"; exports: {sorted(self._funcs)}"
            raise KeyError(f"no exported function {name!r}{hint}") from None
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
        with self.lock:
            return func(self.store, *values)
