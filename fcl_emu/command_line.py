"""What every ``fcl-emu`` command shares: the error console, one line for every mistake
(:class:`OneLineErrors`), the check that its output folders can be written, and its help as prose
(:func:`unwrap_help`)."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any, NoReturn, Optional

import pydantic
import typer
from rich.console import Console
from typer.core import TyperGroup

console = Console(stderr=True, soft_wrap=True)  # an error stays one line in a log


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: message`` on stderr (a line each of a message of several lines) and exit ``code`` (2: a usage
    or configuration mistake)."""
    console.print("\n".join(f"error: {line}" for line in message.splitlines()), style="red", markup=False,
                  highlight=False)
    raise typer.Exit(code)


class OneLineErrors(TyperGroup):
    """The root command: every mistake typer or a command raises (an unknown option, a bad value, a refused
    configuration: ``typer.BadParameter`` and the rest of typer's usage errors; settings a command builds from its
    options that pydantic refuses) prints as ``error: ...`` on stderr with the command to ask for help, and exits
    with its code (2), instead of typer's usage block and panel; a mistake of several parts keeps a line each. No
    traceback: a command that fails for another reason says so itself."""

    def main(self, args: Any = None, prog_name: Optional[str] = None, complete_var: Optional[str] = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.TyperException as exc:  # typer's usage errors (its own click's) derive from it
            if type(exc).__name__ != "NoArgsIsHelpError":  # the help was printed: nothing to add (as typer does)
                console.print(f"error: {one_line(exc)}", style="red", markup=False, highlight=False)
            sys.exit(getattr(exc, "exit_code", 1))
        except pydantic.ValidationError as exc:  # settings a command built from its options (a line each)
            console.print("\n".join(f"error: {'.'.join(map(str, e['loc'])) or exc.title}: {e['msg']}"
                                     for e in exc.errors()), style="red", markup=False, highlight=False)
            sys.exit(2)
        except typer.Abort:
            console.print("aborted", style="red", markup=False, highlight=False)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def one_line(exc: typer.TyperException) -> str:
    """The error's message and, where it came from a command, where its help is."""
    message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    ctx = getattr(exc, "ctx", None)
    return f"{message} (see: {ctx.command_path} --help)" if ctx is not None else message


def writable(*directories: Optional[Path]) -> None:
    """Exit 1 with one line unless each directory given can be written (or made): checked before any work."""
    from fcl_emu.writable import NotWritableError, check_writable

    try:
        for directory in directories:
            if directory is not None:
                check_writable(directory)
    except NotWritableError as exc:
        fail(str(exc), 1)


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
