"""FedAdam (Reddi et al., ICLR 2021, Algorithm 2): ``v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2``; the rest of
the step and the defaults: :mod:`.adaptive`."""

from __future__ import annotations

import numpy as np

from fcl_emu.aggregation.server_optimizers.adaptive import AdaptiveOptimizer, DecayOptions
from fcl_emu.aggregation.server_optimizers.base import register


@register
class FedAdam(AdaptiveOptimizer):
    name = "fedadam"
    Options = DecayOptions

    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        b2 = self.options.beta2
        return b2 * v + (1 - b2) * delta ** 2
