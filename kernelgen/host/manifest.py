"""What a host checks in a manifest before it runs the wasm beside it.

A manifest and its wasm are one build's output; a wasm from another build (another target, other
tune values, a half-replaced out/) would load and compute different numbers, so the manifest
records the wasm's sha256 and the host refuses a mismatch. The memory layout is checked too: the
pool's words must lie below heap_base, where no buffer the host allocates can overwrite them.
runtime/manifest.mjs makes the same checks for the JavaScript runtime.
"""
from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Callable, Mapping, Sequence

from ..errors import KernelgenError
from ..names import variant_name
from .module import I32_MAX, PAGE_SIZE, WASM_BYTES, as_int

MAX_PAGES = WASM_BYTES // PAGE_SIZE  # a 32-bit wasm memory: 4 GiB
MAX_THREADS = 256  # POOL_GEN's low 8 bits count the helpers of a job (kernels.dsl)
# The words the hosts' pools read and write (kernelgen/host/pool.py, runtime/pool.mjs).
POOL_WORDS = ("POOL_GEN", "POOL_LEFT", "POOL_READY", "POOL_NEXT", "POOL_JOB", "POOL_COUNT", "POOL_CHUNK",
              "POOL_WANT", "POOL_STOP", "JOB_ARGS")


SIGNATURE = "manifest_sha256"  # kernels.json's last key: the sha256 of its own text, this value zeroed
_SIGNED = re.compile(rb'"manifest_sha256": "([0-9a-f]{64})"\n}\n$')


def manifest_text(manifest: dict) -> bytes:
    """kernels.json's text for `manifest`, signed: its last key is the sha256 of the text with that
    value written as 64 zeros. The manifest's wasm_sha256 ties the wasm to it, this ties it to its
    build: a manifest edited afterwards (an entry renamed, a plane's size changed) would run kernels
    under arguments, names or layouts they were not built for, and checking every field's meaning
    against the wasm is not possible."""
    body = {k: v for k, v in manifest.items() if k != SIGNATURE}
    zeros = (json.dumps({**body, SIGNATURE: "0" * 64}, indent=2) + "\n").encode()
    return zeros[:-70] + zeros[-70:].replace(b"0" * 64, hashlib.sha256(zeros).hexdigest().encode())


