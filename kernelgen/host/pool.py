"""The thread pool's host side: Python threads running the generated pool over one shared memory.

Each helper thread has its own wasmtime Store and Instance on the module's SharedMemory and sits
in the exported `pool_helper` loop; the calling thread is the driver and runs jobs through
`par_for` (kernels.dsl, "the thread pool"). ctypes releases the GIL during wasm calls, so the
threads run in parallel. A job is a job-table entry (manifest "jobs"), its item count, a chunk
size and up to 16 argument words written to JOB_ARGS.

A helper whose job traps counts itself out (`pool_done`) and re-enters its loop, so the driver
never waits for it; the trap is raised in the caller of `run` once the job has finished. The pool
stops its threads on `close()`, on leaving a `with` block, and at interpreter exit.
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import wasmtime

if TYPE_CHECKING:
    from .api import Kernels


class JobError(RuntimeError):
    """A job trapped on the driver and/or in helper threads; the pool is still usable."""

    def __init__(self, message: str, driver_error: BaseException | None, helper_errors: list[BaseException]) -> None:
        super().__init__(message)
        self.driver_error = driver_error
        self.helper_errors = helper_errors


class Pool:
    """`threads` threads in all: this one (the driver) and threads - 1 helpers."""

    def __init__(self, kernels: Kernels, threads: int = 2, start_timeout: float = 10.0) -> None:
        if threads < 1 or threads > 256:
            raise ValueError(f"threads must be 1..256, got {threads}")
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
        if self._word["POOL_READY"][0] != 0:
            raise RuntimeError("this module's memory already has a pool (close it first)")
        self._word["POOL_STOP"][0] = 0
        self._word["POOL_WANT"][0] = threads - 1
        for i in range(threads - 1):
            t = threading.Thread(target=self._helper, args=(i,), name=f"kernelgen-pool-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        deadline = time.monotonic() + start_timeout
        while self._word["POOL_READY"][0] < threads - 1:
            if time.monotonic() > deadline:
                _stop(self.module, self._threads, self._word["POOL_READY"])
                raise RuntimeError(f"pool: only {self._word['POOL_READY'][0]} of {threads - 1} helpers started")
            time.sleep(0.0005)
        self._finalizer = weakref.finalize(self, _stop, self.module, self._threads, self._word["POOL_READY"])
        atexit.register(self._finalizer)

    def _helper(self, i: int) -> None:
        store, instance = self.module.instantiate_another()
        exports = instance.exports(store)
        helper, done = exports["pool_helper"], exports["pool_done"]
        rejoin, last = 0, 0
        while True:
            try:
                helper(store, i, rejoin, last)
                return  # POOL_STOP was set
            except (wasmtime.Trap, wasmtime.WasmtimeError) as e:
                with self._lock:
                    self._errors.append(e)
                # The failed job's generation: no other job can be published before done() below,
                # and the helper must take part in any published after it.
                last = int(self._word["POOL_GEN"][0])
                done(store)  # count this helper out of the job it failed
                rejoin = 1

    def set_threads(self, threads: int) -> None:
        """Use `threads` threads (1 .. the pool's size) from the next job on."""
        if not 1 <= threads <= self.size:
            raise ValueError(f"set_threads({threads}): this pool has {self.size} threads")
        self._word["POOL_WANT"][0] = threads - 1

    def job_index(self, job: str) -> int:
        jobs = self.kernels.manifest["jobs"]
        if job not in jobs:
            raise KeyError(f"no job {job!r}; jobs: {', '.join(jobs)}")
        return jobs[job]["index"]

    def run(self, job: str, count: int, chunk: int, args: list[int | float]) -> None:
        """Run job `job` (a manifest "jobs" name) on items 0 .. count - 1, `chunk` items per claim."""
        if not self._threads and self.size > 1:
            raise RuntimeError("pool is closed")
        spec = self.kernels.manifest["jobs"].get(job)
        if spec is None:
            raise KeyError(f"no job {job!r}; jobs: {', '.join(self.kernels.manifest['jobs'])}")
        if len(args) != len(spec["args"]):
            raise ValueError(f"{job} takes {len(spec['args'])} arguments "
                             f"({', '.join(a['name'] for a in spec['args'])}), got {len(args)}")
        if count < 0 or chunk < 1:
            raise ValueError(f"{job}: need count >= 0 and chunk >= 1, got count={count}, chunk={chunk}")
        words = self.module.view(self._args_addr, np.int32, self._arg_words)
        for slot, (value, a) in enumerate(zip(args, spec["args"])):
            words[slot:slot + 1].view(np.float32 if a["type"] == "f32" else np.int32)[0] = value
        with self._lock:
            self._errors.clear()
        driver_error: BaseException | None = None
        try:
            self.module.call("par_for", spec["index"], count, chunk)
        except (wasmtime.Trap, wasmtime.WasmtimeError) as e:
            driver_error = e
            self.module.call("pool_wait")  # the helpers finish the job before anyone starts another
        with self._lock:
            errors, self._errors = self._errors, []
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


def _stop(module: Any, threads: list[threading.Thread], ready: np.ndarray, timeout: float = 10.0) -> None:
    """Set POOL_STOP, wake every helper, join them, and zero POOL_READY for a later pool."""
    if threads:
        module.call("pool_stop")
        for t in threads:
            t.join(timeout)
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            raise RuntimeError(f"pool: helper threads did not stop: {', '.join(alive)}")
        threads.clear()
    ready[0] = 0
