"""The options and the common step of Reddi et al.'s adaptive server optimisers ("Adaptive Federated
Optimization", ICLR 2021, Algorithm 2), each in its own module (fedadam, fedyogi, fedadagrad) with its ``v``:

    m_t = beta1 m_{t-1} + (1 - beta1) Delta_t                  (m_{-1} = 0)
    v_t = the optimiser's second moment of Delta_t             (v_{-1} = tau^2)
    x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)

as Algorithm 2 writes it: no bias correction. Defaults: beta1 = 0.9, beta2 = 0.99 (the paper's fixed values,
Section 5 "Optimizers and hyperparameters"), tau = 1e-3 (Section 5, sensitivity to tau: 1e-3 and above do well),
eta = 0.01 (within the best server learning rates of the paper's grid, Appendix D; with m's (1 - beta1) a first
step moves each coordinate by about eta sign(Delta)). Tune eta for a scenario: it is the one that matters most."""

from __future__ import annotations

import numpy as np
import pydantic

from fcl_emu.aggregation.choice import PartOptions
from fcl_emu.aggregation.server_optimizers.base import ServerOptimizer


class AdaptiveOptions(PartOptions):
    lr: float = pydantic.Field(0.01, gt=0, description="the server learning rate eta")
    beta1: float = pydantic.Field(0.9, ge=0, lt=1, description="the first moment's decay beta1")
    tau: float = pydantic.Field(1e-3, gt=0, description="the adaptivity tau (v starts at tau^2)")


class DecayOptions(AdaptiveOptions):
    """FedAdam's and FedYogi's: FedAdagrad's second moment does not decay."""

    beta2: float = pydantic.Field(0.99, ge=0, lt=1, description="the second moment's decay beta2")


class AdaptiveOptimizer(ServerOptimizer):
    """Algorithm 2's step; a subclass gives :meth:`second_moment`."""

    Options = AdaptiveOptions
    slots = ("m", "v")

    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def update(self, name: str, delta: np.ndarray) -> np.ndarray:
        o = self.options
        m = o.beta1 * self.state["m"].get(name, np.zeros_like(delta)) + (1 - o.beta1) * delta
        v = self.second_moment(self.state["v"].get(name, np.full_like(delta, o.tau ** 2)), delta)
        self.state["m"][name], self.state["v"][name] = m, v
        return o.lr * m / (np.sqrt(v) + o.tau)
