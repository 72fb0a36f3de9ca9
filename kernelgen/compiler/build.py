"""The build: kernels.dsl -> for each target, kernels.wat, kernels.wasm and kernels.json in out/.

Everything is compiled in memory first; files are written only when every target succeeded. The
whole out/ switches at once: the new tree is made in a sibling directory (unchanged files copied
with their bytes and times) and exchanged with out/ in one rename, so a reader, a `kill -9` or a
failure never sees one target's wasm beside another build's manifest. A lock on out/'s parent
directory makes a second concurrent build wait (a bounded time) for the first. Two builds give
identical bytes; a build that changes nothing writes nothing.
"""
from __future__ import annotations

import ctypes
import dataclasses
import errno
import functools
import hashlib
import itertools
import json
import multiprocessing
import os
import pickle
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

try:
    import fcntl
except ImportError:  # not POSIX: builds are not locked against each other
    fcntl = None  # type: ignore[assignment]

from .. import __version__
from ..errors import KernelgenError
from . import layout
from .assemble import assemble, wabt_version
from .check import Checked, check, resolve_tune, select_quants, tune_key
from ..tuning.budget import CODE_BUDGET, Upgrade, spend
from ..tuning.size import by_quant, code_sizes
from ..tuning.store import (ALL_QUANTS, Comparison, Record, best_tune, compare, host, load_store, middle_tune,
                            other_hosts, other_versions, shared_tune, smallest, speedup, usable)
from .emit import render_module
from ..host.api import Kernels
from ..host.manifest import manifest_text
from . import types as T
from .lower import Export, lower
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
    flavors: dict[str, Built] = field(default_factory=dict)  # the target's flavors (Target.flavors), by name

    def files(self) -> dict[Path, bytes]:
        """Its files as a build directory holds them: <target>/kernels.{wat,wasm,json}, and each
        flavor's in <target>/<flavor>/ (the directory its manifest entry names)."""
        return {Path(self.target, *([f.manifest["flavor"]] if f is not self else [])) / name: data
                for f in (self, *self.flavors.values()) for name, data in (
                    ("kernels.wat", f.wat.encode()), ("kernels.wasm", f.wasm),
                    ("kernels.json", manifest_text(f.manifest)))}


