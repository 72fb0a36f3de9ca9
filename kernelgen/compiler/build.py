"""The build: kernels.dsl -> for each target, kernels.wat, kernels.wasm and kernels.json in out/.

Everything is compiled in memory first; files are written only when every target succeeded, each
through a temporary file and an atomic rename, and only when its content changed. A failed build
therefore leaves the previous out/ as it was, and two builds give identical bytes.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from . import layout
from .assemble import assemble, wabt_version
from .check import Checked, check, resolve_tune
from ..tuning.store import Record, best_tune, host, load_store
from .emit import render_module
from ..host.api import Kernels
from .lower import lower
from .ops import TARGETS
from .parse import parse

TARGET_NAMES = tuple(TARGETS)


@dataclass
class Built:
    """One target's artifacts, in memory."""

    target: str
    wat: str
    wasm: bytes
    manifest: dict


def inputs_hash(source: str, target: str, tune: dict) -> str:
    """What a build depends on besides the compiler's own code (whose changes the out/ freshness
    test catches by comparing bytes): the DSL text, target, tune values and tool versions."""
    h = hashlib.sha256()
    for part in (source, target, json.dumps(tune, sort_keys=True), __version__, wabt_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def compile_target(checked: Checked, target: str, tune: dict[str, dict[str, int]], dsl_name: str,
                   tune_info: dict) -> Built:
    """`tune_info` is choose_tune's account: where each kernel's values came from, the host, pool choices."""
    t = TARGETS[target]
    lowered = lower(checked, target, tune)
    digest = inputs_hash(checked.source, target, tune)
    memory = layout.describe()
    wat, spans = render_module(lowered.funcs, jobs=[j.name for j in lowered.jobs], file="kernels.wat",
                               version=__version__, dsl=dsl_name, target=target, inputs_hash=digest,
                               features=t.features, memory=memory, constants=t.constants)
    wasm = assemble(wat, t.wat2wasm_flags, spans, checked.source)
    manifest = {
        "kernelgen": __version__,
        "target": target,
        "features": list(t.features),
        "dsl": dsl_name,
        "inputs_sha256": digest,
        "tools": {"wat2wasm": wabt_version()},
        "memory": memory,
        "constants": dict(t.constants),
        # quantize_act's blocks: ACT_MAX-scaled values per this many f32, stored + ACT_ZERO.
        "activation": {"block": 32, "zero": t.constants["ACT_ZERO"], "max": t.constants["ACT_MAX"],
                       "dtype": "int8" if t.constants["ACT_ZERO"] == 0 else "uint8"},
        "quants": {name: q.to_json() for name, q in checked.quants.items()},
        "tune": {"values": tune, "source": tune_info["source"], "host": tune_info["host"]},
        "exports": {e.name: {"kernel": e.kernel, "quant": e.quant, "tune": e.tune, "params": e.params,
                             "result": e.result, "line": e.line} for e in lowered.exports},
        "jobs": {j.name: {"index": i, "kernel": j.kernel, "quant": j.quant, "items": j.items, "args": j.params[2:],
                          "tuned": tune_info["pool"].get(j.kernel), "line": j.line}
                 for i, j in enumerate(lowered.jobs)},
        "wasm_bytes": len(wasm),
    }
    return Built(target, wat, wasm, manifest)


def choose_tune(checked: Checked, target: str, overrides: dict[str, dict[str, int]] | None,
                records: list[Record] | None, tune_host: dict | None) -> tuple[dict[str, dict[str, int]], dict]:
    """Each exported kernel's tune values for `target`: an override, else the store's best for
    `tune_host` (this machine by default), else the declared defaults; and where each came from."""
    overrides = dict(overrides or {})
    want = tune_host or host()
    sources: dict[str, str] = {}
    for name, k in checked.kernels.items():
        if not k.ast.exported or not k.ast.tunes:
            continue
        if name in overrides:
            sources[name] = "override"
        elif records and (best := best_tune(records, checked, name, target, want,
                                            {t.name: t.default for t in k.ast.tunes})) is not None:
            overrides[name] = best
            sources[name] = "store"
        else:
            sources[name] = "default"
    values = resolve_tune(checked, overrides)
    pool = {}  # run-time choices for pool jobs (threads, items per claim), from the store only
    for name, k in checked.kernels.items():
        if k.ast.mode == "job" and records and (best := best_tune(records, checked, name, target, want)) is not None:
            pool[name] = best
    used_store = "store" in sources.values() or bool(pool)
    return values, {"source": sources, "host": want if used_store else None, "pool": pool}


def compile_source(source: str, filename: str = "kernels.dsl", targets: tuple[str, ...] = TARGET_NAMES,
                   tune: dict[str, dict[str, int]] | None = None, records: list[Record] | None = None,
                   tune_host: dict | None = None) -> list[Built]:
    """Parse, check and compile `source` for `targets`; raises DslError on any user mistake.
    `records` (a tuning store) supplies tune values for kernels `tune` does not set."""
    checked = check(parse(source, filename))
    built = []
    for t in targets:
        values, info = choose_tune(checked, t, tune, records, tune_host)
        built.append(compile_target(checked, t, values, Path(filename).name, info))
    return built


def compile_kernels(source: str, target: str = "relaxed-simd", tune: dict[str, dict[str, int]] | None = None,
                    deterministic: bool = False, filename: str = "kernels.dsl") -> Kernels:
    """Compile DSL source in memory (no files written) and load it."""
    (built,) = compile_source(source, filename, (target,), tune)
    return from_built(built, deterministic)


def from_built(built: Built, deterministic: bool = False) -> Kernels:
    """Load a target compiled in memory, as kernelgen.load loads one from out/."""
    return Kernels(built.wasm, built.manifest, deterministic)


def write_outputs(built: list[Built], out_dir: Path) -> list[Path]:
    """Write each target's files under out_dir/<target>/; returns the files that changed."""
    changed = []
    for b in built:
        files = {"kernels.wat": b.wat.encode(), "kernels.wasm": b.wasm,
                 "kernels.json": (json.dumps(b.manifest, indent=2, sort_keys=False) + "\n").encode()}
        for name, data in files.items():
            path = out_dir / b.target / name
            if path.is_file() and path.read_bytes() == data:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{name}.")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
            changed.append(path)
    return changed


def build(dsl: Path, out_dir: Path, targets: tuple[str, ...] = TARGET_NAMES,
          tune: dict[str, dict[str, int]] | None = None, store: Path | None = None,
          tune_host: dict | None = None) -> tuple[list[Built], list[Path]]:
    source = dsl.read_text(encoding="utf-8")
    records = load_store(store) if store is not None else None
    built = compile_source(source, str(dsl), targets, tune, records, tune_host)
    return built, write_outputs(built, out_dir)