def check_signature(text: bytes, where: str) -> None:
    """Raise KernelgenError unless kernels.json's `text` carries its own sha256 (manifest_text)."""
    m = _SIGNED.search(text)
    if m is None:
        raise KernelgenError(f"{where}: not signed by its build (no {SIGNATURE} at its end); rebuild with "
                             "`kernelgen build`")
    zeros = text[:m.start(1)] + b"0" * 64 + text[m.end(1):]
    if hashlib.sha256(zeros).hexdigest() != m.group(1).decode():
        raise KernelgenError(f"{where}: edited after its build (its {SIGNATURE} is not the sha256 of its text); "
                             "rebuild with `kernelgen build`")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_manifest(manifest: Any, wasm: bytes, where: str = "kernels.json") -> None:
    """Raise KernelgenError naming `where` and what is wrong, unless `manifest` describes `wasm`."""
    def fail(message: str) -> KernelgenError:
        return KernelgenError(f"{where}: {message}; rebuild with `kernelgen build`")

    if not isinstance(manifest, dict):
        raise fail("not a kernelgen manifest (not a JSON object)")
    missing = [k for k in ("target", "memory", "exports", "jobs", "quants", "constants", "activation", "wasm_sha256")
               if k not in manifest]
    if missing:
        raise fail(f"not a kernelgen manifest of this version (no {', '.join(missing)})")
    digest = hashlib.sha256(wasm).hexdigest()
    if manifest["wasm_sha256"] != digest:
        raise fail(f"the wasm does not match this manifest (its sha256 is {digest[:16]}..., the manifest "
                   f"names {str(manifest['wasm_sha256'])[:16]}...): they come from different builds")
    mem = manifest["memory"]
    keys = ("min_pages", "max_pages", "heap_base", "job_arg_words")
    if not isinstance(mem, dict) or not all(_int(mem.get(k)) for k in keys) or not isinstance(mem.get("fixed"), dict):
        raise fail(f"memory must give integers {', '.join(keys)} and the fixed addresses")
    if not 1 <= mem["min_pages"] <= mem["max_pages"] <= MAX_PAGES:
        raise fail(f"memory needs 1 <= min_pages <= max_pages <= {MAX_PAGES}, got min_pages={mem['min_pages']}, "
                   f"max_pages={mem['max_pages']}")
    fixed = mem["fixed"]
    absent = [n for n in POOL_WORDS if not _int(fixed.get(n))]
    if absent:
        raise fail(f"memory.fixed has no address for {', '.join(absent)}")
    if not all(_int(a) for a in fixed.values()):
        raise fail("memory.fixed must give an integer address for each name")
    spans = sorted((a, a + (4 * mem["job_arg_words"] if n == "JOB_ARGS" else 4), n) for n, a in fixed.items())
    for (a, end, n), (b, _, m) in zip(spans, spans[1:] + [(mem["heap_base"], 0, "heap_base")]):
        if a <= 0 or a % 4:
            raise fail(f"memory.fixed.{n}={a} is not a positive multiple of 4")
        if end > b:
            raise fail(f"memory.fixed.{n} (bytes {a}..{end}) overlaps {m} at {b}")
    if mem["heap_base"] > mem["max_pages"] * PAGE_SIZE:
        raise fail(f"memory.heap_base={mem['heap_base']} is beyond max_pages={mem['max_pages']}")
    if not (_int(mem.get("align")) and mem["align"] >= 16 and mem["align"] & (mem["align"] - 1) == 0):
        raise fail(f"memory.align must be a power of two of at least 16 (the allocator's alignment), got {mem.get('align')}")
    if not isinstance(manifest["jobs"], dict):
        raise fail("jobs must be an object")
    for name, job in manifest["jobs"].items():
        if not isinstance(job, dict) or not _int(job.get("index")) or not isinstance(job.get("args"), list) \
                or len(job["args"]) > mem["job_arg_words"]:
            raise fail(f"jobs.{name} needs an index and at most {mem['job_arg_words']} args")
        tuned = job.get("tuned")
        if tuned is not None and not (isinstance(tuned, dict) and _int(tuned.get("threads")) and _int(tuned.get("chunk"))
                                      and 1 <= tuned["threads"] <= MAX_THREADS and 1 <= tuned["chunk"] <= I32_MAX):
            raise fail(f"jobs.{name}.tuned must give threads in 1..{MAX_THREADS} and chunk in 1..{I32_MAX}, got {tuned}")
    if not isinstance(manifest["exports"], dict) or not isinstance(manifest["quants"], dict):
        raise fail("exports and quants must be objects")
    flavors = manifest.get("flavors", {})
    if not isinstance(flavors, dict) or not all(isinstance(f, dict) and isinstance(f.get("dir"), str)
                                                and f["dir"].isidentifier() and isinstance(f.get("when"), dict)
                                                for f in flavors.values()):
        raise fail("flavors must map names to a directory name (dir, a plain name) and the probe outcome "
                   "they suit (when)")
    for name, e in manifest["exports"].items():
        if not (isinstance(e, dict) and isinstance(e.get("kernel"), str)
                and (e.get("quant") is None or isinstance(e["quant"], str)) and isinstance(e.get("params"), list)
                and all(isinstance(p, dict) and isinstance(p.get("name"), str) for p in e["params"])):
            raise fail(f"exports.{name} needs a kernel name, a quant type name or null, and its params")
        tune = e.get("tune") or {}
        if not (isinstance(tune, dict) and all(isinstance(k, str) and _int(v) for k, v in tune.items())) \
                or variant_name(e["kernel"], e.get("quant"), tune) != name:
            raise fail(f"exports.{name} names kernel {e['kernel']!r}, quant {e.get('quant')!r} and tune {tune}, whose "
                       f"export is not {name!r}")
        ints = {p["name"] for p in e["params"] if p.get("type") == "i32" and p.get("dsl_type") != "ptr"}
        reads = {p["name"] for p in e["params"] if p.get("dsl_type") == "ptr" and p.get("extent") is not None
                 and not _reads(p["extent"])}
        for p in e["params"]:
            i32 = p["name"] in ints
            if not (p.get("extent") is None or p.get("dsl_type") == "ptr" and _formula(p["extent"], ints, reads)) \
                    or not (p.get("minimum") is None or i32 and _formula(p["minimum"], ints)) \
                    or not (p.get("multiple") is None or i32 and _int(p["multiple"]) and p["multiple"] >= 1):
                raise fail(f"exports.{name}.{p['name']}: an extent (of a pointer) or minimum (of an i32) must be a "
                           f"formula of {name}'s i32 parameters, and a multiple (of an i32) a positive integer")
        par = e.get("parallel")
        job = manifest["jobs"].get(par.get("job")) if isinstance(par, dict) and isinstance(par.get("job"), str) else None
        if par is not None and not (isinstance(job, dict) and isinstance(par.get("items"), str)
                                    and job.get("kernel") == f"{e['kernel']}_job" and job.get("quant") == e.get("quant")):
            raise fail(f"exports.{name}.parallel must give its items and name a job of {e['kernel']}")
        if par is not None and not _formula(par.get("count"), ints):
            raise fail(f"exports.{name}.parallel.count must be a formula of its i32 parameters")
    for name, q in manifest["quants"].items():
        planes = q.get("planes") if isinstance(q, dict) else None
        if not (isinstance(q, dict) and _int(q.get("block")) and q["block"] >= 1
                and _int(q.get("group")) and q["group"] >= 1
                and isinstance(planes, dict) and planes and all(
                    isinstance(p, dict) and isinstance(p.get("dtype"), str) and _int(p.get("bytes_per_block"))
                    and p["bytes_per_block"] >= 1 for p in planes.values())):
            raise fail(f"quants.{name} must give a block, a group of rows and its planes (dtype, bytes_per_block)")
    act = manifest["activation"]
    if not (isinstance(act, dict) and act.get("dtype") in ("int8", "int16") and act.get("sums") == "int32"
            and isinstance(act.get("split"), bool) and _int(act.get("max"))):
        raise fail("activation must give dtype (int8 or int16), sums (int32), split and max")


