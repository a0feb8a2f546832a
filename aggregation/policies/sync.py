"""Synchronous rounds (the default): each round samples ``clients_per_round`` clients and aggregates once its
cohort has answered, missed the deadline or dropped out (coordinator/rounds.py). The round runner hands the round's
updates to :meth:`Sync.apply`: the method aggregates them, then the run's server optimiser
(:mod:`fcl_emu.aggregation.server_optimizers`, ``--server-optimizer``) steps from the model before the round along
the aggregate's pseudo-gradient."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fcl_emu.aggregation.policies.base import RoundPolicy, register
from fcl_emu.aggregation.update import Arrays, ClientUpdate


@register
class Sync(RoundPolicy):
    name = "sync"
    asynchronous = False

    def __init__(self, options: Any, optimizer: Any):  # a ServerOptimizer (aggregation.server_optimizers)
        super().__init__(options)
        self.optimizer = optimizer

    @classmethod
    def of(cls, settings: Any) -> Sync:
        return cls(settings.policy, settings.server_step())

    def apply(self, server: Any, task: int, round: int, updates: list[ClientUpdate]) -> None:
        """Aggregate a round into ``server`` (a :class:`~fcl_emu.methods.base.ServerPart`): its ``aggregate``, then
        the server optimiser's step on the global model's float parameters (none: the aggregate as it is)."""
        before = server.global_state
        server.aggregate(task, round, updates)
        self.optimizer.apply(server, before)

    def state_arrays(self) -> Arrays:
        return self.optimizer.state_arrays()

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.optimizer.load_state_arrays(arrays)
