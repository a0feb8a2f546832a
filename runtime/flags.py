"""A process's command-line flags declared once, as the fields of its arguments dataclass.

Each field of a dataclass that mixes in :class:`Flags` is a flag named after it (``metrics_port`` is
``--metrics-port``), of the type its annotation gives: ``str``, ``int``, ``float``, ``Path`` (or any type made
from a string), ``bool`` as a switch, ``X | None``, and ``tuple[X, ...]`` given once per element. A field without
a default is a required flag. :func:`flag` declares a field with its help and, where needed, a short alias, the
flag of one element of a tuple, and its own parse and format functions::

    @dataclass(frozen=True)
    class WorkerArgs(Flags, prog="python -m worker", description="One worker."):
        connect: str = flag("The endpoint to connect to.")
        threads: int = flag("Threads to run.", default=1)
        roots: tuple[Path, ...] = flag("A data root (repeatable).", default=(), repeat="--root")
        verbose: bool = flag("Log progress.", default=False, alias="-v")

``WorkerArgs.from_argv(argv)`` parses (a bad value exits 2 naming the flag), ``args.to_argv()`` gives the flags
back (``WorkerArgs.from_argv(args.to_argv()) == args``) and ``WorkerArgs.parser()`` is the argparse parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass
from typing import Any, TypeVar

from fcl_emu.runtime.process import OneLineParser, parse_with

F = TypeVar("F", bound="Flags")


@dataclass(frozen=True)
class Flag:
    """What a field's metadata says of its flag (see :func:`flag`)."""

    help: str
    alias: str | None = None
    repeat: str | None = None
    parse: Callable[[str], Any] | None = None
    format: Callable[[Any], str] | None = None


def flag(help: str, default: Any = MISSING, *, alias: str | None = None, repeat: str | None = None,
         parse: Callable[[str], Any] | None = None, format: Callable[[Any], str] | None = None) -> Any:
    """A dataclass field that is a flag: ``help``; ``default`` (none: a required flag); ``alias``, a short form
    (``-v``); ``repeat``, the flag of one element of a ``tuple[X, ...]`` field (``--data-root`` for ``data_roots``;
    default the field's own flag); ``parse`` and ``format``, the field's value from the flag's text and back (a
    ValueError of ``parse`` is the flag's usage error), in place of its annotation's type and ``str``."""
    return dataclasses.field(default=default, metadata={"flag": Flag(help, alias, repeat, parse, format)})


def flag_name(field: dataclasses.Field) -> str:
    """The flag of a dataclass field: its ``repeat`` flag, else its name with ``-`` for ``_`` (``--metrics-port``)."""
    declared = field.metadata.get("flag")
    return declared.repeat if declared and declared.repeat else "--" + field.name.replace("_", "-")


@dataclass(frozen=True)
class _Spec:
    """One field's flag, as the parser and :meth:`Flags.to_argv` use it."""

    name: str
    flag: str
    help: str
    alias: str | None
    parse: Callable[[str], Any]
    format: Callable[[Any], str]
    switch: bool
    repeat: bool
    required: bool
    default: Any


def _parse_text(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` with its ValueError as argparse's error of the flag (``argument --clients: <message>``)."""
    def parsed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parsed


def _spec(field: dataclasses.Field, hint: Any) -> _Spec:
    declared = field.metadata.get("flag") or Flag("")
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (hint,) = [a for a in args if a is not type(None)]  # X | None: an optional X
    repeat = declared.parse is None and typing.get_origin(hint) is tuple
    if repeat:
        (hint, _) = typing.get_args(hint)  # tuple[X, ...]: one X per flag
    switch = hint is bool
    if switch and field.default is not False:
        raise TypeError(f"{field.name}: a bool field is a switch and defaults to False")
    help = declared.help
    if not switch and field.default not in (MISSING, None, ()):
        help += f" Default {(declared.format or str)(field.default)}."
    return _Spec(name=field.name, flag=flag_name(field), help=help.replace("%", "%%"), alias=declared.alias,
                 parse=_parse_text(declared.parse) if declared.parse else hint, format=declared.format or str,
                 switch=switch, repeat=repeat, required=field.default is MISSING, default=field.default)


@functools.cache
def _specs(cls: type) -> tuple[_Spec, ...]:
    hints = typing.get_type_hints(cls)
    return tuple(_spec(field, hints[field.name]) for field in dataclasses.fields(cls))


class Flags:
    """Mixin of a dataclass whose fields are its flags: :meth:`parser`, :meth:`from_argv`, :meth:`to_argv`.
    ``prog`` and ``description`` (class keywords, else the base class's) are the parser's."""

    _flags_prog = _flags_description = None

    def __init_subclass__(cls, prog: str | None = None, description: str | None = None, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        cls._flags_prog, cls._flags_description = prog or cls._flags_prog, description or cls._flags_description

    @classmethod
    def parser(cls, prog: str | None = None) -> argparse.ArgumentParser:
        """The argparse parser of the fields' flags (``prog``: the program its usage names, default the class's)."""
        parser = OneLineParser(prog=prog or cls._flags_prog, description=cls._flags_description)
        for spec in _specs(cls):
            names = [spec.flag, *([spec.alias] if spec.alias else [])]
            if spec.switch:
                parser.add_argument(*names, dest=spec.name, action="store_true", default=argparse.SUPPRESS,
                                    help=spec.help)
            else:
                parser.add_argument(*names, dest=spec.name, type=spec.parse, required=spec.required,
                                    action="append" if spec.repeat else "store", default=argparse.SUPPRESS,
                                    metavar=spec.flag.lstrip("-").replace("-", "_").upper(), help=spec.help)
        return parser

    @classmethod
    def from_argv(cls: type[F], argv: Sequence[str] | None = None, prog: str | None = None) -> F:
        """The object of the flags ``argv`` (default ``sys.argv[1:]``). A bad value exits 2 with one
        line naming the flag, as argparse does: one its type or ``parse`` refuses, or one the object refuses with an
        ``ArgsError``."""
        repeated = {spec.name for spec in _specs(cls) if spec.repeat}
        return parse_with(cls.parser(prog), argv, lambda ns: cls(
            **{name: tuple(value) if name in repeated else value for name, value in vars(ns).items()}))

    def to_argv(self) -> list[str]:
        """The flags that give this object back: every required one, and each other one whose value is not its
        default."""
        argv: list[str] = []
        for spec in _specs(type(self)):
            value = getattr(self, spec.name)
            if not spec.required and value == spec.default:
                continue
            if spec.switch:
                argv.append(spec.flag)
            elif spec.repeat:
                for item in value:
                    argv += [spec.flag, spec.format(item)]
            elif value is not None or spec.default is not None:  # None where the default is not: its own word
                argv += [spec.flag, spec.format(value)]
        return argv
