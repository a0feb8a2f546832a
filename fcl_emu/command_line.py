"""What every ``fcl-emu`` command shares: the error console, the check that its output folders can be
written, and its help as prose (:func:`unwrap_help`)."""

from __future__ import annotations

import inspect
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


def unwrapped(text: str) -> str:
    """``text`` (a docstring) with the source's line breaks inside each paragraph undone."""
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in inspect.cleandoc(text).split("\n\n"))


def unwrap_help(app: typer.Typer) -> None:
    """Give every command of ``app`` and of its sub-apps its docstring unwrapped as its help: typer's rich help keeps
    a docstring's single newlines as hard breaks (in a group's command list, in later paragraphs)."""
    for info in app.registered_commands:
        if info.help is None and info.callback is not None and info.callback.__doc__:
            info.help = unwrapped(info.callback.__doc__)
    for group in app.registered_groups:
        unwrap_help(group.typer_instance)
