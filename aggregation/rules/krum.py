"""Krum and Multi-Krum (Blanchard et al. 2017, "Machine Learning with Adversaries: Byzantine Tolerant Gradient
Descent", Sections 4 and 5): the update(s) closest to their nearest neighbours. Both need ``n >= 2f + 3``.

Krum gives every client one vote, as the paper does; Multi-Krum averages the updates it keeps by their sample
counts, as Flower's MultiKrum does (the paper averages them equally).
"""

from __future__ import annotations

import numpy as np
import pydantic

from fcl_emu.aggregation.choice import PartOptions
from fcl_emu.aggregation.rules.base import Rule, Weighted, names, register, stacked
from fcl_emu.aggregation.rules.mean import weighted_mean


def _squared_distances(updates: Weighted) -> np.ndarray:
    """``D[i, j] = ||Delta_i - Delta_j||^2`` over all tensors (float64, from Gram matrices)."""
    n = len(updates)
    d = np.zeros((n, n), np.float64)
    for name in names(updates):
        x = stacked(updates, name).reshape(n, -1)
        gram = x @ x.T
        sq = np.diag(gram)
        d += sq[:, None] + sq[None, :] - 2 * gram
    np.maximum(d, 0.0, out=d)
    np.fill_diagonal(d, 0.0)
    return d


def krum_scores(updates: Weighted, f: int) -> np.ndarray:
    """Each update's score (Section 4: ``s(i) = sum_{i -> j} ||V_i - V_j||^2`` over the ``n - f - 2`` updates
    closest to ``V_i``; at least one, as Flower counts them, where ``n - f - 2 < 1``)."""
    d = _squared_distances(updates)
    closest = max(1, len(updates) - f - 2)
    return np.array([np.sort(np.delete(row, i))[:closest].sum() for i, row in enumerate(d)])


def _check(n: int, f: int) -> None:
    if n < 2 * f + 3:
        raise ValueError(f"Krum needs n >= 2f + 3 updates; {n} for f = {f}")


def krum(updates: Weighted, f: int) -> dict[str, np.ndarray]:
    """The update of the lowest :func:`krum_scores` (the first on a tie), as it is."""
    _check(len(updates), f)
    chosen = updates[int(np.argmin(krum_scores(updates, f)))][1]
    return {name: np.asarray(chosen[name], np.float32) for name in names(updates)}


def multikrum(updates: Weighted, f: int, m: int | None = None) -> dict[str, np.ndarray]:
    """The ``m`` updates of the lowest :func:`krum_scores` (default ``n - f``; at most ``n``), averaged by their
    weights."""
    _check(len(updates), f)
    keep = min(len(updates), len(updates) - f if m is None else m)
    order = np.argsort(krum_scores(updates, f), kind="stable")[:keep]
    return weighted_mean([updates[i] for i in sorted(order)])


class ByzantineOptions(PartOptions):
    byzantine: int = pydantic.Field(
        1, ge=0, le=1000, description="the hostile updates f a round must withstand (krum and multikrum need "
                                      "2f + 3 updates, bulyan 4f + 3; fewer: the round is skipped)")


class MultiKrumOptions(ByzantineOptions):
    keep: int | None = pydantic.Field(
        None, ge=1, description="the updates of best Krum score averaged (unset: n - f)")


@register
class Krum(Rule):
    name = "krum"
    Options = ByzantineOptions

    def min_updates(self, options: PartOptions) -> int:
        return 2 * options.byzantine + 3

    def combine(self, updates: Weighted, options: PartOptions) -> dict[str, np.ndarray]:
        return krum(updates, options.byzantine)


@register
class MultiKrum(Krum):
    name = "multikrum"
    Options = MultiKrumOptions

    def combine(self, updates: Weighted, options: PartOptions) -> dict[str, np.ndarray]:
        return multikrum(updates, options.byzantine, options.keep)
