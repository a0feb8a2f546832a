"""Aggregation rules over a round's float model deltas: the weighted mean (FedAvg) and robust rules that bound
what a minority of poisoned updates can do (docs/security.md, "Aggregation defences"). One module per rule
(family), each registered by name with :func:`~.base.register`; a new rule is a module here and its name in
:data:`BUILTIN`.

:class:`Aggregator` is one rule with its parameters, as the run configuration chooses it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from fcl_emu.aggregation.rules.base import RULES, RuleParams, Weighted

BUILTIN = ("mean", "median", "trimmed_mean", "krum", "bulyan")  # modules of this package that register rules
for _module in BUILTIN:
    importlib.import_module(f"{__name__}.{_module}")

RULE_NAMES: tuple[str, ...] = tuple(RULES)
RuleName = Literal[RULE_NAMES]  # type: ignore[valid-type]  # the run config's choice, checked by pydantic


@dataclass(frozen=True)
class Aggregator:
    """One registered rule with its parameters (:class:`~.base.RuleParams`)."""

    rule: str = "mean"
    params: RuleParams = field(default_factory=RuleParams)

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown aggregator {self.rule!r}; choose one of {', '.join(RULE_NAMES)}")

    @property
    def min_updates(self) -> int:
        """The fewest updates the rule can aggregate (fewer: the round is skipped)."""
        return RULES[self.rule].min_updates(self.params)

    def __call__(self, updates: Weighted) -> dict[str, np.ndarray]:
        return RULES[self.rule].combine(updates, self.params)


MEAN = Aggregator()
