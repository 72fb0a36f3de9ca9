"""The thread pool's host side: Python threads running the generated pool over one shared memory.

Each helper thread has its own wasmtime Store and Instance on the module's SharedMemory and sits
in the exported `pool_helper` loop; the calling thread is the driver and runs jobs through
`par_for` (kernels.dsl, "the thread pool"). ctypes releases the GIL during wasm calls, so the
threads run in parallel. A job is a job-table entry (manifest "jobs"), its item count, a chunk
size and up to 16 argument words written to JOB_ARGS. A kernel declared `parallel` is called on
the pool with its own arguments (`Pool.call`): its manifest entry says which job runs it, how the
item count follows from the arguments, and which arguments are the job's words (`job_call`).

A helper whose job traps counts itself out (`pool_done`) and re-enters its loop, so the driver
never waits for it; the trap is raised in the caller of `run` once the job has finished. The pool
stops its threads on `close()`, on leaving a `with` block, when it is dropped (a finalizer: the
helper threads hold no reference to the Pool), and at interpreter exit.

`run` holds the module's lock, so Python threads sharing one pool take turns. Its item counts and
chunk sizes are checked and bounded so that POOL_NEXT, which every thread advances by a chunk once
past the end, can never overflow an i32 (a wrapped claim would run items out of range or loop).
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import wasmtime

from ..errors import UnknownName
from .manifest import MAX_THREADS, evaluate
from .module import I32_MAX, as_int, as_real

if TYPE_CHECKING:
    from .api import Kernels


class JobError(RuntimeError):
    """A job trapped on the driver and/or in helper threads; the pool is still usable."""

    def __init__(self, message: str, driver_error: BaseException | None, helper_errors: list[BaseException]) -> None:
        super().__init__(message)
        self.driver_error = driver_error
        self.helper_errors = helper_errors


@dataclass(frozen=True)
class JobCall:
    """A call of a parallel export as the pool runs it."""

    job: str  # the manifest "jobs" entry
    count: int  # items
    words: list[int | float]  # the job's arguments, JOB_ARGS words in order
    items: str  # what an item is (rows, blocks, ...)


def job_call(manifest: dict, export: str, args: Sequence[int | float]) -> JobCall:
    """How a call of `export` with `args` (its parameters in order) runs on the pool, from its
    manifest "parallel" entry."""
    entry = manifest["exports"].get(export)
    if entry is None:
        raise UnknownName(f"no export {export!r}")
    par = entry.get("parallel")
    if par is None:
        raise ValueError(f"{entry['kernel']} has no pool job (its kernel has no 'parallel' declaration)")
    names = [p["name"] for p in entry["params"]]
    if len(args) != len(names):
        raise ValueError(f"{export} takes {len(names)} arguments ({', '.join(names)}), got {len(args)}")
    env = dict(zip(names, args))
    words = [env[a["name"]] for a in manifest["jobs"][par["job"]]["args"]]
    # a negative count is no items, as the export itself takes it (its loop runs from 0 to it)
    return JobCall(par["job"], max(0, evaluate(par["count"], env)), words, par["items"])


class Pool:
    """`threads` threads in all: this one (the driver) and threads - 1 helpers."""

    def __init__(self, kernels: Kernels, threads: int = 2, start_timeout: float = 10.0) -> None:
        threads = as_int("pool threads", threads, 1, MAX_THREADS)
        self.kernels = kernels
        self.module = kernels.module
        fixed = kernels.manifest["memory"]["fixed"]
        self._word = {name: self.module.view(addr, np.int32, 1) for name, addr in fixed.items() if name != "JOB_ARGS"}
        self._args_addr = fixed["JOB_ARGS"]
        self._arg_words = kernels.manifest["memory"]["job_arg_words"]
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.size = threads
        claim = object()
        with self.module.lock:
            if self.module.pool_claim is not None or self._word["POOL_READY"][0] != 0:
                raise ValueError("this module's memory already has a pool (close it first)")
            self.module.pool_claim = claim
        self._word["POOL_STOP"][0] = 0
        self._word["POOL_WANT"][0] = threads - 1
        for i in range(threads - 1):
            t = threading.Thread(target=_helper, args=(self.module, i, self._errors, self._lock, self._word["POOL_GEN"]),
                                 name=f"kernelgen-pool-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        deadline = time.monotonic() + start_timeout
        while self._word["POOL_READY"][0] < threads - 1:
            if time.monotonic() > deadline:
                _stop(self.module, self._threads, self._word["POOL_READY"], claim)
                raise RuntimeError(f"pool: only {self._word['POOL_READY'][0]} of {threads - 1} helpers started")
            time.sleep(0.0005)
        self._finalizer = weakref.finalize(self, _stop, self.module, self._threads, self._word["POOL_READY"], claim)
        atexit.register(self._finalizer)

    def set_threads(self, threads: int) -> None:
        """Use `threads` threads (1 .. the pool's size) from the next job on."""
        threads = as_int(f"set_threads (this pool has {self.size} threads)", threads, 1, self.size)
        self._word["POOL_WANT"][0] = threads - 1

    def job_index(self, job: str) -> int:
        jobs = self.kernels.manifest["jobs"]
        if job not in jobs:
            raise UnknownName(f"no job {job!r}; jobs: {', '.join(jobs)}")
        return jobs[job]["index"]

    def call(self, export: str, args: Sequence[int | float], chunk: int | None = None) -> None:
        """Run parallel export `export` with its own arguments on this pool, `chunk` items per
        claim (default: the job's tuned chunk, else about four claims per thread)."""
        c = job_call(self.kernels.manifest, export, args)
        if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk < 1:  # run() checks the rest
            raise ValueError(f"{export}: chunk ({c.items} per claim) must be >= 1, got {chunk}")
        self.kernels.check_call(export, args)
        self.run(c.job, c.count, self.default_chunk(c) if chunk is None else chunk, c.words)

    def default_chunk(self, call: JobCall) -> int:
        """Items per claim when the caller gives none: the job's tuned chunk, else about four
        claims per thread. A tuned chunk was measured on one large shape, so it is capped at two
        claims per thread: on fewer items it would leave a thread idle (384 rows in chunks of 128
        give one thread twice the other's work)."""
        tuned = (self.kernels.manifest["jobs"][call.job].get("tuned") or {}).get("chunk")
        if tuned:
            return max(1, min(tuned, -(-call.count // (self.size * 2))))
        return max(1, -(-call.count // (self.size * 4)))

    def run(self, job: str, count: int, chunk: int, args: list[int | float]) -> None:
        """Run job `job` (a manifest "jobs" name) on items 0 .. count - 1, `chunk` items per claim.

        count is 0 .. 2**30; chunk is 1 .. 2**31 - 1, used as given up to the bound that keeps the
        claims within an i32 (a larger chunk changes only how the items are split, never a result).
        """
        spec = self.kernels.manifest["jobs"].get(job)
        if spec is None:
            raise UnknownName(f"no job {job!r}; jobs: {', '.join(self.kernels.manifest['jobs'])}")
        if len(args) != len(spec["args"]):
            raise ValueError(f"{job} takes {len(spec['args'])} arguments "
                             f"({', '.join(a['name'] for a in spec['args'])}), got {len(args)}")
        count = as_int(f"{job} count", count, 0, MAX_ITEMS)
        chunk = min(as_int(f"{job} chunk", chunk, 1, I32_MAX), max(1, (I32_MAX - count) // (self.size + 1)))
        values = [as_real(f"{job} {a['name']}", v) if a["type"] == "f32"
                  else self.module.check_address(f"{job} {a['name']}", v) if a["dsl_type"] == "ptr"
                  else as_int(f"{job} {a['name']}", v, -2**31, 2**32 - 1)
                  for v, a in zip(args, spec["args"])]
        with self.module.lock:
            self._run(job, spec, count, chunk, values)

    def _run(self, job: str, spec: dict, count: int, chunk: int, args: list[int | float]) -> None:
        if not self._threads and self.size > 1:
            raise ValueError("pool is closed: start another with Kernels.pool()")
        words = self.module.view(self._args_addr, np.int32, self._arg_words)
        for slot, (value, a) in enumerate(zip(args, spec["args"])):
            words[slot:slot + 1].view(np.float32 if a["type"] == "f32" else np.uint32 if value > I32_MAX else np.int32)[0] = value
        with self._lock:
            self._errors.clear()
        driver_error: BaseException | None = None
        try:
            self.module.call("par_for", spec["index"], count, chunk)
        except (wasmtime.Trap, wasmtime.WasmtimeError) as e:
            driver_error = e
            self.module.call("pool_wait")  # the helpers finish the job before anyone starts another
        with self._lock:
            errors = self._errors[:]
            self._errors.clear()
        if driver_error is not None or errors:
            where = (["the driver thread"] if driver_error else []) + ([f"{len(errors)} helper thread(s)"] if errors else [])
            first = driver_error or errors[0]
            raise JobError(f"{job} trapped in {' and '.join(where)}: {first}", driver_error, errors) from first

    def close(self) -> None:
        """Stop and join the helpers; the module can then get a new pool."""
        self._finalizer()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# The pool machinery's exports (kernels.dsl, "the thread pool"): run by Pool, never by a raw call.
POOL_EXPORTS = frozenset({"pool_helper", "pool_done", "pool_wait", "par_for", "pool_stop"})
MAX_ITEMS = 2**30  # items per job: with the chunk bound in run, the claims stay within an i32


def _helper(module: Any, i: int, errors: list[BaseException], lock: threading.Lock, gen: np.ndarray) -> None:
    """Helper thread `i`: its own instance, in pool_helper until POOL_STOP. It holds no reference
    to its Pool, so a Pool dropped without close() is collected and its finalizer stops the threads."""
    store, instance = module.instantiate_another()
    exports = instance.exports(store)
    helper, done = exports["pool_helper"], exports["pool_done"]
    rejoin, last = 0, 0
    while True:
        try:
            helper(store, i, rejoin, last)
            return  # POOL_STOP was set
        except (wasmtime.Trap, wasmtime.WasmtimeError) as e:
            with lock:
                errors.append(e)
            # The failed job's generation: no other job can be published before done() below,
            # and the helper must take part in any published after it.
            last = int(gen[0])
            done(store)  # count this helper out of the job it failed
            rejoin = 1


def _stop(module: Any, threads: list[threading.Thread], ready: np.ndarray, claim: object,
          timeout: float = 10.0) -> None:
    """Set POOL_STOP, wake every helper, join them, zero POOL_READY and give up the pool's claim on
    the module for a later pool. A pool without helpers (one thread) touches no pool word: another
    pool's helpers are not its to stop (dropping a one-thread pool once zeroed a running pool's
    POOL_READY, a second pool started beside it, and the next job hung)."""
    if threads:
        module.call("pool_stop")
        for t in threads:
            t.join(timeout)
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            raise RuntimeError(f"pool: helper threads did not stop: {', '.join(alive)}")
        threads.clear()
        ready[0] = 0
    with module.lock:
        if module.pool_claim is claim:
            module.pool_claim = None
