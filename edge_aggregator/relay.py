"""The edge aggregator's process: a relay between its edge nodes' shared connections and the coordinator that
holds its clients' updates and sends one aggregate up per round (docs/hierarchy.md).

Downstream it is what the coordinator is to a node: a ROUTER (with keys, a CurveZMQ server under its own key pair
that admits the run's roster) taking shared connections, whose envelopes name the clients. Upstream it is one
shared connection of its own that speaks for all its nodes' clients (its grant in the run's key directory lists
them) and, under its own name, for itself. Only what a client may send goes up (``wire.messages.SENDERS``): a
notice or an aggregate only an aggregator may send, or a coordinator's message, is refused here, and reported up as
the client's error where it stood for its part in a round. The rest crosses frame by frame, as it came, with two
exceptions:

- a client's ``update`` (or ``secagg_masked``) is decoded, checked and held
  (:class:`~fcl_emu.edge_aggregator.held.HeldUpdates`); the coordinator gets an ``update_held``
  (``secagg_masked_held``) in its place (the body, the aggregator's name, the bytes the client sent), and later,
  asked by an ``edge_collect``, one ``edge_aggregate`` for the round;
- tensors the coordinator sends once per connection (a round's model) arrive once and go once down each node's
  connection, as the coordinator's own endpoint does (:class:`~fcl_emu.wire.sockets.HeldSets`).

Every message a client link carries is counted (the client-to-edge tier's bytes) and reported in the next
aggregate; the aggregator's own heartbeat goes up every heartbeat interval, so the coordinator can route to it and
notice it is gone, with the counts of what it refused by reason (the run's ``summary.json``). Its log lines about
refusals are bounded as the coordinator's are, and show no raw bytes of a peer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import msgspec
import zmq

from fcl_emu.aggregation.defences import Defences
from fcl_emu.edge_aggregator.edge_rounds import Again, EdgeRounds, Work
from fcl_emu.edge_aggregator.held import HeldUpdates
from fcl_emu.runtime.log_budget import LogOnce, shown
from fcl_emu.wire.auth import Allowlist, ClientKeys, ServerKeys
from fcl_emu.wire.framing import Limits, WireError, decode, encode, frames_nbytes, peek_header, wire_tensors
from fcl_emu.wire.messages import (BODY_SCHEMAS, CLIENT, HELD_AT_EDGE, ROUND_MESSAGES, EdgeCollect, Error, Heartbeat,
                                   sent_by)
from fcl_emu.wire.sockets import (HELD, MAX_ENVELOPE_BYTES, HeldSets, bound_router, check_grant, drop_rest,
                                  receive_frames, shared_dealer)

log = logging.getLogger("fcl_emu.edge_aggregator")

EDGE_KEY = b"E"  # the aggregator's own tensor sets (an edge model) are held under keys of their own


class EdgeAggregator:
    """One edge aggregator: ``bind`` for its nodes, ``connect`` to the coordinator, speaking as ``name``.

    ``server_keys``: serve CurveZMQ downstream (its key pair and the roster of keys that may connect) and
    ``client_keys``: connect upstream with them; both None for plain TCP. ``edge_rounds``: edge aggregations per
    cloud round (:mod:`~fcl_emu.edge_aggregator.edge_rounds`), each waiting at most ``edge_round_timeout_s``, each
    before the last bounded by ``defences``. ``max_held_bytes``: the most its held updates may take (None: one of
    the model's size per client relayed, :class:`~fcl_emu.edge_aggregator.held.HeldUpdates`)."""

    def __init__(self, name: str, connect: str, bind: str, *, server_keys: ServerKeys | None = None,
                 client_keys: ClientKeys | None = None, heartbeat_interval_s: float = 1.0, edge_rounds: int = 1,
                 edge_round_timeout_s: float = 120.0, defences: Defences = Defences(), limits: Limits = Limits(),
                 max_held_bytes: int | None = None, context: zmq.Context | None = None):
        self.name, self.limits, self.heartbeat_interval_s = name, limits, heartbeat_interval_s
        self.context = context or zmq.Context()
        self._allowlist = None if server_keys is None else Allowlist(self.context, server_keys)
        self.grants = None if server_keys is None else server_keys.grants
        self.down, self.address = bound_router(self.context, bind, limits, server_keys)
        self.up = shared_dealer(self.context, connect, limits, client_keys)
        self.held = HeldUpdates(max_held_bytes)
        self.edge_rounds = EdgeRounds(edge_rounds, edge_round_timeout_s, defences) if edge_rounds > 1 else None
        self._routes: dict[str, bytes] = {}  # client -> the node connection it last spoke on
        self._sets: dict[bytes, list] = {}  # key -> tensor frames the coordinator sent once (the latest few)
        self._node_sets: dict[bytes, HeldSets] = {}  # node connection -> the keys it holds
        self._seq = 0
        self.tier_bytes = {"sent": 0, "received": 0}  # client links, since the last aggregate
        self.rejected: Counter[str] = Counter()  # client messages refused here, by reason (reported up)
        self._log_once = LogOnce(log, counted_in="counted in the coordinator's summary.json, rejected_messages: "
                                                 "edge/<reason>")
        self.shutdown = False

    @property
    def refused(self) -> int:
        """Client messages refused here."""
        return sum(self.rejected.values())

    # ------------------------------------------------------------------ the loop
    def run(self, stop: threading.Event | None = None) -> None:
        """Relay until the coordinator's shutdown (or ``stop``)."""
        poller = zmq.Poller()
        poller.register(self.down, zmq.POLLIN)
        poller.register(self.up, zmq.POLLIN)
        beat_at = 0.0
        while not self.shutdown and not (stop is not None and stop.is_set()):
            now = time.monotonic()
            if now >= beat_at:
                self._send_up(self.name, "heartbeat", Heartbeat(rejected=dict(self.rejected)))
                beat_at = now + self.heartbeat_interval_s
            for sock in dict(poller.poll(int(1000 * min(0.2, self.heartbeat_interval_s)))):
                while not self.shutdown and sock.poll(0):
                    self._from_node() if sock is self.down else self._from_coordinator()
            for again in [] if self.edge_rounds is None else self.edge_rounds.due(time.monotonic()):
                self._train_again(again)

    def close(self) -> None:
        for sock in (self.down, self.up):
            sock.close(linger=1000)
        if self._allowlist is not None:
            self._allowlist.stop()

    # ------------------------------------------------------------------ up
    def _from_node(self) -> None:
        route = self.down.recv(copy=False).bytes
        envelope = self.down.recv(copy=False)
        identity = envelope.bytes.decode("utf-8", "replace")
        try:
            if len(envelope) > MAX_ENVELOPE_BYTES or HELD in envelope.bytes:
                drop_rest(self.down, envelope.more)
                raise WireError("bad_header", f"an envelope of {len(envelope)} bytes from a node")
            try:
                check_grant(self.grants, envelope, identity)
            except WireError:
                drop_rest(self.down, envelope.more)
                raise
            if not envelope.more:  # a close notice: the client's session ended
                if self._routes.get(identity) == route:
                    self.up.send(envelope.bytes)
                return
            frames = receive_frames(self.down, self.limits)  # the whole message, or refused and dropped
            header = peek_header(frames[0], self.limits)
            if header.sender != identity:
                raise WireError("not_authorized", f"a message naming {header.sender!r} in an envelope for "
                                                  f"{identity!r}")
        except WireError as exc:
            self._refuse(identity, exc)
            return
        self._routes[identity] = route
        nbytes = frames_nbytes(frames)
        self.tier_bytes["received"] += nbytes
        if not sent_by(header.type, CLIENT):  # an aggregator's notice or aggregate, a coordinator's or worker's message
            self._refuse_answer(identity, header, WireError("unexpected", f"{header.type!r} is not a client's "
                                                                          f"message: not relayed"))
        elif header.type in HELD_AT_EDGE:
            self._hold(identity, header, frames, nbytes)
        else:
            self.up.send_multipart([envelope.bytes, *frames], copy=False)

    def _hold(self, identity: str, header, frames: list, nbytes: int) -> None:
        """Hold a client's update or masked input (``header``: its read header) and tell the coordinator it arrived
        (with edge rounds: an update of an edge round before the last goes into the edge model instead)."""
        try:
            msg = decode(frames, self.limits)
            if msg.type == "secagg_masked":
                self.held.hold_masked(msg)
            elif self.edge_rounds is None:
                self.held.hold(msg)
            else:
                update = self.held.check(msg)
                if not self._edge_round_answer(msg, update, nbytes):
                    return  # into the edge round in progress: the coordinator hears of the client's last one only
                self.held.keep(msg.round, update)
        except WireError as exc:
            self._refuse_answer(identity, header, exc)
            return
        fields = msgspec.structs.asdict(msg.body)
        work = None if self.edge_rounds is None else self.edge_rounds.work(msg.round, identity)
        if work is not None:  # the client's work over every edge round of the round
            fields.update(cpu_s=work.cpu_s, train_time_s=work.train_time_s)
            nbytes = work.nbytes
        held_type = HELD_AT_EDGE[msg.type]
        if held_type == "update_held":  # what bounds the aggregate at the coordinator
            fields["square_sums"] = dict(msg.square_sums)
        notice = BODY_SCHEMAS[held_type](**fields, aggregator=self.name, nbytes=nbytes)
        head = encode(held_type, notice, sender=identity, seq=msg.seq, round=msg.round, task=msg.task)
        self.up.send_multipart([identity.encode(), *head], copy=False)

    def _edge_round_answer(self, msg, update, nbytes: int) -> bool:
        """A checked update under edge rounds: True if it is its client's last of the round (to hold); else it went
        into the edge round in progress, which may have started the next."""
        last, again = self.edge_rounds.answered(msg.round, update, Work(msg.body.cpu_s, msg.body.train_time_s,
                                                                         nbytes))
        if again is not None:
            self._train_again(again)
        return last

    def _train_again(self, again: Again) -> None:
        """The next edge round: the updates the defences refused in the one that closed are refused as on arrival
        (reported up as their clients' errors of the round); each client asked again is sent the edge model (once
        down each node's connection)."""
        for client, (reason, detail) in again.refused.items():
            self._refuse_answer(client, again, WireError(reason, detail))
        self._seq += 1
        tensors = wire_tensors(again.model)
        key = EDGE_KEY + tensors.key.to_bytes(8, "little")
        self._sets[key] = list(tensors.buffers)
        head = encode("train_request", again.request, sender=self.name, seq=self._seq, round=again.round,
                      task=again.task, tensors=tensors)[0]
        for client in again.clients:
            route = self._routes.get(client)
            if route is None:
                continue
            try:
                self._give_set(route, key)
                self.down.send_multipart([route, client.encode() + HELD + key, head], copy=False)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                continue
            self.tier_bytes["sent"] += len(head) + frames_nbytes(tensors.buffers)

    def _refuse(self, identity: str, exc: WireError) -> None:
        """A client message refused here: counted by reason (each heartbeat reports the counts up, to the run's
        summary) and logged within the log's budgets (:class:`~fcl_emu.runtime.log_budget.LogOnce`), the peer's
        identity and the detail escaped and cut (a refused update is also reported up as the client's ``error``, so
        its round stops waiting for it)."""
        self.rejected[exc.reason] += 1
        self._log_once(identity, exc.reason, f"{self.name}: refused a message from {shown(identity)} ({exc.reason}: "
                                             f"{shown(exc.detail, 200)})")

    def _refuse_answer(self, identity: str, header, exc: WireError) -> None:
        """Refuse a client's message (``header``: its read header); where it was its part in a round (an update, a
        SecAgg+ reply, a side channel, or a notice only an aggregator may send), report it up as the client's
        ``error`` of that round, so the round fails the client at once instead of waiting for it."""
        self._refuse(identity, exc)
        if header.type in ROUND_MESSAGES:
            self._send_up(identity, "error", Error(code=exc.reason, detail=f"refused by {self.name}: {exc.detail}"),
                          round=header.round, task=header.task)

    def _send_up(self, identity: str, msg_type: str, body, **kw) -> None:
        """A message of the aggregator's own up, speaking as ``identity`` (itself, or a client it reports on)."""
        self._seq += 1
        frames = encode(msg_type, body, sender=identity, seq=self._seq, **kw)
        self.up.send_multipart([identity.encode(), *frames], copy=False)

    # ------------------------------------------------------------------ down
    def _from_coordinator(self) -> None:
        first = self.up.recv(copy=False)
        if not first.more:  # nothing the coordinator sends: an envelope alone
            return
        envelope = first.bytes
        name, _, key = envelope.partition(HELD)
        identity = name.decode("utf-8", "replace")
        try:
            frames = receive_frames(self.up, self.limits)
        except WireError as exc:
            log.warning("refused a message from the coordinator (%s)", exc)
            return
        if key and not name:  # tensors to hold for the messages that name them
            self._sets[key] = frames[1:]
            for old in list(self._sets)[:-8]:
                del self._sets[old]
            return
        if identity == self.name:
            self._for_me(frames)
            return
        route = self._routes.get(identity)
        if route is None:
            return  # a client that never spoke through here (or a message after its node left)
        header = peek_header(frames[0], self.limits)
        if header.type == "train_request":
            self.held.on_train_request(header.round, header.tensors, identity)
            if self.edge_rounds is not None and not self.edge_rounds.join(header.round, identity):
                self._first_edge_round(identity, frames, key)  # the round's first: its model is decoded once
        elif header.type == "cancel" and self.edge_rounds is not None:
            self.edge_rounds.cancelled(header.round, identity)
        elif header.type == "secagg_setup":
            self._on_secagg_setup(frames)
        try:
            if key:
                self._give_set(route, key)
            self.down.send_multipart([route, envelope, *frames], copy=False)
        except zmq.ZMQError as exc:  # the node's connection is gone
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            return
        self.tier_bytes["sent"] += frames_nbytes(frames) + (frames_nbytes(self._sets.get(key, [])) if key else 0)

    def _first_edge_round(self, identity: str, frames: list, key: bytes) -> None:
        """A train request from the coordinator: its client takes part in the round's edge rounds."""
        msg = self._from_coordinator_decoded([frames[0], *(self._sets.get(key, []) if key else frames[1:])])
        if msg is not None:
            self.edge_rounds.requested(msg.round, msg.task, identity, msg.body, msg.tensors)

    def _on_secagg_setup(self, frames: list) -> None:
        msg = self._from_coordinator_decoded(frames)
        if msg is not None:
            self.held.on_secagg_setup(msg.round, msg.body.params)

    def _from_coordinator_decoded(self, frames: list):
        """The coordinator's message ``frames`` decoded; None (logged) where it fails its checks."""
        try:
            return decode(frames, self.limits)
        except WireError as exc:
            log.warning("refused a message from the coordinator (%s)", exc)
            return None

    def _give_set(self, route: bytes, key: bytes) -> None:
        """Make the node connection ``route`` hold the tensor set ``key`` (sent once, as the coordinator does)."""
        held = self._node_sets.setdefault(route, HeldSets())
        if held.use(key):
            return
        buffers = self._sets[key]
        self.down.send_multipart([route, HELD + key, b"", *buffers], copy=False)
        held.keep(key, frames_nbytes(buffers), True)

    def _for_me(self, frames: list) -> None:
        msg = self._from_coordinator_decoded(frames)
        if msg is None:
            return
        if msg.type == "shutdown":
            self.shutdown = True
        elif msg.type == "edge_collect":
            self._collect(msg.round, msg.task, msg.body)

    def _collect(self, round: int, task: int, ask: EdgeCollect) -> None:
        try:
            aggregate = self.held.collect(round, ask, None if self.edge_rounds is None else
                                          self.edge_rounds.offset(round))
        except ValueError as exc:  # uploads that cannot be averaged together (a method's extras in some only)
            log.warning("round %d: cannot combine the updates asked for (%s); sending no aggregate", round, exc)
            return
        aggregate.body.tier_bytes, self.tier_bytes = self.tier_bytes, {"sent": 0, "received": 0}
        self._send_up(self.name, "edge_aggregate", aggregate.body, round=round, task=task,
                      tensors=wire_tensors(aggregate.tensors))
