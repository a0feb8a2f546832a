"""Settings that another setting changes without an error, each an :class:`Adjustment` that a run tells its user
once at its start (a warning line and a ``config_warning`` event in ``events.jsonl``).

- ``rounds.clients_per_round`` left unset is the default cohort, or every client where there are fewer;
- ``rounds.overcommit``: a round cannot select more clients than there are;
- ``rounds.late_updates: next_round`` drops late updates all the same for a method that uploads more than the
  model delta;
- ``secagg.neighbors`` is capped at n - 1 for a round of n sampled clients;
- ``network.heartbeat_interval_s`` and ``liveness_timeout_s`` are stretched to the heartbeat budget;
- a config file's value of a setting that the config ignores is back at its default (:mod:`fcl_emu.runconfig.ignored`).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from fcl_emu.runconfig.config import RunConfig


@dataclass(frozen=True)
class Adjustment:
    """A setting (its config path) that a run uses at ``value`` instead of what it says, and why, in one line."""

    setting: str
    value: Any
    message: str


def adjustments(config: RunConfig) -> list[Adjustment]:
    """What ``config``'s settings change in each other, in the order of the module docstring."""
    found: list[Adjustment] = []
    clients, rounds = config.scenario.num_clients, config.rounds
    cohort = rounds.clients_per_round
    if config.capped_cohort is not None:
        found.append(Adjustment("rounds.clients_per_round", cohort, (
            f"clients per round is {cohort}, every client: the default {config.capped_cohort} exceeds the "
            f"{clients} clients (--clients-per-round sets it)")))
    selected = rounds.planned_cohort
    if selected > clients:
        found.append(Adjustment("rounds.overcommit", round(clients / cohort, 4), (
            f"overcommit {rounds.overcommit:g} asks for ceil({cohort} x {rounds.overcommit:g}) = {selected} "
            f"clients a round, more than the {clients} clients: every round selects all {clients}")))
    if rounds.late_updates == "next_round" and not _accepts_stale_updates(config.method):
        found.append(Adjustment("rounds.late_updates", "drop", (
            f"late updates are dropped: method {config.method!r} uploads more than the model delta, which "
            f"--late-updates next_round cannot carry into a later round")))
    neighbors = config.secagg.neighbors
    if config.secagg.enabled and neighbors is not None:
        sampled = min(selected, clients)
        k = config.secagg.neighbors_for(sampled)
        if k < neighbors:
            found.append(Adjustment("secagg.neighbors", k, (
                f"secagg neighbours {neighbors} capped at {k}: a round of {sampled} sampled clients gives each "
                f"at most {sampled - 1}")))
    network = config.network
    interval, timeout = network.liveness(clients)
    if interval > network.heartbeat_interval_s:
        found.append(Adjustment("network.heartbeat_interval_s", round(interval, 4), (
            f"heartbeat interval {network.heartbeat_interval_s:g} s stretched to {interval:.3g} s and the "
            f"liveness timeout {network.liveness_timeout_s:g} s to {timeout:.3g} s: {clients} clients exceed "
            f"the budget of {network.heartbeat_budget_per_s:g} heartbeats a second")))
    found += [Adjustment(i.setting, attrgetter(i.setting)(config), f"config file: {i}") for i in config.ignored]
    return found


def _accepts_stale_updates(method: str) -> bool:
    """Whether the method's server part aggregates late deltas in a later round (a property of its class)."""
    from fcl_emu.methods import registry
    from fcl_emu.methods.base import ServerPart

    return ServerPart.accepts_stale_updates.fget(registry.get(method).server)
