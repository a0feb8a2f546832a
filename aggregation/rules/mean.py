"""FedAvg's sample-weighted mean (McMahan et al. 2017, Algorithm 1: ``w <- sum_k (n_k / n) w_k``): the default
rule. One update can move it anywhere."""

from __future__ import annotations

import numpy as np

from fcl_emu.aggregation.rules.base import Rule, RuleParams, Weighted, names, register


def weighted_mean(updates: Weighted) -> dict[str, np.ndarray]:
    """``sum_k (n_k / n) Delta_k``, summed in float64 in the updates' order."""
    total = float(sum(w for w, _ in updates))
    out = {}
    for name in names(updates):
        acc = np.zeros(np.shape(updates[0][1][name]), np.float64)
        for w, d in updates:
            acc += d[name] * (w / total)
        out[name] = acc.astype(np.float32)
    return out


@register
class Mean(Rule):
    name = "mean"

    def combine(self, updates: Weighted, params: RuleParams) -> dict[str, np.ndarray]:
        return weighted_mean(updates)
