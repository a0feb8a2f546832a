"""The defaults a run's settings are told apart from (:mod:`fcl_emu.monitoring.settings_diff`)."""

from __future__ import annotations

from typing import Any, Mapping

import pydantic

from fcl_emu.aggregation.choice import members
from fcl_emu.aggregation.settings import AggregationSettings
from fcl_emu.runconfig.config import RunConfig

# aggregation's parts, each chosen with its options (policy, rule, server_optimizer)
CHOSEN = tuple(name for name, field in AggregationSettings.model_fields.items() if members(field.annotation))


def defaults_for(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config.yaml with every setting at the default a run like ``config`` (a run's config.yaml) has: RunConfig's
    defaults, with the training values of its method (a method may bring its own, ``fcl-emu methods``) and the
    data set's (``runconfig.dataset_defaults``), the clients per round capped at a smaller population and the edge
    nodes an unset ``nodes`` chooses for it (``runconfig.nodes``), and the options of each part of aggregation it
    chose (its policy, rule, server optimiser) at that part's defaults. An unknown method, data set or population:
    RunConfig's defaults."""
    defaults = RunConfig().model_dump(mode="json")
    scenario = config.get("scenario")
    like = {"method": config.get("method", defaults["method"])}
    if isinstance(scenario, Mapping):
        like["scenario"] = {key: scenario[key] for key in ("num_clients", "dataset") if key in scenario}
    try:
        run = RunConfig.model_validate(like)
    except pydantic.ValidationError:
        return defaults
    defaults["training"] = run.training.model_dump(mode="json")
    defaults["rounds"]["clients_per_round"] = run.rounds.clients_per_round
    defaults["nodes"] = run.nodes
    aggregation = config.get("aggregation")
    for part, chosen in (aggregation.items() if isinstance(aggregation, Mapping) else ()):
        if part in CHOSEN and isinstance(chosen, Mapping):
            try:
                options = AggregationSettings.model_validate({part: chosen.get("name")}).model_dump(mode="json")[part]
            except pydantic.ValidationError:
                continue  # an unknown part: its name is told apart from the default's
            defaults["aggregation"][part] = {**options, "name": defaults["aggregation"][part]["name"]}
    return defaults
