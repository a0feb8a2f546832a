"""FedBuff (Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022, Algorithm 1):
every ``buffer`` kept updates the server adds their mean, each delta weighted ``s(t) = 1 / sqrt(1 + t)``
(:func:`fedbuff_weight`); the weights are not renormalised, so stale updates take smaller steps. Deviation: the
mean is the run's sample-weighted mean (the paper's is uniform) with a server learning rate of 1."""

from __future__ import annotations

import math

import numpy as np
import pydantic

from fcl_emu.aggregation.policies.base import AsyncOptions, RoundPolicy, register
from fcl_emu.aggregation.update import DELTA, Arrays, ClientUpdate


def fedbuff_weight(staleness: int) -> float:
    """FedBuff's staleness weight ``1 / sqrt(1 + staleness)``."""
    return 1.0 / math.sqrt(1.0 + staleness)


def fedbuff_update(update: ClientUpdate, staleness: int) -> ClientUpdate:
    """The update with its float deltas weighted by :func:`fedbuff_weight` (integer buffers as they are)."""
    w = np.float32(fedbuff_weight(staleness))
    return update.with_tensors({k: v * w if k.startswith(DELTA) and v.dtype.kind == "f" else v
                                for k, v in update.tensors.items()})


class FedBuffOptions(AsyncOptions):
    buffer: int = pydantic.Field(
        10, ge=1, description="the server aggregates every B arrived updates (10, as in the FedBuff paper)")


@register
class FedBuff(RoundPolicy):
    name = "fedbuff"
    Options = FedBuffOptions

    @property
    def needed(self) -> int:
        return self.options.buffer

    def weigh(self, update: ClientUpdate, staleness: int, sent: Arrays | None, current: Arrays
              ) -> tuple[ClientUpdate, float]:
        return fedbuff_update(update, staleness), fedbuff_weight(staleness)
