"""Flower's own environment: the comparisons with Flower (``fcl-emu bench flower``, the Flower client of
``fcl-emu bench secagg``) run Flower's side in a virtual environment of its own, because flwr pins a typer (and a
click) that fcl-emu's command line cannot use.

- :func:`create` makes it: ``python -m venv DIR`` with this Python, then ``pip install -c constraints/flower.txt
  "flwr[simulation]"`` (the versions the comparisons are measured with). An environment already there with the
  pinned flwr is kept.
- :func:`find_python` finds its interpreter: the benches' ``--flower-python``, else ``$FCL_EMU_FLOWER_PYTHON``,
  else ``bin/python`` of the default environment (``$FCL_EMU_FLOWER_ENV``, else ``~/.cache/fcl-emu/flower-env``),
  and checks that it has flwr and this Python's major.minor.
- :func:`module_command` runs one of fcl-emu's modules there with the product's site-packages after Flower's own:
  flwr, its typer and click, numpy and Ray come from Flower's environment, torch and fcl-emu from the product's.
  They are added with ``site.addsitedir`` (PYTHONPATH would not do): it runs their ``.pth`` files, and an editable
  install of fcl-emu is found through one.

Only the standard library at the top level: CI runs this file by path (``python3 fcl_emu/bench/flower_env.py``)
to create the default environment before the project is installed.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ENV_DIR_VAR = "FCL_EMU_FLOWER_ENV"
PYTHON_VAR = "FCL_EMU_FLOWER_PYTHON"
PRODUCT_SITE_VAR = "FCL_EMU_PRODUCT_SITE"
REQUIREMENT = "flwr[simulation]"
CONSTRAINTS = Path(__file__).resolve().parents[2] / "constraints" / "flower.txt"
HOW = (f"create Flower's environment with `fcl-emu bench flower-env` (or `python3 fcl_emu/bench/flower_env.py`), "
       f"or name its interpreter with --flower-python or ${PYTHON_VAR}")

# The first statement of every Flower-side process (module_command's, and Ray's workers, which start bare): the
# product's site-packages, listed in $FCL_EMU_PRODUCT_SITE, after Flower's own.
ADD_PRODUCT_SITE = (f"import os, site; [site.addsitedir(d) for d in os.environ[{PRODUCT_SITE_VAR!r}]"
                    f".split(os.pathsep)]")

# Prints "<major>.<minor> <flwr version>" ("3.11 " without flwr), in any Python.
PROBE = ("import importlib.metadata as m, sys\n"
         "try:\n    flwr = m.version('flwr')\nexcept m.PackageNotFoundError:\n    flwr = ''\n"
         "print('%d.%d' % sys.version_info[:2], flwr)")


class FlowerEnvError(Exception):
    """A Flower environment that cannot be used; the message says why and what to do."""


class NoFlowerEnv(FlowerEnvError):
    """No Flower environment is named and none is at the default place."""


@dataclass(frozen=True)
class FlowerPython:
    """The interpreter of a Flower environment, checked, and the flwr it has."""

    path: Path
    flwr: str


def default_dir() -> Path:
    return Path(os.environ.get(ENV_DIR_VAR) or Path.home() / ".cache" / "fcl-emu" / "flower-env").expanduser()


def env_python(directory: Path) -> Path:
    return directory / "bin" / "python"


def product_python() -> str:
    return "%d.%d" % sys.version_info[:2]


def find_python(explicit: str | Path | None = None) -> FlowerPython:
    """The Flower interpreter to use: ``explicit``, else ``$FCL_EMU_FLOWER_PYTHON``, else the default environment's.

    Raises :class:`NoFlowerEnv` when none is named and the default environment is not there, and
    :class:`FlowerEnvError` when the one found is not usable."""
    named = explicit or os.environ.get(PYTHON_VAR)
    if named:
        path = Path(named).expanduser()
        if not path.exists():
            raise FlowerEnvError(f"{path}: no such interpreter; {HOW}")
    else:
        path = env_python(default_dir())
        if not path.exists():
            raise NoFlowerEnv(f"no Flower environment at {default_dir()}: {HOW}")
    return checked(path)


@functools.lru_cache
def probe(path: Path) -> tuple[str, str]:
    """(Python major.minor, flwr version or "") of the interpreter at ``path``."""
    try:
        done = subprocess.run([str(path), "-c", PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FlowerEnvError(f"{path} does not run ({exc}); {HOW}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise FlowerEnvError(f"{path} does not run ({last}); {HOW}")
    python, _, flwr = done.stdout.strip().partition(" ")
    return python, flwr


def checked(path: Path) -> FlowerPython:
    python, flwr = probe(path)
    if python != product_python():
        raise FlowerEnvError(f"{path} is Python {python} and fcl-emu runs on {product_python()} (Flower's side "
                             f"loads fcl-emu's packages, so both need the same Python); {HOW}")
    if not flwr:
        raise FlowerEnvError(f"{path} has no flwr; {HOW}")
    return FlowerPython(path, flwr)


def product_site() -> str:
    """This interpreter's site-packages (pure and platform), as ``$FCL_EMU_PRODUCT_SITE`` lists them."""
    paths = sysconfig.get_paths()
    return os.pathsep.join(dict.fromkeys((paths["purelib"], paths["platlib"])))


