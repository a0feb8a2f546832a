"""Coordinate-wise trimmed mean (Yin et al. 2018, Definition 2: ``g = 1/((1 - 2 beta) m) sum_{x in U} x``, ``U`` a
coordinate's values without its ``beta`` fraction of largest and of smallest). ``k = floor(trim x n)`` values are
cut at each end; withstands ``f <= k``. One vote per client, as in the paper."""

from __future__ import annotations

import numpy as np
import pydantic

from fcl_emu.aggregation.choice import PartOptions
from fcl_emu.aggregation.rules.base import Rule, Weighted, names, register, stacked


def trimmed_mean(updates: Weighted, trim: float) -> dict[str, np.ndarray]:
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim fraction {trim} outside [0, 0.5)")
    k = int(trim * len(updates))
    out = {}
    for name in names(updates):
        values = np.sort(stacked(updates, name), axis=0)
        out[name] = values[k:len(updates) - k].mean(axis=0).astype(np.float32)
    return out


class TrimOptions(PartOptions):
    trim_fraction: float = pydantic.Field(
        0.1, ge=0, lt=0.5, description="the fraction of values cut at each end of every coordinate")


@register
class TrimmedMean(Rule):
    name = "trimmed_mean"
    Options = TrimOptions

    def combine(self, updates: Weighted, options: PartOptions) -> dict[str, np.ndarray]:
        return trimmed_mean(updates, options.trim_fraction)
