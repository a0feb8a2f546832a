"""Aggregation rules over a round's float model deltas: the weighted mean (FedAvg) and robust rules that bound
what a minority of poisoned updates can do (docs/security.md, "Aggregation defences").

Every rule is a pure function of ``updates``, a list of ``(weight, delta)`` pairs (weight: the client's sample
count; delta: ``{name: float array}``, the same names and shapes in every pair), and returns one delta of the
same names and shapes in float32. With ``n`` updates and ``f`` the number of Byzantine (arbitrarily wrong)
updates a rule must withstand:

- :func:`weighted_mean`: FedAvg, ``sum_k (n_k / n) Delta_k`` (McMahan et al. 2017); one update can move it
  anywhere;
- :func:`coordinate_median`, :func:`trimmed_mean`: Yin et al. 2018, each coordinate on its own;
- :func:`krum`, :func:`multikrum`: Blanchard et al. 2017, the update(s) closest to their nearest neighbours;
- :func:`bulyan`: El Mhamdi et al. 2018, Krum's selection then a trimmed mean around the median.

The median, trimmed mean, Krum and Bulyan give every client one vote whatever its sample count, as the papers
do (a weight would let a liar buy influence with its claimed count); MultiKrum averages the updates it keeps
by their weights, as Flower's MultiKrum does (the paper averages them equally).

:class:`Aggregator` is one rule with its parameters, as the run configuration chooses it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

Delta = Mapping[str, np.ndarray]
Weighted = Sequence[tuple[float, Delta]]
Rule = Literal["mean", "median", "trimmed_mean", "krum", "multikrum", "bulyan"]
RULES: tuple[str, ...] = get_args(Rule)


def _names(updates: Weighted) -> list[str]:
    if not updates:
        raise ValueError("no update to aggregate")
    return list(updates[0][1])


def _stacked(updates: Weighted, name: str) -> np.ndarray:
    """The ``name`` tensors of every update as one float64 array of shape ``(n, *shape)``."""
    return np.stack([np.asarray(d[name], np.float64) for _, d in updates])


def weighted_mean(updates: Weighted) -> dict[str, np.ndarray]:
    """FedAvg's sample-weighted mean (McMahan et al. 2017, Algorithm 1: ``w <- sum_k (n_k / n) w_k``), summed in
    float64 in the updates' order."""
    total = float(sum(w for w, _ in updates))
    out = {}
    for name in _names(updates):
        acc = np.zeros(np.shape(updates[0][1][name]), np.float64)
        for w, d in updates:
            acc += d[name] * (w / total)
        out[name] = acc.astype(np.float32)
    return out


def coordinate_median(updates: Weighted) -> dict[str, np.ndarray]:
    """Coordinate-wise median (Yin et al. 2018, "Byzantine-Robust Distributed Learning: Towards Optimal
    Statistical Rates", Definition 1: ``g = med{g^i : i in [m]}``, each coordinate on its own; the mean of the two
    middle values for an even count). Withstands any ``f < n / 2``."""
    return {name: np.median(_stacked(updates, name), axis=0).astype(np.float32) for name in _names(updates)}


def trimmed_mean(updates: Weighted, trim: float) -> dict[str, np.ndarray]:
    """Coordinate-wise trimmed mean (Yin et al. 2018, Definition 2: ``g = 1/((1 - 2 beta) m) sum_{x in U} x``,
    ``U`` a coordinate's values without its ``beta`` fraction of largest and of smallest). ``k = floor(trim x n)``
    values are cut at each end; withstands ``f <= k``."""
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim fraction {trim} outside [0, 0.5)")
    k = int(trim * len(updates))
    out = {}
    for name in _names(updates):
        values = np.sort(_stacked(updates, name), axis=0)
        out[name] = values[k:len(updates) - k].mean(axis=0).astype(np.float32)
    return out


def _squared_distances(updates: Weighted) -> np.ndarray:
    """``D[i, j] = ||Delta_i - Delta_j||^2`` over all tensors (float64, from Gram matrices)."""
    n = len(updates)
    d = np.zeros((n, n), np.float64)
    for name in _names(updates):
        x = _stacked(updates, name).reshape(n, -1)
        gram = x @ x.T
        sq = np.diag(gram)
        d += sq[:, None] + sq[None, :] - 2 * gram
    np.maximum(d, 0.0, out=d)
    np.fill_diagonal(d, 0.0)
    return d


