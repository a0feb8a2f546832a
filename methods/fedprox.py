"""FedProx.

Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020,
eq. (2): each client minimises h_k(w; w^t) = F_k(w) + mu/2 ||w - w^t||^2, where
w^t is the global model it received. The server aggregates as FedAvg. ``mu``
defaults to 0.01, one of the values the paper sweeps ({0.001, 0.01, 0.1, 1})
and the one most FCIL comparisons use. The paper's inexact-solver and
partial-work variations are not emulated here (stragglers belong to the
churn layer).
"""

from __future__ import annotations

import pydantic
import torch
import torch.nn.functional as F

from fcl_emu.methods.base import ClientContext, ClientPart, Options, ServerPart
from fcl_emu.methods.registry import MethodSpec, register


class FedProxOptions(Options):
    mu: float = pydantic.Field(0.01, ge=0.0, description="weight of the proximal term")


def proximal_term(model: torch.nn.Module, anchor: dict[str, torch.Tensor], mu: float) -> torch.Tensor:
    """mu/2 * sum over trainable parameters of ||w - w_global||^2."""
    total = torch.zeros(())
    for name, p in model.named_parameters():
        total = total + (p - anchor[name]).pow(2).sum()
    return 0.5 * mu * total


class FedProxClient(ClientPart):
    options: FedProxOptions

    def begin_job(self, ctx: ClientContext, model) -> None:
        ctx.job["anchor"] = {n: p.detach().clone() for n, p in model.named_parameters()}

    def loss(self, ctx, model, x, y, logits):
        return F.cross_entropy(logits, y) + proximal_term(model, ctx.job["anchor"], self.options.mu)


SPEC = register(MethodSpec(
    name="fedprox",
    description="FedProx: local proximal term mu/2 ||w - w_global||^2 against client drift",
    options=FedProxOptions,
    server=ServerPart,
    client=FedProxClient,
))
