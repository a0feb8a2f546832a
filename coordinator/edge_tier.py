"""The coordinator's side of edge aggregators (``--edge-aggregators M``, docs/hierarchy.md).

Each aggregator relays its nodes' clients and holds their updates; the coordinator hears of each update at once
(``update_held``: the body, the bytes its client sent, which the clock places on the client's link as it would
the update, and the square sums of its tensors) and, when the round has closed, asks each aggregator for the
aggregate of its clients that made the round (``edge_collect``; a secure round asks for the ring sum of its clients'
masked inputs before its masked-input phase closes). :meth:`EdgeTier.ask` sends the asks and serves until every
aggregator asked has answered (``edge_aggregate``), had its answer refused, has gone silent for the liveness timeout,
or the answer timeout has passed since the asks (``topology.aggregate_timeout_s``: a figure of its own, which the
client count does not stretch); the clients of an aggregator that did not answer are counted out of the round (event
``edge_aggregate_missing``; a secure round recovers them as dropouts).

An aggregate is checked as an update is, and more: it names only clients it was asked for, each once; its tensors
have the model's names, shapes and dtypes (:func:`~fcl_emu.coordinator.update_checks.check_delta`, as a client's
delta); it weighs no more samples than its clients announced, and no tensor of it is longer than the longest of its
clients' updates (a weighted mean cannot be: their square sums came with their notices); it repeats no aggregate
already taken; its ``tier_bytes`` are counts. A refused aggregate fails its aggregator's share of the round at once
(counted under its reason, event ``edge_aggregate_refused``), never the coordinator. Across the aggregates taken,
the plain round's direction check and adaptive bound act as they do over clients' updates, and the run's
``--aggregator`` rule combines them.

The tier is chosen once per run, as the clock and the collection are (:func:`make_tier`): a flat star
(:class:`FlatStar`: no aggregators, no round bytes or aggregates, nothing held at an edge) or the edge tier
(:class:`EdgeTier`). The dispatcher, the collections and the summary call the same methods on either; none asks which
one it has.

An aggregator speaks under its own name (``edge-aggregator-<a>``): heartbeats, by which the coordinator routes to
it and notices that it is gone (each with the aggregator's refusals so far, by reason: the summary's), and its
aggregates.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fcl_emu.aggregation.clipping import delta_norm
from fcl_emu.aggregation.defences import Defences, bound
from fcl_emu.aggregation.update import ClientUpdate
from fcl_emu.coordinator.collection import Gathered, PlainCollection, Serve, SideChannel
from fcl_emu.coordinator.open_round import OpenRound
from fcl_emu.coordinator.state import RunState
from fcl_emu.coordinator.update_checks import check_delta
from fcl_emu.runconfig.topology import aggregator_name
from fcl_emu.wire.framing import Message, WireError
from fcl_emu.wire.messages import HELD_AT_EDGE, EdgeCollect, Shutdown

log = logging.getLogger("fcl_emu.coordinator")

Send = Callable[..., int]  # (peer, type, body, **header) -> bytes sent, 0 where the peer is gone
MaskedSums = dict[str, tuple[list[str], np.ndarray | None]]  # aggregator -> (clients summed, their ring sum)

TIER_DIRECTIONS = ("sent", "received")
MAX_TIER_BYTES = 1 << 50  # what one aggregate may say its clients' links carried (a petabyte)
SQUARES_TOLERANCE = 1e-4  # relative, on an aggregate tensor's square sum: float32 rounding of the mean
TAKEN_KEPT = 4096  # digests of the aggregates taken last, which a new one may not repeat
EDGE_REFUSALS = "edge/"  # the edge aggregators' refusals in ``rejected_messages``: edge/<reason>


@dataclass
class EdgeGroups:
    """What the aggregators sent for one round: one update per aggregator taken (its clients' weighted mean, named
    after it) and the clients in each."""

    updates: list[ClientUpdate]
    clients: dict[str, list[str]]


class Tier(ABC):
    """What lies between the clients and the coordinator, as the coordinator's parts see it: :attr:`names` are the
    peers that speak for the tier (their messages go to :meth:`on_message`); a round's :attr:`round_bytes` and
    :attr:`round_aggregates` go into its record (None: no tier below the coordinator)."""

    names: frozenset[str]
    round_bytes: dict[str, int] | None
    round_aggregates: dict[str, dict[str, Any]] | None
    last_wide_area_s: float  # the last round's time on the tier's links to the coordinator

    @abstractmethod
    def plain_collection(self, state: RunState) -> PlainCollection:
        """A plain run's collection over this tier (:func:`~fcl_emu.coordinator.collection.make_collection`)."""

    @abstractmethod
    def on_message(self, peer: str, msg: Message) -> None:
        """A message one of :attr:`names` sent under its own name."""

    def refused(self, peer: str | None, number: int, reason: str) -> None:
        """An ``edge_aggregate`` of round ``number`` from ``peer`` was refused."""

    @abstractmethod
    def check_held(self, msg: Message, came_from: Callable[[str], bool]) -> None:
        """Raise :class:`WireError` for a notice that an aggregator holds a client's answer (``update_held``,
        ``secagg_masked_held``) that this tier cannot have sent; ``came_from(peer)``: the notice came over
        ``peer``'s connection."""

    def check_direct(self, msg_type: str) -> None:
        """Raise :class:`WireError` (``unexpected``) for a client's answer that this tier holds instead of passing
        it on."""

    def new_round(self) -> None:
        """Forget the last round's bytes, wide-area time and aggregates."""

    def sum_masked(self, task: int, number: int, groups: dict[str, list[str]], serve: Serve) -> MaskedSums:
        """A secure round's masked-input sums held in the tier, by aggregator (``groups``: its clients)."""
        return {}

    def summary_bytes(self, received: int) -> dict[str, dict[str, int]]:
        """Each tier's bytes over the run for ``summary.json`` (``received``: what the coordinator received)."""
        return {}

    def refusals(self) -> dict[str, int]:
        """What the tier refused, by reason as ``edge/<reason>`` (summary.json's ``rejected_messages``)."""
        return {}

    def shutdown(self, reason: str) -> None:
        """Tell the tier the run is over (after its clients were told)."""


