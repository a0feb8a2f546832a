"""``none``: the plain FedAvg step, ``x <- x_after``: the method's aggregate is the new model, bit for bit (the
server's model is not touched)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fcl_emu.aggregation.server_optimizers.base import ServerOptimizer, register
from fcl_emu.aggregation.update import Arrays


@register
class NoServerOptimizer(ServerOptimizer):
    name = "none"

    def apply(self, server: Any, before: Mapping[str, np.ndarray]) -> None:
        """Nothing to do: the aggregate stands."""

    def step(self, before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray],
             parameters: frozenset[str]) -> Arrays:
        return dict(after)
