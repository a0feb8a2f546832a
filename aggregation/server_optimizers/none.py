"""``none``: the plain FedAvg step, ``x <- x_after`` (the method's aggregate is the new model, bit for bit)."""

from __future__ import annotations

import numpy as np

from fcl_emu.aggregation.server_optimizers.base import ServerOptimizer, register


@register
class NoServerOptimizer(ServerOptimizer):
    name = "none"

    def update(self, name: str, delta: np.ndarray) -> np.ndarray:
        return delta
