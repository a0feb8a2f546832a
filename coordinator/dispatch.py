"""Message dispatch: how the coordinator serves its ROUTER socket.

:meth:`MessageDispatch.serve` handles every message that arrives (clients', and the GPU pool's) while the
coordinator waits, for joins, for updates or for a server-side job, so joins, heartbeats and leaves are served
during rounds. Each client message is received, validated by the wire layer, then handled by its type:
``join`` (registers the client and answers ``welcome``), ``heartbeat``, ``leave``, ``error``, ``update`` (into
the open round, or late), the secure-aggregation replies (into the open :class:`~coordinator.secure_round.
SecureRound`) and a method's side-channel messages. A bad message is rejected: counted under its reason, logged
once per reason, answered with an ``error`` where the peer is online; it never stops the loop.

A mixin of :class:`coordinator.engine.Coordinator`: it uses the coordinator's ``config``, ``endpoint``,
``registry``, ``metrics``, ``server``, ``scenario``, ``pool`` and the open round (``_round``, ``_secure``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import zmq

from coordinator.guard import delta_norm
from methods.base import DELTA, ClientUpdate
from scenario.availability import client_availability
from scenario.devices import DeviceProfile, assign_profile
from wire.framing import Message, WireError
from wire.messages import SECAGG_REPLIES, SIDE_CHANNEL_TYPES, EdgeSettings, Error, Welcome, client_id

log = logging.getLogger("fcl_emu.coordinator")

CLIENT_TYPES = frozenset({"join", "heartbeat", "leave", "update", "error", *SECAGG_REPLIES, *SIDE_CHANNEL_TYPES})
RATE_LIMITED = frozenset({"join", "heartbeat", "leave", "error"})  # control messages: a peer's bucket (guard.py)
NOT_JOINED_INTERVAL_S = 1.0  # at most one `not_joined` error per peer in this time


class MessageDispatch:
    """Serving the coordinator's socket: receive, validate, handle by type, reject (mixin of Coordinator)."""

    _next_expiry = 0.0  # monotonic time of the next liveness scan

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
                    while sock.poll(0):
                        self._receive_one()
                else:
                    self.pool.on_readable(ready)
            self.pool.tick()
            self._expire()
            self._check_nodes()

    def _receive_one(self) -> None:
        """Receive, validate and handle one message; time it by message type."""
        started = time.perf_counter()
        msg_type = "rejected"
        try:
            peer, msg = self.endpoint.recv()
            msg_type = msg.type
            try:
                self._handle(peer, msg)
            finally:
                if self.endpoint.switched:
                    self._on_new_connection(peer, msg.type)
        except WireError as exc:
            self._reject(exc)
        elapsed = time.perf_counter() - started
        self.handling_s[msg_type] += elapsed
        self.metrics.handled(msg_type, elapsed)

    def _drain(self) -> None:
        """Handle every message already waiting, without blocking; then expire silent clients."""
        while self.endpoint.sock.poll(0):
            self._receive_one()
        self._expire()

    def _expire(self) -> None:
        """Declare dead the clients silent for longer than the liveness timeout; a scan over all clients, so at
        most ten per timeout (and one per second)."""
        now = time.monotonic()
        if now < self._next_expiry:
            return
        self._next_expiry = now + min(1.0, self.registry.liveness_timeout_s / 10)
        for silent in self.registry.expire(now):
            self.metrics.client_dropped("heartbeat_timeout")
            self.progress("dead", {"client": silent})

    # ------------------------------------------------------------ by message type
    def _handle(self, peer: str, msg: Message) -> None:
        try:
            self._dispatch(peer, msg)
        except WireError as exc:
            exc.peer = peer
            raise

    def _dispatch(self, peer: str, msg: Message) -> None:
        if msg.type not in CLIENT_TYPES:
            raise WireError("unexpected", f"{msg.type!r} is not a client-to-coordinator message")
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
                self.log_once(None, f"leave: {msg.body.reason}", f"client {peer} left: {msg.body.reason}")
            self.progress("leave", {"client": peer})
        elif msg.type == "update":
            self._on_update(peer, msg)
        elif msg.type in SECAGG_REPLIES:
            self._on_secagg(peer, msg)
        elif msg.type in SIDE_CHANNEL_TYPES:
            self._on_side_channel(peer, msg)
        elif msg.type == "error":
            r = self._round
            if r is not None and peer in r.selected and msg.round == r.number:
                r.failed.add(peer)
                self._arrived(r, peer, msg.nbytes, 0.0, 0)
            self.log_once(peer, f"reported {msg.body.code}", f"client {peer} reported {msg.body.code}: "
                                                             f"{msg.body.detail}")

    def _on_new_connection(self, peer: str, msg_type: str) -> None:
        """``peer`` spoke over another connection than before (its message is handled already): what was sent
        to it over the old one may be lost, so the open round stops waiting for it unless it has answered, and
        its next round starts with the task's start and assets again (a join says itself which assets the
        client holds). Two connections taking turns mean two holders of one key."""
        r = self._round
        if r is not None and peer in r.selected and peer not in r.answered():
            r.lost.add(peer)
        record = self.registry.records.get(peer)
        if record is not None and msg_type != "join":
            record.assets_task = -1
        self.connection_switches += 1
        self.log_once(peer, "new connection", f"client {peer} now speaks over another connection (a restart, a "
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
        self._send(peer, "error", Error(code="not_joined", detail="send a join first"))

    def _on_join(self, peer: str, msg: Message) -> None:
        index = msg.body.client_index
        if not 0 <= index < self.config.scenario.num_clients:
            raise WireError("unknown_sender",
                            f"client index {index} outside 0..{self.config.scenario.num_clients - 1}")
        if peer != client_id(index):
            raise WireError("not_authorized", f"{peer} may not join as client index {index}")
        join_task = self.scenario.join_task(index)
        known = peer in self.registry.records
        was_online = self.registry.is_online(peer)
        r = self._round
        if r is not None and peer in r.selected and peer not in {u.client for u in r.updates}:
            r.lost.add(peer)  # left or crashed and came back: its work for this round is gone
        record = self.registry.join(peer, index, msg.body.node, join_task, msg.body.assets_task)
        profile = None if self._profiles is None else assign_profile(self._profiles, index, self.config.seed)
        record.device_class = None if profile is None else profile.name
        record.profile = profile or DeviceProfile()
        if not known:
            self.metrics.client_joined()
        elif not was_online:
            self.metrics.client_joined(rejoin=True)
        self._send(peer, "welcome", Welcome(join_task=join_task, edge=self._edge_settings(index, profile),
                                            **self._welcome_template),
                   task=self._task, round=self._global_round)
        self.progress("join", {"client": peer, "index": record.index})

    def _edge_settings(self, index: int, profile: DeviceProfile | None) -> EdgeSettings:
        """What the client's node emulates in host time: everything under the real clock; under the emulated
        clock nothing (availability, crashes and delays are this coordinator's: coordinator/emulated.py)."""
        edge, seed = self.config.edge, self.config.seed
        wire_profile = None if profile is None else profile.to_wire()
        if self.clock is not None:
            return EdgeSettings(profile=wire_profile, clock="emulated")
        return EdgeSettings(
            availability=client_availability(self._availability, index, seed, slot_s=edge.availability_slot_s,
                                             trace_time_scale=edge.trace_time_scale),
            profile=wire_profile, crash_rate=edge.crash_rate, crash_downtime_s=edge.crash_downtime_s,
            clock_s=time.monotonic() - self._clock0)

    def _on_update(self, peer: str, msg: Message) -> None:
        if self.config.secagg.enabled:
            raise WireError("unexpected", "a plain update in a secure-aggregation run (send secagg_masked)")
        r = self._round
        if r is None or msg.round != r.number or peer not in r.selected or peer in r.lost:
            self.late_updates += 1
            self.metrics.late_update()
            if (self.config.rounds.late_updates == "next_round" and self.server.accepts_stale_updates
                    and msg.task == self._task and (r is None or msg.round < r.number)):
                self._keep_stale(peer, msg)
            return
        if peer in {u.client for u in r.updates} | r.failed:
            raise WireError("unexpected", f"second update from {peer} in round {r.number}")
        try:
            self._check_update(peer, msg, r.task)
        except WireError:
            r.failed.add(peer)  # refused: the round does not wait for it
            self._arrived(r, peer, msg.nbytes, 0.0, 0)
            raise
        body = msg.body
        r.updates.append(ClientUpdate(peer, body.num_samples, msg.tensors, body.loss, body.metrics))
        r.train_s[peer] = body.train_time_s
        self.registry.records[peer].rounds_trained += 1
        self._arrived(r, peer, msg.nbytes, body.cpu_s, body.num_samples * self.config.training.local_epochs)

    def _arrived(self, r, peer: str, nbytes: int, cpu_s: float, samples_trained: int) -> None:
        """Emulated clock: place a selected client's answer (update or error) on the round's timeline."""
        timeline = None if r.timeline is None else r.timeline.get(peer)
        if timeline is not None:
            timeline.up_bytes += nbytes
            timeline.arrival = self.clock.arrival(r.started_at, timeline, cpu_s, samples_trained)

    def _keep_stale(self, peer: str, msg: Message) -> None:
        """Keep a late update for the next round: one per client, at most one round's cohort of them (each
        holds a model delta)."""
        cap = math.ceil(self.config.rounds.clients_per_round * self.config.rounds.overcommit)
        if self._stale_task != msg.task:
            self._stale, self._stale_task = [], msg.task
        if len(self._stale) >= cap or any(u.client == peer for u in self._stale):
            raise WireError("late_cap", f"late update from {peer} beyond the {cap} kept for the next round "
                                        f"(one per client)")
        self._check_update(peer, msg, msg.task)
        self._stale.append(ClientUpdate(peer, msg.body.num_samples, msg.tensors, msg.body.loss, msg.body.metrics))

    def _on_side_channel(self, peer: str, msg: Message) -> None:
        """A method's side-channel message (GLFC's prototype gradients): from a client of the open round, it goes
        to the server part without the sender's identity; one from outside the round is counted late and
        dropped."""
        if msg.type not in self.spec.server.side_channels:
            raise WireError("unexpected", f"method {self.spec.name!r} takes no {msg.type!r} messages")
        r = self._round
        if r is None or msg.round != r.number or msg.task != r.task or peer not in r.selected or peer in r.lost:
            self.late_side_channel += 1
            return
        if r.timeline is not None:  # emulated clock: it counts if the client's update makes the deadline
            if peer in r.timeline:
                r.timeline[peer].up_bytes += msg.nbytes
            r.side.append((peer, msg.type, msg.tensors))
            return
        self._side_channel_to_method(r.task, msg.type, msg.tensors)

    def _side_channel_to_method(self, task: int, msg_type: str, tensors) -> None:
        try:
            self.server.on_side_channel(task, msg_type, tensors)
        except ValueError as exc:
            raise WireError("bad_shape", str(exc)) from None

    def _on_secagg(self, peer: str, msg: Message) -> None:
        """A client's reply in a secure-aggregation phase; a masked input that comes too late counts as late."""
        sr, r = self._secure, self._round
        current = sr is not None and r is not None and msg.round == sr.number and peer in r.selected \
            and peer not in r.lost
        if not current or not sr.on_message(peer, msg):
            if msg.type == "secagg_masked":
                self.late_updates += 1
                self.metrics.late_update()
            return
        if msg.type == "secagg_masked":
            r.masked.add(peer)
            self.registry.records[peer].rounds_trained += 1

    def _check_update(self, peer: str, msg: Message, task: int) -> None:
        """A delta must name exactly the global model's tensors with their shapes, count no more samples than
        the client holds in the task, and stay within the norm bound; the method checks the rest."""
        self._check_delta(msg)
        record = self.registry.records[peer]
        held = len(self.scenario.client_indices(record.index, task))
        if msg.body.num_samples > held:
            raise WireError("implausible", f"{peer} claims {msg.body.num_samples} samples; it holds {held} in "
                                           f"task {task}")
        bound = self.config.security.max_update_norm
        if bound is not None and msg.body.num_samples > 0:
            norm = delta_norm(ClientUpdate(peer, msg.body.num_samples, msg.tensors))
            if not norm <= bound:
                raise WireError("norm_bound", f"{peer}'s model delta has L2 norm {norm:.4g} > {bound:g}")
        try:
            self.server.check_update(task, msg.tensors)
        except ValueError as exc:
            raise WireError("bad_shape", str(exc)) from None

    def _check_delta(self, msg: Message) -> None:
        expected = self.server.global_state
        got = {k[len(DELTA):]: v for k, v in msg.tensors.items() if k.startswith(DELTA)}
        if msg.body.num_samples == 0:
            return
        if got.keys() != expected.keys():
            missing = sorted(expected.keys() - got.keys())[:3]
            extra = sorted(got.keys() - expected.keys())[:3]
            raise WireError("bad_shape", f"delta keys differ from the model (missing {missing}, unknown {extra})")
        for name, value in got.items():
            if value.shape != expected[name].shape:
                raise WireError("bad_shape", f"delta {name!r} has shape {list(value.shape)}, "
                                             f"model has {list(expected[name].shape)}")
        if msg.body.num_samples < 0:
            raise WireError("bad_body", "negative num_samples")

    # ------------------------------------------------------------ refusing, sending
    def _reject(self, exc: WireError) -> None:
        self.rejected[exc.reason] += 1
        self.metrics.rejected(exc.reason)
        self.log_once(exc.peer, exc.reason, f"rejected a message from {exc.peer!r} ({exc})")
        if exc.peer and self.registry.is_online(exc.peer) and exc.reason != "rate_limited":
            self._send(exc.peer, "error", Error(code=exc.reason, detail=exc.detail[:500]))

    def _try_send(self, client_id: str, msg_type: str, body, **kw) -> int:
        """Send; returns the bytes sent, 0 if the peer is gone (EHOSTUNREACH under ROUTER_MANDATORY) or its
        queue is full."""
        try:
            return self.endpoint.send(client_id, msg_type, body, **kw)
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            return 0

    def _send(self, client_id: str, msg_type: str, body, **kw) -> int:
        """Send (returns the bytes sent); a vanished peer is declared dead (returns 0)."""
        sent = self._try_send(client_id, msg_type, body, **kw)
        if not sent and self.registry.drop(client_id):
            self.metrics.client_dropped("unreachable")
        return sent