Formula = int | str | list  # a manifest formula: a number, an i32 argument's name, or [op, left, right]
FORMULA_OPS = ("+", "-", "*", "/", "%")
MAX_FORMULA_DEPTH = 32  # deeper than any the compiler writes: a manifest's are checked, not recursed blind


def _formula(tree: Any, names: set[str], reads: set[str] = frozenset(), depth: int = 0) -> bool:
    """Whether `tree` is a formula of the i32 arguments `names`, reading (["i32", p, index]) only
    pointers in `reads`, with indices that read nothing."""
    if _int(tree):
        return True
    if isinstance(tree, str):
        return tree in names
    if isinstance(tree, list) and len(tree) == 3 and tree[0] == "i32":
        return isinstance(tree[1], str) and tree[1] in reads and _formula(tree[2], names, frozenset(), depth + 1)
    return (isinstance(tree, list) and len(tree) == 3 and tree[0] in FORMULA_OPS and depth < MAX_FORMULA_DEPTH
            and _formula(tree[1], names, reads, depth + 1) and _formula(tree[2], names, reads, depth + 1))


def _reads(tree: Any, depth: int = 0) -> bool:
    """Whether a formula reads memory (["i32", p, index] in it); a malformed one is not checked here."""
    return (isinstance(tree, list) and len(tree) == 3 and depth < MAX_FORMULA_DEPTH
            and (tree[0] == "i32" or _reads(tree[1], depth + 1) or _reads(tree[2], depth + 1)))


