"""Timings that survive an edit of the kernel source. The store keys each timing on the text of the
declarations its kernel can reach (store.kernel_hash), so an edit to a shared kernel drops the
timings of every quant type, although a branch taken by one type (`static if Q.has_sub_scales`)
changes the code of that type alone. A timing still times the edited source when the variant it
timed compiles to the same WebAssembly: `carry` finds those timings by lowering each variant from
both sources and comparing the code it runs, and keys copies of them to the edited source, so a
re-tune after such an edit times only what changed (`kernelgen carry OLD.dsl`, then
`kernelgen tune --quant ...`).

The code compared is fingerprint.Code's: every function the timed call reaches. A kernel can read
another kernel's tune value (qmatmul's tiles read qmatvec.accs); the code is compared under each
variant of that kernel the store holds, as a timing may have been taken beside any of them.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..compiler.check import Checked, resolve_tune, tune_key
from ..errors import DslError
from .fingerprint import Code
from .store import Record, declares, kernel_hash


@dataclass
class Carried:
    """What carry found: copies of the timings whose code is unchanged, keyed to the new source, and
    the (target, kernel, quant) whose code the edit changed (their timings are left as they are)."""

    records: list[Record] = field(default_factory=list)
    changed: set[tuple[str, str, str | None]] = field(default_factory=set)
    kept: set[tuple[str, str, str | None]] = field(default_factory=set)


def _same_record(r: Record) -> tuple:
    return r.key(), json.dumps(r.tune, sort_keys=True), r.seconds, r.status, r.when


def carry(records: Iterable[Record], old: Checked, new: Checked) -> Carried:
    """Copies, keyed to `new` (kernel_hash), of the timings in `records` that time `old`'s source
    and whose variant compiles to the same code from `new`; and which kernels the edit changed."""
    records = list(records)
    codes = Code(old), Code(new)
    current = [r for r in records if r.dsl_hash == kernel_hash(old, r.kernel, r.quant) and declares(new, r)
               and r.dsl_hash != kernel_hash(new, r.kernel, r.quant)]
    variants: dict[tuple[str, str, str | None], list[dict[str, int]]] = {}  # stored variants per kernel
    for r in current:
        if r.kernel in old.kernels and r.tune not in (v := variants.setdefault((r.target, r.kernel, r.quant), [])):
            v.append(r.tune)
    stored = {_same_record(r) for r in records}
    out = Carried()
    verdicts: dict[tuple, bool] = {}
    for r in current:
        exported = old.jobs[r.kernel].name if r.kernel in old.jobs else r.kernel
        mine = {} if r.kernel in old.jobs else {tune_key(r.kernel, r.quant): r.tune}
        key = (r.target, r.kernel, r.quant, json.dumps(mine, sort_keys=True))
        if key not in verdicts:
            verdicts[key] = _same(codes, r.target, r.kernel, r.quant, exported, mine, variants)
        (out.kept if verdicts[key] else out.changed).add((r.target, r.kernel, r.quant))
        copy = dataclasses.replace(r, dsl_hash=kernel_hash(new, r.kernel, r.quant))
        if verdicts[key] and _same_record(copy) not in stored:  # not carried before
            out.records.append(copy)
    out.kept -= out.changed
    return out


def _same(codes: tuple[Code, Code], target: str, kernel: str, quant: str | None, exported: str,
          mine: dict[str, dict[str, int]], variants: dict[tuple[str, str, str | None], list[dict[str, int]]]) -> bool:
    """Whether the timed call compiles alike from both sources, under each table it may have run
    with: the declared defaults, and each stored variant of each kernel whose values it reads (a
    pool job: of its exported kernel too)."""
    try:
        base = {**resolve_tune(codes[0].checked), **mine}
        (a, reads_a), (b, reads_b) = (c.reached(target, kernel, quant, base) for c in codes)
        if a != b:
            return False
        others = (reads_a | reads_b | ({(exported, quant)} if not mine else set())) - {(kernel, quant)}
        for k, q in sorted(others, key=str):
            for v in variants.get((target, k, q), []):
                table = {**base, tune_key(k, q): v}
                if codes[0].reached(target, kernel, quant, table)[0] != codes[1].reached(target, kernel, quant, table)[0]:
                    return False
    except DslError:  # the new source does not take these values (a parameter or its domain changed)
        return False
    return True
