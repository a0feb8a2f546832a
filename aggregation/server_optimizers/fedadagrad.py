"""FedAdagrad (Reddi et al., ICLR 2021, Algorithm 2): ``v_t = v_{t-1} + Delta_t^2`` (no beta2: it does not decay); the rest of
the step and the defaults: :mod:`.adaptive`."""

from __future__ import annotations

import numpy as np

from fcl_emu.aggregation.server_optimizers.adaptive import AdaptiveOptimizer
from fcl_emu.aggregation.server_optimizers.base import register


@register
class FedAdagrad(AdaptiveOptimizer):
    name = "fedadagrad"

    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        return v + delta ** 2