def module_command(flower: FlowerPython, module: str, args: Sequence[str]) -> list[str]:
    """The command that runs ``python -m module *args`` in Flower's environment, the product's site-packages after
    Flower's own (also in the processes it starts: ``$FCL_EMU_PRODUCT_SITE`` is set for them)."""
    code = (f"import os, runpy, sys; os.environ[{PRODUCT_SITE_VAR!r}] = {product_site()!r}; {ADD_PRODUCT_SITE}; "
            f"runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")
    return [str(flower.path), "-c", code, module, *args]


def pinned_flwr() -> str:
    """The flwr version of constraints/flower.txt."""
    if not CONSTRAINTS.exists():
        raise FlowerEnvError(f"{CONSTRAINTS} is missing: create Flower's environment from a checkout of fcl-emu, "
                             f"or install {REQUIREMENT} in a virtual environment of Python {product_python()} "
                             f"yourself and name its interpreter with --flower-python")
    found = re.search(r"^flwr==(\S+)", CONSTRAINTS.read_text(), re.MULTILINE)
    if found is None:
        raise FlowerEnvError(f"{CONSTRAINTS} pins no flwr version")
    return found[1]


def create(directory: Path | None = None) -> FlowerPython:
    """Flower's environment in ``directory`` (default :func:`default_dir`): kept if it has the pinned flwr on this
    Python, else made afresh (an older Flower environment there is cleared first) and installed with pip."""
    directory = Path(directory or default_dir()).expanduser().absolute()
    python, pinned = env_python(directory), pinned_flwr()
    try:
        state = probe(python) if python.exists() else None
    except FlowerEnvError:
        state = None
    if state == (product_python(), pinned):
        return checked(python)
    stale_flower = state is not None and bool(state[1])
    print(f"creating Flower's environment in {directory} (flwr {pinned}) ...", file=sys.stderr, flush=True)
    step([sys.executable, "-m", "venv", *(["--clear"] if stale_flower else []), str(directory)])
    step([str(python), "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS), REQUIREMENT])
    probe.cache_clear()
    return checked(python)


def step(command: list[str]) -> None:
    """One step of :func:`create`; a failure is a :class:`FlowerEnvError` naming the command."""
    code = subprocess.run(command).returncode
    if code != 0:
        raise FlowerEnvError(f"creating Flower's environment failed: {shlex.join(command)} exited {code}")


def created_lines(flower: FlowerPython) -> list[str]:
    """What creating it prints: where it is, and the line that points the benches to it."""
    directory = flower.path.parent.parent
    return [f"Flower's environment: {directory} (flwr {flower.flwr})",
            f"export {ENV_DIR_VAR}={shlex.quote(str(directory))}"]


def main() -> None:
    parser = argparse.ArgumentParser(description="Create Flower's environment for fcl-emu's comparisons.")
    parser.add_argument("--dir", type=Path, default=None,
                        help=f"where (default: ${ENV_DIR_VAR}, else ~/.cache/fcl-emu/flower-env)")
    args = parser.parse_args()
    try:
        flower = create(args.dir)
    except FlowerEnvError as exc:
        sys.exit(f"error: {exc}")
    print("\n".join(created_lines(flower)))


if __name__ == "__main__":
    main()
