"""What every ``fcl-emu`` command shares: the error console and the check that its output folders can be
written."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

console = Console(stderr=True, soft_wrap=True)  # an error stays one line in a log


def writable(*directories: Optional[Path]) -> None:
    """Exit 1 with one line unless each directory given can be written (or made): checked before any work."""
    from fcl_emu.writable import NotWritableError, check_writable

    try:
        for directory in directories:
            if directory is not None:
                check_writable(directory)
    except NotWritableError as exc:
        console.print(f"error: {exc}", style="red", markup=False, highlight=False)
        raise typer.Exit(1) from None


def folder(file: Optional[Path]) -> Optional[Path]:
    """The directory ``file`` goes into (None: no file)."""
    return None if file is None else file.parent
