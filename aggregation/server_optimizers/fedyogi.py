"""FedYogi (Reddi et al., ICLR 2021, Algorithm 2):
``v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)``; the rest of the step and the defaults:
:mod:`.adaptive`."""

from __future__ import annotations

import numpy as np

from fcl_emu.aggregation.server_optimizers.adaptive import AdaptiveOptimizer, DecayOptions
from fcl_emu.aggregation.server_optimizers.base import register


@register
class FedYogi(AdaptiveOptimizer):
    name = "fedyogi"
    Options = DecayOptions

    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        d2 = delta ** 2
        return v - (1 - self.options.beta2) * d2 * np.sign(v - d2)
