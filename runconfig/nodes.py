"""How many edge nodes ``fcl-emu up`` starts when ``nodes`` is left unset: enough for the population."""

from __future__ import annotations

import math
from typing import Annotated, Any

import pydantic

CLIENTS_PER_NODE = 50_000
"""The largest population one edge-node process is measured to join and serve (docs/results/scaling.md); an unset
``nodes`` starts one node per this many clients."""

MIN_NODES = 2
"""The fewest edge nodes an unset ``nodes`` starts (where the population has that many clients)."""


def auto_nodes(num_clients: int) -> int:
    """The edge nodes for ``num_clients`` clients: one per :data:`CLIENTS_PER_NODE`, at least :data:`MIN_NODES`,
    never more than the clients."""
    return min(num_clients, max(MIN_NODES, math.ceil(num_clients / CLIENTS_PER_NODE)))


NODES_HELP = (f"edge nodes `up` starts (unset: {MIN_NODES}, or one per {CLIENTS_PER_NODE:,} clients beyond "
              f"{MIN_NODES * CLIENTS_PER_NODE:,}; never more than the clients)")
"""The description of ``RunConfig.nodes`` (the help of ``--nodes``)."""


def _resolved(value: int | None, info: pydantic.ValidationInfo) -> int | None:
    scenario = info.data.get("scenario")
    if scenario is None:  # it failed, and its error says why
        return value
    if value is None:  # and one per edge aggregator at least (topology is validated before nodes)
        aggregators = getattr(info.data.get("topology"), "edge_aggregators", 0)
        return max(auto_nodes(scenario.num_clients), min(scenario.num_clients, aggregators))
    if value > scenario.num_clients:
        raise ValueError(f"{value} exceeds the number of clients ({scenario.num_clients})")
    return value


Nodes = Annotated[int | None, pydantic.AfterValidator(_resolved)]
"""``RunConfig.nodes``: None (unset) becomes :func:`auto_nodes` of the scenario validated before it; a given count
is at most the clients."""


def unset_null_nodes(data: Any) -> Any:
    """Raw config data with ``nodes: null`` (YAML) taken as unset."""
    if isinstance(data, dict) and "nodes" in data and data["nodes"] is None:
        return {key: value for key, value in data.items() if key != "nodes"}
    return data


def nodes_chosen(config: pydantic.BaseModel) -> bool:
    """Whether ``config`` (a ``RunConfig``) left ``nodes`` unset, so that :func:`auto_nodes` chose it."""
    return "nodes" not in config.model_fields_set