def inputs_hash(source: str, target: str, tune: dict, max_pages: int) -> str:
    """What a build depends on besides the compiler's own code (whose changes the out/ freshness
    test catches by comparing bytes): the DSL text, target, tune values, memory maximum and tool
    versions."""
    h = hashlib.sha256()
    for part in (source, target, json.dumps(tune, sort_keys=True), str(max_pages), __version__, wabt_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


@dataclass
class Memo:
    """What the builds of one checked program share (within_budget makes up to nine per target,
    most of their functions alike): lowered functions (lower's memo) and their text (render_module's
    cache). Both targets' default build measured 2.1-2.3 s in one process with one, 4.8 s without
    (seven builds; lowering 3.0 s -> 0.9 s)."""

    lowered: dict = field(default_factory=dict)
    rendered: dict = field(default_factory=dict)


def compile_target(checked: Checked, target: str, tune: dict[str, dict[str, int]], dsl_name: str,
                   tune_info: dict, max_pages: int = layout.MAX_PAGES, memo: Memo | None = None) -> Built:
    """`tune_info` is choose_tune's account: where each kernel's values came from, the host, pool
    choices; `max_pages` the memory's maximum, in 64 KiB pages; `memo` shared by the builds of one
    checked program."""
    t = TARGETS[target]
    memo = memo or Memo()
    lowered, wat, wasm, digest = _module(checked, target, tune, dsl_name, max_pages, memo)
    memory = layout.describe(max_pages)
    manifest = {
        "kernelgen": __version__,
        "target": target,
        "features": list(t.features),
        "dsl": dsl_name,
        "inputs_sha256": digest,
        "tools": {"wat2wasm": wabt_version()},
        "memory": memory,
        "constants": dict(t.constants),
        # quantize_act's blocks: ACT_MAX-scaled values per this many f32, stored + ACT_ZERO in
        # ACT_BYTES each (hosts size and type the activation buffer from this), with "split" each
        # 16 stored as the 8 at even positions, then the 8 at odd ones (ACT_SPLIT; hosts pass the
        # stored values on as they are, and reorder them only to show them). The scales' buffer
        # holds one f32 per block, then after all of them one "sums" per block: the sum of its
        # values (act_sums in kernels.dsl).
        "activation": {"block": 32, "zero": t.constants["ACT_ZERO"], "max": t.constants["ACT_MAX"],
                       "dtype": _act_dtype(t.constants), "split": bool(t.constants["ACT_SPLIT"]), "sums": "int32"},
        # each type as this target packs it (Target.layout: "group") and its integer-dot scheme
        # here (Target.dot_scheme): "i7" or "i16"
        "quants": {name: {**t.layout(q).to_json(), "dot": t.dot_scheme(q.codes is not None)}
                   for name, q in checked.quants.items()},
        "tune": {"values": tune, "source": tune_info["source"], "host": tune_info["host"],
                 **({"budget": tune_info["budget"]} if "budget" in tune_info else {}),
                 # tune keys built without a pick, the store's timings of them (this many) being
                 # for other versions of their source (store.other_versions)
                 **({"stale": tune_info["stale"]} if tune_info.get("stale") else {}),
                 # tune keys built without a pick, the store's current timings of them (this many)
                 # being from other hosts only (store.other_hosts)
                 **({"untimed": tune_info["untimed"]} if tune_info.get("untimed") else {}),
                 # tune keys picked without some of the store's current timings (store.Comparison):
                 # variants left out and, per engine, timings unused
                 **({"partial": tune_info["partial"]} if tune_info.get("partial") else {})},
        "exports": {e.name: _export_entry(e) for e in lowered.exports},
        "jobs": {j.name: {"index": i, "kernel": j.kernel.job, "quant": j.quant.name if j.quant else None,
                          "args": _params(j), "tuned": tune_info["pool"].get(j.kernel.job),
                          "line": j.kernel.ast.parallel.span.line}
                 for i, j in enumerate(lowered.jobs)},
        "wasm_bytes": len(wasm),
        "wasm_sha256": hashlib.sha256(wasm).hexdigest(),  # the hosts refuse a wasm from another build
        # other builds of these kernels, each in the directory named here beside this manifest, for
        # the engines whose probe of the relaxed dot finds `when` (ops.Flavor; hosts choose)
        **({"flavors": {f.name: {"dir": f.name, "when": f.when, "why": f.why} for f in t.flavors}}
           if t.flavors else {}),
    }
    return Built(target, wat, wasm, manifest)


def _module(checked: Checked, target: str, tune: dict[str, dict[str, int]], dsl_name: str, max_pages: int,
            memo: Memo, flavor: str | None = None) -> tuple[Any, str, bytes, str]:
    """Lowered, text, wasm and inputs hash of one target's module (in `flavor`: its inputs are its
    base build's, so is their hash)."""
    t = TARGETS[target] if flavor is None else TARGETS[target].flavored(flavor)
    lowered = lower(checked, target, tune, memo.lowered, flavor)
    digest = inputs_hash(checked.source, target, tune, max_pages)
    wat, spans = render_module(lowered.funcs, memo.rendered, jobs=[j.name for j in lowered.jobs], file="kernels.wat",
                               version=__version__, dsl=dsl_name, target=t.key, inputs_hash=digest,
                               features=t.features, memory=layout.describe(max_pages), constants=t.constants)
    return lowered, wat, assemble(wat, t.wat2wasm_flags, spans, checked.source), digest


def with_flavors(checked: Checked, base: Built, dsl_name: str, max_pages: int, memo: Memo) -> Built:
    """`base` with its target's flavors built on the same tune values: each a manifest like base's
    but for its constants and its own wasm (so hosts check it alike), the same exports and jobs."""
    values = base.manifest["tune"]["values"]
    flavors = {}
    for f in TARGETS[base.target].flavors:
        lowered, wat, wasm, _ = _module(checked, base.target, values, dsl_name, max_pages, memo, f.name)
        manifest = {k: v for k, v in base.manifest.items() if k != "flavors"}
        manifest.update(flavor=f.name, constants={**base.manifest["constants"], **f.constants}, wasm_bytes=len(wasm),
                        wasm_sha256=hashlib.sha256(wasm).hexdigest())
        if {e.name: _export_entry(e) for e in lowered.exports} != base.manifest["exports"]:
            raise KernelgenError(f"{base.target}'s {f.name} flavor exports other functions than its base build")
        flavors[f.name] = Built(base.target, wat, wasm, manifest)
    return dataclasses.replace(base, flavors=flavors)


def _act_dtype(constants: dict[str, int]) -> str:
    """The numpy/typed-array name of a stored activation: signed where stored as is, else unsigned."""
    bits = 8 * constants["ACT_BYTES"]
    return f"int{bits}" if constants["ACT_ZERO"] == 0 else f"uint{bits}"


def _export_entry(e: Export) -> dict:
    """An export as hosts see it. A parallel one says how a call runs on the pool: its "job", the
    item "count" from the call's arguments (see Lowerer._count_tree) and, through the job's "args",
    its argument words (each an export parameter of the same name)."""
    k = e.kernel.ast
    entry = {"kernel": e.kernel.name, "quant": e.quant.name if e.quant else None, "tune": e.tune,
             "params": _params(e), "result": T.resolve(k.ret) if k.ret else None, "line": k.span.line}
    if e.job is not None:
        entry["parallel"] = {"items": k.parallel.items, "count": e.contract.count, "job": e.job}
    return entry


def _params(e: Export) -> list[dict]:
    """The wasm parameters of an export, or the argument words of a job: name, wasm type, meaning
    (from the kernel's doc comment); a packed matrix is one pointer per plane of its quant type. An
    export's pointers give their "extent" (bytes, a formula of its i32 arguments; null where the
    doc gives none or a `?`), its i32 parameters a required "multiple" and a "minimum" (a formula)
    where the doc says one."""
    out = []
    for p in e.params:
        meaning = e.kernel.param_docs.get(p.name, "")
        if p.packed:
            assert e.quant is not None
            for plane, (_, per_block) in e.quant.planes.items():
                out.append({"name": f"{p.name}_{plane}", "type": "i32", "dsl_type": "ptr",
                            "meaning": f"{meaning} [{e.quant.name} plane {plane!r}: {per_block} bytes per block]".strip()})
        else:
            out.append({"name": p.name, "type": T.wasm_type(T.resolve(p.type) or "i32"), "dsl_type": p.type,
                        "meaning": meaning})
    if e.contract is not None:  # an export's (a job's words are checked as its export's arguments)
        for entry in out:
            if entry["dsl_type"] == "ptr":
                entry["extent"] = e.contract.extents.get(entry["name"])
            else:
                if entry["name"] in e.contract.multiples:
                    entry["multiple"] = e.contract.multiples[entry["name"]]
                if entry["name"] in e.contract.minimums:
                    entry["minimum"] = e.contract.minimums[entry["name"]]
    return out


def choose_tune(checked: Checked, target: str, overrides: dict[str, dict[str, int]] | None,
                records: list[Record] | None, tune_host: dict | None) -> tuple[dict[str, dict[str, int]], dict]:
    """Each exported kernel's tune values for `target` (a table of check.tune_key entries), and where
    each came from: an override; else, per quant type, the store's pick from that type's timings on
    `tune_host` (this machine by default; store.best_tune: the smallest variant unless a larger one
    is SIZE_MARGIN faster); a type the store has no timing for, when others have some, takes the
    smallest variant (its code is built for every such type); a kernel without timings takes its
    declared defaults. The account's "upgrades" are the store's picks of one type that are not the
    smallest variant (what a byte budget may take back), and for each its middle variant where the
    store has one (store.middle_tune: what the budget may build instead), and the type's other
    kernels' variants on its tile (store.shared_tune)."""
    overrides = dict(overrides or {})
    want = tune_host or host()
    # This target's and host's records by kernel and quant type (ALL_QUANTS: of any type): each of
    # the hundred-odd lookups below reads only its own (reading the whole store each time took
    # 0.3-0.5 s of a 2.5 s target).
    mine: dict[tuple[str, str | None], list[Record]] = {}
    theirs: dict[tuple[str, str | None], list[Record]] = {}  # other hosts' (for `untimed`)
    for r in records or []:
        if r.target == target:
            by = mine if r.host == want else theirs
            by.setdefault((r.kernel, ALL_QUANTS), []).append(r)
            by.setdefault((r.kernel, r.quant), []).append(r)
    sources: dict[str, str] = {}
    upgrades: list[Upgrade] = []
    stale: dict[str, int] = {}  # tune keys left unpicked whose store timings are all of other versions
    untimed: dict[str, int] = {}  # tune keys left unpicked that only other hosts time
    partial: dict[str, dict] = {}  # tune keys picked blind to some current timings (_partial)
    for name, k in checked.kernels.items():
        if not k.ast.exported or not k.ast.tunes:
            continue
        if name in overrides:
            sources[name] = "override"
            continue
        least = smallest(checked, name)
        quants = checked.quants if k.ast.generics else (None,)
        picks = {q: best for q in quants
                 if (best := best_tune(mine.get((name, q), []), checked, name, target, want, least, q)) is not None}
        for q in quants:
            if q not in picks and (n := other_versions(mine.get((name, q), []), checked, name, target, want, q)):
                stale[tune_key(name, q) if q else name] = n
            elif q not in picks and (n := other_hosts(theirs.get((name, q), []), checked, name, target, want, q)):
                untimed[tune_key(name, q) if q else name] = n
            elif q in picks and (gap := _partial(compare(mine[name, q], checked, name, target, want, q))):
                partial[tune_key(name, q) if q else name] = gap
        if not picks:
            sources[name] = "default"
            continue
        overrides[name], sources[name] = (picks[None], "store") if None in picks else (least, "smallest")
        for q, best in picks.items():
            if q is not None and best != least and tune_key(name, q) not in overrides:
                overrides[tune_key(name, q)] = best
                sources[tune_key(name, q)] = "store"
                upgrades.append(Upgrade(tune_key(name, q), q, least, best,
                                        speedup(mine[name, q], checked, name, target, want, best, least, q)))
                if (mid := middle_tune(mine[name, q], checked, name, target, want, least, best, q)) is not None:
                    upgrades.append(Upgrade(tune_key(name, q), q, least, mid,
                                            speedup(mine[name, q], checked, name, target, want, mid, least, q), middle=True))
    for u in [u for u in upgrades if not u.middle]:  # each pick's tile for the type's other kernels
        owner = u.key.removesuffix(f"_{u.quant}")
        for name, k in checked.kernels.items():
            key = tune_key(name, u.quant)
            if name == owner or not k.ast.generics or not k.ast.tunes or sources.get(key) != "store":
                continue
            least = smallest(checked, name)
            shared = shared_tune(mine.get((name, u.quant), []), checked, name, target, want, least, u.fast, u.quant)
            if shared is not None and all(x.fast != shared for x in upgrades if x.key == key):
                gain = speedup(mine[name, u.quant], checked, name, target, want, shared, least, u.quant)
                upgrades.append(Upgrade(key, u.quant, least, shared, gain, shares=owner))
    values = resolve_tune(checked, overrides)
    sources.update({key: "override" for key in overrides if key not in sources})
    pool = {}  # run-time choices for pool jobs (threads, items per claim), from the store only
    for name in checked.jobs:
        if (best := best_tune(mine.get((name, ALL_QUANTS), []), checked, name, target, want)) is not None:
            pool[name] = best
            if gap := _partial(compare(mine[name, ALL_QUANTS], checked, name, target, want)):
                partial[name] = gap
        elif n := other_versions(mine.get((name, ALL_QUANTS), []), checked, name, target, want):
            stale[name] = n
        elif n := other_hosts(theirs.get((name, ALL_QUANTS), []), checked, name, target, want):
            untimed[name] = n
    used_store = "store" in sources.values() or bool(pool)
    return values, {"source": sources, "host": want if used_store else None, "pool": pool, "upgrades": upgrades,
                    "stale": stale, "untimed": untimed, "partial": partial}


def _partial(c: Comparison) -> dict:
    """A pick's blind spots, for the manifest: how many variants with current timings it left out,
    and per engine how many current timings of the others it did not use; empty when none."""
    return {**({"left_out": len(c.left_out)} if c.left_out else {}), **({"unused": c.unused} if c.unused else {})}


def within_budget(checked: Checked, built: Built, values: dict[str, dict[str, int]], info: dict, budget: int,
                  dsl_name: str, max_pages: int, memo: Memo | None = None) -> Built:
    """`built` when its quant-type code fits `budget` bytes; else the build of budget.spend's choice
    of store picks and middle variants (the others at their smallest variants), each dropped pick's
    source "budget" and the manifest's `tune.budget` naming it with its fast variant and the speedup
    it gives up (and the middle variant built instead, with its own).

    Costs are measured, not modelled: one build per combination of the tuned kernels' levels
    (smallest, middle, pick, on another pick's tile; qmatvec and qmatmul: at most sixteen builds, one
    of them `built`) gives every type's code at each level, since types share no code. A model from
    function names and call graphs missed what an export's name leaves out (qmatmul's tiles take qmatvec's accs): 1,571
    bytes under the truth on relaxed SIMD, and the greedy repair after it dropped four picks to keep
    one. Taking a middle variant instead of the smallest kept relaxed SIMD's Q8_0 mat-vec at 1.35x of
    the smallest's speed where the pick (1.42x) did not fit; a GEMM on qmatvec's tile cut what the
    committed build gives up from 158x to 16x on simd128 and from 38x to 18x on relaxed SIMD (the
    products of the speedups left out, weighed by priority)."""
    upgrades: list[Upgrade] = info["upgrades"]
    quants = tuple(checked.quants)
    priority = {q.name: q.priority for q in checked.program.quants if q.priority is not None and q.name in quants}
    keys = {u.key for u in upgrades}

    def by_type(b: Built) -> dict[str, int]:
        return {q: n for q, n in by_quant(code_sizes(b), quants).items() if q is not None}

    def kernel_of(u: Upgrade) -> str:
        return u.key.removesuffix(f"_{u.quant}")

    def level(u: Upgrade) -> int:  # 0 is the smallest variant
        return 1 if u.middle else 3 if u.shares else 2

    def compiled(taken: list[Upgrade], account: dict) -> Built:
        chosen = {k: v for k, v in values.items() if k not in keys}  # a key left out: the kernel's smallest
        chosen.update({u.key: u.fast for u in taken})
        return compile_target(checked, built.target, resolve_tune(checked, chosen), dsl_name, account, max_pages, memo)

    if sum(by_type(built).values()) <= budget or not upgrades:
        return built
    # Each tuned kernel at each level (0: smallest, 1: middle, 2: pick, 3: on another pick's tile)
    # across all types at once; a type with no such variant of a kernel keeps its smallest there.
    kernels = sorted({kernel_of(u) for u in upgrades})
    levels = [tuple(sorted({0, 2} | {level(u) for u in upgrades if kernel_of(u) == k})) for k in kernels]
    sizes: dict[tuple[int, ...], dict[str, int]] = {}
    for combo in itertools.product(*levels):
        taken = [u for u in upgrades if level(u) == combo[kernels.index(kernel_of(u))]]
        sizes[combo] = by_type(built if all(n == 2 for n in combo) else compiled(taken, info))

    def cost(quant: str, names: frozenset[str]) -> int:
        chosen = {kernel_of(u): level(u) for u in upgrades if u.quant == quant and u.name in names}
        return sizes[tuple(chosen.get(k, 0) for k in kernels)].get(quant, 0)

    def build(names: set[str]) -> Built:
        taken = [u for u in upgrades if u.name in names]
        built_as = {u.key: u for u in taken}
        dropped = [u for u in upgrades if not u.alternative and (u.key not in built_as or built_as[u.key].alternative)]
        return compiled(taken, {**info, "source": {**info["source"], **{u.key: "budget" for u in dropped}},
                                "budget": {"bytes": budget, **({"priority": priority} if priority else {}),
                                           "dropped": {u.key: {
                                    "fast": values[u.key], "speedup": round(u.speedup, 3),
                                    **({"built": {p: built_as[u.key].fast[p] for p in values[u.key]},
                                        "built_speedup": round(built_as[u.key].speedup, 3)} if u.key in built_as else {})}
                                    for u in dropped}}})

    # A type's code can still move by a few bytes with the whole module's function count (the size
    # of call indices): a choice that misses by that much is made again with the miss taken off.
    fixed = sum(n for q, n in sizes[(0,) * len(kernels)].items() if q not in {u.quant for u in upgrades})
    short = 0
    tried = []
    for _ in range(BUDGET_RETRIES):
        out = build(spend(upgrades, cost, budget - fixed - short, priority))
        used = sum(by_type(out).values())
        if used <= budget:
            return out
        tried.append((used, out))
        short += used - budget
    least = build(set())  # nothing fits: the fewest bytes, which the smallest variants need not be
    return min([*tried, (sum(by_type(least).values()), least)], key=lambda t: t[0])[1]


BUDGET_RETRIES = 4  # choices made again when a measured choice misses the budget by its call indices


def compile_source(source: str, filename: str = "kernels.dsl", targets: tuple[str, ...] = TARGET_NAMES,
                   tune: dict[str, dict[str, int]] | None = None, records: list[Record] | None = None,
                   tune_host: dict | None = None, max_pages: int = layout.MAX_PAGES,
                   code_budget: int | None = CODE_BUDGET, quants: tuple[str, ...] | None = None,
                   flavors: bool = True) -> list[Built]:
    """Parse, check and compile `source` for `targets`; raises DslError on any user mistake.
    `records` (a tuning store) supplies tune values for kernels `tune` does not set, within
    `code_budget` bytes of quant-type code per target (within_budget; None: no budget). `quants`
    names the quant types to build (check.select_quants; None: every declared type); `flavors`
    whether to build each target's flavors too (Built.flavors)."""
    checked = check(parse(source, filename))
    if quants is not None:
        checked = select_quants(checked, quants)
    if records:
        records = usable(records, checked)
    one = functools.partial(_compile_one, checked, tune=tune, records=records, tune_host=tune_host,
                            dsl_name=Path(filename).name, max_pages=max_pages, code_budget=code_budget,
                            flavors=flavors)
    if not _fork_targets(targets):
        return [one(t) for t in targets]
    # One process per target: the targets share nothing past `checked`, and lowering is pure Python
    # (both targets' default build: 2.6-2.7 s in one process, 1.5-1.8 s so).
    return _in_processes(one, targets)


def _in_processes(one: Callable[[str], Built], targets: tuple[str, ...]) -> list[Built]:
    """one(t) for each target, each in a process forked for it: the children start with the parsed
    program and the imports, do their one target, send back its Built (or the error it raised, as
    itself) and end. Nothing in a child waits on this process: one whose build was killed ends
    after its own target, when its result finds no reader (a process pool's workers would wait on
    their queue for ever, as the first version of this did)."""
    ctx = multiprocessing.get_context("fork")
    running = []
    try:
        for t in targets:
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_target_process, args=(one, t, recv, send))
            p.start()
            send.close()
            running.append((p, recv))
        results = []
        for p, recv in running:
            try:
                ok, value = recv.recv()
            except EOFError:
                raise KernelgenError("a target's build process stopped abruptly (killed, or out of memory); "
                                     "nothing was written") from None
            if not ok:
                raise value
            results.append(value)
        return results
    finally:
        for p, recv in running:  # done, or this build stops: no child outlives it
            recv.close()
            p.join(CHILD_EXIT)
            if p.is_alive():
                p.kill()
                p.join()


