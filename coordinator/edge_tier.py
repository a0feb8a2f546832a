"""The coordinator's side of edge aggregators (``--edge-aggregators M``, docs/hierarchy.md).

Each aggregator relays its nodes' clients and holds their updates; the coordinator hears of each update at once
(``update_held``: the body and the bytes its client sent, which the clock places on the client's link as it would
the update) and, when the round has closed, asks each aggregator for the aggregate of its clients that made the
round (``edge_collect``; a secure round asks for the ring sum of its clients' masked inputs before its masked-input
phase closes). :meth:`EdgeTier.ask` sends the asks and serves until every aggregator asked has answered
(``edge_aggregate``), has gone silent for the liveness timeout, or that timeout has passed since the asks; the
clients of an aggregator that did not answer are counted out of the round (event ``edge_aggregate_missing``; a
secure round recovers them as dropouts).
An aggregator speaks under its own name (``edge-aggregator-<a>``): heartbeats, by which the coordinator routes to
it and notices that it is gone, and its aggregates.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fcl_emu.aggregation.update import ClientUpdate
from fcl_emu.coordinator.open_round import OpenRound
from fcl_emu.coordinator.state import RunState
from fcl_emu.runconfig.topology import aggregator_name
from fcl_emu.wire.framing import Message, WireError
from fcl_emu.wire.messages import EdgeCollect, Shutdown

log = logging.getLogger("fcl_emu.coordinator")

Serve = Callable[[Callable[[], bool], float], None]


@dataclass
class EdgeGroups:
    """What the aggregators sent for one round: one update per aggregator (its clients' weighted mean, named after
    it) and the clients in each."""

    updates: list[ClientUpdate]
    clients: dict[str, list[str]]


class EdgeTier:
    """The run's edge aggregators as the coordinator sees them. ``send(identity, type, body, **kw)`` returns the
    bytes sent, 0 where the peer is gone (the dispatcher's ``try_send``) and ``serve`` serves the socket (its
    ``serve``): both set once the dispatcher exists."""

    def __init__(self, state: RunState, count: int, liveness_timeout_s: float):
        self.state, self.liveness_timeout_s = state, liveness_timeout_s
        self.names = frozenset(aggregator_name(a) for a in range(count))
        self.send: Callable[..., int] = lambda *a, **kw: 0
        self.serve: Serve = lambda until, deadline: None  # the dispatcher's serve(until, deadline), once it exists
        self.wire_sent: Callable[[], int] = lambda: 0  # bytes the coordinator's socket put on the wire
        self.seen: dict[str, float] = {}  # aggregator -> monotonic time it last spoke
        self.tier_bytes = {"sent": 0, "received": 0}  # the client-to-edge links, as the aggregators report them
        self.round_bytes = {"sent": 0, "received": 0}  # the same, in the round being gathered
        self.last_wide_area_s = 0.0  # the last round's time on the aggregators' links to the coordinator
        self._round: tuple[int, int] | None = None  # (task, round) being gathered
        self._asked: dict[str, list[str]] = {}
        self._answers: dict[str, Message] = {}
        self._samples: dict[str, int] = {}  # the round being gathered: each client's announced samples

    def on_message(self, peer: str, msg: Message) -> None:
        """A message an aggregator sent under its own name: a heartbeat, or the aggregate of a round asked for."""
        self.seen[peer] = time.monotonic()
        if msg.type == "heartbeat":
            return
        if msg.type != "edge_aggregate":
            raise WireError("unexpected", f"{msg.type!r} from edge aggregator {peer}")
        if self._round != (msg.task, msg.round) or peer not in self._asked or peer in self._answers:
            raise WireError("unexpected", f"an edge aggregate of round {msg.round} from {peer}, not asked for")
        strangers = set(msg.body.clients) - set(self._asked[peer])
        if strangers or not set(msg.body.refused) <= set(self._asked[peer]):
            raise WireError("unexpected", f"{peer}'s aggregate names clients it was not asked for "
                                          f"({sorted(strangers)[:3]})")
        self._answers[peer] = msg

    def gather(self, r: OpenRound) -> EdgeGroups:
        """Ask each aggregator for the aggregate of its clients among the round's on-time updates, after the
        plain round's defences; wait; return the answers (the refusals each reports counted and logged as the
        coordinator's own)."""
        groups: dict[str, list[str]] = defaultdict(list)
        for u in r.counted:
            groups[r.held_at[u.client]].append(u.client)
        security = self.state.config.security
        self._samples = {u.client: u.num_samples for u in r.counted}  # what each client's notice claimed
        answers = self.ask(r.task, r.number, groups, lambda clients: EdgeCollect(
            clients=clients, prefixes=list(self.state.server.summable), max_update_norm=security.max_update_norm,
            direction_check=security.direction_check, clip_norm=security.clip_norm,
            adaptive_clip=security.adaptive_clip))
        return self._groups(answers)

    def sum_masked(self, task: int, number: int, groups: dict[str, list[str]]) -> dict[str, np.ndarray]:
        """A secure round's masked-input phase: each aggregator's ring sum of the masked inputs of its clients in
        ``groups`` (none for an aggregator that sent none); :attr:`last_wide_area_s` their time up."""
        answers = self.ask(task, number, groups, lambda clients: EdgeCollect(clients=clients, prefixes=[]))
        self._count_tier_bytes(answers)
        self.last_wide_area_s = self.wide_area_s(answers)
        return {name: msg.tensors.get("y") for name, msg in answers.items()}

    def ask(self, task: int, number: int, groups: dict[str, list[str]],
            ask_for: Callable[[list[str]], EdgeCollect]) -> dict[str, Message]:
        """Send each aggregator of ``groups`` its ``edge_collect`` for its clients; serve until each has answered,
        gone silent or the liveness timeout passed; the answers, by aggregator."""
        self._round, self._asked, self._answers = (task, number), {}, {}
        self.new_round()
        for name, clients in sorted(groups.items()):
            if self.send(name, "edge_collect", ask_for(sorted(clients)), task=task, round=number):
                self._asked[name] = sorted(clients)
            else:
                self._missing(number, name, clients, "unreachable")
        self.serve(lambda: self._waiting() == [], time.monotonic() + self.liveness_timeout_s)
        for name in self._waiting(all_of_them=True):
            self._missing(number, name, self._asked[name], "no answer")
        self._round = None
        return dict(self._answers)

    def new_round(self) -> None:
        """Forget the last round's bytes and wide-area time (a round that asks nothing has none)."""
        self.round_bytes, self.last_wide_area_s = {"sent": 0, "received": 0}, 0.0

    def wide_area_s(self, answers: dict[str, Message]) -> float:
        """The slowest answering aggregator's time on its link to the coordinator this round: the model down, its
        aggregate up (``topology`` settings; 0 where they leave the link unlimited)."""
        model = sum(a.nbytes for a in self.state.server.global_state.values())
        topology = self.state.config.topology
        return max((topology.wide_area_s(model, msg.nbytes) for msg in answers.values()), default=0.0)

    def _waiting(self, all_of_them: bool = False) -> list[str]:
        """The aggregators asked that have not answered (but for those silent for the liveness timeout)."""
        now = time.monotonic()
        return [name for name in self._asked if name not in self._answers
                and (all_of_them or now - self.seen.get(name, 0.0) < self.liveness_timeout_s)]

    def _groups(self, answers: dict[str, Message]) -> EdgeGroups:
        updates, clients = [], {}
        self.last_wide_area_s = self.wide_area_s(answers)
        self._count_tier_bytes(answers)
        for name, msg in sorted(answers.items()):
            body = msg.body
            for client, (reason, detail) in body.refused.items():
                self.state.rejected(reason, client, detail)
            claimed = sum(self._samples.get(c, 0) for c in body.clients)
            if body.num_samples > claimed:  # an aggregator may not weigh its clients more than they said
                self.state.rejected("implausible", name, f"{name}'s aggregate weighs {body.num_samples} samples; its "
                                                         f"{len(body.clients)} clients announced {claimed}")
                continue
            clients[name] = list(body.clients)
            if body.num_samples > 0:
                updates.append(ClientUpdate(name, body.num_samples, msg.tensors, body.loss,
                                            square_sums=msg.square_sums))
        return EdgeGroups(updates, clients)

    def _count_tier_bytes(self, answers: dict[str, Message]) -> None:
        for msg in answers.values():
            for direction in self.tier_bytes:
                nbytes = msg.body.tier_bytes.get(direction, 0)
                self.tier_bytes[direction] += nbytes
                self.round_bytes[direction] += nbytes
                self.state.metrics.edge_tier_bytes(direction, nbytes)

    def _missing(self, number: int, name: str, clients: list[str], why: str) -> None:
        log.warning("edge aggregator %s sent no aggregate for round %d (%s): its %d clients' answers are lost",
                    name, number, why, len(clients))
        self.state.event("edge_aggregate_missing", aggregator=name, round=number, clients=len(clients), why=why)

    def shutdown(self, reason: str) -> None:
        """Tell every aggregator the run is over (after its clients were told)."""
        for name in sorted(self.names):
            self.send(name, "shutdown", Shutdown(reason=reason))
