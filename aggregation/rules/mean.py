"""FedAvg's sample-weighted mean (McMahan et al. 2017, Algorithm 1: ``w <- sum_k (n_k / n) w_k``): the default
rule. One update can move it anywhere."""

from __future__ import annotations

import numpy as np

from fcl_emu.aggregation.choice import PartOptions
from fcl_emu.aggregation.rules.base import Rule, Weighted, names, register

PARTIAL_TERMS = 32  # terms summed in float32 before their sum joins the float64 total


def weighted_mean(updates: Weighted) -> dict[str, np.ndarray]:
    """``sum_k (n_k / n) Delta_k`` in the updates' order. Each term is rounded to float32 (as its delta is), runs
    of :data:`PARTIAL_TERMS` terms are summed in float32 and those sums in float64: the float32 sums add an error of
    the order of the terms' own rounding, and the mean of 1,000 updates of 285,000 values takes 0.16 s instead of
    0.35 s with every term added to a float64 total (the cast of each term to float64 was the cost; 2026-11-28,
    the project's 2-core machine)."""
    total = float(sum(w for w, _ in updates))
    out = {}
    for name in names(updates):
        shape = np.shape(updates[0][1][name])
        acc = np.zeros(shape, np.float64)
        partial, term = np.zeros(shape, np.float32), np.empty(shape, np.float32)
        for k, (w, d) in enumerate(updates, 1):
            np.multiply(d[name], np.float32(w / total), out=term, casting="same_kind")
            partial += term
            if k % PARTIAL_TERMS == 0 or k == len(updates):
                acc += partial
                partial.fill(0.0)
        out[name] = acc.astype(np.float32)
    return out


@register
class Mean(Rule):
    name = "mean"

    def combine(self, updates: Weighted, options: PartOptions) -> dict[str, np.ndarray]:
        return weighted_mean(updates)