CHILD_EXIT = 5.0  # seconds a target's process has to end after it sent its result


def _target_process(one: Callable[[str], Built], target: str, recv: Any, send: Any) -> None:
    recv.close()  # the parent's end: with it closed, a parent that died leaves this write no reader
    try:
        result: tuple[bool, object] = (True, one(target))
    except BaseException as e:  # noqa: BLE001 - raised again in the parent
        result = (False, e)
    try:
        send.send(result)
    except (pickle.PicklingError, TypeError, AttributeError):  # an error that does not pickle: its text
        send.send((False, KernelgenError(f"{target}: {result[1]!r}")))


def _fork_targets(targets: tuple[str, ...]) -> bool:
    """Build `targets` in forked processes: more than one target and one CPU, a platform that forks,
    and no other Python thread in this process (a fork copies only the calling thread, so a lock
    another one holds would never be released in the child)."""
    return (len(targets) > 1 and (os.cpu_count() or 1) > 1 and "fork" in multiprocessing.get_all_start_methods()
            and threading.active_count() == 1)


def _compile_one(checked: Checked, target: str, tune: dict[str, dict[str, int]] | None, records: list[Record] | None,
                 tune_host: dict | None, dsl_name: str, max_pages: int, code_budget: int | None,
                 flavors: bool = True) -> Built:
    """One target of compile_source: its tune values, its build, the byte budget's builds."""
    memo = Memo()  # shared by the builds within_budget makes
    values, info = choose_tune(checked, target, tune, records, tune_host)
    b = compile_target(checked, target, values, dsl_name, info, max_pages, memo)
    if code_budget is not None:
        b = within_budget(checked, b, values, info, code_budget, dsl_name, max_pages, memo)
    return with_flavors(checked, b, dsl_name, max_pages, memo) if flavors else b


