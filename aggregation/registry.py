"""The registries of aggregation's named parts (rules, round policies, server optimisers): each a table by name,
filled by a class decorator (:func:`registrar`) as its part's module is imported."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

Part = TypeVar("Part", bound=type)


def registrar(table: dict[str, Any], what: str, flag: str,
              entry: Callable[[type], Any] = lambda cls: cls) -> Callable[[Part], Part]:
    """A class decorator that puts ``entry(cls)`` into ``table`` under ``cls.name`` (the name ``flag`` takes), and
    refuses a name registered twice (``what`` names the kind of part in that error)."""

    def register(cls: Part) -> Part:
        if cls.name in table:
            raise ValueError(f"{what} {cls.name!r} is registered twice")
        table[cls.name] = entry(cls)
        return cls

    register.__doc__ = f"Class decorator: make a {what} available under its ``name`` (``{flag} NAME``)."
    return register
