"""FedAsync (Xie, Koyejo and Gupta, "Asynchronous Federated Optimization", 2019, eq. "x <- (1 - a_t) x + a_t
x_new"): every kept update is mixed in on arrival, ``a_t = alpha * (1 + t) ** -a`` (:func:`fedasync_mixing`, the
paper's polynomial staleness function), where ``x_new`` is the client's model: the version it was sent plus its
delta."""

from __future__ import annotations

import numpy as np
import pydantic

from fcl_emu.aggregation.policies.base import AsyncOptions, RoundPolicy, register
from fcl_emu.aggregation.update import DELTA, Arrays, ClientUpdate


def fedasync_mixing(alpha: float, exponent: float, staleness: int) -> float:
    """FedAsync's mixing weight ``alpha * (1 + staleness) ** -exponent`` (polynomial staleness function)."""
    return alpha * (1.0 + staleness) ** -exponent


def fedasync_update(update: ClientUpdate, staleness: int, alpha: float, exponent: float, sent: Arrays,
                    current: Arrays) -> ClientUpdate:
    """The update as the delta that takes the current model ``x`` to ``(1 - a) x + a (sent + delta)``."""
    a = fedasync_mixing(alpha, exponent, staleness)
    out = {}
    for key, value in update.tensors.items():
        name = key[len(DELTA):]
        if key.startswith(DELTA) and value.dtype.kind == "f" and name in current:
            mixed = a * (sent[name].astype(np.float64) + value - current[name])
            out[key] = mixed.astype(value.dtype)
        else:
            out[key] = value
    return update.with_tensors(out)


class FedAsyncOptions(AsyncOptions):
    alpha: float = pydantic.Field(
        0.6, gt=0, le=1, description="the mixing weight alpha of x <- (1 - a_t) x + a_t x_new")
    staleness_exponent: float = pydantic.Field(
        0.5, ge=0, description="a of the polynomial staleness function s(t) = (1 + t)^-a, a_t = alpha * s(t)")


@register
class FedAsync(RoundPolicy):
    name = "fedasync"
    Options = FedAsyncOptions
    keeps_sent_models = True
    takes_server_step = False  # each update is mixed in by its own weight: no aggregate to step along

    def weigh(self, update: ClientUpdate, staleness: int, sent: Arrays | None, current: Arrays
              ) -> tuple[ClientUpdate, float]:
        o = self.options
        return (fedasync_update(update, staleness, o.alpha, o.staleness_exponent, sent, current),
                fedasync_mixing(o.alpha, o.staleness_exponent, staleness))
