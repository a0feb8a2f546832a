"""One run, one run directory: a new run refuses a folder that holds another run's record, before anything starts,
unless ``--overwrite`` may empty it of that run's files first (docs/resume.md)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from fcl_emu.coordinator.resume import CHECKPOINT_DIR
from fcl_emu.monitoring.run_dir import CONFIG, EVENTS, SUMMARY
from fcl_emu.monitoring.stack import TARGETS_FILE
from fcl_emu.writable import NotWritableError

RECORD = (CONFIG, EVENTS, SUMMARY, CHECKPOINT_DIR)  # a run's record, what `report` and `--resume` read
OWN = (*RECORD, "logs", "keys", "prometheus", TARGETS_FILE, "report")  # what a run and its report write there


class RunDirInUse(NotWritableError):
    """The run directory holds another run (the message says what to do, in one line)."""


def recorded(run_dir: Path) -> list[str]:
    """The files of a run's record that ``run_dir`` holds: none, and a new run may start in it as it is."""
    return [name for name in RECORD if os.path.lexists(Path(run_dir) / name)]  # False where it cannot look


def check_new_run_dir(run_dir: Path, overwrite: bool, keys: Path | None = None) -> None:
    """Raise :class:`RunDirInUse` unless a new run may start in ``run_dir``: it holds no run's record, or
    ``overwrite`` and it holds only a run's own files (:data:`OWN`), the new run's ``keys`` not among them. A
    folder with anything else (``--run-dir .``, a home directory) is never emptied."""
    run_dir = Path(run_dir)
    held = recorded(run_dir)
    if not held:
        return
    if not overwrite:
        raise RunDirInUse(f"{run_dir} holds a run already ({', '.join(held)}): give another --run-dir, replace "
                          f"that run with --overwrite, or continue it with --resume {run_dir} if it did not end")
    foreign = sorted(entry.name for entry in run_dir.iterdir() if not _own(entry.name))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise RunDirInUse(f"--overwrite empties only a run directory, and {run_dir} holds more than a run's files "
                          f"({shown}): remove the run yourself or give another --run-dir")
    if keys is not None and Path(keys).resolve().is_relative_to(run_dir.resolve()):
        raise RunDirInUse(f"--overwrite would delete the run's keys {keys}, in {run_dir}: move them out of it first")


def empty_run_dir(run_dir: Path, keys: Path | None = None) -> None:
    """``--overwrite``: delete the run's files in ``run_dir`` where :func:`check_new_run_dir` allows it (checked
    again); the folder itself stays, and a link in it is removed, not what it points to."""
    check_new_run_dir(run_dir, True, keys)
    if not recorded(run_dir):
        return
    for entry in Path(run_dir).iterdir():
        if not _own(entry.name):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError as exc:
            raise NotWritableError(f"cannot empty {run_dir} for --overwrite: {entry}: {exc.strerror}") from None


def _own(name: str) -> bool:
    """A name a run writes, or one of its files' temporaries a crash left (``summary.json.tmp``)."""
    return name.removesuffix(".tmp") in OWN
