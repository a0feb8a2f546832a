"""FedAvgM (Hsu, Qi and Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
Classification", 2019, Section 3): server momentum on the pseudo-gradient,

    v_t = beta v_{t-1} + Delta_t        (v_{-1} = 0)
    x_{t+1} = x_t + eta v_t

Defaults: beta = 0.9 (the momentum the paper reports best, Section 4) and eta = 1 - beta = 0.1, so the effective
learning rate eta / (1 - beta) the paper studies is 1, FedAvg's (our choice: the paper sweeps eta)."""

from __future__ import annotations

import numpy as np
import pydantic

from fcl_emu.aggregation.choice import PartOptions
from fcl_emu.aggregation.server_optimizers.base import ServerOptimizer, register


class MomentumOptions(PartOptions):
    lr: float = pydantic.Field(0.1, gt=0, description="the server learning rate eta")
    momentum: float = pydantic.Field(0.9, ge=0, lt=1, description="the server momentum beta")


@register
class FedAvgM(ServerOptimizer):
    name = "fedavgm"
    Options = MomentumOptions
    slots = ("v",)

    def update(self, name: str, delta: np.ndarray) -> np.ndarray:
        o = self.options
        v = o.momentum * self.state["v"].get(name, np.zeros_like(delta)) + delta
        self.state["v"][name] = v
        return o.lr * v
