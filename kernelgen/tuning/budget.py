"""The byte budget of a build's quant-type code: which tuned variants a target keeps when all of
them would not fit.

The store's pick (store.best_tune) chooses each quant type's variant of a tunable kernel by speed
alone, with SIZE_MARGIN against the smallest variant; each pick is code in that type's functions
(a four-row mat-vec tile is ~3 KB per type), and ten types of picks outgrow a page's download
budget. When they do, the build keeps the picks that together give the most measured speed (the
product of their speedups over the smallest variants, from the tuning records, each type's raised
to its declared `priority`: the types most models ship count most) within the budget, and builds
the smallest variant for the others (or an alternative: a middle variant, or one that calls the tile
another kernel's pick holds). The manifest's `tune.budget` names the picks left
out and the speed each gives up. A build of the types one model uses (`kernelgen build --quant`,
check.select_quants) spends the same budget on those types alone.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Mapping

from ..compiler.quant import DEFAULT_PRIORITY
from ..names import variant_name

# Issue 13: the ten quant types' kernels in 32 KB per target (function bodies of quant-type code,
# size.QUANT_CODE); the bench judges the same figure against this goal.
CODE_BUDGET = 32768


@dataclass(frozen=True)
class Upgrade:
    """One quant type's tuned variant of one kernel, in place of its smallest variant: the store's
    pick, or for a budget the pick does not fit (an alternative) the fastest variant between the two
    (`middle`), or the one that takes another kernel's pick's values (`shares`: store.shared_tune)."""

    key: str  # the build table's key (check.tune_key): `qmatvec_q8_0`
    quant: str
    small: dict[str, int]
    fast: dict[str, int]
    speedup: float  # time of `small` / time of `fast`, by the tuning records (store.speedup)
    middle: bool = False
    shares: str | None = None  # the kernel whose pick's tile this variant calls

    @property
    def alternative(self) -> bool:  # built in place of the pick, never beside it
        return self.middle or self.shares is not None

    @property
    def name(self) -> str:  # what spend's choices hold: the key and the variant (`qmatvec_q8_0__rows2_accs1`)
        return variant_name(self.key, None, self.fast)


def spend(upgrades: list[Upgrade], cost: Callable[[str, frozenset[str]], int], budget: int,
          priority: Mapping[str, int] | None = None) -> set[str]:
    """The names of the upgrades to build, at most one per key (a kernel's pick or its middle
    variant): the choice with the largest sum of priority * log(speedup) (a weighted geometric mean
    of the speedups over the types' kernels; a type's `priority N;`, DEFAULT_PRIORITY where it
    declares none) whose bytes stay within `budget`, the fewest bytes among equals.
    `cost(quant, names)` is the bytes of one quant type's code with the upgrades `names` of that type
    (the others at their smallest variants): one type's upgrades need not add up (two kernels can
    share a tile), so each type's choices are costed as wholes. Exact, a knapsack over the types:
    the choices kept after each type are those no other choice beats on both bytes and speed."""
    front: list[tuple[int, float, frozenset[str]]] = [(0, 0.0, frozenset())]
    for quant in sorted({u.quant for u in upgrades}):
        per_key: dict[str, list[Upgrade]] = {}
        for u in upgrades:
            if u.quant == quant:
                per_key.setdefault(u.key, []).append(u)
        options = []
        for combo in itertools.product(*([None, *ups] for ups in per_key.values())):
            chosen = [u for u in combo if u is not None]
            names = frozenset(u.name for u in chosen)
            weight = (priority or {}).get(quant, DEFAULT_PRIORITY)
            options.append((cost(quant, names), weight * sum(math.log(u.speedup) for u in chosen), names))
        states = sorted(((b + ob, v + ov, keys | ok) for b, v, keys in front for ob, ov, ok in options),
                        key=lambda s: (s[0], -s[1], sorted(s[2])))
        front = []
        for state in states:
            if not front or state[1] > front[-1][1]:
                front.append(state)
    fits = [s for s in front if s[0] <= budget] or front[:1]  # over the budget even at the smallest: the least bytes
    return set(max(fits, key=lambda s: (s[1], -s[0]))[2])


def dropped_text(dropped: dict[str, dict], unit: str = "x") -> str:
    """A manifest's tune.budget.dropped as one line: each pick left out and its speedup (and the
    middle variant built in its place, with its own)."""
    return ", ".join(f"{variant_name(key, None, d['fast'])} ({d['speedup']}{unit}"
                     + (f"; {variant_name(key, None, d['built'])} built, {d['built_speedup']}{unit}" if "built" in d else "")
                     + ")" for key, d in dropped.items())
