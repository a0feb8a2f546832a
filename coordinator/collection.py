"""How a round's answers reach the server, chosen once per run (:func:`make_collection`), as the clock is:

- :class:`PlainCollection`: each selected client sends its ``update``; the server sees every one, bounds and
  clips them (:mod:`fcl_emu.aggregation.clipping`) and hands them to the method's aggregate with any late updates
  kept from the round before;
- :class:`~fcl_emu.coordinator.edge_tier.EdgeCollection` (``--edge-aggregators``): as plain, each aggregator's
  aggregate of its clients in place of their updates;
- :class:`SecureCollection` (``--secagg``): each client is sent a ``secagg_setup`` before its train request and
  answers the four SecAgg+ exchanges (:mod:`fcl_emu.coordinator.secure_round`); the server sees only the unmasked
  mean, which the method aggregates as one update.

The round runner, the dispatcher and the clock call the same methods on either; none asks which one it has. How
long a round waits for its answers is the clock's (:mod:`fcl_emu.coordinator.clock`): :meth:`Collection.collect`
asks it for the plain or the secure wait.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from fcl_emu.aggregation.defences import Defences, bound
from fcl_emu.aggregation.update import ClientUpdate, DeltaLayout
from fcl_emu.coordinator.open_round import OpenRound
from fcl_emu.coordinator.privacy import DistributedPrivacy
from fcl_emu.coordinator.secure_round import Reject, Send, SecureOutcome, SecureRound
from fcl_emu.coordinator.state import RunState
from fcl_emu.wire.framing import Message, WireError
from fcl_emu.wire.messages import SECAGG_REPLIES

Serve = Callable[[Callable[[], bool], float], None]
SideChannel = Callable[[str, int, str, dict], None]


@dataclass
class Gathered:
    """What a closed round hands to aggregation."""

    updates: list[ClientUpdate]  # what the method aggregates (secure: one, the unmasked mean of the summed clients)
    losses: list[float]  # the training losses the clients in it reported
    quorum: int  # fewer updates than this: the round is skipped
    stale: int = 0  # late updates of earlier rounds among ``updates``
    contributors: list[str] | None = None  # whose own update of this round counted (secure: None, nobody's is seen)
    secagg: dict[str, Any] | None = None  # the secure round's record (RoundRecord.secagg)
    client_edge_bytes: dict[str, int] | None = None  # edge aggregators: their clients' links in the round
    edge_aggregates: dict[str, dict] | None = None  # edge aggregators: what became of each one's aggregate


class Collection(ABC):
    """One round's collection at a time: :meth:`open` it, send each client its :meth:`setup` message before its
    train request, :meth:`collect`, then take what it :meth:`gathered`."""

    masked: ClassVar[bool]  # train requests ask for a masked input (TrainRequest.secure)

    def __init__(self, state: RunState):
        self.state = state

    @abstractmethod
    def open(self, task: int, number: int, chosen: list[str], send: Send, reject: Reject) -> list[str]:
        """Open round ``number``'s collection over the ``chosen`` clients; the clients to ask to train (none if it
        cannot even start)."""

    def setup(self, client: str) -> tuple[str, Any] | None:
        """The message (type, body) ``client`` needs before its train request, if any."""
        return None

    @abstractmethod
    def check(self, msg_type: str) -> None:
        """Raise :class:`WireError` (``unexpected``) for an answer this collection never takes."""

    def on_secagg(self, peer: str, msg: Message) -> bool:
        """A SecAgg+ reply of the open round (checked first); False where it came too late for its phase."""
        return False

    @abstractmethod
    def collect(self, r: OpenRound, clock, serve: Serve, side_channel: SideChannel) -> None:
        """Serve until round ``r`` is over and close it, as ``clock`` (:class:`~fcl_emu.coordinator.clock.RunClock`)
        waits for this kind of answer."""

    @abstractmethod
    def gathered(self, r: OpenRound, stale: list[ClientUpdate]) -> Gathered:
        """The closed round's input to aggregation; ``stale``: late updates kept from the round before."""


