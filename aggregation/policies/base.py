"""What a round policy is (:class:`RoundPolicy`), its options (:class:`AsyncOptions` for the asynchronous ones), and
the registry of policies by name (:func:`register`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import pydantic

from fcl_emu.aggregation.choice import PartOptions
from fcl_emu.aggregation.registry import registrar
from fcl_emu.aggregation.update import Arrays, ClientUpdate


class AsyncOptions(PartOptions):
    """What every asynchronous policy takes."""

    max_staleness: int = pydantic.Field(
        4, ge=0, description="updates staler than S server versions are discarded (4: the bound of FedAsync's "
                             "experiments)")
    concurrency: int | None = pydantic.Field(
        None, ge=1, description="clients kept training at once (unset: clients_per_round)")

    def resolved_concurrency(self, clients_per_round: int) -> int:
        return self.concurrency if self.concurrency is not None else clients_per_round


class RoundPolicy:
    """When the server aggregates, and what an update weighs for its staleness.

    A synchronous policy aggregates each round's cohort once it has answered. An asynchronous one keeps
    ``concurrency`` clients training, takes their updates as they arrive on the emulated clock and aggregates every
    :attr:`needed` of them, each through :meth:`weigh`; staleness is counted in server model versions (how many
    aggregations happened between the version a client was sent and the one its update is applied to).

    Each aggregation goes through :meth:`apply`: the method's aggregate, then the run's server optimiser's step
    along what it moved the model (:mod:`fcl_emu.aggregation.server_optimizers`); a policy whose aggregations are
    no pseudo-gradient to step along says so (:attr:`takes_server_step`, refused at configuration time)."""

    name: ClassVar[str]
    Options: ClassVar[type[PartOptions]] = PartOptions  # its options (none: it takes none)
    asynchronous: ClassVar[bool] = True
    keeps_sent_models: ClassVar[bool] = False  # weigh() needs the model each client was sent
    takes_server_step: ClassVar[bool] = True

    def __init__(self, options: Any, optimizer: Any):
        """``options``: its Options, as the run config's ``aggregation.policy`` sets them; ``optimizer``: the run's
        :class:`~fcl_emu.aggregation.server_optimizers.base.ServerOptimizer` (``none``: the aggregate as it is)."""
        self.options, self.optimizer = options, optimizer

    @classmethod
    def of(cls, settings: Any) -> RoundPolicy:
        """The policy a run's :class:`~fcl_emu.aggregation.settings.AggregationSettings` choose."""
        return cls(settings.policy, settings.server_step())

    def apply(self, server: Any, task: int, number: int, updates: list[ClientUpdate]) -> None:
        """Aggregate ``updates`` (a round's, or an asynchronous buffer's, each as :meth:`weigh` made it) into
        ``server`` (a :class:`~fcl_emu.methods.base.ServerPart`): its ``aggregate``, then the server optimiser's
        step on the global model's float parameters from the model before."""
        before = server.global_state
        server.aggregate(task, number, updates)
        self.optimizer.apply(server, before)

    @property
    def needed(self) -> int:
        """Updates per aggregation."""
        return 1

    def weigh(self, update: ClientUpdate, staleness: int, sent: Arrays | None, current: Arrays
              ) -> tuple[ClientUpdate, float]:
        """The update as the method's aggregate should take it, and its weight (for the round's event); ``sent``:
        the model the client trained from (where :attr:`keeps_sent_models`), ``current``: the global model now."""
        raise NotImplementedError(f"{self.name} aggregates rounds, not single updates")

    def state_arrays(self) -> Arrays:
        """The state to checkpoint: the server optimiser's moments (none: none)."""
        return self.optimizer.state_arrays()

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Restore :meth:`state_arrays` (arrays of another state are refused)."""
        self.optimizer.load_state_arrays(arrays)


POLICIES: dict[str, type[RoundPolicy]] = {}
register = registrar(POLICIES, "round policy", "--aggregation")
