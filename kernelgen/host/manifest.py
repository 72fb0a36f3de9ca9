"""What a host checks in a manifest before it runs the wasm beside it.

A manifest and its wasm are one build's output; a wasm from another build (another target, other
tune values, a half-replaced out/) would load and compute different numbers, so the manifest
records the wasm's sha256 and the host refuses a mismatch. The memory layout is checked too: the
pool's words must lie below heap_base, where no buffer the host allocates can overwrite them.
runtime/manifest.mjs makes the same checks for the JavaScript runtime.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Mapping, Sequence

from ..errors import KernelgenError
from ..names import variant_name
from .module import I32_MAX, PAGE_SIZE, WASM_BYTES, as_int

MAX_PAGES = WASM_BYTES // PAGE_SIZE  # a 32-bit wasm memory: 4 GiB
MAX_THREADS = 256  # POOL_GEN's low 8 bits count the helpers of a job (kernels.dsl)
# The words the hosts' pools read and write (kernelgen/host/pool.py, runtime/pool.mjs).
POOL_WORDS = ("POOL_GEN", "POOL_LEFT", "POOL_READY", "POOL_NEXT", "POOL_JOB", "POOL_COUNT", "POOL_CHUNK",
              "POOL_WANT", "POOL_STOP", "JOB_ARGS")


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
    spans = sorted((a, a + (4 * mem["job_arg_words"] if n == "JOB_ARGS" else 4), n) for n, a in fixed.items())
    for (a, end, n), (b, _, m) in zip(spans, spans[1:] + [(mem["heap_base"], 0, "heap_base")]):
        if a <= 0 or a % 4:
            raise fail(f"memory.fixed.{n}={a} is not a positive multiple of 4")
        if end > b:
            raise fail(f"memory.fixed.{n} (bytes {a}..{end}) overlaps {m} at {b}")
    if mem["heap_base"] > mem["max_pages"] * PAGE_SIZE:
        raise fail(f"memory.heap_base={mem['heap_base']} is beyond max_pages={mem['max_pages']}")
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
                or variant_name(e["kernel"], e["quant"], tune) != name:
            raise fail(f"exports.{name} names kernel {e['kernel']!r}, quant {e['quant']!r} and tune {tune}, whose "
                       f"export is not {name!r}")
        ints = {p["name"] for p in e["params"] if p.get("type") == "i32" and p.get("dsl_type") != "ptr"}
        reads = {p["name"] for p in e["params"] if p.get("dsl_type") == "ptr" and p.get("extent") is not None}
        for p in e["params"]:
            if not (p.get("extent") is None or _formula(p["extent"], ints, reads)) \
                    or not (p.get("minimum") is None or _formula(p["minimum"], ints)) \
                    or not (p.get("multiple") is None or _int(p["multiple"]) and p["multiple"] >= 1):
                raise fail(f"exports.{name}.{p['name']}: an extent or minimum must be a formula of {name}'s i32 "
                           "parameters and a multiple a positive integer")
        if isinstance(e.get("parallel"), dict) and not _formula(e["parallel"].get("count"), ints):
            raise fail(f"exports.{name}.parallel.count must be a formula of its i32 parameters")
    for name, q in manifest["quants"].items():
        planes = q.get("planes") if isinstance(q, dict) else None
        if not (_int(q.get("block")) and q["block"] >= 1 and _int(q.get("group")) and q["group"] >= 1
                and isinstance(planes, dict) and planes and all(
                    isinstance(p, dict) and isinstance(p.get("dtype"), str) and _int(p.get("bytes_per_block"))
                    and p["bytes_per_block"] >= 1 for p in planes.values())):
            raise fail(f"quants.{name} must give a block, a group of rows and its planes (dtype, bytes_per_block)")
    act = manifest["activation"]
    if not (isinstance(act, dict) and isinstance(act.get("dtype"), str) and isinstance(act.get("sums"), str)
            and isinstance(act.get("split"), bool) and _int(act.get("max"))):
        raise fail("activation must give dtype, sums, split and max")


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
        return tree[1] in reads and _formula(tree[2], names, frozenset(), depth + 1)
    return (isinstance(tree, list) and len(tree) == 3 and tree[0] in FORMULA_OPS and depth < MAX_FORMULA_DEPTH
            and _formula(tree[1], names, reads, depth + 1) and _formula(tree[2], names, reads, depth + 1))


def _reads(tree: Any) -> bool:
    """Whether a formula reads memory (["i32", p, index] in it)."""
    return isinstance(tree, list) and (tree[0] == "i32" or _reads(tree[1]) or _reads(tree[2]))


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