class PlainCollection(Collection):
    masked = False

    def open(self, task: int, number: int, chosen: list[str], send: Send, reject: Reject) -> list[str]:
        return chosen

    def check(self, msg_type: str) -> None:
        if msg_type in SECAGG_REPLIES:
            raise WireError("unexpected", f"{msg_type!r} in a run without secure aggregation")

    def collect(self, r: OpenRound, clock, serve: Serve, side_channel: SideChannel) -> None:
        clock.collect(r, serve, side_channel)

    def gathered(self, r: OpenRound, stale: list[ClientUpdate]) -> Gathered:
        """The on-time updates with samples and the late ones kept, in client order, without those that agree with
        nothing of their cohort (``aggregation.direction_check``), each delta clipped to ``aggregation.clip_norm`` and
        then to the cohort's adaptive bound (over the method's summed uploads); the quorum is
        ``min_participants``, or what the run's rule needs if more."""
        settings, own = self.state.config.aggregation, [u for u in r.counted if u.num_samples > 0]
        defences = replace(Defences.of(settings), max_update_norm=None)  # the norm bound refused them on arrival
        useful, refused = bound(sorted(own + stale, key=lambda u: u.client), defences, self.state.server.summable)
        for client, (reason, detail) in refused.items():
            self.state.rejected(reason, client, detail)
        losses = [u.loss for u in useful]
        quorum = max(self.state.config.rounds.min_participants, settings.aggregator().min_updates)
        kept = {u.client for u in useful}
        contributors = sorted(u.client for u in own if u.client in kept)
        return Gathered(useful, losses, quorum, len(stale), contributors=contributors)


class SecureCollection(Collection):
    """SecAgg+ over each round's chosen clients; weights clipped to the largest client dataset of the task unless
    ``secagg.max_weight`` is set; under distributed DP with its clients' clipping and noise. ``tier``: the run's
    :class:`~fcl_emu.coordinator.edge_tier.Tier`, which sums the masked inputs its aggregators hold."""

    masked = True

    def __init__(self, state: RunState, privacy: DistributedPrivacy | None, tier):
        super().__init__(state)
        self.tier = tier
        settings = state.config.secagg
        self.settings = settings if privacy is None else privacy.secagg_settings(settings)
        self.noise = None if privacy is None else privacy.noise
        self._round: SecureRound | None = None
        self._outcome: SecureOutcome | None = None
        self._setups: dict[str, Any] = {}

    def open(self, task: int, number: int, chosen: list[str], send: Send, reject: Reject) -> list[str]:
        state, scenario = self.state, self.state.scenario
        records = state.registry.records
        max_weight = self.settings.max_weight or max(
            [1] + [len(scenario.client_indices(records[c].index, task)) for c in chosen])
        opened = SecureRound.open(chosen, DeltaLayout.of(state.server.global_state), self.settings, max_weight,
                                  noise=self.noise, run_id=state.run_id, number=number,
                                  seed=state.config.seed * 1_000_003 + number,
                                  send=lambda c, t, body: send(c, t, body, task=task, round=number),
                                  metrics=state.metrics, reject=reject)
        if isinstance(opened, SecureOutcome):  # aborted before it started: no client is asked to train
            self._round, self._outcome, self._setups = None, opened, {}
            return []
        self._round, self._outcome, self._setups = opened, None, opened.setup_messages()
        return chosen

    def setup(self, client: str) -> tuple[str, Any] | None:
        return "secagg_setup", self._setups[client]

    def check(self, msg_type: str) -> None:
        if msg_type in ("update", "update_held"):
            raise WireError("unexpected", "a plain update in a secure-aggregation run (send secagg_masked)")
        self.tier.check_direct(msg_type)

    def on_secagg(self, peer: str, msg: Message) -> bool:
        sr = self._round
        return sr is not None and self._outcome is None and msg.round == sr.number and sr.on_message(peer, msg)

    def collect(self, r: OpenRound, clock, serve: Serve, side_channel: SideChannel) -> None:
        sr = self._round
        if sr is not None:
            self.tier.new_round()  # nothing is asked of the aggregators unless the masked-input phase ends
            sr.presum = lambda groups: self.tier.sum_masked(r.task, sr.number, groups, serve)
            self._outcome = clock.collect_secure(r, sr, serve)
            clock.wide_area(r, self.tier.last_wide_area_s)

    def gathered(self, r: OpenRound, stale: list[ClientUpdate]) -> Gathered:
        """One update, the unmasked weighted mean of the clients in the masked sum (none if the round aborted); no
        single one is seen, so nothing is clipped here and late updates have no place."""
        outcome, self._round = self._outcome, None
        updates = [] if outcome.delta is None else [ClientUpdate("secagg", outcome.weight, outcome.delta)]
        return Gathered(updates, list(outcome.losses), quorum=1, secagg=outcome.record,
                        client_edge_bytes=self.tier.round_bytes, edge_aggregates=self.tier.round_aggregates)


def make_collection(state: RunState, privacy, tier) -> Collection:
    """The run's collection, as its config says (``secagg.enabled``) over the run's ``tier``
    (:func:`~fcl_emu.coordinator.edge_tier.make_tier`: a plain run's collection is the tier's); ``privacy``: the
    run's DP part."""
    if state.config.secagg.enabled:
        return SecureCollection(state, privacy if isinstance(privacy, DistributedPrivacy) else None, tier)
    return tier.plain_collection(state)