class FlatStar(Tier):
    """No tier: every client speaks to the coordinator itself. Nothing is held at an edge, so a notice that an
    aggregator holds an answer is refused; a round has no tier bytes and no aggregates."""

    names = frozenset()
    round_bytes = None
    round_aggregates = None
    last_wide_area_s = 0.0

    def plain_collection(self, state: RunState) -> PlainCollection:
        return PlainCollection(state)

    def on_message(self, peer: str, msg: Message) -> None:
        raise WireError("unexpected", f"{msg.type!r} from {peer}, in a run without edge aggregators")

    def check_held(self, msg: Message, came_from: Callable[[str], bool]) -> None:
        raise WireError("unexpected", f"{msg.type!r}: an answer held at an edge aggregator, in a run without them")


def make_tier(state: RunState, liveness_timeout_s: float, send: Send, wire_sent: Callable[[], int]) -> Tier:
    """The run's tier, as its config says (``topology.edge_aggregators``): ``send`` sends to a peer (0 where it is
    gone), ``wire_sent()`` is what the coordinator's socket put on the wire."""
    config = state.config
    count = config.topology.edge_aggregators
    if not count:
        return FlatStar()
    return EdgeTier(state, count, liveness_timeout_s, config.topology.aggregate_wait_s(config.network), send=send,
                    wire_sent=wire_sent)


