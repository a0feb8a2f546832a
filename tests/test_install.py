"""What a fresh install gets is what the suite tests: every import declared (deptry over the repository, and a
copy of it with one undeclared import, which it must catch), and the test environment holding the same version of
every product package as `pip install -e .` with constraints/fcl-emu.txt (the README's commands)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def deptry(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deptry", "--no-ansi", "."], cwd=root, capture_output=True,
                          text=True, timeout=300)


def product_pins() -> dict[str, str]:
    """constraints/fcl-emu.txt's product section: distribution name -> version."""
    text = (ROOT / "constraints" / "fcl-emu.txt").read_text()
    section = text.split("# the product:", 1)[1].split("\n\n", 1)[0]
    return dict(line.split("==", 1) for line in section.splitlines()[1:] if "==" in line)


def test_every_import_is_declared_and_every_dependency_imported():
    done = deptry(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_an_undeclared_import_fails_the_check(tmp_path):
    """The same configuration over a copy of the code, with one module that imports what only another package
    brings (click, which typer no longer installs): deptry names it."""
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    for folder in folders:
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "fcl_emu" / "undeclared.py").write_text("import click\n")
    done = deptry(tmp_path)
    assert done.returncode == 1
    issues = [line for line in (done.stdout + done.stderr).splitlines() if re.search(r"DEP00\d", line)]
    assert len(issues) == 1 and "undeclared.py" in issues[0] and "'click'" in issues[0], done.stderr


def test_the_test_environment_has_the_users_versions():
    """Each product package at its pin: no test tool moved one (pip would refuse the constraints instead). torch may
    be another build (the README: any torch >= 2.4); then this environment is not the pinned one and says so."""
    pins = product_pins()
    assert {"typer", "torch", "numpy", "pydantic"} <= set(pins) and "click" not in pins
    if version("torch").split("+")[0] != pins["torch"]:
        pytest.skip(f"torch {version('torch')} installed, not the pinned {pins['torch']}: installed without "
                    f"constraints/fcl-emu.txt")
    installed = {}
    for name in pins:
        try:
            installed[name] = version(name)
        except PackageNotFoundError:
            installed[name] = None
    moved = {name: (installed[name], pin) for name, pin in pins.items()
             if (installed[name] or "").split("+")[0] != pin}
    assert not moved, f"installed vs constraints/fcl-emu.txt: {moved}"