def evaluate(tree: Formula, env: Mapping[str, int | float], exact: bool = False,
             load: Callable[[str, int], int] | None = None) -> int:
    """A manifest formula of a call's i32 arguments (an item count, an extent) as wasm's i32 ops
    compute it, or (`exact`) in whole numbers: an extent in bytes, whose wrap would hide an overrun.
    `load(p, i)`: the i32 at index i of pointer argument p (an extent's ["i32", p, i])."""
    if isinstance(tree, str):
        return int(env[tree])
    if isinstance(tree, int):
        return tree
    if tree[0] == "i32":
        if load is None:
            raise ValueError(f"{tree} reads memory")
        return load(tree[1], evaluate(tree[2], env, exact))
    op, a, b = tree[0], evaluate(tree[1], env, exact, load), evaluate(tree[2], env, exact, load)
    if op in "/%" and b == 0:
        raise ValueError(f"{tree} divides by zero with {dict(env)}")
    q = abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1) if op in "/%" else 0  # i32.div_s truncates
    value = {"+": a + b, "-": a - b, "*": a * b, "/": q, "%": a - q * b}[op]
    return value if exact else (value + (1 << 31)) % (1 << 32) - (1 << 31)


def check_arguments(name: str, spec: dict, args: Sequence[int | float], end: int,
                    read: Callable[[int], int] | None = None) -> None:
    """Refuse a call of export `name` (manifest entry `spec`) that its contract does not allow, with
    a ValueError: an i32 argument that is not the "multiple" the kernel needs (it would skip a tail
    or misread a super-block's record) or below its "minimum" (softmax's stride below its row's
    scores wrote the next row), or a pointer whose "extent" (bytes) from its address runs
    past the memory's `end` (the kernel would trap midway, or read what lies there). An extent that
    reads an i32 of another pointer (attention's rows, starts[seqs]) comes after that pointer's own
    check, and reads within it (`read(addr)`: the i32 there). The caller has checked each address
    lies in the heap."""
    params = spec["params"]
    env = {p["name"]: as_int(f"{name} {p['name']}", a, -2**31, 2**32 - 1)
           for p, a in zip(params, args) if p.get("type") == "i32" and p.get("dsl_type") != "ptr"}
    for p, a in zip(params, args):
        if p.get("multiple") and env[p["name"]] % p["multiple"]:
            raise ValueError(f"{name} {p['name']}: must be a multiple of {p['multiple']}, got {a}")
        if p.get("minimum") is not None and env[p["name"]] < (least := evaluate(p["minimum"], env, exact=True)):
            said = f" ({p['minimum']})" if isinstance(p["minimum"], str) else ""
            raise ValueError(f"{name} {p['name']}: must be at least {least}{said}, got {a}")
    spans: dict[str, tuple[int, int]] = {}  # pointer -> (address, bytes) its extent was checked for

    def load(pointer: str, i: int) -> int:
        addr, size = spans[pointer]
        if not 0 <= 4 * i <= size - 4 or read is None:
            raise ValueError(f"{name}: {pointer}[{i}] is outside {pointer}'s extent ({size} bytes)")
        return read(addr + 4 * i)

    for p, a in sorted(zip(params, args), key=lambda pa: _reads(pa[0].get("extent"))):  # those that read last
        if p.get("extent") is None:
            continue
        if int(a) + (need := evaluate(p["extent"], env, exact=True, load=load)) > end:
            raise ValueError(f"{name} {p['name']} ({shape_of(p)}): {need} bytes from address {a} run past the memory's"
                             f" end at {end}")
        spans[p["name"]] = (int(a), need)


def shape_of(param: dict) -> str:
    """The declared shape a parameter's meaning starts with (`f32[rows, k]`): to its first comma
    outside brackets."""
    text, depth = str(param.get("meaning", "")), 0
    for i, c in enumerate(text):
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            return text[:i]
    return text


def check_exports(manifest: dict, signatures: Mapping[str, list[str]], where: str = "kernels.json") -> None:
    """Raise KernelgenError unless the wasm exports each function the manifest lists with the wasm
    parameter types it gives (`signatures`: name -> types, from the compiled module): a manifest
    edited after its build (its sha256 covers the wasm only) would run one kernel under another's
    name or arguments."""
    for name, e in manifest["exports"].items():
        want = [p.get("type") for p in e["params"]]
        if signatures.get(name) != want:
            got = "no such function" if name not in signatures else f"parameters ({', '.join(signatures[name])})"
            raise KernelgenError(f"{where}: exports.{name} gives parameters ({', '.join(map(str, want))}), the wasm "
                                 f"{got}; rebuild with `kernelgen build`")