def compile_kernels(source: str, target: str = "relaxed-simd", tune: dict[str, dict[str, int]] | None = None,
                    deterministic: bool = False, filename: str = "kernels.dsl", flavor: str | None = None) -> Kernels:
    """Compile DSL source in memory (no files written) and load it (its `flavor`: Target.flavors)."""
    (built,) = compile_source(source, filename, (target,), tune, flavors=flavor is not None)
    if flavor is not None:
        if flavor not in built.flavors:
            raise ValueError(f"compile_kernels flavor: {target} has {', '.join(built.flavors) or 'no flavors'}, "
                             f"not {flavor!r}")
        built = built.flavors[flavor]
    return from_built(built, deterministic)


def from_built(built: Built, deterministic: bool = False) -> Kernels:
    """Load a target compiled in memory, as kernelgen.load loads one from out/."""
    return Kernels(built.wasm, built.manifest, deterministic)


LOCK_TIMEOUT = 120.0  # seconds a build waits for another one writing the same out/


def write_outputs(built: list[Built], out_dir: Path, lock_timeout: float = LOCK_TIMEOUT) -> list[Path]:
    """Write each target's files under out_dir/<target>/ (a flavor's in out_dir/<target>/<flavor>/),
    all at once; returns the files that changed.

    out_dir must be new, empty, or hold only target directories: it is replaced as a whole.
    """
    files = {path: data for b in built for path, data in b.files().items()}
    out_dir = Path(out_dir)
    try:
        parent = out_dir.absolute().parent
        blocking = next((a for a in (parent, *parent.parents) if a.exists()), parent)
        if not blocking.is_dir():
            raise KernelgenError(f"{out_dir}: {blocking} is not a directory")
        parent.mkdir(parents=True, exist_ok=True)
        with _locked(parent, out_dir, lock_timeout):
            return _replace_tree(files, out_dir)
    except OSError as e:
        raise KernelgenError(f"{out_dir}: cannot write the build there ({e.strerror or e})") from None


