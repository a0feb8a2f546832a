"""Synchronous rounds (the default): each round samples ``clients_per_round`` clients and aggregates once its
cohort has answered, missed the deadline or dropped out (coordinator/rounds.py)."""

from __future__ import annotations

from fcl_emu.aggregation.policies.base import RoundPolicy, register


@register
class Sync(RoundPolicy):
    name = "sync"
    asynchronous = False
