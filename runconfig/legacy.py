"""The layout of aggregation's settings before ``aggregation:`` held them all (fcl-emu 2026-12-02 and earlier): the
policy as ``aggregation.kind`` with every policy's parameters beside it, the server optimiser's options as
``aggregation.server_*``, and the rule, its parameters and the update defences under ``security:``.

:func:`upgrade` reads a config of that layout (a run directory's config.yaml, a user's file) into today's, with a
warning naming each key it moved; :func:`as_legacy` writes today's config back in that layout for the run
fingerprint, so that a checkpoint of a run from then still resumes.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

from fcl_emu.runconfig.ignored import Ignored

# old key -> (its new section key, the option it is there); old default of each key the new layout may lack
POLICY_KEYS = {"buffer": "buffer", "max_staleness": "max_staleness", "concurrency": "concurrency",
               "async_alpha": "alpha", "async_staleness_exponent": "staleness_exponent"}
SERVER_KEYS = {"server_lr": "lr", "server_momentum": "momentum", "server_beta1": "beta1", "server_beta2": "beta2",
               "server_tau": "tau"}
RULE_KEYS = {"trim_fraction": "trim_fraction", "byzantine": "byzantine", "multikrum_keep": "keep"}
DEFENCES = ("max_update_norm", "clip_norm", "adaptive_clip", "direction_check")  # security.X -> aggregation.X
OLD_DEFAULTS = {"buffer": 10, "max_staleness": 4, "concurrency": None, "async_alpha": 0.6,
                "async_staleness_exponent": 0.5, "trim_fraction": 0.1, "byzantine": 1, "multikrum_keep": None,
                **dict.fromkeys(SERVER_KEYS)}


def _part(section: dict[str, Any], key: str, default: str) -> dict[str, Any]:
    """The part chosen at ``section[key]`` as a mapping (a name alone is ``{"name": it}``)."""
    value = section.get(key, {"name": default})
    return dict({"name": value} if isinstance(value, str) else value)


def _takes(kind: str, name: Any) -> frozenset[str]:
    """The options part ``name`` of ``kind`` (rule, policy, server optimiser) takes (none for an unknown name: the
    config's validation says it is unknown)."""
    from fcl_emu.aggregation.policies import POLICIES
    from fcl_emu.aggregation.rules import RULES
    from fcl_emu.aggregation.server_optimizers import OPTIMIZERS

    table = {"rule": RULES, "policy": POLICIES, "server_optimizer": OPTIMIZERS}[kind]
    return frozenset(table[name].Options.option_names()) if name in table else frozenset()


def upgrade(data: Any) -> tuple[Any, list[Ignored]]:
    """``data`` (a run config's mapping) in today's layout (``data`` itself where it holds no old key), and what it
    set that the run ignores. Each old key moves to its place; a parameter of a part the config does not choose is
    dropped (it did nothing then either), and told as ignored where it differed from its default. One
    ``FutureWarning`` lists what moved."""
    if not isinstance(data, Mapping):
        return data, []
    aggregation, security = data.get("aggregation", {}), data.get("security", {})
    if not isinstance(aggregation, Mapping) or not isinstance(security, Mapping):
        return data, []
    old_aggregation = [k for k in aggregation if k == "kind" or k in POLICY_KEYS or k in SERVER_KEYS]
    old_security = [k for k in security if k == "aggregator" or k in RULE_KEYS or k in DEFENCES]
    if not old_aggregation and not old_security:
        return data, []
    new = {k: v for k, v in aggregation.items() if k not in old_aggregation}
    moved: list[str] = []
    ignored: list[Ignored] = []

    def into(kind: str, default: str, name_key: str | None, source: Mapping[str, Any], keys: dict[str, str],
             where: str) -> None:
        part = _part(new, kind, default)
        if name_key is not None and name_key in source:
            part["name"] = source[name_key]
            moved.append(f"{where}.{name_key} -> aggregation.{kind}.name")
        takes = _takes(kind, part["name"])
        for old, option in keys.items():
            if source.get(old) is None:  # not there, or unset (its part's default)
                continue
            if option in takes:
                part[option] = source[old]
                moved.append(f"{where}.{old} -> aggregation.{kind}.{option}")
            elif source[old] != OLD_DEFAULTS[old]:
                ignored.append(Ignored(f"{where}.{old}", source[old], f"not an option of {kind.replace('_', ' ')} "
                                                                      f"{part['name']}"))
        new[kind] = part

    if old_aggregation:
        into("policy", "sync", "kind", aggregation, POLICY_KEYS, "aggregation")
        into("server_optimizer", "none", None, aggregation, SERVER_KEYS, "aggregation")
    if old_security:
        into("rule", "mean", "aggregator", security, RULE_KEYS, "security")
        for key in DEFENCES:
            if key in security:
                new[key] = security[key]
                moved.append(f"security.{key} -> aggregation.{key}")
    warnings.warn("this config uses the settings' layout from before aggregation held them all; read as today's "
                  f"({'; '.join(moved)})" + (f"; ignored: {', '.join(map(str, ignored))}" if ignored else "")
                  + " (docs/aggregation.md, \"Settings\")", FutureWarning, stacklevel=2)
    out = {**data, "aggregation": new}
    kept = {k: v for k, v in security.items() if k not in old_security}
    return ({**out, "security": kept} if "security" in data else out), ignored


def as_legacy(dump: Mapping[str, Any]) -> dict[str, Any]:
    """A run config's JSON dump (``model_dump(mode="json")``) in the old layout, every old key at its value or its
    old default, as a config of then dumped it; the server optimiser's keys only where one is chosen, and an option
    at its default as unset (None), as a config of then held it."""
    from fcl_emu.aggregation.server_optimizers import OPTIMIZERS

    out = copy.deepcopy(dict(dump))
    aggregation = out.pop("aggregation")
    policy, rule, server = aggregation["policy"], aggregation["rule"], aggregation["server_optimizer"]
    old = {"kind": policy["name"]}
    for key, option in POLICY_KEYS.items():
        old[key] = policy.get(option, OLD_DEFAULTS[key])
    if server["name"] != "none":
        defaults = OPTIMIZERS[server["name"]].Options()
        old["server_optimizer"] = server["name"]
        for key, option in SERVER_KEYS.items():
            value = server.get(option)
            old[key] = None if value is None or value == getattr(defaults, option) else value
    out["aggregation"] = old
    security = out.setdefault("security", {})
    security["aggregator"] = rule["name"]
    for key, option in RULE_KEYS.items():
        security[key] = rule.get(option, OLD_DEFAULTS[key])
    for key in DEFENCES:
        security[key] = aggregation[key]
    return out
