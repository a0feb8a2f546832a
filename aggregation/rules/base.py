"""What every aggregation rule is: a pure function of weighted deltas, registered by name (:func:`register`).

A rule takes ``updates``, a list of ``(weight, delta)`` pairs (weight: the client's sample count; delta:
``{name: float array}``, the same names and shapes in every pair) and its options as the run sets them (its
``Options``, a :class:`~fcl_emu.aggregation.choice.PartOptions`: the run config's ``aggregation.rule``), and
returns one delta of the same names and shapes in float32.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np

from fcl_emu.aggregation.choice import PartOptions
from fcl_emu.aggregation.registry import registrar

Delta = Mapping[str, np.ndarray]
Weighted = Sequence[tuple[float, Delta]]


class Rule:
    """One aggregation rule. Subclasses set ``name``, implement :meth:`combine` and, where the rule needs more than
    one update, :meth:`min_updates`; a rule with options declares them as its ``Options``."""

    name: ClassVar[str]
    Options: ClassVar[type[PartOptions]] = PartOptions

    def min_updates(self, options: PartOptions) -> int:
        """The fewest updates the rule can combine (fewer: the round is skipped)."""
        return 1

    def combine(self, updates: Weighted, options: PartOptions) -> dict[str, np.ndarray]:
        raise NotImplementedError


RULES: dict[str, Rule] = {}
register = registrar(RULES, "aggregation rule", "--aggregator", entry=lambda rule: rule())


def names(updates: Weighted) -> list[str]:
    if not updates:
        raise ValueError("no update to aggregate")
    return list(updates[0][1])


def stacked(updates: Weighted, name: str) -> np.ndarray:
    """The ``name`` tensors of every update as one float64 array of shape ``(n, *shape)``."""
    return np.stack([np.asarray(d[name], np.float64) for _, d in updates])
