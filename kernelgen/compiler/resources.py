"""Files kernelgen reads at run time: its grammar and its WAT templates.

In a wheel the top-level templates/ is shipped inside the package (pyproject's force-include); in a
source checkout or editable install they are read from the repository itself."""
from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent  # the kernelgen package


def template_dir() -> Path:
    shipped = PACKAGE / "templates"
    return shipped if shipped.is_dir() else PACKAGE.parent / "templates"

