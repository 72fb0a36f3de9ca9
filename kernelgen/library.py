"""Where the kernel library (kernels.dsl), its committed build (out/) and the JS runtime (runtime/) live.

An installed wheel carries both inside the package, as kernelgen/library/ (pyproject.toml's
force-include); in a checkout (or an editable install) they are the repository's own, beside the
package. `kernelgen.load()` with no directory loads this build; `kernelgen build` names this
kernels.dsl when the current directory has none.
"""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def root() -> Path:
    """The directory holding kernels.dsl and out/."""
    packaged = _PACKAGE / "library"
    return packaged if packaged.is_dir() else _PACKAGE.parent


def dsl() -> Path:
    return root() / "kernels.dsl"


def out() -> Path:
    return root() / "out"


def runtime() -> Path:
    """The JS runtime's modules (runtime/): `kernelgen bench --engine node` runs the kernels through them."""
    return root() / "runtime"
