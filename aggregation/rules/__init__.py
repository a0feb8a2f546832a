"""Aggregation rules over a round's float model deltas: the weighted mean (FedAvg) and robust rules that bound
what a minority of poisoned updates can do (docs/security.md, "Aggregation defences"). One module per rule
(family), each registered by name with :func:`~.base.register`; a new rule is a module here and its name in
:data:`BUILTIN`.

:class:`Aggregator` is one rule with its options, as the run configuration chooses it (``aggregation.rule``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from fcl_emu.aggregation.choice import PartOptions, choice
from fcl_emu.aggregation.rules.base import RULES, Weighted

BUILTIN = ("mean", "median", "trimmed_mean", "krum", "bulyan")  # modules of this package that register rules
for _module in BUILTIN:
    importlib.import_module(f"{__name__}.{_module}")

RULE_NAMES: tuple[str, ...] = tuple(RULES)
RuleChoice, DEFAULT_RULE = choice(RULES, "aggregation rule", "mean")  # the run config's rule


@dataclass(frozen=True)
class Aggregator:
    """One registered rule with its options (a :data:`RuleChoice` value, or the rule's ``Options``)."""

    options: PartOptions = DEFAULT_RULE

    @classmethod
    def named(cls, rule: str, **options: Any) -> Aggregator:
        """Rule ``rule`` with ``options`` (the rest at its defaults)."""
        if rule not in RULES:
            raise ValueError(f"unknown aggregator {rule!r}; choose one of {', '.join(RULE_NAMES)}")
        return cls(RULES[rule].Options(name=rule, **options))

    @property
    def rule(self) -> str:
        return self.options.name

    @property
    def min_updates(self) -> int:
        """The fewest updates the rule can aggregate (fewer: the round is skipped)."""
        return RULES[self.rule].min_updates(self.options)

    def __call__(self, updates: Weighted) -> dict[str, np.ndarray]:
        return RULES[self.rule].combine(updates, self.options)


MEAN = Aggregator()