class EdgeTier(Tier):
    """The run's edge aggregators as the coordinator sees them. ``send(identity, type, body, **kw)`` returns the
    bytes sent, 0 where the peer is gone (:func:`~fcl_emu.coordinator.dispatch.try_send` on the coordinator's
    socket); ``wire_sent()``: the bytes that socket put on the wire. A round's asks serve the socket with the
    ``serve`` they are given. :attr:`round_aggregates` is the last round's outcome per aggregator asked (its round
    record's ``edge_aggregates``)."""

    def __init__(self, state: RunState, count: int, liveness_timeout_s: float, answer_timeout_s: float | None = None,
                 *, send: Send = lambda *a, **kw: 0, wire_sent: Callable[[], int] = lambda: 0):
        self.state, self.liveness_timeout_s = state, liveness_timeout_s
        self.answer_timeout_s = answer_timeout_s or liveness_timeout_s  # the most a round waits for its aggregates
        self.names = frozenset(aggregator_name(a) for a in range(count))
        self.send, self.wire_sent = send, wire_sent
        self.seen: dict[str, float] = {}  # aggregator -> monotonic time it last spoke
        self.rejected: dict[str, dict[str, int]] = {}  # aggregator -> its refusals by reason (its last heartbeat's)
        self.tier_bytes = dict.fromkeys(TIER_DIRECTIONS, 0)  # the client-to-edge links, as the aggregators report them
        self.round_bytes = dict.fromkeys(TIER_DIRECTIONS, 0)  # the same, in the round being gathered
        self.round_aggregates: dict[str, dict[str, Any]] = {}
        self.last_wide_area_s = 0.0  # the last round's time on the aggregators' links to the coordinator
        self._round: tuple[int, int] | None = None  # (task, round) being gathered
        self._sums = False  # the round being gathered asks for ring sums of masked inputs, not means
        self._asked: dict[str, list[str]] = {}
        self._answers: dict[str, Message] = {}
        self._failed: dict[str, str] = {}  # aggregators asked whose answer was refused, and why
        self._announced: dict[str, ClientUpdate] = {}  # the round being gathered: each client's notice
        self._taken: OrderedDict[bytes, None] = OrderedDict()  # digests of the aggregates taken

    def on_message(self, peer: str, msg: Message) -> None:
        """A message an aggregator sent under its own name: a heartbeat, or the aggregate of a round asked for
        (checked: WireError for one refused, which :meth:`refused` then fails)."""
        self.seen[peer] = time.monotonic()
        if msg.type == "heartbeat":
            self.rejected[peer] = dict(msg.body.rejected)
            return
        if msg.type != "edge_aggregate":
            raise WireError("unexpected", f"{msg.type!r} from edge aggregator {peer}")
        if self._round != (msg.task, msg.round) or peer not in self._asked or peer in self._answers \
                or peer in self._failed:
            raise WireError("unexpected", f"an edge aggregate of round {msg.round} from {peer}, not asked for")
        digest = self._check(peer, msg)
        self._answers[peer] = msg
        if digest is not None:
            self._taken[digest] = None
            while len(self._taken) > TAKEN_KEPT:
                self._taken.popitem(last=False)

    def refused(self, peer: str | None, number: int, reason: str) -> None:
        """An aggregate of round ``number`` from ``peer`` was refused (by the wire layer or :meth:`on_message`): where
        it was the answer asked for, that aggregator's share of the round fails at once (its clients are counted
        out, the round waits for it no longer)."""
        if self._round is None or number != self._round[1] or peer not in self._asked or peer in self._answers \
                or peer in self._failed:
            return
        self._failed[peer] = reason
        self._counted_out(number, peer, reason)

    def plain_collection(self, state: RunState) -> PlainCollection:
        return EdgeCollection(state, self)

    def check_held(self, msg: Message, came_from: Callable[[str], bool]) -> None:
        """A notice is taken only naming one of the run's aggregators, over that aggregator's own connection: with
        keys, one whose grant lists the aggregator (and, as every message's, the client: its clients); without, the
        connection the aggregator's own messages come on. A client sending one through its aggregator is refused
        there (edge_aggregator/relay.py); this refuses one sent straight here, or naming an aggregator that did not
        send it."""
        aggregator = msg.body.aggregator
        if aggregator not in self.names or not came_from(aggregator):
            raise WireError("not_authorized", f"{msg.type!r} naming {aggregator!r} did not come over that edge "
                                              f"aggregator's connection")

    def check_direct(self, msg_type: str) -> None:
        if msg_type in HELD_AT_EDGE:
            raise WireError("unexpected", f"{msg_type!r} from a client of an edge aggregator (it holds the client's "
                                          f"{HELD_WHAT[msg_type]}: {HELD_AT_EDGE[msg_type]})")

    def summary_bytes(self, received: int) -> dict[str, dict[str, int]]:
        # sent: what the wire carried, each round's model once per aggregator (``bytes`` counts it per client)
        return {"edge_cloud": {"sent": self.wire_sent(), "received": received}, "client_edge": dict(self.tier_bytes)}

    def refusals(self) -> dict[str, int]:
        """Summed over the aggregators, each as its last heartbeat reported it."""
        counts = Counter()
        for reported in self.rejected.values():
            counts.update(reported)
        return {f"{EDGE_REFUSALS}{reason}": n for reason, n in sorted(counts.items())}

    def gather(self, r: OpenRound, serve: Serve) -> EdgeGroups:
        """Ask each aggregator for the aggregate of its clients among the round's on-time updates, after the
        plain round's defences; wait; return the answers taken (the refusals each reports counted and logged as the
        coordinator's own)."""
        groups: dict[str, list[str]] = defaultdict(list)
        for u in r.counted:
            groups[r.held_at[u.client]].append(u.client)
        settings = self.state.config.aggregation
        self._announced = {u.client: u for u in r.counted}  # what each client's notice said: samples, square sums
        answers = self.ask(r.task, r.number, groups, lambda clients: EdgeCollect(
            clients=clients, prefixes=list(self.state.server.summable), max_update_norm=settings.max_update_norm,
            direction_check=settings.direction_check, clip_norm=settings.clip_norm,
            adaptive_clip=settings.adaptive_clip), serve)
        return self._groups(r.number, answers)

    def sum_masked(self, task: int, number: int, groups: dict[str, list[str]], serve: Serve) -> MaskedSums:
        """A secure round's masked-input phase: each answering aggregator's ring sum of the masked inputs of its
        clients in ``groups``, with the clients its answer names; :attr:`last_wide_area_s` their time up."""
        answers = self.ask(task, number, groups, lambda clients: EdgeCollect(clients=clients, prefixes=[]), serve,
                           sums=True)
        for name, msg in answers.items():
            self.round_aggregates[name]["taken"] = len(msg.body.clients)
        self._count_tier_bytes(answers)
        self.last_wide_area_s = self.wide_area_s(answers)
        return {name: (list(msg.body.clients), msg.tensors.get("y")) for name, msg in answers.items()}

    def ask(self, task: int, number: int, groups: dict[str, list[str]],
            ask_for: Callable[[list[str]], EdgeCollect], serve: Serve, sums: bool = False) -> dict[str, Message]:
        """Send each aggregator of ``groups`` its ``edge_collect`` for its clients (``sums``: for the ring sum of
        their masked inputs); ``serve`` until each has answered (or its answer was refused), gone silent or the answer
        timeout passed; the answers taken, by aggregator (:attr:`round_aggregates` says what became of each)."""
        self._round, self._sums = (task, number), sums
        self._asked, self._answers, self._failed = {}, {}, {}
        self.new_round()
        for name, clients in sorted(groups.items()):
            self.round_aggregates[name] = {"asked": len(clients), "taken": 0}
            if self.send(name, "edge_collect", ask_for(sorted(clients)), task=task, round=number):
                self._asked[name] = sorted(clients)
            else:
                self._missing(number, name, clients, "unreachable")
        serve(lambda: self._waiting() == [], time.monotonic() + self.answer_timeout_s)
        for name in self._waiting(all_of_them=True):
            self._missing(number, name, self._asked[name], "no answer")
        self._round = None
        for name, msg in self._answers.items():
            self._note_missing(number, name, msg.body)
        return dict(self._answers)

    def new_round(self) -> None:
        """Forget the last round's bytes, wide-area time and aggregates (a round that asks nothing has none)."""
        self.round_bytes, self.last_wide_area_s = dict.fromkeys(TIER_DIRECTIONS, 0), 0.0
        self.round_aggregates = {}

    def wide_area_s(self, answers: dict[str, Message]) -> float:
        """The slowest answering aggregator's time on its link to the coordinator this round: the model down, its
        aggregate up (``topology`` settings; 0 where they leave the link unlimited)."""
        model = sum(a.nbytes for a in self.state.server.global_state.values())
        topology = self.state.config.topology
        return max((topology.wide_area_s(model, msg.nbytes) for msg in answers.values()), default=0.0)

    def _waiting(self, all_of_them: bool = False) -> list[str]:
        """The aggregators asked that have not answered (but for those silent for the liveness timeout)."""
        now = time.monotonic()
        return [name for name in self._asked if name not in self._answers and name not in self._failed
                and (all_of_them or now - self.seen.get(name, 0.0) < self.liveness_timeout_s)]

    # ------------------------------------------------------------------ checking an aggregate
    def _check(self, peer: str, msg: Message) -> bytes | None:
        """WireError for an aggregate of ``peer`` that the round may not take (module docstring); else its digest
        (None for one without tensors)."""
        body, asked = msg.body, set(self._asked[peer])
        named = [*body.clients, *body.refused, *body.missing]
        if not set(named) <= asked or len(set(named)) < len(named):
            raise WireError("unexpected", f"{peer}'s aggregate names clients it was not asked for, or one twice "
                                          f"({sorted(set(named) - asked)[:3]})")
        counts = body.tier_bytes
        if not set(counts) <= set(TIER_DIRECTIONS) or not all(0 <= n <= MAX_TIER_BYTES for n in counts.values()):
            raise WireError("bad_body", f"{peer}'s tier_bytes {dict(list(counts.items())[:2])} are no byte counts")
        if body.num_samples < 0:
            raise WireError("bad_body", f"{peer}'s aggregate weighs {body.num_samples} samples")
        digest = _digest(msg.tensors)
        if digest is not None and digest in self._taken:
            raise WireError("replayed", f"{peer}'s aggregate of round {msg.round} repeats one already taken")
        if self._sums:  # a ring sum's ring and length are the protocol's to check (SecAggServer.add_sum)
            if msg.tensors.keys() - {"y"}:
                raise WireError("bad_shape", f"{peer}'s ring sum carries {sorted(msg.tensors)[:3]}")
            return digest
        claimed = sum(self._announced[c].num_samples for c in body.clients if c in self._announced)
        if body.num_samples > claimed:  # an aggregator may not weigh its clients more than they said
            raise WireError("implausible", f"{peer}'s aggregate weighs {body.num_samples} samples; its "
                                           f"{len(body.clients)} clients announced {claimed}")
        if body.num_samples > 0:
            self._check_tensors(peer, msg)
        return digest

    def _check_tensors(self, peer: str, msg: Message) -> None:
        """An aggregate's tensors: only the method's summed uploads, its delta as a client's is checked (and the
        method's own check), within the norm bound, and no float tensor longer than the longest of its clients'
        (from their notices' square sums; not under edge rounds, whose aggregate adds what the earlier edge rounds
        moved)."""
        server, settings = self.state.server, self.state.config.aggregation
        stray = sorted(name for name in msg.tensors if not name.startswith(tuple(server.summable)))
        if stray:
            raise WireError("bad_shape", f"{peer}'s aggregate carries tensors the method does not sum ({stray[:3]})")
        check_delta(msg.tensors, msg.body.num_samples, server.global_state)
        try:
            server.check_update(msg.task, msg.tensors)
        except ValueError as exc:
            raise WireError("bad_shape", str(exc)) from None
        update = ClientUpdate(peer, msg.body.num_samples, msg.tensors, square_sums=msg.square_sums)
        if (limit := settings.max_update_norm) is not None and not (norm := delta_norm(update)) <= limit:
            raise WireError("norm_bound", f"{peer}'s aggregate has L2 norm {norm:.4g} > {limit:g}")
        if self.state.config.topology.edge_rounds > 1:
            return
        clients = [self._announced[c] for c in msg.body.clients
                   if c in self._announced and self._announced[c].num_samples > 0]
        for name, squares in msg.square_sums.items():
            longest = max((u.square_sums.get(name, 0.0) for u in clients), default=0.0)
            if squares > longest * (1 + SQUARES_TOLERANCE):
                raise WireError("norm_bound", f"{peer}'s aggregate: {name!r} has L2 norm {math.sqrt(squares):.4g}, "
                                              f"longer than any of its {len(clients)} clients' updates "
                                              f"({math.sqrt(longest):.4g})")

    # ------------------------------------------------------------------ what a round takes
    def _groups(self, number: int, answers: dict[str, Message]) -> EdgeGroups:
        """The aggregates taken, after the plain round's defences across them (each aggregate one update of the
        cohort of aggregates: the norm bound, the direction check, clipping and the adaptive bound)."""
        self.last_wide_area_s = self.wide_area_s(answers)
        self._count_tier_bytes(answers)
        updates, clients = [], {}
        for name, msg in sorted(answers.items()):
            body = msg.body
            for client, (reason, detail) in body.refused.items():
                self.state.rejected(reason, client, detail)
            clients[name] = list(body.clients)
            if body.num_samples > 0:
                updates.append(ClientUpdate(name, body.num_samples, msg.tensors, body.loss,
                                            square_sums=msg.square_sums))
        kept, refused = bound(updates, Defences.of(self.state.config.aggregation), tuple(self.state.server.summable),
                              cohort="the other aggregators' aggregates")
        for name, (reason, detail) in sorted(refused.items()):
            self.state.rejected(reason, name, detail)
            del clients[name]
            self._counted_out(number, name, reason)
        for name in clients:
            self.round_aggregates[name]["taken"] = len(clients[name])
        return EdgeGroups(kept, clients)

    def _count_tier_bytes(self, answers: dict[str, Message]) -> None:
        for msg in answers.values():
            for direction in self.tier_bytes:
                nbytes = msg.body.tier_bytes.get(direction, 0)
                self.tier_bytes[direction] += nbytes
                self.round_bytes[direction] += nbytes
                self.state.metrics.edge_tier_bytes(direction, nbytes)

    def _note_missing(self, number: int, name: str, body) -> None:
        """An answer that leaves out clients it was asked for, said (``missing``) or not: in the round's record; one
        that leaves out every one, also a warning (once per aggregator) and an event."""
        record = self.round_aggregates[name]
        left_out = set(self._asked[name]) - set(body.clients) - set(body.refused)
        record.update(refused=len(body.refused), missing=len(left_out))
        if not left_out:
            return
        unsaid = len(left_out - set(body.missing))
        self.state.event("edge_clients_missing", aggregator=name, round=number, missing=len(left_out),
                         asked=len(self._asked[name]), unsaid=unsaid)
        if len(left_out) == len(self._asked[name]):
            self.state.log_once(name, "dropped all its clients",
                                f"edge aggregator {name} left out every one of the {len(left_out)} clients it was "
                                f"asked for in round {number} ({unsaid} without saying so): their answers are lost")

    def _counted_out(self, number: int, name: str, reason: str) -> None:
        """An aggregator's share of round ``number`` failed on its refused aggregate: its clients are out of it."""
        self.round_aggregates[name]["outcome"] = reason
        self.state.event("edge_aggregate_refused", aggregator=name, round=number, clients=len(self._asked[name]),
                         reason=reason)

    def _missing(self, number: int, name: str, clients: list[str], why: str) -> None:
        self.round_aggregates[name]["outcome"] = why
        log.warning("edge aggregator %s sent no aggregate for round %d (%s): its %d clients' answers are lost",
                    name, number, why, len(clients))
        self.state.event("edge_aggregate_missing", aggregator=name, round=number, clients=len(clients), why=why)

    def shutdown(self, reason: str) -> None:
        """Tell every aggregator the run is over (after its clients were told)."""
        for name in sorted(self.names):
            self.send(name, "shutdown", Shutdown(reason=reason))


