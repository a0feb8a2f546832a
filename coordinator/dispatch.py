"""Message dispatch: how the coordinator serves its ROUTER socket.

:meth:`Dispatcher.serve` handles every message that arrives (clients', and the GPU pool's) while the
coordinator waits, for joins, for updates or for a server-side job, so joins, heartbeats and leaves are served
during rounds. Each client message is received, validated by the wire layer, then handled by its type:
``join`` (registers the client and answers ``welcome``), ``heartbeat``, ``leave``, ``error``, ``update`` (into
the open round, or late), the secure-aggregation replies (to the run's collection,
:mod:`fcl_emu.coordinator.collection`) and a method's side-channel messages. A bad message is rejected: counted
under its reason, logged once per reason, answered with an ``error`` where the peer is online; it never stops the
loop.

The round runner opens and closes the round the dispatcher fills in (:attr:`Dispatcher.round`); every answer of
every kind of round (plain, secure, an asynchronous wave) passes through here, so after each batch of messages the
dispatcher tells the progress display how many of the round's clients have answered (``answered``). Which answers a
round takes is its collection's; where a client's answer lands in time is the clock's
(:mod:`fcl_emu.coordinator.clock`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from fcl_emu.coordinator.clock import RunClock
from fcl_emu.aggregation.clipping import delta_norm
from fcl_emu.coordinator.guard import RateLimiter
from fcl_emu.coordinator.open_round import OpenRound, StaleUpdates
from fcl_emu.coordinator.collection import Collection
from fcl_emu.coordinator.edge_tier import FlatStar, Tier
from fcl_emu.coordinator.state import RunState
from fcl_emu.coordinator.update_checks import check_delta
from fcl_emu.aggregation.update import ClientUpdate
from fcl_emu.runtime.run_log import NONFINITE_LOSS
from fcl_emu.scenario.devices import DeviceProfile
from fcl_emu.wire.framing import Message, WireError, link_nbytes
from fcl_emu.wire.messages import (CLIENT, HELD_AT_EDGE, ROUND_MESSAGES, SECAGG_REPLIES, SIDE_CHANNEL_TYPES, Cancel,
                                   Error, Welcome, client_id, sent_by)

log = logging.getLogger("fcl_emu.coordinator")

HELD_NOTICES = frozenset(HELD_AT_EDGE.values())  # an edge aggregator's word, in a client's name, that it holds one
UPDATES = frozenset({"update", "update_held"})  # a client's update, or its edge aggregator's word that it holds one
RATE_LIMITED = frozenset({"join", "heartbeat", "leave", "error"})  # control messages: a peer's bucket (guard.py)
NOT_JOINED_INTERVAL_S = 1.0  # at most one `not_joined` error per peer in this time


class Dispatcher:
    """Serving the coordinator's socket: receive, validate, handle by type, reject.

    ``endpoint``: the ROUTER (:class:`fcl_emu.wire.sockets.ServerEndpoint`); ``pool``: the GPU worker pool, whose
    sockets are served in the same loop; ``welcome``: the run's fields of every ``welcome`` (the device profiles
    clients are assigned at join: ``state.devices``); ``on_tick``: called each time the loop wakes (the node
    watch); ``tier``: the run's tier (:func:`~fcl_emu.coordinator.edge_tier.make_tier`), whose own messages go
    there."""

    def __init__(self, state: RunState, endpoint, pool, clock: RunClock, collection: Collection, stale: StaleUpdates,
                 rate_limiter: RateLimiter, *, welcome: dict[str, Any], on_tick: Callable[[], None] = lambda: None,
                 tier: Tier = FlatStar()):
        self.state, self.config, self.registry, self.metrics = state, state.config, state.registry, state.metrics
        self.endpoint, self.pool, self.clock, self.collection, self.stale = endpoint, pool, clock, collection, stale
        self.rate_limiter, self.welcome, self.on_tick, self.tier = rate_limiter, welcome, on_tick, tier
        self.round: OpenRound | None = None  # the open round, set by the round runner
        self._not_joined_at: dict[str, float] = {}  # when each unknown peer was last told to join
        self._next_expiry = 0.0  # monotonic time of the next liveness scan
        self._listened_at = time.monotonic()  # when the waiting messages were last all handled
        self._answers_shown: tuple[int, int, int] | None = None  # (round, answered, selected) last told

    # ------------------------------------------------------------------ the loop
    def serve(self, until: Callable[[], bool], deadline: float) -> None:
        """Handle messages (clients', and the GPU pool's) until ``until()`` holds or the monotonic ``deadline``
        passes."""
        sock = self.endpoint.sock
        poller = zmq.Poller()
        for s in (sock, *self.pool.sockets()):
            poller.register(s, zmq.POLLIN)
        tick_ms = max(10, int(1000 * min(0.2, self.config.network.heartbeat_interval_s)))
        while not until():
            now = time.monotonic()
            if now >= deadline:
                return
            for ready in dict(poller.poll(min(tick_ms, int(1000 * (deadline - now)) + 1))):
                if ready is sock:
                    self._receive_waiting()
                else:
                    self.pool.on_readable(ready)
            self.pool.tick()
            self._expire()
            self.on_tick()

    def _receive_waiting(self) -> None:
        """Handle every message waiting; those queued while the coordinator did not listen (a task's end, a
        long aggregation) are rate-limited as sent over that time, not as a burst."""
        with self.rate_limiter.backlog(time.monotonic() - self._listened_at):
            while self.endpoint.sock.poll(0):
                self._receive_one()
        self._listened_at = time.monotonic()
        self._show_answers()

    def _show_answers(self) -> None:
        """An ``answered`` progress event when the open round's count of answers (updates, masked inputs,
        errors) has changed since the last one."""
        r = self.round
        if r is None:
            return
        shown = (r.number, len(r.answered()), len(r.selected))
        if shown != self._answers_shown:
            self._answers_shown = shown
            self.state.progress("answered", {"task": r.task, "answered": shown[1], "selected": shown[2]})

    def _receive_one(self) -> None:
        """Receive, validate and handle one message; time it by message type."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        msg_type = "rejected"
        try:
            received = self.endpoint.recv()
            if received is None:  # a close notice on a shared connection, taken by the endpoint
                return
            peer, msg = received
            msg_type = msg.type
            try:
                self._handle(peer, msg)
            finally:
                if self.endpoint.switched:
                    self._on_new_connection(peer, msg.type)
        except WireError as exc:
            self.reject(exc)
        elapsed = time.perf_counter() - started
        self.state.tally.handling_s[msg_type] += elapsed
        self.state.tally.handling_cpu_s[msg_type] += time.thread_time() - cpu_started
        self.metrics.handled(msg_type, elapsed)

    def drain(self) -> None:
        """Handle every message already waiting, without blocking; then expire silent clients and look at the
        edge nodes (a node that died while nothing was served, at a task's end, say, is noticed here)."""
        self._receive_waiting()
        self._expire()
        self.on_tick()

    def _expire(self) -> None:
        """Declare dead the clients silent for longer than the liveness timeout; a scan over all clients, so ten
        per timeout (the timeout grows with the population: at 100,000 clients a scan every 100 s, not every
        second)."""
        now = time.monotonic()
        if now < self._next_expiry:
            return
        self._next_expiry = now + self.registry.liveness_timeout_s / 10
        for silent in self.registry.expire(now):
            self.metrics.client_dropped("heartbeat_timeout")
            self.state.progress("dead", {"client": silent})

    # ------------------------------------------------------------ by message type
    def _handle(self, peer: str, msg: Message) -> None:
        """Handle a received message by its type; a refusal names what was refused (its sender, type and round), so
        that :meth:`reject` fails its client for the round as it does a refusal of the wire layer's."""
        try:
            self._dispatch(peer, msg)
        except WireError as exc:
            exc.peer, exc.msg_type, exc.round = peer, msg.type, msg.round
            raise

    def _dispatch(self, peer: str, msg: Message) -> None:
        if peer in self.tier.names:
            self.tier.on_message(peer, msg)
            return
        if msg.type in HELD_NOTICES:  # taken only over the connection of an aggregator of the run, naming it
            self.tier.check_held(msg, self.endpoint.came_from)
        elif not sent_by(msg.type, CLIENT):
            raise WireError("unexpected", f"{msg.type!r} is not a client's message")
        if msg.type in RATE_LIMITED and not self.rate_limiter.allow(peer):
            raise WireError("rate_limited", f"{msg.type!r}: more control messages than "
                                            f"{self.rate_limiter.rate:g}/s (burst {self.rate_limiter.burst})")
        if msg.type == "join":
            self._on_join(peer, msg)
            return
        if not self.registry.is_online(peer):
            if msg.type != "leave":
                self._not_joined(peer)
            raise WireError("unknown_sender", f"{msg.type!r} from a client that has not joined")
        self.registry.touch(peer)
        if msg.type == "leave":
            if self.registry.leave(peer):
                self.metrics.client_left()
            if msg.body.reason != "unavailable":
                self.state.log_once(None, f"leave: {msg.body.reason}", f"client {peer} left: {msg.body.reason}",
                                    budget="leave")
            self.state.progress("leave", {"client": peer})
        elif msg.type in UPDATES:
            self._on_update(peer, msg)
        elif msg.type in SECAGG_REPLIES:
            self._on_secagg(peer, msg)
        elif msg.type in SIDE_CHANNEL_TYPES:
            self._on_side_channel(peer, msg)
        elif msg.type == "error":
            r = self.round
            if r is not None and peer in r.selected and msg.round == r.number:
                r.failed.add(peer)
                if msg.body.code == "train_failed" and NONFINITE_LOSS.search(msg.body.detail):
                    r.nonfinite_loss.add(peer)
                self.clock.answered(r, peer, msg.nbytes, 0.0, 0)
            self.state.log_once(peer, f"reported {msg.body.code}", f"client {peer} reported {msg.body.code}: "
                                                             f"{msg.body.detail}", budget="reported")

    def _on_new_connection(self, peer: str, msg_type: str) -> None:
        """``peer`` spoke over another connection than before (its message is handled already): what was sent
        to it over the old one may be lost, so the open round stops waiting for it unless it has answered, and
        its next round starts with the task's start and assets again (a join says itself which assets the
        client holds). Two connections taking turns mean two holders of one key."""
        r = self.round
        if r is not None and peer in r.selected and peer not in r.answered():
            r.lost.add(peer)
        record = self.registry.records.get(peer)
        if record is not None and msg_type != "join":
            record.assets_task = -1
        self.state.tally.connection_switches += 1
        self.state.log_once(peer, "new connection", f"client {peer} now speaks over another connection (a restart, a "
                                              f"reconnect, or a second holder of its key): messages sent over "
                                              f"the old one may be lost")

    def _not_joined(self, peer: str) -> None:
        """Tell a peer that is not online to join (again): after a coordinator restart, or once declared dead.
        At most once per peer per NOT_JOINED_INTERVAL_S."""
        now = time.monotonic()
        if now - self._not_joined_at.get(peer, -NOT_JOINED_INTERVAL_S) < NOT_JOINED_INTERVAL_S:
            return
        if len(self._not_joined_at) >= 10_000:  # strangers with ever new identities: forget the old ones
            self._not_joined_at = {p: t for p, t in self._not_joined_at.items()
                                   if now - t < NOT_JOINED_INTERVAL_S}
        self._not_joined_at[peer] = now
        self.send(peer, "error", Error(code="not_joined", detail="send a join first"))

    def _on_join(self, peer: str, msg: Message) -> None:
        index = msg.body.client_index
        if not 0 <= index < self.config.scenario.num_clients:
            raise WireError("unknown_sender",
                            f"client index {index} outside 0..{self.config.scenario.num_clients - 1}")
        if peer != client_id(index):
            raise WireError("not_authorized", f"{peer} may not join as client index {index}")
        join_task = self.state.scenario.join_task(index)
        known = peer in self.registry.records
        was_online = self.registry.is_online(peer)
        r = self.round
        if r is not None and peer in r.selected and peer not in {u.client for u in r.updates}:
            r.lost.add(peer)  # left or crashed and came back: its work for this round is gone
        record = self.registry.join(peer, index, msg.body.node, join_task, msg.body.assets_task)
        devices = self.state.devices
        profile = None if devices is None else devices.assign(index, self.config.seed)
        record.device_class = None if profile is None else profile.name
        record.profile = profile or DeviceProfile()
        self.clock.joined(peer)
        if not known:
            self.metrics.client_joined()
        elif not was_online:
            self.metrics.client_joined(rejoin=True)
        self.send(peer, "welcome", Welcome(join_task=join_task, edge=self.clock.edge_settings(index, profile),
                                           **self.welcome),
                  task=self.state.task, round=self.state.global_round)
        self.state.progress("join", {"client": peer, "index": record.index})

    def _on_update(self, peer: str, msg: Message) -> None:
        self.collection.check(msg.type)
        r = self.round
        if r is None or not r.is_current(peer, msg.round):
            self.state.tally.late_updates += 1
            self.metrics.late_update()
            if (self.config.rounds.late_updates == "next_round" and self.state.server.accepts_stale_updates
                    and msg.task == self.state.task and (r is None or msg.round < r.number)):
                self._keep_stale(peer, msg)
            return
        if peer in r.answered():  # its update or error (a plain collection takes no masked inputs)
            raise WireError("unexpected", f"second update from {peer} in round {r.number}")
        body = msg.body
        nbytes = link_nbytes(msg)  # what the client's link carried
        try:
            self._check_update(peer, msg, r.task)
        except WireError:
            r.failed.add(peer)  # refused: the round does not wait for it
            self.clock.answered(r, peer, nbytes, 0.0, 0)
            raise
        r.updates.append(_client_update(peer, msg))
        if msg.type == "update_held":
            r.held_at[peer] = body.aggregator
        r.reported_s[peer] = body.train_time_s
        self.registry.records[peer].rounds_trained += 1
        trainings = self.config.topology.edge_rounds if msg.type == "update_held" else 1  # each edge round's
        self.clock.answered(r, peer, nbytes, body.cpu_s,
                            body.num_samples * self.config.training.local_epochs * trainings)
        self.cancel(r, self.clock.hopeless(r))

    def _keep_stale(self, peer: str, msg: Message) -> None:
        """Keep a late update for the next round (:class:`~fcl_emu.coordinator.open_round.StaleUpdates`)."""
        if not self.stale.has_room_for(peer, msg.task):
            raise WireError("late_cap", f"late update from {peer} beyond the {self.stale.cap} kept for the next "
                                        f"round (one per client)")
        self._check_update(peer, msg, msg.task)
        self.stale.keep(_client_update(peer, msg))

    def _on_side_channel(self, peer: str, msg: Message) -> None:
        """A method's side-channel message (GLFC's prototype gradients): from a client of the open round, it goes
        to the server part without the sender's identity; one from outside the round is counted late and
        dropped."""
        if msg.type not in self.state.spec.server.side_channels:
            raise WireError("unexpected", f"method {self.state.spec.name!r} takes no {msg.type!r} messages")
        r = self.round
        if r is None or msg.task != r.task or not r.is_current(peer, msg.round):
            self.state.tally.late_side_channel += 1
            return
        if not self.clock.hold_side_channel(r, peer, msg.type, msg.nbytes, msg.tensors):
            self._side_channel_to_method(r.task, msg.type, msg.tensors)

    def side_channel(self, client: str, task: int, msg_type: str, tensors) -> None:
        """A held side-channel message of ``client`` that made its round (the emulated clock's close) to the
        method; one the method refuses is rejected as the message would have been."""
        try:
            self._side_channel_to_method(task, msg_type, tensors)
        except WireError as exc:
            exc.peer = client
            self.reject(exc)

    def _side_channel_to_method(self, task: int, msg_type: str, tensors) -> None:
        try:
            self.state.server.on_side_channel(task, msg_type, tensors)
        except ValueError as exc:
            raise WireError("bad_shape", str(exc)) from None

    def _on_secagg(self, peer: str, msg: Message) -> None:
        """A client's reply in a secure-aggregation phase; a masked input that comes too late counts as late."""
        self.collection.check(msg.type)
        r = self.round
        masked = SECAGG_REPLIES[msg.type] == "masked_input"
        if r is None or not r.is_current(peer, msg.round) or not self.collection.on_secagg(peer, msg):
            if masked:
                self.state.tally.late_updates += 1
                self.metrics.late_update()
            return
        if masked:
            r.masked.add(peer)
            self.registry.records[peer].rounds_trained += 1

    def _check_update(self, peer: str, msg: Message, task: int) -> None:
        """A delta must name exactly the global model's tensors with their shapes, count no more samples than
        the client holds in the task, and stay within the norm bound; the method checks the rest. Of an update
        held at an edge aggregator only the sample count is seen here (the aggregator checks the rest)."""
        record = self.registry.records[peer]
        held = len(self.state.scenario.client_indices(record.index, task))
        if msg.body.num_samples > held:
            raise WireError("implausible", f"{peer} claims {msg.body.num_samples} samples; it holds {held} in "
                                           f"task {task}")
        if msg.type == "update_held":
            return
        check_delta(msg.tensors, msg.body.num_samples, self.state.server.global_state)
        bound = self.config.aggregation.max_update_norm
        if bound is not None and msg.body.num_samples > 0:
            norm = delta_norm(_client_update(peer, msg))
            if not norm <= bound:
                raise WireError("norm_bound", f"{peer}'s model delta has L2 norm {norm:.4g} > {bound:g}")
        try:
            self.state.server.check_update(task, msg.tensors)
        except ValueError as exc:
            raise WireError("bad_shape", str(exc)) from None

    # ------------------------------------------------------------ refusing, sending
    def reject(self, exc: WireError) -> None:
        """Count, log (once) and answer a refused message. A refused message of a client's part in the open round (an
        update, a SecAgg+ reply, a side channel: refused by the wire layer, a handler's checks or the protocol) fails
        its client for the round at once, so the round waits for it no longer; a refused aggregate stops the round's
        wait for that aggregator (its clients' answers are lost, a secure round recovers them as dropouts)."""
        r = self.round
        if r is not None and exc.msg_type in ROUND_MESSAGES and exc.peer is not None and exc.round is not None \
                and r.is_current(exc.peer, exc.round) and exc.peer not in r.answered():
            r.failed.add(exc.peer)
            self.clock.answered(r, exc.peer, 0, 0.0, 0)
        if exc.msg_type == "edge_aggregate" and exc.round is not None:
            self.tier.refused(exc.peer, exc.round, exc.reason)
        self.state.rejected(exc.reason, exc.peer, f"rejected a message from {exc.peer!r} ({exc})")
        if exc.peer and self.registry.is_online(exc.peer) and exc.reason != "rate_limited":
            self.send(exc.peer, "error", Error(code=exc.reason, detail=exc.detail[:500]))

    def cancel(self, r: OpenRound, clients: list[str]) -> None:
        """Tell ``clients`` to drop their training of round ``r``: the clock knows it can no longer count. Outside
        the message sequence: the later messages' headers, whose bytes the emulated clock places, keep their
        sizes."""
        for client in clients:
            self.try_send(client, "cancel", Cancel(), task=r.task, round=r.number, sequenced=False)

    def try_send(self, client_id: str, msg_type: str, body, **kw) -> int:
        """Send; returns the bytes sent, 0 if the peer is gone or its queue is full (:func:`try_send`)."""
        return try_send(self.endpoint, client_id, msg_type, body, **kw)

    def send(self, client_id: str, msg_type: str, body, **kw) -> int:
        """Send (returns the bytes sent); a vanished peer is declared dead (returns 0)."""
        sent = self.try_send(client_id, msg_type, body, **kw)
        if not sent and self.registry.drop(client_id):
            self.metrics.client_dropped("unreachable")
        return sent


def try_send(endpoint, peer: str, msg_type: str, body, **kw) -> int:
    """Send over the ROUTER ``endpoint``; returns the bytes sent, 0 if the peer is gone (EHOSTUNREACH under
    ROUTER_MANDATORY) or its queue is full."""
    try:
        return endpoint.send(peer, msg_type, body, **kw)
    except zmq.ZMQError as exc:
        if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
            raise
        return 0


def _client_update(peer: str, msg: Message) -> ClientUpdate:
    """An update message as the server part sees it, with the square sums its finite check computed."""
    body = msg.body
    square_sums = body.square_sums if msg.type == "update_held" else msg.square_sums  # held: what its aggregator saw
    return ClientUpdate(peer, body.num_samples, msg.tensors, body.loss, body.metrics, square_sums)
