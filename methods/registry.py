"""Registry of learning methods by name.

A method module calls :func:`register` at import time; :func:`get` imports
the built-in method modules on first use so that ``fcl-emu methods`` and the
config validator see all of them.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from fcl_emu.methods import requirements
from fcl_emu.methods.base import ClientPart, Options, ServerPart

# The built-in methods, each the module fcl_emu.methods.<name>: the one place a new method is listed (its module
# registers its spec, and its server-side jobs under <name>.<kind>, methods/jobs.py).
BUILTIN = ("fedavg", "fedprox", "fedlwf2t", "fedewc", "mfcl", "target", "lander", "glfc", "icarl", "affcl",
           "fedcbc")


@dataclass(frozen=True)
class MethodSpec:
    name: str
    description: str
    options: type[Options]
    server: type[ServerPart]
    client: type[ClientPart]
    aliases: tuple[str, ...] = ()
    # The local-training settings of the method's official code (keys of the run config's ``training``
    # section: lr, momentum, weight_decay): they apply where the run config leaves that key unset, and the
    # resolved values are what the run's config.json records. Empty: the project's defaults.
    training: Mapping[str, float] = field(default_factory=dict)
    # The extras (pyproject.toml's optional dependencies, methods.requirements.EXTRAS) the method imports: a run
    # checks them before it starts; `fcl-emu methods` names them.
    requires_extras: tuple[str, ...] = ()

    @property
    def refusals(self) -> dict[str, str]:
        """The run features the method refuses, each with why (:func:`fcl_emu.methods.requirements.refusals`)."""
        return requirements.refusals(self.name, self.server)


_REGISTRY: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    for key in (spec.name, *spec.aliases):
        if key in _REGISTRY and _REGISTRY[key] is not spec:
            raise ValueError(f"method name {key!r} registered twice")
        _REGISTRY[key] = spec
    return spec


def _load_builtins() -> None:
    for name in BUILTIN:
        importlib.import_module(f"fcl_emu.methods.{name}")


def get(name: str) -> MethodSpec:
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; registered: {', '.join(names())}") from None


def names() -> list[str]:
    """Canonical names (no aliases), sorted."""
    _load_builtins()
    return sorted({spec.name for spec in _REGISTRY.values()})


def all_specs() -> list[MethodSpec]:
    return [get(n) for n in names()]
