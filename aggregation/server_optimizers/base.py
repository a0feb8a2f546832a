"""What a server optimiser is (:class:`ServerOptimizer`), and the registry of optimisers by name (:func:`register`).

A server optimiser (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2) takes a synchronous
round's pseudo-gradient ``Delta = x_after - x_before`` (``x_after``: the global model once the method aggregated the
round, ``x_before``: the global model the round's clients were sent) and returns ``x_before + step(Delta)``. It acts
on the aggregate only, so it works unchanged under SecAgg+ (the coordinator sees only the sum) and with edge
aggregators. It steps the model's float *parameters* (the names :meth:`step` is given); BatchNorm statistics,
integer buffers and a method's other server state (generators, VAEs, prototypes) keep what the aggregate made them.

Its state (moments) is kept per parameter; a parameter whose shape changed (the classifier head grown at a new task)
restarts its state. :meth:`state_arrays` / :meth:`load_state_arrays` carry the state through a checkpoint."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from fcl_emu.aggregation.choice import PartOptions
from fcl_emu.aggregation.registry import registrar
from fcl_emu.aggregation.update import Arrays


class ServerOptimizer:
    """``x <- x_before + step(Delta)`` per float parameter; subclasses give :meth:`direction` and their state."""

    name: ClassVar[str]
    Options: ClassVar[type[PartOptions]] = PartOptions
    slots: ClassVar[tuple[str, ...]] = ()  # the per-parameter state arrays (m, v), checkpointed

    def __init__(self, options: PartOptions):
        self.options = options
        self.state: dict[str, dict[str, np.ndarray]] = {slot: {} for slot in self.slots}

    def apply(self, server: Any, before: Mapping[str, np.ndarray]) -> None:
        """Step ``server``'s global model (a :class:`~fcl_emu.methods.base.ServerPart` that has aggregated a round)
        from ``before``, the model the round's clients were sent."""
        server.set_global_state(self.step(before, server.global_state, server.parameter_names()))

    def step(self, before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray],
             parameters: frozenset[str]) -> Arrays:
        """The new global model: ``after`` with each float parameter of ``parameters`` replaced by
        ``before + step(after - before)`` (computed in float64, stored in the parameter's dtype)."""
        out = dict(after)
        for name in sorted(parameters):
            old, new = before.get(name), after.get(name)
            if old is None or new is None or new.dtype.kind != "f" or old.shape != new.shape:
                continue
            delta = new.astype(np.float64) - old.astype(np.float64)
            for slot in self.slots:
                if self.state[slot].get(name, delta).shape != delta.shape:
                    self.state[slot].pop(name)  # the head grew: this parameter starts afresh
            out[name] = (old.astype(np.float64) + self.update(name, delta)).astype(new.dtype)
        return out

    def update(self, name: str, delta: np.ndarray) -> np.ndarray:
        """The step for one parameter given its pseudo-gradient (updating this parameter's state)."""
        raise NotImplementedError

    def state_arrays(self) -> Arrays:
        """The state as flat arrays ``<slot>/<parameter>``."""
        return {f"{slot}/{name}": value for slot in self.slots for name, value in self.state[slot].items()}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Restore :meth:`state_arrays`; a name of another slot is refused."""
        self.state = {slot: {} for slot in self.slots}
        for key, value in arrays.items():
            slot, _, name = key.partition("/")
            if slot not in self.state:
                raise ValueError(f"checkpoint: server optimiser {self.name} has no state {slot!r}")
            self.state[slot][name] = np.array(value, dtype=np.float64)


OPTIMIZERS: dict[str, type[ServerOptimizer]] = {}
register = registrar(OPTIMIZERS, "server optimiser", "--server-optimizer")
