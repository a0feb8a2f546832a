"""What a run varied: the settings of its ``config.yaml`` that differ from the defaults, grouped by what they
vary (the scenario, the method, or the system it ran on), and the system settings on which several runs differ.

The defaults come from the caller (:func:`fcl_emu.runconfig.defaults.defaults_for`: ``RunConfig``'s, with the
method's own training values), as this package sits below the run configuration. Settings that say only where
a run was (its directory, data roots, addresses, ports, keys, the metrics endpoints) are not listed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

Config = Mapping[str, Any]
Defaults = Callable[[Config], Config]  # a run's config.yaml -> the same keys at their defaults for that run

SCENARIO, METHOD = "scenario", "method"
GROUPS: dict[str, tuple[str, ...]] = {  # group -> the top-level keys of config.yaml it holds, in print order
    SCENARIO: ("scenario", "seed"),
    METHOD: ("method", "method_options", "model", "training"),
    "rounds & aggregation": ("rounds", "aggregation"),
    "churn & devices": ("edge",),
    "security & privacy": ("security", "secagg", "privacy"),
    "deployment": ("nodes", "device", "coordinator_threads", "containers", "gpu", "network", "topology"),
}
OTHER = "other"  # a top-level key no group names (a section newer than this list)
NOT_SETTINGS = ("run_dir", "data_root", "download", "metrics", "network.bind", "security.keys", "containers.image",
                "containers.network", "containers.advertise", "containers.cluster")
_GROUP_OF = {key: group for group, keys in GROUPS.items() for key in keys}
_RANK = {group: k for k, group in enumerate([*GROUPS, OTHER])}


@dataclass(frozen=True)
class Setting:
    """One setting by its dotted name in config.yaml (``aggregation.policy.name``), its value and its group."""

    group: str
    name: str
    value: Any

    @property
    def system(self) -> bool:
        """Whether it varies neither the scenario nor the method: what a comparison of methods must hold fixed."""
        return self.group not in (SCENARIO, METHOD)

    def __str__(self) -> str:
        return f"{self.name}={value_text(self.value)}"


def value_text(value: Any) -> str:
    """A value as config.yaml spells it (``true``, ``null``, ``0.5``), strings bare."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _excluded(name: str) -> bool:
    return any(name == n or name.startswith(n + ".") for n in NOT_SETTINGS)


def _setting(name: str, value: Any) -> Setting:
    return Setting(_GROUP_OF.get(name.partition(".")[0], OTHER), name, value)


def _differences(config: Config, defaults: Config, prefix: str = "") -> Iterator[Setting]:
    for key, value in config.items():
        name = prefix + str(key)
        if key not in defaults or _excluded(name):
            continue  # a key of another version of fcl-emu has no default here
        default = defaults[key]
        if isinstance(value, Mapping) and isinstance(default, Mapping) and default:
            yield from _differences(value, default, name + ".")
        elif value != default:  # an open mapping (method_options, default {}) lists its keys
            items = value.items() if isinstance(value, Mapping) and value else [(None, value)]
            yield from (_setting(name if k is None else f"{name}.{k}", v) for k, v in items)


def non_default_settings(config: Config | None, defaults: Config) -> list[Setting]:
    """The settings of ``config`` (a run's config.yaml) that differ from ``defaults``, by group (scenario,
    method, then the system's groups) and in config.yaml's order within one. Keys either side lacks are left out
    (a config.yaml of another version, or a partial one)."""
    return sorted(_differences(config or {}, defaults), key=lambda s: _RANK[s.group])  # stable within a group


def settings_text(settings: Sequence[Setting], separator: str = "; ") -> str:
    """``method: method=glfc, training.lr=0.1; churn & devices: edge.availability=onoff:60:30``, or ``none``
    (every setting at its default)."""
    groups: dict[str, list[str]] = {}
    for s in settings:
        groups.setdefault(s.group, []).append(str(s))
    return separator.join(f"{group}: {', '.join(names)}" for group, names in groups.items()) or "none"


def flat_settings(config: Config, prefix: str = "") -> dict[str, Any]:
    """Every setting of ``config`` by dotted name (open mappings such as ``method_options`` as one value), those
    in :data:`NOT_SETTINGS` left out."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = prefix + str(key)
        if _excluded(name):
            continue
        if isinstance(value, Mapping) and value and name != "method_options":
            out.update(flat_settings(value, name + "."))
        else:
            out[name] = value
    return out


def system_differences(configs: Sequence[tuple[str, Config]]) -> list[tuple[Setting, dict[str, list[str]]]]:
    """The system settings (neither scenario nor method) on which the named configs differ: each with the runs
    that had each value (``{repr(value): [name, ...]}``). A setting some config lacks is left out."""
    flat = [(name, flat_settings(config)) for name, config in configs]
    if len(flat) < 2:
        return []
    common = [k for k in flat[0][1] if all(k in f for _, f in flat[1:])]
    found = []
    for key in common:
        setting = _setting(key, None)
        if not setting.system:
            continue
        values: dict[str, list[str]] = {}
        for name, f in flat:
            values.setdefault(repr(f[key]), []).append(name)
        if len(values) > 1:
            found.append((setting, values))
    return sorted(found, key=lambda f: _RANK[f[0].group])
