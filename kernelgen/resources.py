"""Files kernelgen reads at run time: its grammar and its WAT templates.

In a wheel the top-level templates/ is shipped inside the package (pyproject's force-include); in a
source checkout or editable install they are read from the repository itself."""
from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def template_dir() -> Path:
    shipped = PACKAGE / "templates"
    return shipped if shipped.is_dir() else PACKAGE.parent / "templates"


def compiler_files() -> list[Path]:
    """Everything whose change changes the output: hashed into each manifest's inputs hash."""
    files = sorted(PACKAGE.glob("*.py")) + [PACKAGE / "grammar.lark"] + sorted(template_dir().glob("*.j2"))
    return [f for f in files if f.is_file()]
