"""Timing a kernel in V8 (Node), the engine browsers run, for the tuner: the same wasm bytes and the
same memory contents the tuner verified under wasmtime, one batch of calls at a time (the batches,
warm-up and median are timing.measure's, so both engines are timed by one protocol).

V8 compiles the code shapes kernelgen emits differently from cranelift (register allocation, which
loads it merges): a variant that ties under wasmtime was 1.56x faster in V8, so a pick made from
wasmtime alone can cost browsers that much.
"""
from __future__ import annotations

import json
import select
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import KernelgenError
from ..host.api import Kernels
from .timing import Timing, measure

V8_TIME = Path(__file__).with_name("v8_time.mjs")
# relaxed SIMD (Node 20); optimized code from the first call (Node 20's Liftoff also doubles relaxed dots)
NODE_FLAGS = ("--experimental-wasm-relaxed-simd", "--no-liftoff")
STARTUP_SECONDS = 120  # instantiating a module and copying its memory; far less in practice
BATCH_SECONDS = 120  # one batch (timing.measure aims at 20 ms; a first batch of one slow call is longer)


def node_path() -> str:
    node = shutil.which("node")
    if node is None:
        raise KernelgenError("timing in V8 needs Node.js (node) on PATH; or tune with --engine wasmtime")
    return node


def engine_name() -> str:
    """'v8 <version>' of the Node on PATH: V8 versions compile differently, so timings keep it."""
    out = subprocess.run([node_path(), "-p", "process.versions.v8"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise KernelgenError(f"node -p process.versions.v8 failed: {out.stderr.strip()[-500:]}")
    return f"v8 {out.stdout.strip()}"


@contextmanager
def _node_batches(wasm_bytes: bytes, k: Kernels, export: str, args: list[int]) -> Iterator[subprocess.Popen]:
    """A Node process holding the module `wasm_bytes` (`k`'s) over a copy of `k`'s memory, running
    batches on request."""
    info = k.manifest["memory"]
    with tempfile.TemporaryDirectory(prefix="kernelgen-v8-") as tmp:
        wasm, image = Path(tmp, "kernels.wasm"), Path(tmp, "memory.bin")
        wasm.write_bytes(wasm_bytes)
        image.write_bytes(k.module.get(0, np.uint8, k.module.memory.data_len()).tobytes())
        config = {"wasm": str(wasm), "image": str(image), "minPages": info["min_pages"],
                  "maxPages": info["max_pages"], "export": export, "args": args}
        proc = subprocess.Popen([node_path(), *NODE_FLAGS, str(V8_TIME), json.dumps(config)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            yield proc
        finally:
            proc.stdin.close()
            try:
                proc.wait(timeout=STARTUP_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _line(proc: subprocess.Popen, timeout: float) -> str:
    """Node's next line of output, waiting at most `timeout` seconds (then Node is stopped)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        proc.kill()
        proc.wait()
        raise KernelgenError(f"node did not answer within {timeout:g} s; stopped it")
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=STARTUP_SECONDS)
        raise KernelgenError(f"node stopped: {proc.stderr.read().strip()[-2000:]}")
    return line.strip()


def measure_v8(wasm_bytes: bytes, k: Kernels, export: str, args: list[int], min_batch: float = 0.02,
               samples: int = 5) -> Timing:
    """Seconds per call of `export(reps, *args)` of the module `wasm_bytes` (the one `k` runs) in V8,
    on a copy of `k`'s memory: timing.measure's protocol, each batch timed in Node by its CPU time."""
    with _node_batches(wasm_bytes, k, export, args) as proc:
        if _line(proc, STARTUP_SECONDS) != "ready":
            raise KernelgenError("node did not start the kernel module")

        def batch(reps: int) -> float:
            proc.stdin.write(f"{reps}\n")
            proc.stdin.flush()
            return float(_line(proc, BATCH_SECONDS))

        return measure(batch, min_batch, samples, timed_by_call=True)
