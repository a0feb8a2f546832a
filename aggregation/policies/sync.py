"""Synchronous rounds (the default): each round samples ``clients_per_round`` clients and aggregates once its
cohort has answered, missed the deadline or dropped out (coordinator/rounds.py). The round runner hands the round's
updates to :meth:`~.base.RoundPolicy.apply`: the method aggregates them, then the run's server optimiser
(:mod:`fcl_emu.aggregation.server_optimizers`, ``--server-optimizer``) steps from the model before the round along
the aggregate's pseudo-gradient."""

from __future__ import annotations

from fcl_emu.aggregation.policies.base import RoundPolicy, register


@register
class Sync(RoundPolicy):
    name = "sync"
    asynchronous = False
