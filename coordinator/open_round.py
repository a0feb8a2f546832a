"""The round in progress (:class:`OpenRound`) and the late updates kept for the next round (:class:`StaleUpdates`):
what the dispatcher fills in as messages arrive and the round runner reads at the close."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fcl_emu.coordinator.emulated import ClientRound
from fcl_emu.methods.base import ClientUpdate


@dataclass
class OpenRound:
    """The round in progress: who was chosen and what each has answered so far."""

    task: int
    number: int
    chosen: list[str]  # in selection order
    selected: set[str]  # emptied if a secure round aborts before it starts
    wanted: int  # updates that close the round early (clients_per_round; fewer than selected with overcommit)
    updates: list[ClientUpdate] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)  # reported an error, or its update was refused
    lost: set[str] = field(default_factory=set)  # left or crashed and joined again during the round
    masked: set[str] = field(default_factory=set)  # secure aggregation: sent a masked input in time
    late: int = 0  # at the close: selected, online, and no answer yet
    dropped: int = 0  # at the close: selected, gone without an answer
    train_s: dict[str, float] = field(default_factory=dict)  # client -> its reported local training time
    # emulated clock (coordinator/clock.py): when the round opened, each dispatched client's timeline,
    # side-channel messages held until the close (only the on-time clients' count)
    started_at: float = 0.0
    timeline: dict[str, ClientRound] = field(default_factory=dict)
    side: list[tuple[str, str, dict[str, np.ndarray]]] = field(default_factory=list)
    emulated_s: float | None = None
    host_timeout: bool = False
    kept_late: list[ClientUpdate] = field(default_factory=list)  # late updates for the next round
    bytes_discarded: int = 0  # uploads of clients gone (in emulated time) before they would have arrived
    cancelled: set[str] = field(default_factory=set)  # told to drop their training: it could no longer count
    host_cpu_saved_s: float = 0.0  # what that saved the host (an estimate)

    def answered(self) -> set[str]:
        return {u.client for u in self.updates} | self.masked | self.failed

    def pending(self, online: Callable[[str], bool]) -> set[str]:
        done = self.answered() | self.lost | self.cancelled
        return {c for c in self.selected - done if online(c)}

    def done(self, online: Callable[[str], bool]) -> bool:
        useful = sum(u.num_samples > 0 for u in self.updates)
        return useful >= self.wanted or not self.pending(online)

    def is_current(self, peer: str, number: int) -> bool:
        """Whether a message of round ``number`` from ``peer`` belongs to this round."""
        return number == self.number and peer in self.selected and peer not in self.lost


class StaleUpdates:
    """Late updates kept for the next round of the same task (``rounds.late_updates: next_round``): one per client,
    at most one round's cohort (each holds a model delta)."""

    def __init__(self, cap: int):
        self.cap = cap
        self.task = -1
        self.updates: list[ClientUpdate] = []

    @classmethod
    def for_rounds(cls, clients_per_round: int, overcommit: float) -> StaleUpdates:
        return cls(math.ceil(clients_per_round * overcommit))

    def has_room_for(self, client: str, task: int) -> bool:
        if self.task != task:
            self.task, self.updates = task, []
        return len(self.updates) < self.cap and all(u.client != client for u in self.updates)

    def keep(self, update: ClientUpdate) -> None:
        self.updates.append(update)

    def take(self, task: int, next_round: list[ClientUpdate]) -> list[ClientUpdate]:
        """The useful updates kept for ``task``; ``next_round`` (a closed round's late ones) are kept instead."""
        kept = [u for u in self.updates if u.num_samples > 0] if self.task == task else []
        self.updates, self.task = next_round[:self.cap], task
        return kept
