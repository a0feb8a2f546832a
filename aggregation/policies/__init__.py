"""Round policies (``--aggregation``): ``sync`` rounds, or the asynchronous ``fedbuff`` and ``fedasync`` on the
emulated clock (coordinator/async_rounds.py runs them). One module per policy, each registered by name with
:func:`~.base.register`; a new policy is a module here and its name in :data:`BUILTIN`."""

from __future__ import annotations

import importlib

from fcl_emu.aggregation.choice import choice
from fcl_emu.aggregation.policies.base import POLICIES, RoundPolicy

BUILTIN = ("sync", "fedbuff", "fedasync")  # modules of this package that register policies
for _module in BUILTIN:
    importlib.import_module(f"{__name__}.{_module}")

POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
PolicyChoice, DEFAULT_POLICY = choice(POLICIES, "round policy", "sync")  # the run config's policy


def make_policy(settings) -> RoundPolicy:
    """The policy a run's :class:`~fcl_emu.aggregation.settings.AggregationSettings` choose, with its options."""
    return POLICIES[settings.policy.name].of(settings)