def krum_scores(updates: Weighted, f: int) -> np.ndarray:
    """Krum's score of each update (Blanchard et al. 2017, "Machine Learning with Adversaries: Byzantine
    Tolerant Gradient Descent", Section 4: ``s(i) = sum_{i -> j} ||V_i - V_j||^2``, over the ``n - f - 2``
    updates closest to ``V_i``; at least one, as Flower counts them, where ``n - f - 2 < 1``)."""
    d = _squared_distances(updates)
    closest = max(1, len(updates) - f - 2)
    return np.array([np.sort(np.delete(row, i))[:closest].sum() for i, row in enumerate(d)])


def _check_krum(n: int, f: int) -> None:
    if n < 2 * f + 3:
        raise ValueError(f"Krum needs n >= 2f + 3 updates; {n} for f = {f}")


def krum(updates: Weighted, f: int) -> dict[str, np.ndarray]:
    """Krum (Blanchard et al. 2017, Section 4): the update of the lowest :func:`krum_scores` (the first on a
    tie), as it is. Needs ``n >= 2f + 3``."""
    _check_krum(len(updates), f)
    chosen = updates[int(np.argmin(krum_scores(updates, f)))][1]
    return {name: np.asarray(chosen[name], np.float32) for name in _names(updates)}


def multikrum(updates: Weighted, f: int, m: int | None = None) -> dict[str, np.ndarray]:
    """Multi-Krum (Blanchard et al. 2017, Section 5): the ``m`` updates of the lowest :func:`krum_scores`
    (default ``n - f``; at most ``n``), averaged by their weights. Needs ``n >= 2f + 3``."""
    _check_krum(len(updates), f)
    keep = min(len(updates), len(updates) - f if m is None else m)
    order = np.argsort(krum_scores(updates, f), kind="stable")[:keep]
    return weighted_mean([updates[i] for i in sorted(order)])


def bulyan(updates: Weighted, f: int) -> dict[str, np.ndarray]:
    """Bulyan (El Mhamdi et al. 2018, "The Hidden Vulnerability of Distributed Learning in Byzantium",
    Algorithm 1): select ``theta = n - 2f`` updates by Krum applied again and again to those not yet selected;
    then each coordinate is the mean of the ``beta = theta - 2f`` selected values closest to their median.
    Needs ``n >= 4f + 3``."""
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
    for name in _names(updates):
        values = _stacked(chosen, name)
        spread = np.abs(values - np.median(values, axis=0))
        closest = np.argsort(spread, axis=0, kind="stable")[:beta]
        out[name] = np.take_along_axis(values, closest, axis=0).mean(axis=0).astype(np.float32)
    return out


@dataclass(frozen=True)
class Aggregator:
    """One rule of :data:`RULES` with its parameters: ``trim`` (trimmed_mean), ``f`` (krum, multikrum, bulyan),
    ``m`` (multikrum; None: ``n - f``)."""

    rule: Rule = "mean"
    trim: float = 0.1
    f: int = 1
    m: int | None = None

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown aggregator {self.rule!r}; choose one of {', '.join(RULES)}")

    @property
    def min_updates(self) -> int:
        """The fewest updates the rule can aggregate (fewer: the round is skipped)."""
        return {"krum": 2 * self.f + 3, "multikrum": 2 * self.f + 3, "bulyan": 4 * self.f + 3}.get(self.rule, 1)

    def __call__(self, updates: Weighted) -> dict[str, np.ndarray]:
        rules: dict[str, Callable[[], dict[str, np.ndarray]]] = {
            "mean": lambda: weighted_mean(updates),
            "median": lambda: coordinate_median(updates),
            "trimmed_mean": lambda: trimmed_mean(updates, self.trim),
            "krum": lambda: krum(updates, self.f),
            "multikrum": lambda: multikrum(updates, self.f, self.m),
            "bulyan": lambda: bulyan(updates, self.f),
        }
        return rules[self.rule]()


MEAN = Aggregator()
