"""The command line: `kernelgen build | check | list | tune | carry | prune | bench`. User mistakes (bad DSL, bad
options, missing files) print a message and exit 2; nothing is written unless every target built."""
from __future__ import annotations

import argparse
import fnmatch
import json
import math
import re
import sys
import warnings
from pathlib import Path

from . import __version__, library
from .compiler.build import TARGET_NAMES, build
from .compiler.layout import HEAP_BASE, LIMIT_PAGES, MAX_PAGES, PAGE_SIZE
from .compiler.check import Checked, check, resolve_tune
from .compiler.lower import lower
from .errors import DslError, KernelgenError
from .compiler.parse import parse
from .compiler.quant import DEFAULT_PRIORITY
from .tuning.budget import CODE_BUDGET, dropped_text
from .tuning.store import STORE, StoreWarning, load_store
from .tuning.timing import ENGINE_CHOICES, ENGINES

DEFAULT_DSL = Path("kernels.dsl")
EXIT_USER = 2
EXIT_INTERNAL = 70


def _targets(value: str) -> tuple[str, ...]:
    if value == "all":
        return TARGET_NAMES
    if value not in TARGET_NAMES:
        raise argparse.ArgumentTypeError(f"unknown target {value!r}; choose {', '.join(TARGET_NAMES)} or all")
    return (value,)


_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def _memory(value: str) -> int:
    """--max-memory SIZE (bytes, or with KiB/MiB/GiB; a whole number of 64 KiB pages) -> pages."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]iB|B)?\s*", value, re.I)
    nbytes = int(m.group(1)) * _UNITS[(m.group(2) or "").upper()] if m else 0
    if not m or nbytes % PAGE_SIZE or not HEAP_BASE < nbytes <= LIMIT_PAGES * PAGE_SIZE:
        raise argparse.ArgumentTypeError(
            f"{value!r}: give a size in KiB, MiB or GiB (e.g. 256MiB), a multiple of 64KiB, up to 4GiB")
    return nbytes // PAGE_SIZE


def positive_int(value: str) -> int:
    """argparse's type for a positive integer: anything else is a usage error (exit 2)."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a positive integer, got {value!r}")
    return n


def _out_dir(value: str) -> Path:
    if not value.strip():
        raise argparse.ArgumentTypeError("needs a directory name (an empty one would mean the current directory)")
    return Path(value)


PLOT_FORMATS = (".png", ".svg", ".pdf")


def _plot_path(value: str) -> Path:
    """--plot FILE: checked before the run it draws (a tune or bench of many minutes), not after:
    a suffix matplotlib writes as named (without one it wrote FILE.png, and said FILE), in a
    directory that exists."""
    path = Path(value)
    if path.suffix.lower() not in PLOT_FORMATS:
        raise argparse.ArgumentTypeError(f"{value!r}: name a {', '.join(PLOT_FORMATS)} file")
    if path.is_dir() or not path.resolve().parent.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r}: not a file in an existing directory")
    return path


