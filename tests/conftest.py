"""Shared fixtures for the kernel tests: each (target, deterministic, tune) module compiles once.

`mode` parametrizes a test over simd128 and relaxed SIMD with wasmtime's relaxed-SIMD
determinism on and off (the flag only changes relaxed instructions, so simd128 runs once).
`kgen(tune=None, deterministic=None)` returns the cached module for the test's mode; every
module a test touched is `reset()` afterwards, so packed weights never leak between tests.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest
from hypothesis import settings

from kernelgen.compiler.build import compile_kernels
from kernelgen.host.api import Kernels

DSL_PATH = Path(__file__).parents[1] / "kernels.dsl"
TARGETS = ("simd128", "relaxed-simd")

# CI draws hypothesis examples from a fixed seed, so a run fails or passes for the code alone; a
# developer's run explores new examples (and keeps failing ones in .hypothesis/).
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@dataclass(frozen=True)
class Mode:
    target: str
    deterministic: bool

    @property
    def id(self) -> str:
        if self.target == "simd128":
            return "simd128"
        return f"relaxed-{'det' if self.deterministic else 'nondet'}"

    @property
    def relaxed_nondet(self) -> bool:
        return self.target == "relaxed-simd" and not self.deterministic


MODES = (Mode("simd128", False), Mode("relaxed-simd", True), Mode("relaxed-simd", False))


def tune_key(tune: dict | None) -> str:
    return json.dumps(tune or {}, sort_keys=True)


class ModuleCache:
    """Compiled modules keyed by (target, deterministic, tune-json); each compiles once."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._mods: dict[tuple[str, bool, str], Kernels] = {}

    def get(self, target: str, deterministic: bool = False, tune: dict | None = None) -> Kernels:
        key = (target, bool(deterministic), tune_key(tune))
        if key not in self._mods:
            self._mods[key] = compile_kernels(self.source, target, tune=tune,
                                              deterministic=deterministic, filename=str(DSL_PATH))
        return self._mods[key]

    def __len__(self) -> int:
        return len(self._mods)


@pytest.fixture(scope="session")
def dsl_source() -> str:
    return DSL_PATH.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def module_cache(dsl_source: str) -> ModuleCache:
    return ModuleCache(dsl_source)


@pytest.fixture(params=MODES, ids=[m.id for m in MODES])
def mode(request: pytest.FixtureRequest) -> Mode:
    return request.param


@pytest.fixture
def kgen(mode: Mode, module_cache: ModuleCache) -> Iterator[Callable[..., Kernels]]:
    """Factory for the test's mode: kgen(tune=None, deterministic=None) -> cached Kernels."""
    used: list[Kernels] = []

    def get(tune: dict | None = None, deterministic: bool | None = None) -> Kernels:
        det = mode.deterministic if deterministic is None else deterministic
        k = module_cache.get(mode.target, det, tune)
        used.append(k)
        return k

    yield get
    for k in used:
        k.reset()


@pytest.fixture
def kernels(kgen: Callable[..., Kernels]) -> Kernels:
    """The default-tuned module for the test's mode."""
    return kgen()


@pytest.fixture
def any_module(module_cache: ModuleCache) -> Iterator[Callable[..., Kernels]]:
    """Factory for modules of any target/mode (for tests that pick their own), reset afterwards."""
    used: list[Kernels] = []

    def get(target: str, deterministic: bool = False, tune: dict | None = None) -> Kernels:
        k = module_cache.get(target, deterministic, tune)
        used.append(k)
        return k

    yield get
    for k in used:
        k.reset()
