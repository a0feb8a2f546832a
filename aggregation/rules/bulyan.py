"""Bulyan (El Mhamdi et al. 2018, "The Hidden Vulnerability of Distributed Learning in Byzantium", Algorithm 1):
select ``theta = n - 2f`` updates by Krum applied again and again to those not yet selected; then each coordinate
is the mean of the ``beta = theta - 2f`` selected values closest to their median. Needs ``n >= 4f + 3``; one vote
per client, as in the paper."""

from __future__ import annotations

import numpy as np

from fcl_emu.aggregation.choice import PartOptions
from fcl_emu.aggregation.rules.base import Rule, Weighted, names, register, stacked
from fcl_emu.aggregation.rules.krum import ByzantineOptions, krum_scores


def bulyan(updates: Weighted, f: int) -> dict[str, np.ndarray]:
    n = len(updates)
    if n < 4 * f + 3:
        raise ValueError(f"Bulyan needs n >= 4f + 3 updates; {n} for f = {f}")
    remaining, selected = list(range(n)), []
    while len(selected) < n - 2 * f:
        scores = krum_scores([updates[i] for i in remaining], f)
        selected.append(remaining.pop(int(np.argmin(scores))))
    chosen = [updates[i] for i in sorted(selected)]
    beta = len(chosen) - 2 * f
    out = {}
    for name in names(updates):
        values = stacked(chosen, name)
        spread = np.abs(values - np.median(values, axis=0))
        closest = np.argsort(spread, axis=0, kind="stable")[:beta]
        out[name] = np.take_along_axis(values, closest, axis=0).mean(axis=0).astype(np.float32)
    return out


@register
class Bulyan(Rule):
    name = "bulyan"
    Options = ByzantineOptions

    def min_updates(self, options: PartOptions) -> int:
        return 4 * options.byzantine + 3

    def combine(self, updates: Weighted, options: PartOptions) -> dict[str, np.ndarray]:
        return bulyan(updates, options.byzantine)
