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

An aggregator speaks under its own name (``edge-aggregator-<a>``): heartbeats, by which the coordinator routes to
it and notices that it is gone (each with the aggregator's refusals so far, by reason: the summary's), and its
aggregates.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fcl_emu.aggregation.clipping import delta_norm
from fcl_emu.aggregation.defences import Defences, bound
from fcl_emu.aggregation.update import ClientUpdate
from fcl_emu.coordinator.open_round import OpenRound
from fcl_emu.coordinator.state import RunState
from fcl_emu.coordinator.update_checks import check_delta
from fcl_emu.runconfig.topology import aggregator_name
from fcl_emu.wire.framing import Message, WireError
from fcl_emu.wire.messages import EdgeCollect, Shutdown

log = logging.getLogger("fcl_emu.coordinator")

Serve = Callable[[Callable[[], bool], float], None]

TIER_DIRECTIONS = ("sent", "received")
MAX_TIER_BYTES = 1 << 50  # what one aggregate may say its clients' links carried (a petabyte)
SQUARES_TOLERANCE = 1e-4  # relative, on an aggregate tensor's square sum: float32 rounding of the mean
TAKEN_KEPT = 4096  # digests of the aggregates taken last, which a new one may not repeat


@dataclass
class EdgeGroups:
    """What the aggregators sent for one round: one update per aggregator taken (its clients' weighted mean, named
    after it) and the clients in each."""

    updates: list[ClientUpdate]
    clients: dict[str, list[str]]


class EdgeTier:
    """The run's edge aggregators as the coordinator sees them. ``send(identity, type, body, **kw)`` returns the
    bytes sent, 0 where the peer is gone (the dispatcher's ``try_send``) and ``serve`` serves the socket (its
    ``serve``): both set once the dispatcher exists. :attr:`round_aggregates` is the last round's outcome per
    aggregator asked (its round record's ``edge_aggregates``)."""

    def __init__(self, state: RunState, count: int, liveness_timeout_s: float, answer_timeout_s: float | None = None):
        self.state, self.liveness_timeout_s = state, liveness_timeout_s
        self.answer_timeout_s = answer_timeout_s or liveness_timeout_s  # the most a round waits for its aggregates
        self.names = frozenset(aggregator_name(a) for a in range(count))
        self.send: Callable[..., int] = lambda *a, **kw: 0
        self.serve: Serve = lambda until, deadline: None  # the dispatcher's serve(until, deadline), once it exists
        self.wire_sent: Callable[[], int] = lambda: 0  # bytes the coordinator's socket put on the wire
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

    def gather(self, r: OpenRound) -> EdgeGroups:
        """Ask each aggregator for the aggregate of its clients among the round's on-time updates, after the
        plain round's defences; wait; return the answers taken (the refusals each reports counted and logged as the
        coordinator's own)."""
        groups: dict[str, list[str]] = defaultdict(list)
        for u in r.counted:
            groups[r.held_at[u.client]].append(u.client)
        security = self.state.config.security
        self._announced = {u.client: u for u in r.counted}  # what each client's notice said: samples, square sums
        answers = self.ask(r.task, r.number, groups, lambda clients: EdgeCollect(
            clients=clients, prefixes=list(self.state.server.summable), max_update_norm=security.max_update_norm,
            direction_check=security.direction_check, clip_norm=security.clip_norm,
            adaptive_clip=security.adaptive_clip))
        return self._groups(r.number, answers)

    def sum_masked(self, task: int, number: int,
                   groups: dict[str, list[str]]) -> dict[str, tuple[list[str], np.ndarray | None]]:
        """A secure round's masked-input phase: each answering aggregator's ring sum of the masked inputs of its
        clients in ``groups``, with the clients its answer names; :attr:`last_wide_area_s` their time up."""
        answers = self.ask(task, number, groups, lambda clients: EdgeCollect(clients=clients, prefixes=[]), sums=True)
        for name, msg in answers.items():
            self.round_aggregates[name]["taken"] = len(msg.body.clients)
        self._count_tier_bytes(answers)
        self.last_wide_area_s = self.wide_area_s(answers)
        return {name: (list(msg.body.clients), msg.tensors.get("y")) for name, msg in answers.items()}

    def ask(self, task: int, number: int, groups: dict[str, list[str]],
            ask_for: Callable[[list[str]], EdgeCollect], sums: bool = False) -> dict[str, Message]:
        """Send each aggregator of ``groups`` its ``edge_collect`` for its clients (``sums``: for the ring sum of
        their masked inputs); serve until each has answered (or its answer was refused), gone silent or the answer
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
        self.serve(lambda: self._waiting() == [], time.monotonic() + self.answer_timeout_s)
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
        server, security = self.state.server, self.state.config.security
        stray = sorted(name for name in msg.tensors if not name.startswith(tuple(server.summable)))
        if stray:
            raise WireError("bad_shape", f"{peer}'s aggregate carries tensors the method does not sum ({stray[:3]})")
        check_delta(msg.tensors, msg.body.num_samples, server.global_state)
        try:
            server.check_update(msg.task, msg.tensors)
        except ValueError as exc:
            raise WireError("bad_shape", str(exc)) from None
        update = ClientUpdate(peer, msg.body.num_samples, msg.tensors, square_sums=msg.square_sums)
        if (limit := security.max_update_norm) is not None and not (norm := delta_norm(update)) <= limit:
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
        kept, refused = bound(updates, Defences.of(self.state.config.security), tuple(self.state.server.summable),
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


def _digest(tensors: dict[str, np.ndarray]) -> bytes | None:
    """A digest of an aggregate's tensors, names and bytes (None where it carries none): what a replay repeats."""
    if not tensors:
        return None
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(np.ascontiguousarray(tensors[name]).data)
    return h.digest()
