"""Timing a kernel in V8, the engine browsers run, for the tuner: in Node, or in a page of headless
Chromium (the V8 browsers ship). The same wasm bytes and the same memory contents the tuner
verified under wasmtime, one batch of calls at a time (the batches, warm-up and median are
timing.measure's, so every engine is timed by one protocol).

V8 compiles the code shapes kernelgen emits differently from cranelift (register allocation, which
loads it merges): a variant that ties under wasmtime was 1.56x faster in V8, so a pick made from
wasmtime alone can cost browsers that much. And Node 20's V8 is not the browsers': Chromium's
lowers the relaxed integer dot to one vpdpbusd on AVX-VNNI (a register-only loop of it ran 71 G
MACs/s there, 31 in Node 20, on one AMD EPYC).
"""
from __future__ import annotations

import json
import os
import select
import signal
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from .. import library
from ..errors import KernelgenError
from ..host.api import Kernels
from .timing import Timing, measure

V8_TIME = Path(__file__).with_name("v8_time.mjs")
CHROMIUM_TIME = Path(__file__).with_name("chromium_time.mjs")
CHROMIUM = Path("/usr/bin/chromium")  # Debian's (.ci/run installs it), driven by playwright-core (npm ci)
# relaxed SIMD (Node 20); optimized code from the first call (Node 20's Liftoff also doubles relaxed dots)
NODE_FLAGS = ("--experimental-wasm-relaxed-simd", "--no-liftoff")
STARTUP_SECONDS = 120  # instantiating a module and copying its memory; far less in practice
BATCH_SECONDS = 120  # one batch (timing.measure aims at 20 ms; a first batch of one slow call is longer)


def node_path() -> str:
    node = shutil.which("node")
    if node is None:
        raise KernelgenError("timing in V8 needs Node.js (node) on PATH; or tune with --engine wasmtime")
    return node


def chromium_path() -> Path:
    """CHROMIUM, or a clear error where it is missing."""
    if not CHROMIUM.is_file():
        raise KernelgenError(f"timing in Chromium needs {CHROMIUM} (Debian: apt-get install chromium)")
    return CHROMIUM


def engine_name(browser: bool = False) -> str:
    """'v8 <version>' of the Node on PATH, or (`browser`) 'chromium <version>' of CHROMIUM: V8
    versions compile differently, so timings keep it (a Record's engine)."""
    argv = [str(chromium_path()), "--version"] if browser else [node_path(), "-p", "process.versions.v8"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise KernelgenError(f"{' '.join(argv[1:])} failed: {out.stderr.strip()[-500:]}")
    if browser:  # "Chromium 150.0.7871.100 built on Debian ..."
        return f"chromium {out.stdout.split()[1]}"
    return f"v8 {out.stdout.strip()}"


def in_browser(engine: str) -> bool:
    """Whether a Record's engine (engine_name) is Chromium's."""
    return engine.startswith("chromium ")


@contextmanager
def _node_batches(wasm_bytes: bytes, k: Kernels, export: str, args: list[int],
                  browser: bool) -> Iterator[subprocess.Popen]:
    """A Node process holding the module `wasm_bytes` (`k`'s) over a copy of `k`'s memory, running
    batches on request: itself, or (`browser`) in a page of the headless Chromium it starts. Its
    own process group, killed if it outlives the timing (a browser is Node's child, not ours)."""
    info = k.manifest["memory"]
    with tempfile.TemporaryDirectory(prefix="kernelgen-v8-") as tmp:
        wasm, image = Path(tmp, "kernels.wasm"), Path(tmp, "memory.bin")
        wasm.write_bytes(wasm_bytes)
        image.write_bytes(k.module.get(0, np.uint8, k.module.memory.data_len()).tobytes())
        config = {"wasm": str(wasm), "image": str(image), "minPages": info["min_pages"],
                  "maxPages": info["max_pages"], "export": export, "args": args}
        if browser:
            config.update(chromium=str(chromium_path()), runtimeDir=str(library.runtime()))
            argv = [node_path(), str(CHROMIUM_TIME), json.dumps(config)]
        else:
            argv = [node_path(), *NODE_FLAGS, str(V8_TIME), json.dumps(config)]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            yield proc
        finally:
            proc.stdin.close()
            try:
                proc.wait(timeout=STARTUP_SECONDS)
            except subprocess.TimeoutExpired:
                stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """Stop `proc`, and every process it started when it leads a group of its own (start_new_session:
    a browser is its child, not ours), and reap it."""
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except ProcessLookupError:  # it has exited already
        pass
    proc.wait()


def run_group(argv: list[str], timeout: float) -> tuple[int | None, str, str]:
    """Run `argv` in a process group of its own: (exit code, stdout, stderr), the code None if it
    ran past `timeout` seconds, when the whole group is killed (Chromium and its helpers with it:
    they are the script's children, not Python's)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        return None, *proc.communicate()
    except BaseException:  # Ctrl-C: nothing of the run is left behind
        stop(proc)
        raise
    return proc.returncode, stdout, stderr


def _line(proc: subprocess.Popen, timeout: float) -> str:
    """Node's next line of output, waiting at most `timeout` seconds (then Node is stopped)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        stop(proc)
        raise KernelgenError(f"node did not answer within {timeout:g} s; stopped it")
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=STARTUP_SECONDS)
        raise KernelgenError(f"node stopped: {proc.stderr.read().strip()[-2000:]}")
    return line.strip()


def measure_v8(wasm_bytes: bytes, k: Kernels, export: str, args: list[int], min_batch: float = 0.02,
               samples: int = 5, browser: bool = False) -> Timing:
    """Seconds per call of `export(reps, *args)` of the module `wasm_bytes` (the one `k` runs) in V8,
    on a copy of `k`'s memory: timing.measure's protocol, each batch timed in Node by its CPU time,
    or (`browser`) in a page of headless Chromium by the page's clock."""
    with _node_batches(wasm_bytes, k, export, args, browser) as proc:
        if _line(proc, STARTUP_SECONDS) != "ready":
            raise KernelgenError(f"{'chromium' if browser else 'node'} did not start the kernel module")

        def batch(reps: int) -> float:
            proc.stdin.write(f"{reps}\n")
            proc.stdin.flush()
            return float(_line(proc, BATCH_SECONDS))

        return measure(batch, min_batch, samples, timed_by_call=True)
