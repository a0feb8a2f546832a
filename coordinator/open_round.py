"""The round in progress (:class:`OpenRound`) and the late updates kept for the next round (:class:`StaleUpdates`):
what the dispatcher fills in as messages arrive and the round runner reads at the close."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fcl_emu.coordinator.emulated import ClientRound
from fcl_emu.aggregation.update import ClientUpdate


@dataclass
class OpenRound:
    """The round in progress. Each field has one writer: the round runner fills the first group when it opens the
    round, the dispatcher records the answers as they arrive, the clock (:mod:`fcl_emu.coordinator.clock`) keeps
    its timeline and closes the round."""

    # the round runner, at the open
    task: int
    number: int
    chosen: list[str]  # in selection order
    selected: set[str]  # asked to train (a secure round that could not start asks none)
    wanted: int  # updates that close the round early (clients_per_round; fewer than selected with overcommit)
    eligible: int = 0  # the eligible online clients ``chosen`` was drawn from
    # the dispatcher, as answers arrive
    updates: list[ClientUpdate] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)  # reported an error, or its update was refused
    nonfinite_loss: set[str] = field(default_factory=set)  # of the failed: their training loss became NaN or inf
    lost: set[str] = field(default_factory=set)  # left or crashed and joined again during the round
    masked: set[str] = field(default_factory=set)  # secure aggregation: sent a masked input in time
    reported_s: dict[str, float] = field(default_factory=dict)  # client -> its reported local training time
    held_at: dict[str, str] = field(default_factory=dict)  # client -> the edge aggregator holding its update
    # the clock: its timeline while the round runs (emulated: when the round opened, each dispatched client's
    # timeline, side-channel messages held until the close, trainings cancelled because they could no longer count)
    started_at: float = 0.0
    timeline: dict[str, ClientRound] = field(default_factory=dict)
    side: list[tuple[str, str, dict[str, np.ndarray]]] = field(default_factory=list)
    cancelled: set[str] = field(default_factory=set)
    hopeless_checked: bool = False  # the cancellations at dispatch are done (later ones need wanted updates in)
    # the clock, at the close
    counted: list[ClientUpdate] = field(default_factory=list)  # the updates that arrived in time
    masked_in_time: set[str] = field(default_factory=set)  # secure aggregation: the masked inputs that did
    late: int = 0  # selected, online, and no answer in time
    dropped: int = 0  # selected, gone without an answer
    train_s: dict[str, float] = field(default_factory=dict)  # client -> its training time (emulated: compute time)
    emulated_s: float | None = None
    host_timeout: bool = False
    kept_late: list[ClientUpdate] = field(default_factory=list)  # late updates for the next round
    bytes_discarded: int = 0  # uploads of clients gone (in emulated time) before they would have arrived
    host_cpu_saved_s: float = 0.0  # what the cancelled trainings saved the host (an estimate)
    energy: dict[str, list[float]] | None = None  # emulated clock: joules [compute, radio] per dispatched client
    low_battery: int = 0  # emulated clock: clients that sat the round out for a low battery

    _answered: tuple[tuple[int, int, int], set[str]] = field(  # answered() as of these sizes
        default_factory=lambda: ((0, 0, 0), set()), init=False, repr=False, compare=False)
    _waited_for: str | None = field(default=None, init=False, repr=False, compare=False)  # awaiting() found it
    _useful: tuple[int, int] = field(default=(0, 0), init=False, repr=False, compare=False)  # (updates, useful)

    def answered(self) -> set[str]:
        """The clients that sent an update, a masked input or an error (one set, not to be changed: the three
        only grow, so it is grown by what each added since the last call, as a round of 1,000 clients asks after
        every message)."""
        (updates, masked, failed), answered = self._answered
        sizes = (len(self.updates), len(self.masked), len(self.failed))
        if sizes != (updates, masked, failed):
            answered.update(u.client for u in self.updates[updates:])
            if sizes[1] != masked:
                answered |= self.masked
            if sizes[2] != failed:
                answered |= self.failed
            self._answered = (sizes, answered)
        return answered

    def pending(self, online: Callable[[str], bool]) -> set[str]:
        done = self.answered() | self.lost | self.cancelled
        return {c for c in self.selected - done if online(c)}

    def awaiting(self, online: Callable[[str], bool]) -> bool:
        """Whether ``pending`` is not empty; in O(1) while the client it found last time is still pending (the
        serving loop asks after every message)."""
        if self._waited_for is not None and self._may_answer(self._waited_for, online):
            return True
        self._waited_for = next((c for c in self.selected if self._may_answer(c, online)), None)
        return self._waited_for is not None

    def _may_answer(self, client: str, online: Callable[[str], bool]) -> bool:
        return (client not in self.answered() and client not in self.lost and client not in self.cancelled
                and online(client))

    def useful(self) -> int:
        """Updates that carry samples (counted on from the last call: updates are only appended)."""
        counted, useful = self._useful
        if counted != len(self.updates):
            self._useful = (len(self.updates), useful + sum(u.num_samples > 0 for u in self.updates[counted:]))
        return self._useful[1]

    def done(self, online: Callable[[str], bool]) -> bool:
        return not self.awaiting(online) or self.useful() >= self.wanted

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
