"""`kernelgen build | check | list`: the command line. User mistakes (bad DSL, bad options, missing
files) print a message and exit 2; nothing is written unless every target built."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .build import TARGET_NAMES, build
from .check import check, resolve_tune
from .lower import lower
from .errors import DslError, KernelgenError
from .parse import parse

EXIT_USER = 2
EXIT_INTERNAL = 70


def _targets(value: str) -> tuple[str, ...]:
    if value == "all":
        return TARGET_NAMES
    if value not in TARGET_NAMES:
        raise argparse.ArgumentTypeError(f"unknown target {value!r}; choose {', '.join(TARGET_NAMES)} or all")
    return (value,)


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
    try:
        return dsl.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KernelgenError(f"{dsl}: cannot read ({e.strerror if isinstance(e, OSError) else e})") from None


def cmd_build(args: argparse.Namespace) -> int:
    _read(args.dsl)
    built, changed = build(args.dsl, args.out, args.target, _tune(args.tune))
    for b in built:
        print(f"{b.target}: {len(b.manifest['exports'])} exports, {len(b.wasm)} bytes of wasm")
    print(f"{len(changed)} file(s) written under {args.out}" if changed else f"{args.out} is up to date")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    checked = check(parse(_read(args.dsl), str(args.dsl)))
    values = resolve_tune(checked, _tune(args.tune))
    for t in TARGET_NAMES:
        lower(checked, t, values)  # type-checks every kernel body for the target
    print(f"{args.dsl}: ok ({len(checked.kernels)} kernels, {len(checked.quants)} quant types)")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    checked = check(parse(_read(args.dsl), str(args.dsl)))
    info = {
        "kernels": [{"name": k.name, "mode": k.ast.mode or "internal",
                     "generics": [f"{g.name}: {g.kind}" for g in k.ast.generics],
                     "params": [f"{p.name}: {'packed ' if p.packed else ''}{p.type}" for p in k.ast.params],
                     "returns": k.ast.ret,
                     "tune": {t.name: {"domain": list(t.domain), "default": t.default} for t in k.ast.tunes},
                     "line": k.ast.span.line} for k in checked.kernels.values()],
        "quants": {n: q.describe() for n, q in checked.quants.items()},
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
    print("quant types:")
    for name, q in info["quants"].items():
        fields = ", ".join(f["name"] + ": " + f["type"] + (f"[{f['count']}]" if f["count"] else "")
                           for f in q["fields"])
        print(f"  {name}: block {q['block']}, {q['stored_bytes']} bytes stored ({fields});"
              f" unpack {q['unpack']}; dequant {q['dequant']}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kernelgen", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dsl", type=Path, default=Path("kernels.dsl"), help="kernel source (default kernels.dsl)")
    tune = argparse.ArgumentParser(add_help=False)
    tune.add_argument("--tune", action="append", default=[], metavar="KERNEL.PARAM=VALUE",
                      help="override a tune parameter's default (repeatable)")
    b = sub.add_parser("build", parents=[common, tune], help="compile to out/<target>/kernels.{wat,wasm,json}")
    b.add_argument("--target", type=_targets, default=TARGET_NAMES, help="simd128, relaxed-simd or all (default all)")
    b.add_argument("--out", type=Path, default=Path("out"), help="output directory (default out)")
    b.set_defaults(func=cmd_build)
    c = sub.add_parser("check", parents=[common, tune], help="parse and check for every target, write nothing")
    c.set_defaults(func=cmd_check)
    ls = sub.add_parser("list", parents=[common], help="list kernels, quant types and tune parameters")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_list)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except KernelgenError as e:
        located = isinstance(e, DslError) and e.span is not None
        print(str(e) if located else f"kernelgen: error: {e}", file=sys.stderr)
        return EXIT_USER
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug in kernelgen, not in the input: say so, distinctly from exit 2
        print(f"kernelgen: internal error: {type(e).__name__}: {e} (please report, with the input)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