def _budget(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not (math.isfinite(seconds) and seconds >= 0):
        raise argparse.ArgumentTypeError(f"{value!r}: need a finite number of seconds >= 0")
    return seconds


def _quant_names(value: str) -> list[str]:
    """`--quant a,b` or `--quant a --quant b` (action "extend"): the names, each non-empty."""
    names = [n.strip() for n in value.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"{value!r}: an empty quant type name (write e.g. q4_k,q6_k)")
    return names


def _tune(values: list[str]) -> dict[str, dict[str, int]]:
    """`kernel.param=value` pairs -> {kernel: {param: value}}."""
    out: dict[str, dict[str, int]] = {}
    for item in values:
        key, eq, value = item.partition("=")
        kernel, dot, param = key.partition(".")
        if not (eq and dot and kernel and param):
            raise KernelgenError(f"--tune {item!r}: write KERNEL.PARAM=VALUE, e.g. qmatvec.rows=2")
        try:
            out.setdefault(kernel, {})[param] = int(value)
        except ValueError:
            raise KernelgenError(f"--tune {item!r}: {value!r} is not an integer") from None
    return out


def _read(dsl: Path) -> str:
    if dsl == DEFAULT_DSL and not dsl.is_file():
        raise KernelgenError(f"no {dsl} in the current directory: pass --dsl FILE (the library that ships with"
                             f" kernelgen is {library.dsl()}; kernelgen.load() loads its build without building)")
    try:
        return dsl.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KernelgenError(f"{dsl}: cannot read ({e.strerror if isinstance(e, OSError) else e})") from None


def _store(args: argparse.Namespace) -> Path | None:
    if args.no_store:
        return None
    if args.store is not None and not args.store.is_file():
        raise KernelgenError(f"--store {args.store}: no such file")
    return args.store or (STORE if STORE.is_file() else None)


def _tune_host(args: argparse.Namespace) -> dict | None:
    """--tune-host-from MANIFEST: build with the tunings of the host that manifest was built for."""
    if args.tune_host_from is None:
        return None
    try:
        manifest = json.loads(args.tune_host_from.read_text(encoding="utf-8"))
        found = manifest["tune"]["host"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise KernelgenError(f"--tune-host-from {args.tune_host_from}: not a kernelgen manifest ({e})") from None
    if found is not None and not (isinstance(found, dict) and isinstance(found.get("cpu"), str)
                                  and isinstance(found.get("cores"), int)):
        raise KernelgenError(f"--tune-host-from {args.tune_host_from}: not a kernelgen manifest (tune.host is"
                             f" {json.dumps(found)[:80]}, not a host's cpu and cores)")
    return found  # None: that build used no tunings


def _gguf_quants(args: argparse.Namespace) -> list[str]:
    """--quant-from FILE.gguf: the declared quant types the file's tensors use (all of them declared)."""
    if args.quant_from is None:
        return []
    from .host.formats import gguf_quants

    declared = check(parse(_read(args.dsl), str(args.dsl))).quants
    try:
        found = gguf_quants(args.quant_from, list(declared))
    except ImportError as e:
        raise KernelgenError(f"--quant-from: {e}") from None
    except OSError as e:
        raise KernelgenError(f"--quant-from {args.quant_from}: cannot read ({e.strerror or e})") from None
    except ValueError as e:  # not GGUF, or a tensor of a type the DSL does not declare
        raise KernelgenError(f"--quant-from {e}") from None
    if not found:
        raise KernelgenError(f"--quant-from {args.quant_from}: no quantized tensor (only F32/F16/BF16): name --quant")
    return found


def cmd_build(args: argparse.Namespace) -> int:
    _read(args.dsl)
    store, tune_host = _store(args), _tune_host(args)
    if args.tune_host_from is not None and tune_host is None:
        store = None  # that build used no tunings: neither does this one
    budget = None if args.no_code_budget else args.code_budget
    quants = tuple(dict.fromkeys([*(args.quant or []), *_gguf_quants(args)])) or None
    built, changed = build(args.dsl, args.out, args.target, _tune(args.tune), store, tune_host, args.max_memory,
                           budget, quants)
    for b in built:
        print(f"{b.target}: {len(b.manifest['exports'])} exports, {len(b.wasm)} bytes of wasm")
        for name, f in b.flavors.items():
            print(f"  {name} flavor ({b.target}/{name}/, {len(f.wasm)} bytes): for engines where "
                  + b.manifest["flavors"][name]["why"])
        if dropped := b.manifest["tune"].get("budget", {}).get("dropped"):
            print(f"  within the {budget}-byte budget of quant-type code, the smallest variant instead of: "
                  + dropped_text(dropped, "x faster"))
        if stale := b.manifest["tune"].get("stale"):
            print("  not tuned (the tuning store times other versions of their source; `kernelgen tune --kernel NAME` "
                  "times this one): " + ", ".join(f"{key} ({n} timings)" for key, n in stale.items()))
        if untimed := b.manifest["tune"].get("untimed"):
            keys = list(untimed)
            print(f"  not tuned on this host, whose smallest variants were built instead (the store times them on other "
                  f"hosts only; `kernelgen tune` times them here, `--tune-host-from MANIFEST` builds another host's "
                  f"picks): {', '.join(keys[:6])}" + (f" and {len(keys) - 6} more" if len(keys) > 6 else ""))
        if partial := b.manifest["tune"].get("partial"):
            print("  picked without some timings (variants left out, or engines that timed some variants but not the"
                  " others; `kernelgen tune --kernel NAME --engine ENGINE` times the rest): "
                  + ", ".join(f"{key} ({_gap_text(gap)})" for key, gap in partial.items()))
        if args.sizes:
            from .tuning.size import format_sizes, sizes
            print(format_sizes(sizes(b)))
    print(f"{len(changed)} file(s) written under {args.out}" if changed else f"{args.out} is up to date")
    return 0


def _gap_text(gap: dict) -> str:
    """A manifest's tune.partial entry as words: "2 variant(s) left out; 3 chromium timing(s) unused"."""
    words = [f"{gap['left_out']} variant(s) left out"] if "left_out" in gap else []
    return "; ".join(words + [f"{n} {engine} timing(s) unused" for engine, n in gap.get("unused", {}).items()])


def _lowered(dsl: Path, tune: dict[str, dict[str, int]] | None = None) -> Checked:
    """The checked source of `dsl`, every kernel body lowered for each target (type-checked: a
    mistake in a body is reported with its location here, not taken for a changed kernel)."""
    checked = check(parse(_read(dsl), str(dsl)))
    values = resolve_tune(checked, tune)
    for t in TARGET_NAMES:
        lower(checked, t, values)
    return checked


def cmd_check(args: argparse.Namespace) -> int:
    checked = _lowered(args.dsl, _tune(args.tune))
    print(f"{args.dsl}: ok ({len(checked.kernels)} kernels, {len(checked.quants)} quant types)")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from .tuning.tune import SPECS, parse_shape, shape_forms, tune, unfit_cases

    source = _read(args.dsl)
    checked = check(parse(source, str(args.dsl)))
    kernels = [k for k in SPECS if fnmatch.fnmatch(k, args.kernel)]
    if not kernels:
        raise KernelgenError(f"--kernel {args.kernel!r} matches no tunable kernel ({', '.join(SPECS)})")
    for k in kernels:
        if k not in checked.kernels and k not in checked.jobs:
            raise KernelgenError(f"{args.dsl}: kernel {k} is not declared")
    try:
        shapes = {k: [parse_shape(s) for s in args.shape] for k in kernels} if args.shape else {}
    except ValueError as e:
        raise KernelgenError(str(e)) from None
    for k, given in shapes.items():
        forms = shape_forms(k)
        if any(len(s) not in {f.count("x") + 1 for f in forms} for s in given):
            example = "x".join(map(str, SPECS[k][1][-1]))
            raise KernelgenError(f"--shape: {k} takes shapes {' or '.join(forms)}, e.g. {example}")
    args.quant = list(dict.fromkeys(args.quant)) if args.quant else None  # a type named twice is timed once
    for q in args.quant or []:
        if q not in checked.quants:
            raise KernelgenError(f"--quant {q}: not a quant type of {args.dsl} (declared: {', '.join(checked.quants)})")
    try:
        unfit_cases(checked, kernels, shapes, args.quant)
    except ValueError as e:
        raise KernelgenError(f"--shape: {e}") from None
    store = args.store or STORE
    if store.exists() and not store.is_file():
        raise KernelgenError(f"--store {store}: not a file")
    try:  # before any timing: the results must have somewhere to go
        store.parent.mkdir(parents=True, exist_ok=True)
        with store.open("a", encoding="utf-8"):
            pass
    except OSError as e:
        raise KernelgenError(f"--store {store}: cannot write it ({e.strerror})") from None
    recs = tune(source, args.target, kernels, shapes, args.quant, store, args.budget, args.strategy, args.seed,
                out=sys.stderr, remeasure=args.remeasure, engine=args.engine)
    if not recs:
        return 0  # tune said why: nothing left to do, no budget, or interrupted
    ok = [r for r in recs if r.seconds is not None]
    failed = [r for r in recs if r.seconds is None]
    print(f"{len(ok)} timing(s) and {len(failed)} failed variant(s) appended to {store}")
    for r in failed:
        print(f"  {r.target} {r.kernel} {r.tune} {r.shape}: {r.status}")
    if args.plot:
        try:
            from .tuning.tune import plot
            plot(recs, args.plot)
        except ImportError:
            raise KernelgenError("--plot needs matplotlib: pip install 'kernelgen[plot]'") from None
        print(f"plot written to {args.plot}")
    return 0


def cmd_carry(args: argparse.Namespace) -> int:
    from .tuning.carry import carry
    from .tuning.store import append_record

    old = check(parse(_read(args.old), str(args.old)))
    new = _lowered(args.dsl)  # a body that does not compile is a mistake to report, not a changed kernel
    store = args.store or STORE
    if not store.is_file():
        raise KernelgenError(f"--store {store}: no such file")
    found = carry(load_store(store), old, new)
    for rec in found.records:
        append_record(store, rec)
    print(f"{len(found.records)} timing(s) of {len(found.kept)} kernel(s) whose code {args.dsl} leaves unchanged"
          f" keyed to it in {store}")
    if found.changed:
        print("code changed (their timings are of the old code; time them again):")
        for target, kernel, quant in sorted(found.changed, key=str):
            print(f"  kernelgen tune --target {target} --kernel {kernel}"
                  + (f" --quant {quant}" if quant else ""))
    if found.records or found.changed:
        print(f"the old source's timings stay in {store}; no build picks them: `kernelgen prune` drops them")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    from .tuning.store import prune

    checked = check(parse(_read(args.dsl), str(args.dsl)))
    store = args.store or STORE
    if not store.is_file():
        raise KernelgenError(f"--store {store}: no such file")
    p = prune(store, checked, dry_run=args.dry_run)
    verb = "would drop" if args.dry_run else "dropped"
    print(f"{store}: {verb} {p.dropped} timing(s) of other versions of the source than {args.dsl}'s"
          + (f" or of code this compiler no longer emits ({p.stale}: time them again)" if p.stale else "") + f"; kept {p.kept}"
          + (f" and {p.unreadable} unreadable line(s), as they are" if p.unreadable else "")
          + f" ({p.bytes_before / 1e6:.1f} MB -> {p.bytes_after / 1e6:.1f} MB)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .tuning.bench import as_json, dram_table, format_table, run

    table = {}
    if args.dram:
        if args.engine != "wasmtime":
            raise KernelgenError(f"--dram runs in wasmtime only, not with --engine {args.engine}")
        try:
            cases, ratios = dram_table(*_dram_shape(args.dram))
        except ValueError as e:
            raise KernelgenError(str(e)) from None
        table = {"cases": cases, "ratios": ratios, "limits": []}
    source = _read(args.dsl)
    check(parse(source, str(args.dsl)))
    store = _store(args)
    engines = ENGINES[args.engine]
    report = run(source, args.target, load_store(store) if store else None, args.repeat,
                 progress=lambda s: print(f"\r{s}".ljust(70), end="", file=sys.stderr, flush=True),
                 engines=engines, **table)
    print(file=sys.stderr)
    print(json.dumps(as_json(report), indent=2) if args.json else format_table(report))
    if args.plot:
        from .tuning.bench import plot
        try:
            plot(report, args.plot)
        except ImportError:
            raise KernelgenError("--plot needs matplotlib: pip install 'kernelgen[plot]'") from None
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _dram_shape(text: str) -> tuple[int, int, int]:
    """--dram's [LAYERSx]ROWSxCOLS: (rows, cols, layers)."""
    try:
        *layers, rows, cols = (int(d) for d in text.lower().split("x"))
        if len(layers) > 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"--dram {text!r}: write ROWSxCOLS or LAYERSxROWSxCOLS, e.g. 16384x32768 or 32x4096x4096") from None
    return rows, cols, layers[0] if layers else 1


def cmd_list(args: argparse.Namespace) -> int:
    checked = check(parse(_read(args.dsl), str(args.dsl)))
    info = {
        "kernels": [{"name": k.name, "mode": k.ast.mode or "internal",
                     "generics": [f"{g.name}: {g.kind}" for g in k.ast.generics],
                     "params": [f"{p.name}: {'packed ' if p.packed else ''}{p.type}" for p in k.ast.params],
                     "returns": k.ast.ret,
                     "tune": {t.name: {"domain": list(t.domain), "default": t.default} for t in k.ast.tunes},
                     "parallel": {"items": k.ast.parallel.items, "job": k.job} if k.ast.parallel else None,
                     "line": k.ast.span.line} for k in checked.kernels.values()],
        # priority: the weight of the type's speedups in a build's code budget (budget.spend)
        "quants": {q.name: {**checked.quants[q.name].to_json(), "priority": q.priority or DEFAULT_PRIORITY}
                   for q in checked.program.quants},
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print("kernels:")
    for k in info["kernels"]:
        gen = f"[{', '.join(k['generics'])}]" if k["generics"] else ""
        ret = f" -> {k['returns']}" if k["returns"] else ""
        print(f"  {k['mode']:8} {k['name']}{gen}({', '.join(k['params'])}){ret}   line {k['line']}")
        for name, t in k["tune"].items():
            print(f"           tune {name} in {t['domain']} (default {t['default']})")
        if k["parallel"]:
            print(f"           parallel over {k['parallel']['items']}: pool job {k['parallel']['job']}")
    print("quant types:")
    for name, q in info["quants"].items():
        fields = ", ".join(f["name"] + ": " + f["type"] + (f"[{f['count']}]" if f["count"] else "")
                           for f in q["fields"])
        print(f"  {name}: block {q['block']}, {q['stored_bytes']} bytes stored ({fields}), priority {q['priority']};"
              f" unpack {q['unpack']}; dequant {q['dequant']}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kernelgen",
        description="Compile kernels.dsl to WebAssembly (SIMD128 and relaxed SIMD), check it, list it, tune it "
                    "on this machine and time it. Mistakes in the DSL or the options exit with status 2.",
        epilog="Run 'kernelgen COMMAND --help' for a command's options.")
    p.add_argument("--version", action="version", version=f"kernelgen {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           title="commands")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dsl", type=Path, default=DEFAULT_DSL, help="kernel source (default ./kernels.dsl)")
    stored = argparse.ArgumentParser(add_help=False)
    stored.add_argument("--store", type=Path, help=f"tuning store (default {STORE} when it exists)")
    stored.add_argument("--no-store", action="store_true", help="ignore the tuning store: declared defaults")
    tune = argparse.ArgumentParser(add_help=False)
    tune.add_argument("--tune", action="append", default=[], metavar="KERNEL.PARAM=VALUE",
                      help="override a tune parameter's default (repeatable)")
    b = sub.add_parser("build", parents=[common, tune, stored], help="compile to out/<target>/kernels.{wat,wasm,json}")
    b.add_argument("--target", type=_targets, default=TARGET_NAMES, help="simd128, relaxed-simd or all (default all)")
    b.add_argument("--out", type=_out_dir, default=Path("out"),
                   help="output directory, replaced as a whole (default out)")
    b.add_argument("--max-memory", type=_memory, default=MAX_PAGES, metavar="SIZE",
                   help=f"the most memory the module may grow to, e.g. 256MiB (default {MAX_PAGES * PAGE_SIZE >> 30}GiB);"
                        " recorded in the manifest (memory.max_pages), honoured by both hosts")
    b.add_argument("--tune-host-from", type=Path, metavar="MANIFEST",
                   help="use the tunings recorded for the host a manifest was built for (reproduces a committed out/)")
    b.add_argument("--code-budget", type=positive_int, default=CODE_BUDGET, metavar="BYTES",
                   help=f"bytes of quant-type code per target the store's picks may take (default {CODE_BUDGET}: issue 13's"
                        " goal); over it, the picks with the least speed per byte take the smallest variant")
    b.add_argument("--no-code-budget", action="store_true", help="build the store's picks whatever their size")
    b.add_argument("--quant", action="extend", type=_quant_names, metavar="TYPE[,TYPE..]",
                   help="build only these quant types' kernels (repeatable; default: every declared type), e.g. "
                        "--quant q4_k,q6_k for a Q4_K_M model: smaller, and the byte budget spends itself on them")
    b.add_argument("--quant-from", type=Path, metavar="FILE.gguf",
                   help="build the quant types a GGUF model file uses (with --quant: both); a tensor of a type the DSL "
                        "does not declare is an error naming it")
    b.add_argument("--sizes", action="store_true",
                   help="print where each module's bytes go: raw, gzip and brotli sizes, code per quant type and per kernel")
    b.set_defaults(func=cmd_build)
    c = sub.add_parser("check", parents=[common, tune], help="parse and check for every target, write nothing")
    c.set_defaults(func=cmd_check)
    t = sub.add_parser("tune", parents=[common], help="time every variant of tunable kernels, append to the store")
    t.add_argument("--target", type=_targets, default=TARGET_NAMES, help="simd128, relaxed-simd or all (default all)")
    t.add_argument("--kernel", default="*", help="kernel name pattern (default: every tunable kernel)")
    t.add_argument("--shape", action="append", default=[],
                   help="N, NxK, MxNxK for matrix products, or LxNxK for mat-vec over L matrices in turn (weights"
                        " from DRAM) (repeatable; default: each kernel's shapes)")
    t.add_argument("--quant", action="extend", type=_quant_names, metavar="TYPE[,TYPE..]",
                   help="quant types for generic kernels (repeatable or comma-separated; default: all)")
    t.add_argument("--budget", type=_budget, default=600.0, help="seconds to spend (default 600)")
    t.add_argument("--strategy", choices=("exhaustive", "random"), default="exhaustive",
                   help="every case (kernel, type, shape) in order, or the cases and their variants in a random"
                        " order (with --budget: a sample of cases; a case's variants are timed together)")
    t.add_argument("--seed", type=int, default=0, help="for --strategy random")
    t.add_argument("--store", type=Path, help=f"where results go (default {STORE})")
    t.add_argument("--remeasure", action="store_true",
                   help="time again what the store already holds for this host (default: skip it)")
    t.add_argument("--plot", type=_plot_path, metavar="PNG", help="plot this run's timings (needs matplotlib)")
    t.add_argument("--engine", choices=ENGINE_CHOICES, default="both",
                   help="time variants in wasmtime, in V8 through Node, in headless Chromium's V8 (what browsers"
                        " run; /usr/bin/chromium), both (wasmtime and Node: the default) or all three; the build's"
                        " pick weighs every engine timed; pool jobs are timed in wasmtime, and with wasmtime a"
                        " kernel that has a pool job is timed on it on every core too")
    t.set_defaults(func=cmd_tune)
    ca = sub.add_parser("carry", parents=[common],
                        help="after an edit: key the store's timings whose code the edit leaves unchanged to the new source")
    ca.add_argument("old", type=Path, metavar="OLD_DSL", help="the source before the edit (e.g. git show HEAD:kernels.dsl)")
    ca.add_argument("--store", type=Path, help=f"tuning store (default {STORE})")
    ca.set_defaults(func=cmd_carry)
    pr = sub.add_parser("prune", parents=[common],
                        help="drop the store's timings of other versions of the source (a build cannot pick them;"
                             " run after carry and tune, with version control holding the old store) and of code the"
                             " compiler no longer emits (after a change to the compiler: time those again)")
    pr.add_argument("--store", type=Path, help=f"tuning store (default {STORE})")
    pr.add_argument("--dry-run", action="store_true", help="say what would be dropped, change nothing")
    pr.set_defaults(func=cmd_prune)
    be = sub.add_parser("bench", parents=[common, stored], help="time the library, with ratios and goals")
    be.add_argument("--target", type=_targets, default=TARGET_NAMES, help="simd128, relaxed-simd or all (default all)")
    be.add_argument("--repeat", type=positive_int, default=1, metavar="N",
                    help="run the whole table N times; cells show median [min .. max] (default 1)")
    be.add_argument("--json", action="store_true", help="print the results as JSON")
    be.add_argument("--engine", choices=ENGINE_CHOICES, default="wasmtime",
                    help="run in wasmtime, or the mat-vec and GEMM rows through the JS runtime in Node (V8) or in"
                         " headless Chromium (/usr/bin/chromium); both: wasmtime and Node; all: the three")
    be.add_argument("--plot", type=_plot_path, metavar="PNG", help="draw the mat-vec rows as a roofline chart (needs matplotlib)")
    be.add_argument("--dram", metavar="[LAYERSx]ROWSxCOLS",
                    help="only the decode goals that assume weights from DRAM, at this shape (wasmtime): for a machine"
                         " whose last-level cache holds 8192x8192's weights, e.g. 16384x32768 (570 MB of Q8_0); with"
                         " LAYERS, as many matrices read in turn, as decoding reads a model's layers, e.g. 32x4096x4096;"
                         " on more than one core, the same bytes on the pool on every core too")
    be.set_defaults(func=cmd_bench)
    ls = sub.add_parser("list", parents=[common], help="list kernels, quant types and tune parameters")
    ls.add_argument("--json", action="store_true", help="print the list as JSON")
    ls.set_defaults(func=cmd_list)
    return p


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: object = None, line: str | None = None) -> None:
    """A skipped store line as one line, `file:line: why`; other warnings as Python prints them."""
    if issubclass(category, StoreWarning):
        print(f"kernelgen: warning: {message}", file=sys.stderr)
    else:
        _python_show_warning(message, category, filename, lineno, file, line)  # type: ignore[arg-type]


_python_show_warning = warnings.showwarning


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return args.func(args)
    except KernelgenError as e:
        located = isinstance(e, DslError) and e.span is not None
        print(str(e) if located else f"kernelgen: error: {e}", file=sys.stderr)
        return EXIT_USER
    except RecursionError:  # the explicit limits (kernelgen/compiler/parse.py, lower.py) should come first
        print("kernelgen: error: the input is nested too deeply to compile", file=sys.stderr)
        return EXIT_USER
    except OSError as e:  # a path the user named that cannot be read or written
        print(f"kernelgen: error: {e.filename + ': ' if e.filename else ''}{e.strerror or e}", file=sys.stderr)
        return EXIT_USER
    except MemoryError:
        print("kernelgen: error: out of memory (a shape or an input too large for this machine?)", file=sys.stderr)
        return EXIT_USER
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug in kernelgen, not in the input: say so, distinctly from exit 2
        print(f"kernelgen: internal error: {type(e).__name__}: {e} (please report, with the input)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
