"""Installed, kernelgen works from anywhere: the wheel carries kernels.dsl and its built out/, a fresh
venv with only the wheel (and its dependencies) runs the README's API example from a temporary
directory, and `kernelgen build` there says what to pass. Builds and installs for real, so it runs
under CI (or with KERNELGEN_TEST_WHEEL=1): about 40 s, most of it pip."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.wheel,
    pytest.mark.skipif(not (os.environ.get("CI") or os.environ.get("KERNELGEN_TEST_WHEEL")),
                       reason="builds and installs the wheel: set KERNELGEN_TEST_WHEEL=1 (CI runs it)"),
]


def readme_api_example() -> str:
    section = (ROOT / "README.md").read_text(encoding="utf-8").split("## The Python API")[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_installed_wheel_runs_the_readme_example_from_anywhere(tmp_path: Path) -> None:
    run = lambda *argv, **kw: subprocess.run(argv, capture_output=True, text=True, **kw)  # noqa: E731
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(ROOT))
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("kernelgen-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for target in ("simd128", "relaxed-simd"):
        for f in ("kernels.wasm", "kernels.json", "kernels.wat"):
            assert f"kernelgen/library/out/{target}/{f}" in names
    assert "kernelgen/library/kernels.dsl" in names and "kernelgen/templates/module.wat.j2" in names

    venv = tmp_path / "venv"
    assert run(sys.executable, "-m", "venv", str(venv)).returncode == 0
    python, kernelgen = venv / "bin" / "python", venv / "bin" / "kernelgen"
    installed = run(str(python), "-m", "pip", "install", "-q", str(wheel))
    assert installed.returncode == 0, installed.stderr

    anywhere = tmp_path / "elsewhere"
    anywhere.mkdir()
    script = readme_api_example() + (
        "\nimport pathlib\nassert pathlib.Path(kernelgen.__file__).is_relative_to(" + repr(str(venv)) + ")"
        "\nassert y.shape == (256,) and (y == y2).all() and p.shape == (8, 32)"
        "\nref = reference.dequantize_q8_0(w).astype('float64') @ x.astype('float64')"
        "\nassert abs(y - ref).max() < 0.05 * abs(ref).max(), abs(y - ref).max()"
        "\nprint(k.target, 'ok')\n")
    example = run(str(python), "-c", script, cwd=anywhere)
    assert example.returncode == 0, example.stderr
    assert example.stdout.strip() == "relaxed-simd ok"

    version = run(str(kernelgen), "--version", cwd=anywhere)
    assert version.returncode == 0 and version.stdout.startswith("kernelgen ")
    no_dsl = run(str(kernelgen), "build", cwd=anywhere)
    assert no_dsl.returncode == 2 and not (anywhere / "out").exists()
    shipped = re.search(r"the library that ships with kernelgen is (\S+kernels\.dsl);", no_dsl.stderr)
    assert no_dsl.stderr.startswith("kernelgen: error: no kernels.dsl in the current directory: pass --dsl FILE")
    assert shipped and Path(shipped.group(1)).is_relative_to(venv), no_dsl.stderr
    rebuilt = run(str(kernelgen), "build", "--dsl", shipped.group(1), "--target", "simd128", "--no-store", cwd=anywhere)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert (anywhere / "out" / "simd128" / "kernels.wasm").is_file()