HELD_WHAT = {"update": "update", "secagg_masked": "masked input"}  # an answer held at an edge, in words


class EdgeCollection(PlainCollection):
    """``--edge-aggregators``: each client's update stays at its edge aggregator, which the coordinator hears of
    (``update_held``); once the round has closed, each aggregator sends the weighted mean of its clients that made
    the round, after the plain round's defences over them. The method aggregates one update per aggregator,
    weighing its clients' samples: the flat round's weighted mean."""

    def __init__(self, state: RunState, tier: EdgeTier):
        super().__init__(state)
        self.tier = tier
        self._groups: EdgeGroups | None = None

    def check(self, msg_type: str) -> None:
        super().check(msg_type)
        self.tier.check_direct(msg_type)

    def collect(self, r: OpenRound, clock, serve: Serve, side_channel: SideChannel) -> None:
        clock.collect(r, serve, side_channel)
        self._groups = self.tier.gather(r, serve)
        clock.wide_area(r, self.tier.last_wide_area_s)

    def gathered(self, r: OpenRound, stale: list[ClientUpdate]) -> Gathered:
        """One update per aggregator that answered; the contributors are its clients it did not refuse."""
        groups, self._groups = self._groups, None
        contributors = sorted(c for clients in groups.clients.values() for c in clients)
        counted = set(contributors)
        losses = [u.loss for u in r.counted if u.client in counted]
        enough = len(contributors) >= self.state.config.rounds.min_participants
        rule = self.state.config.aggregation.aggregator().min_updates  # --aggregator over the aggregates
        return Gathered(groups.updates, losses, quorum=rule if enough else len(groups.updates) + 1,
                        contributors=contributors, client_edge_bytes=self.tier.round_bytes,
                        edge_aggregates=self.tier.round_aggregates)


def _digest(tensors: dict[str, np.ndarray]) -> bytes | None:
    """A digest of an aggregate's tensors, names and bytes (None where it carries none): what a replay repeats."""
    if not tensors:
        return None
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(np.ascontiguousarray(tensors[name]).data)
    return h.digest()
