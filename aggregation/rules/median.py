"""Coordinate-wise median (Yin et al. 2018, "Byzantine-Robust Distributed Learning: Towards Optimal Statistical
Rates", Definition 1: ``g = med{g^i : i in [m]}``, each coordinate on its own; the mean of the two middle values
for an even count). Withstands any ``f < n / 2``. Every client has one vote whatever its sample count, as in the
paper (a weight would let a liar buy influence with its claimed count)."""

from __future__ import annotations

import numpy as np

from fcl_emu.aggregation.choice import PartOptions
from fcl_emu.aggregation.rules.base import Rule, Weighted, names, register, stacked


def coordinate_median(updates: Weighted) -> dict[str, np.ndarray]:
    return {name: np.median(stacked(updates, name), axis=0).astype(np.float32) for name in names(updates)}


@register
class Median(Rule):
    name = "median"

    def combine(self, updates: Weighted, options: PartOptions) -> dict[str, np.ndarray]:
        return coordinate_median(updates)
