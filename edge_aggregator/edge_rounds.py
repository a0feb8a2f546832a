"""Several edge aggregations per cloud round (HierFAVG's edge rounds: Liu et al., "Client-Edge-Cloud Hierarchical
Federated Learning", ICC 2020, Algorithm 1 with kappa_2 = ``edge_rounds``).

With ``--edge-rounds K`` an aggregator that relays a round's train requests keeps the round's clients training
from its own edge model: each time every client it asked has answered (or was cancelled, or the edge round's
time ran out), the edge model gains their sample-weighted mean delta and the same clients are asked again, K
times in all. The last edge round's updates are held for the coordinator's collect as in a one-step round, each
announced with its client's work over all K (CPU seconds, bytes up, training time); the aggregate the
coordinator gets is the edge model's delta from the cloud model: the mean of the last updates plus the edge
rounds before (:attr:`EdgeRound.offset`).

Every edge round is bounded as a plain round is (:func:`fcl_emu.aggregation.defences.bound`): the last one's updates
at the coordinator's collect, with the defences it names; each earlier one's before its mean moves the edge model,
with the defences the aggregator was started with (``--max-update-norm``, ``--direction-check``, ``--clip-norm``,
``--adaptive-clip``: ``up`` passes the run's, and the collect comes only after the last edge round). A client
refused in an edge round takes no part in the later ones: its refusal goes up as its error of the round (the
coordinator stops waiting for it), as a refusal on arrival does.

Deviations, each stated in docs/hierarchy.md: each client trains with the round's seed in every edge round (the
same batch order); on the emulated clock a client's K trainings and uploads count back to back, without the waits
for its group's slowest between them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from fcl_emu.aggregation.combine import fedavg
from fcl_emu.aggregation.defences import Defences, Refused, bound
from fcl_emu.aggregation.update import Arrays, ClientUpdate
from fcl_emu.wire.messages import TrainRequest


@dataclass
class Work:
    """A client's work over a round's edge rounds so far."""

    cpu_s: float = 0.0
    train_time_s: float = 0.0
    nbytes: int = 0


@dataclass
class EdgeRound:
    """One cloud round at one aggregator: its edge model and the edge round in progress."""

    task: int
    request: TrainRequest
    cloud: Arrays  # the model the coordinator sent
    model: Arrays  # the edge model the clients train from now
    step: int = 1  # the edge round in progress, 1..K
    members: set[str] = field(default_factory=set)  # asked in this edge round
    answers: dict[str, ClientUpdate] = field(default_factory=dict)
    work: dict[str, Work] = field(default_factory=dict)
    deadline: float = 0.0  # monotonic: the edge round's answers are not awaited after it

    @property
    def offset(self) -> Arrays:
        """What the edge rounds before the last moved the model: edge model minus cloud model, per tensor."""
        return {name: self.model[name] - self.cloud[name] for name in self.cloud if self.cloud[name].dtype.kind == "f"}

    def complete(self, now: float) -> bool:
        return self.members <= self.answers.keys() or now >= self.deadline


@dataclass
class Again:
    """Ask ``clients`` to train round ``round`` again, from ``model``; ``refused``: the updates of the edge round
    that closed that the defences refused (their clients are not asked again)."""

    round: int
    task: int
    clients: list[str]
    request: TrainRequest
    model: Arrays
    refused: Refused = field(default_factory=dict)
    type: str = "update"  # what the refused messages were (a refusal is reported as its client's error of the round)


class EdgeRounds:
    """A round's edge rounds at one aggregator; ``k``: edge rounds per cloud round; ``timeout_s``: the longest
    one edge round waits for its answers; ``defences``: the bounds on each edge round before the last."""

    def __init__(self, k: int, timeout_s: float, defences: Defences = Defences()):
        self.k, self.timeout_s, self.defences = k, timeout_s, defences
        self.rounds: dict[int, EdgeRound] = {}

    def requested(self, round: int, task: int, client: str, request: TrainRequest, model: Arrays) -> None:
        """The coordinator asked ``client`` to train ``round`` from ``model`` (the round's first edge round)."""
        if round not in self.rounds:
            for old in [r for r in self.rounds if r < round]:
                del self.rounds[old]
            model = {k: np.asarray(v) for k, v in model.items()}
            self.rounds[round] = EdgeRound(task, request, model, dict(model),
                                           deadline=time.monotonic() + self.timeout_s)
        self.join(round, client)

    def join(self, round: int, client: str) -> bool:
        """``client`` was asked to train ``round``, whose first request came already: it takes part in the first
        edge round (if that is still in progress). False where the round is new (:meth:`requested` opens it)."""
        er = self.rounds.get(round)
        if er is None:
            return False
        if er.step == 1:
            er.members.add(client)
        return True

    def cancelled(self, round: int, client: str) -> None:
        """The coordinator dropped ``client``'s training of ``round``: no edge round waits for it."""
        er = self.rounds.get(round)
        if er is not None:
            er.members.discard(client)
            er.answers.pop(client, None)

    def answered(self, round: int, update: ClientUpdate, work: Work) -> tuple[bool, Again | None]:
        """``update`` of one of ``round``'s clients: (whether it is the client's last, to hold for the collect;
        the next edge round to start, if this answer completed one)."""
        er = self.rounds.get(round)
        if er is None or update.client not in er.members:
            return True, None  # not one of this aggregator's edge rounds: held as a one-step update
        total = er.work.setdefault(update.client, Work())
        total.cpu_s, total.train_time_s, total.nbytes = (total.cpu_s + work.cpu_s, total.train_time_s +
                                                         work.train_time_s, total.nbytes + work.nbytes)
        if er.step == self.k:
            return True, None
        er.answers[update.client] = update
        return False, self.advance(round)

    def advance(self, round: int, now: float | None = None) -> Again | None:
        """Close ``round``'s edge round in progress if it is complete (all answered, or its time is up): the edge
        model gains the mean delta of the answers the defences keep (bounded over those that answered), and
        their clients are asked again."""
        er = self.rounds.get(round)
        if er is None or er.step == self.k or not er.complete(time.monotonic() if now is None else now):
            return None
        useful = sorted((u for u in er.answers.values() if u.num_samples > 0), key=lambda u: u.client)
        useful, refused = bound(useful, self.defences, cohort=f"its edge group in edge round {er.step}")
        if useful:
            delta = fedavg(useful)
            er.model = {name: (value + delta[name]).astype(value.dtype) if value.dtype.kind == "f" and name in delta
                        else delta.get(name, value) for name, value in er.model.items()}
        er.members, er.answers, er.step = set(er.answers) - refused.keys(), {}, er.step + 1
        er.deadline = time.monotonic() + self.timeout_s
        return Again(round, er.task, sorted(er.members), er.request, er.model, refused)

    def due(self, now: float) -> list[Again]:
        """The edge rounds whose time ran out, advanced."""
        return [again for round in list(self.rounds) if (again := self.advance(round, now)) is not None]

    def offset(self, round: int) -> Arrays:
        er = self.rounds.get(round)
        return {} if er is None else er.offset

    def work(self, round: int, client: str) -> Work | None:
        er = self.rounds.get(round)
        return None if er is None else er.work.get(client)