def _replace_tree(files: dict[Path, bytes], out_dir: Path) -> list[Path]:
    parent, name = out_dir.absolute().parent, out_dir.name
    for stale in [*parent.glob(f".{name}.new-*"), *parent.glob(f".{name}.old-*")]:
        shutil.rmtree(stale, ignore_errors=True)  # left by a build that was killed (we hold the lock)
    if out_dir.exists() and not out_dir.is_dir():
        raise KernelgenError(f"{out_dir}: not a directory")
    present = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    foreign = [n for n in present if n not in TARGET_NAMES and not n.startswith(".")]
    if foreign or any(not (out_dir / n).is_dir() for n in present if n in TARGET_NAMES):
        raise KernelgenError(f"{out_dir}: holds files that are not kernelgen's ({', '.join(foreign[:5]) or 'target files'}); "
                             "the build replaces the whole directory: choose a new or empty one")
    changed = [p for p, data in files.items() if not ((out_dir / p).is_file() and (out_dir / p).read_bytes() == data)]
    if not changed:
        return []
    new = parent / f".{name}.new-{os.getpid()}"
    try:
        if out_dir.is_dir():
            shutil.copytree(out_dir, new, ignore=shutil.ignore_patterns(".*"))  # copy2: bytes and times kept
        else:
            new.mkdir()
        for p in changed:
            (new / p).parent.mkdir(parents=True, exist_ok=True)
            (new / p).write_bytes(files[p])
            os.chmod(new / p, 0o644)
        if not out_dir.is_dir():
            os.rename(new, out_dir)
        elif _exchange(new, out_dir):
            shutil.rmtree(new)  # now the previous tree
        else:  # no atomic exchange here: two renames, the old tree kept until the new one is in place
            old = parent / f".{name}.old-{os.getpid()}"
            os.rename(out_dir, old)
            os.rename(new, out_dir)
            shutil.rmtree(old)
    finally:
        shutil.rmtree(new, ignore_errors=True)
    return [out_dir / p for p in changed]


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except (OSError, TypeError):  # no C library to ask (Windows)
        return False
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


@contextmanager
def _locked(parent: Path, out_dir: Path, timeout: float) -> Iterator[None]:
    """Hold an exclusive lock on `parent` (the directory whose entry out_dir is) while writing."""
    if fcntl is None:
        yield
        return
    fd = os.open(parent, os.O_RDONLY)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise KernelgenError(f"{out_dir}: another kernelgen build is writing it (waited {timeout:.0f} s); "
                                         "run this one when it has finished") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def build(dsl: Path, out_dir: Path, targets: tuple[str, ...] = TARGET_NAMES,
          tune: dict[str, dict[str, int]] | None = None, store: Path | None = None,
          tune_host: dict | None = None, max_pages: int = layout.MAX_PAGES,
          code_budget: int | None = CODE_BUDGET, quants: tuple[str, ...] | None = None) -> tuple[list[Built], list[Path]]:
    source = dsl.read_text(encoding="utf-8")
    records = load_store(store) if store is not None else None
    built = compile_source(source, str(dsl), targets, tune, records, tune_host, max_pages, code_budget, quants)
    return built, write_outputs(built, out_dir)
