"""What code a timing times. The store keys a timing on the kernel source it was built from
(store.kernel_hash), but the compiler turns that source into code too: a change to the lowering of
one type (Q2_K's codes from nibbles to 2-bit fields) leaves the source, and so the key, as it was,
and the old timings would go on picking that type's variants. Each timing therefore also records a
fingerprint of the WebAssembly it ran (Record.code), and `kernelgen prune` drops the timings whose
fingerprint the compiler no longer emits.

The code compared is every function the timed call reaches (a pool job's: the job and par_for, the
pool's driver), as WAT without comments (they name DSL lines, which an edit moves) and with its
locals declared in name order. A fingerprint lowers the variant under every other kernel's declared
defaults: a kernel can read another kernel's tune value (qmatmul's tiles read qmatvec.accs), and the
one timed beside it is not recorded; carry compares under each stored value instead (carry.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re

from ..compiler.check import Checked, resolve_tune, select_quants, tune_key
from ..compiler.lower import Lowered, lower
from ..compiler.wat import Func, Writer
from ..errors import DslError

_CALL = re.compile(r"\(call \$([A-Za-z0-9_]+)")
_COMMENT = re.compile(r"\s*;;.*$")
DRIVER = "par_for"  # the pool's driver: a pool job's timing runs it (timing.POOL_REPEAT)


def _text(f: Func) -> str:
    """f's WAT without comments, its locals in name order: where a declaration sits is not code (the
    body names every local), and an edit of one type's branch can move another's."""
    w = Writer()
    w.func(0, dataclasses.replace(f, locals=sorted(f.locals)))
    return "\n".join(line for line in (_COMMENT.sub("", s) for s in w.lines) if line.strip())


class Code:
    """The code one source lowers to, per target and tune table (lowerings shared through lower's memo)."""

    def __init__(self, checked: Checked) -> None:
        self.checked = checked
        self._memo: dict = {}
        self._lowered: dict[tuple, tuple[Lowered, dict[str, str]]] = {}
        self._prints: dict[tuple, str | None] = {}

    def lowered(self, target: str, quant: str | None, table: dict[str, dict[str, int]]) -> tuple[Lowered, dict[str, str]]:
        key = (target, quant, json.dumps(table, sort_keys=True))
        if key not in self._lowered:
            checked = select_quants(self.checked, [quant]) if quant else self.checked
            low = lower(checked, target, table, self._memo.setdefault((target, quant), {}))
            self._lowered[key] = low, {f.name: _text(f) for f in low.funcs}
        return self._lowered[key]

    def reached(self, target: str, kernel: str, quant: str | None,
                table: dict[str, dict[str, int]]) -> tuple[str, set[tuple[str, str | None]]]:
        """sha256 of the functions a timing of `kernel` (an export, or a pool job) runs, and the
        (kernel, quant) of the other kernels whose tune values they read."""
        low, texts = self.lowered(target, quant, table)
        job = kernel in self.checked.jobs
        roots = [e.name for e in (low.jobs if job else low.exports)
                 if (e.kernel.job if job else e.kernel.name) == kernel and (e.quant.name if e.quant else None) == quant]
        roots += [DRIVER] * job
        seen: list[str] = []
        while roots:
            name = roots.pop()
            if name in seen or name not in texts:
                continue
            seen.append(name)
            roots += _CALL.findall(texts[name])
        reads = {(k, q) for r in self._memo[(target, quant)].values() if r.func is not None and r.func.name in seen
                 for k, q, _, _ in r.reads}
        return hashlib.sha256("\n".join(texts[n] for n in sorted(seen)).encode()).hexdigest(), reads

    def fingerprint(self, target: str, kernel: str, quant: str | None, tune: dict[str, int], threads: int = 1) -> str | None:
        """The code a timing of `kernel` (an export or a pool job) with `tune` on `threads` runs,
        every other kernel at its declared defaults: an export timed on several threads runs on its
        pool job. None when the source cannot build that variant (a parameter or its domain changed)."""
        key = (target, kernel, quant, json.dumps(tune, sort_keys=True), threads > 1)
        if key not in self._prints:
            self._prints[key] = self._fingerprint(target, kernel, quant, tune, threads)
        return self._prints[key]

    def _fingerprint(self, target: str, kernel: str, quant: str | None, tune: dict[str, int], threads: int) -> str | None:
        checked = self.checked
        try:  # a job's own values (threads, chunk) are run-time arguments: its code is the defaults'
            table = resolve_tune(checked, {} if kernel in checked.jobs else {tune_key(kernel, quant): tune}, where="tuning record")
        except DslError:
            return None
        if kernel in checked.jobs:
            return self.reached(target, kernel, quant, table)[0]
        job = next((name for name, j in checked.jobs.items() if j.name == kernel), None) if threads > 1 else None
        return self.reached(target, job or kernel, quant, table)[0]
