"""The edge-node process: many emulated clients over one shared connection (or each over its own).

:class:`EdgeNode` is the node's composition root. Its main thread owns every
socket: it polls them, hands each message of the coordinator to the client
it is for, and sends each client's heartbeats on time. By default the node's
clients speak over one shared connection, each client its own session on it
(wire/sockets.py, :class:`~fcl_emu.wire.sockets.SharedConnection`: one socket
and one CurveZMQ handshake per node, however many clients); with
``own_connections``, or keys per device, each client has a DEALER of its own.
An idle client (edge_node/client.py) holds its session, a few counters and the
references to its task assets; no model copy. The node's collaborators:

- :class:`~fcl_emu.edge_node.training.Trainer`: local training on one trainer thread;
  finished uploads come back through a queue and a wake-up socket;
- :class:`~fcl_emu.edge_node.secure_session.SecureSessions`: the SecAgg+ client on
  the wire;
- :class:`~fcl_emu.edge_node.churn.Churn`: availability, crashes and restarts in host
  time.

How the run aggregates is the node's own knowledge (``secure``: ``--secagg``, from its launcher), chosen once at
start (:mod:`~fcl_emu.edge_node.security`: plain or secure rounds): its results go into the masked sum or up as plain updates, whatever a relayed train request says, and what
a client cannot do that way (a secure round whose setup never came, a SecAgg+ setup in a plain run) is refused as
its error for the round; a welcome into a run that aggregates otherwise ends the node in one line.

Device profiles (docs/edge.md) are applied here, under ``--clock real``
only: training results are held back until the profile's compute time has
passed (``compute_factor`` times the measured training time, or
``ms_per_sample`` per sample trained), and train requests, task assets and
updates go through the client's emulated link (scenario/links.py), so their
delays follow the bytes actually sent. Under the emulated clock (the
default, coordinator/emulated.py) the coordinator places availability,
crashes, compute and link times on its own clock: the node sends everything
at once and reports the CPU time of each client's own training, which is
what the emulated clock scales.

Timed actions (delayed sends and deliveries) wait in a heap that the main
loop runs; nothing sleeps, so one slow client never holds up the others.
Heartbeats are the main loop's too: they are sends on the loop's clock;
churn only decides which clients are active, and so send them. A run's setup
(its data set loaded, its method built), made on the first welcome, takes a
setup thread of its own: the clients' messages wait for it in order, and the
welcomed clients heartbeat meanwhile, so a node that is loading is alive to
the coordinator and one that is gone is noticed within the liveness timeout.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from fcl_emu.edge_node.churn import Churn
from fcl_emu.edge_node.client import EmulatedClient
from fcl_emu.edge_node.connection import JoinWatch
from fcl_emu.edge_node.secure_session import SECAGG_DOWN, SecureSessions
from fcl_emu.edge_node.security import SECURITY_MISMATCH, round_security
from fcl_emu.edge_node.store import ArrayStore, AssetCache, RoundPayloads
from fcl_emu.edge_node.client import TrainJob, TrainResult
from fcl_emu.edge_node.training import RunSetup, Trainer
from fcl_emu.monitoring.metrics import EdgeNodeMetrics
from fcl_emu.runtime.log_budget import LogOnce
from fcl_emu.scenario.datasets import DatasetNotFoundError, load_dataset
from fcl_emu.scenario.spec import ScenarioSpec
from fcl_emu.wire.auth import ClientKeyring
from fcl_emu.wire.framing import Message, WireError, frames_nbytes
from fcl_emu.wire.messages import ASSET_TYPES, Error, Heartbeat, Join, Leave, SideChannel, Update, client_id
from fcl_emu.wire.sockets import ClientEndpoint, Counters, SharedConnection, ensure_socket_capacity, tee

log = logging.getLogger("fcl_emu.edge_node")

HEARTBEAT_SCAN_MAX_S = 1.0  # the heartbeat scan's period at most (a quarter of the interval below 4 s)
DATA_DOWN = frozenset({"task_start", *ASSET_TYPES, "train_request"})  # what the emulated downlink delays
SETUP_POLL_S = 0.02  # how often the main loop looks whether a run's setup is made


@dataclass
class PendingSetup:
    """A run's setup being made on the setup thread; the clients' messages meanwhile, in arrival order, each
    with the client's generation then (one that crashed since loses them, as a closed socket would)."""
    welcome: Any
    made: Future
    parked: list[tuple[EmulatedClient, int, Message]] = field(default_factory=list)


class NodeSetupError(RuntimeError):
    """The node cannot take part in the run it joined (its clients have said they leave, giving the reason)."""


class EdgeNode:
    def __init__(self, connect: str, client_indices: list[int], *, name: str | None = None,
                 data_roots: list[Path] | None = None, state_dir: Path | None = None,
                 threads: int = 1, context: zmq.Context | None = None, keys: ClientKeyring | None = None,
                 own_connections: bool = False, secure: bool = False, check_models: bool = True):
        """``keys``: the clients connect over CurveZMQ with these keys (docs/security.md); None: plain TCP.
        ``own_connections``: a connection per client rather than one shared by all (keys per device imply it).
        ``secure``: the run aggregates under SecAgg+ (``--secagg``, from the node's launcher): the node's clients
        send masked inputs only, else plain updates only, whatever a relayed message says; what they cannot do
        that way is refused as their error for the round (:meth:`_refuse`). ``check_models``: in a secure run, a
        client releases its shares only if every survivor trained its model (secagg.consistency; off: research)."""
        self.connect = connect
        self.keys = keys
        self.name = name or f"node-{os.getpid()}"
        self.data_roots = list(data_roots or [])
        self.context = context or zmq.Context.instance()
        shared = not own_connections and (keys is None or not keys.per_device)
        # the clients' DEALERs (or the shared one), the wake pair and the socket monitor's pair while they join
        ensure_socket_capacity(self.context, (1 if shared else len(client_indices)) + 3)
        self.counters = Counters.empty()
        # Prometheus metrics (served only when asked: ``metrics.serve``, see ``fcl-emu node --metrics-port``)
        self.metrics = EdgeNodeMetrics()
        self._count = tee(self.counters, self.metrics.count_message)
        self.rejected: dict[str, int] = {}
        self._state_dir = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix="fcl-emu-node-"))
        self.assets = AssetCache()
        self.payloads = RoundPayloads()
        self.setup: RunSetup | None = None
        self._pending_setup: PendingSetup | None = None
        self._setup_thread = ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-setup")
        self._datasets: dict[str, Any] = {}  # by name, read on the setup thread only
        self._trainer = Trainer(self.context, threads=threads, payloads=self.payloads, metrics=self.metrics,
                                setup=lambda: self.setup, masked=secure)
        self._log_once = LogOnce(log, counted_in="the coordinator counts each as the client's error")
        self._poller = zmq.Poller()
        self._poller.register(self._trainer.wake, zmq.POLLIN)
        self._by_socket: dict[zmq.Socket, EmulatedClient] = {}  # own connections: the client behind each socket
        self._attached: dict[str, EmulatedClient] = {}  # a shared connection: the clients with a session on it
        self._shared: SharedConnection | None = None
        if shared:
            self._shared = SharedConnection(self.context, connect, count=self._count,
                                            keys=None if keys is None else keys.for_identity(self.name))
            self._poller.register(self._shared.sock, zmq.POLLIN)
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = itertools.count()
        self.clients = [self._new_client(i) for i in client_indices]
        self.heartbeat_interval_s = 1.0
        self._next_heartbeat_scan = 0.0
        self._open = len(self.clients)  # clients not closed: the node serves while there are any
        # chosen once, from what the node was started with (edge_node/security.py)
        self.security = round_security(secure, send_update=self._send_update, refuse=self._refuse, sessions=lambda: (
            SecureSessions(send=self._send, upload=self._upload, seed=lambda: self.setup.seed, metrics=self.metrics,
                           keys=keys, check_models=check_models)))
        self._churn = Churn(join=self._join, send=self._send, detach=self._detach,
                            reconnect=self._reconnect, retain_assets=self._retain_assets, metrics=self.metrics)
        self.metrics.watch(self.clients, self._trainer.queued)
        self._joins = JoinWatch(self.name, connect, len(self.clients))
        if self.clients:
            self._joins.watch(self.clients[0].endpoint.sock)  # the shared connection, where there is one

    def _new_client(self, index: int) -> EmulatedClient:
        cid = client_id(index)
        client = EmulatedClient(index, self._open_endpoint(cid), ArrayStore(self._state_dir / cid))
        self._attach(client)
        return client

    def _open_endpoint(self, cid: str) -> ClientEndpoint:
        if self._shared is not None:
            return self._shared.channel(cid)
        return ClientEndpoint(self.context, self.connect, cid, count=self._count,
                              keys=None if self.keys is None else self.keys.for_identity(cid))

    def _attach(self, client: EmulatedClient) -> None:
        """Take the client's messages: poll its socket, or deliver its share of the shared connection's."""
        if self._shared is not None:
            self._attached[client.id] = client
            return
        self._by_socket[client.endpoint.sock] = client
        self._poller.register(client.endpoint.sock, zmq.POLLIN)

    def _detach(self, client: EmulatedClient) -> None:
        """Stop taking the client's messages and close its connection or session without a goodbye (a crash)."""
        if self._shared is not None:
            del self._attached[client.id]
        else:
            self._poller.unregister(client.endpoint.sock)
            del self._by_socket[client.endpoint.sock]
        client.endpoint.close(linger_ms=0)

    def _reconnect(self, client: EmulatedClient) -> None:
        """A new connection or session for the client (a restart after a crash), attached."""
        client.endpoint = self._open_endpoint(client.id)
        self._attach(client)

    def _retain_assets(self) -> None:
        """Let go of the task assets no client holds any longer."""
        self.assets.retain([c.assets for c in self.clients])

    def _join(self, client: EmulatedClient) -> None:
        self._send(client, "join", Join(node=self.name, pid=os.getpid(), client_index=client.index,
                                        assets_task=client.task if client.assets else -1))

    def _at(self, due: float, action: Callable[[], None]) -> None:
        """Run ``action`` on the main thread at monotonic time ``due``."""
        heapq.heappush(self._timers, (due, next(self._timer_seq), action))

    def _run_timers(self, now: float) -> None:
        """Run the timed actions that are due."""
        while self._timers and self._timers[0][0] <= now:
            heapq.heappop(self._timers)[2]()

    def _make_setup(self, body) -> RunSetup:
        """On the setup thread: load the run's data set (once per node) and build its setup."""
        spec = ScenarioSpec(**body.scenario)
        dataset = self._datasets.get(spec.dataset)
        if dataset is None:
            dataset = self._datasets[spec.dataset] = load_dataset(spec.dataset, self.data_roots)
        return RunSetup.from_welcome(body, spec, dataset)

    def _finish_setup(self) -> None:
        """Once the pending setup is made: take it, then hand the clients the messages parked meanwhile."""
        pending = self._pending_setup
        if pending is None or not pending.made.done():
            return
        self._pending_setup = None
        body = pending.welcome
        try:
            self.setup = pending.made.result()
        except DatasetNotFoundError as exc:
            roots = ", ".join(map(str, self.data_roots)) or "none given"
            raise NodeSetupError(f"{self.name} cannot take part in run {body.run_id}: dataset "
                                 f"{exc.dataset!r} is not under its data roots ({roots})") from None
        self._churn.edge = body.edge
        log.info("%s configured for run %s: %s on %s", self.name, body.run_id, body.method, body.scenario["dataset"])
        for client, generation, msg in pending.parked:
            if client.generation == generation:
                self._on_message(client, msg)

    def _park(self, client: EmulatedClient, msg: Message) -> bool:
        """While a run's setup is made (a welcome into a run not set up starts it), keep the message for later;
        a welcome still counts at once: its client heartbeats from now on. False: handle it now."""
        if msg.type == "welcome" and self._pending_setup is None \
                and (self.setup is None or self.setup.run_id != msg.body.run_id):
            if (refused := self.security.welcome_refusal(self.name, msg.body)) is not None:
                raise NodeSetupError(refused)
            self._pending_setup = PendingSetup(msg.body, self._setup_thread.submit(self._make_setup, msg.body))
            self.heartbeat_interval_s = msg.body.heartbeat_interval_s
        if self._pending_setup is None:
            return False
        if msg.type == "welcome":
            client.welcomed = True
            self._joins.welcomed(client.id, msg.body.run_id)
        self._pending_setup.parked.append((client, client.generation, msg))
        return True

    def _on_message(self, client: EmulatedClient, msg: Message) -> None:
        if self._park(client, msg):
            return
        if msg.type == "welcome":
            client.welcomed = True
            self._joins.welcomed(client.id, msg.body.run_id)
            self._churn.start(client, msg.body.edge, time.monotonic())
        elif msg.type == "task_start":
            client.task = msg.task
            client.classes = list(msg.body.classes)
            client.seen_classes = list(msg.body.seen_classes)
            client.assets = {}
            if msg.body.restart:  # crashed on the emulated clock: what a restarted device has lost
                client.state, client.trained_task = {}, -1
            self._retain_assets()
        elif msg.type in ASSET_TYPES:
            if client.task != msg.task:
                log.warning("%s: ignoring %s of task %d (in task %d)", client.id, msg.type, msg.task, client.task)
                return
            client.assets = {**client.assets, **self.assets.intern_all(msg.tensors)}
        elif msg.type == "train_request":
            if self.setup is None or client.task != msg.task:
                self._send(client, "error", Error(code="not_ready", detail="train request before task start"),
                           round=msg.round, task=msg.task)
                return
            if (otherwise := self.security.relayed_otherwise(client.id, msg.round, msg.body)) is not None:
                self._log_once(client.id, "train request", otherwise)  # a relay changed it: the run's own way holds
            if (why := self.security.cannot_train(client, msg.round)) is not None:
                self._refuse(client, msg, why)
                return
            now = time.monotonic()
            self._trainer.submit(TrainJob(client, msg.round, msg.task, self.payloads.acquire(msg.round, msg.tensors),
                                          client.generation, now, msg.body), self._train_order(client, msg))
            self._churn.draw_crash(client, msg.round, self.setup.seed, now)
        elif msg.type == "cancel":  # the emulated clock knows this round's update would come too late
            self._trainer.cancel(client.id, msg.round)
        elif msg.type in SECAGG_DOWN:
            self.security.on_secagg(client, msg)
        elif msg.type == "shutdown":  # the run is over for every client of this node
            for c in self.clients:
                c.closed = True
            self._open = 0
        elif msg.type == "error":
            if msg.body.code == "not_joined":  # a restarted (resumed) coordinator does not know this client
                if client.active:
                    log.info("%s: the coordinator does not know this client; joining again", client.id)
                    self._join(client)
                return
            log.warning("%s: coordinator says %s: %s", client.id, msg.body.code, msg.body.detail)
        else:
            log.warning("%s: ignoring unexpected %s", client.id, msg.type)

    def _train_order(self, client: EmulatedClient, msg: Message) -> float:
        """Under the emulated clock, with a cost per sample: when the client's update would arrive after the
        round opened (the train request down, its training, an update as large up), so that the node trains
        the round's early clients first; 0 (first come, first served) otherwise, and for a method whose jobs
        leave client state behind (its late jobs are never cancelled)."""
        profile = client.profile
        if self._churn.edge.clock != "emulated" or profile is None or profile.ms_per_sample is None \
                or self.setup.client_part.keeps_state:
            return 0.0
        samples = len(self.setup.scenario.client_indices(client.index, client.task)) * msg.body.local_epochs
        return (msg.nbytes / profile.downlink_bytes_s + profile.compute_s(0.0, samples)
                + msg.nbytes / profile.uplink_bytes_s + 2 * profile.latency_s)

    def _refuse(self, client: EmulatedClient, msg: Message, what: str) -> None:
        """Refuse what the client cannot do the way the run aggregates (a relay may have changed or dropped the
        coordinator's messages): the client's ``error`` for the round, so the round stops waiting for it; logged
        once per client."""
        detail = self.security.refusal(what)
        self._log_once(client.id, SECURITY_MISMATCH, f"{client.id}: round {msg.round}: {detail}")
        self._send(client, "error", Error(code=SECURITY_MISMATCH, detail=detail), round=msg.round, task=msg.task)

    def _send(self, client: EmulatedClient, msg_type: str, body, **kw) -> None:
        client.endpoint.send(msg_type, body, **kw)
        client.last_sent = time.monotonic()

    def _receive(self, client: EmulatedClient, msg: Message, now: float) -> None:
        """Hand a received message to the client, after its emulated downlink delay for data messages."""
        if msg.type in DATA_DOWN and not client.available:
            return  # sent before the coordinator saw its leave: an away device never gets it
        if client.link is None or msg.type not in DATA_DOWN:
            self._on_message(client, msg)
            return
        due = client.link.arrival("down", msg.nbytes, now)
        self.metrics.link_delay("down", client.link.profile.name, due - now)
        generation = client.generation

        def arrive() -> None:
            if client.generation == generation:  # lost if the client left or crashed meanwhile
                self._on_message(client, msg)
        self._at(due, arrive)

    def _deliver(self, result: TrainResult) -> None:
        """Send a finished job's update (under secure aggregation: its masked input, once the shares are
        there): after the emulated compute slowdown and uplink delay."""
        client = result.client
        result.finished_at = time.monotonic()
        if client.closed or result.generation != client.generation or result.stale:
            return
        self.security.send_result(client, result)

    def _send_update(self, client: EmulatedClient, result: TrainResult) -> None:
        """A plain run's result: its side-channel messages, then its update (or the client's error)."""
        if result.error is not None:
            self._send(client, "error", Error(code="train_failed", detail=result.error[:500]),
                       round=result.round, task=result.task)
            return
        for kind, (items, tensors) in result.side.items():  # ahead of the update, on the same link
            self._upload(client, result, kind, SideChannel(items=items), tensors)
        self._upload(client, result, "update", Update(num_samples=result.num_samples, **result.report()),
                     result.uploads)

    def _upload(self, client: EmulatedClient, result: TrainResult, msg_type: str, body,
                tensors: dict[str, np.ndarray]) -> None:
        """Send a training result through the client's emulated device: its compute slowdown, then its uplink."""
        frames = client.endpoint.encode(msg_type, body, round=result.round, task=result.task, tensors=tensors)
        now = time.monotonic()
        due = now
        if client.link is not None:
            hold_s = client.link.profile.compute_s(result.train_s, result.samples_trained) - result.train_s
            ready = max(now, result.finished_at + hold_s)
            due = client.link.arrival("up", frames_nbytes(frames), ready)
            self.metrics.link_delay("up", client.link.profile.name, due - ready)

        def send() -> None:
            if client.generation == result.generation and client.active:
                client.endpoint.send_frames(msg_type, frames)
                client.last_sent = time.monotonic()
                client.round_s = client.last_sent - result.received_at
        if due <= now:
            send()
        else:
            self._at(due, send)

    def _heartbeats(self, now: float) -> None:
        """Send the heartbeats due: a scan over the clients, a quarter of an interval apart at most (a heartbeat
        is then at most that late, well inside the liveness timeout of more than two intervals)."""
        if now < self._next_heartbeat_scan:
            return
        self._next_heartbeat_scan = now + min(self.heartbeat_interval_s / 4, HEARTBEAT_SCAN_MAX_S)
        for client in self.clients:
            if client.active and now - client.last_sent >= self.heartbeat_interval_s:
                self._send(client, "heartbeat", Heartbeat())

    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until every client was shut down (or ``stop`` is set)."""
        stop = stop or threading.Event()
        self._trainer.start()
        self._joins.start(time.monotonic())
        for client in self.clients:
            self._join(client)
        try:
            while not stop.is_set() and self._open:
                wait_s = min(0.25, self.heartbeat_interval_s / 2)  # the welcome may change the interval
                if self._pending_setup is not None:
                    wait_s = min(wait_s, SETUP_POLL_S)
                if self._timers:
                    wait_s = min(wait_s, max(0.0, self._timers[0][0] - time.monotonic()))
                events = dict(self._poller.poll(timeout=math.ceil(1000 * wait_s)))
                for sock in events:
                    if sock is self._trainer.wake:
                        for result in self._trainer.finished():
                            self._deliver(result)
                        continue
                    if self._shared is not None and sock is self._shared.sock:
                        self._receive_shared()
                        continue
                    client = self._by_socket.get(sock)
                    while client is not None and sock in self._by_socket and sock.poll(0):
                        try:
                            self._receive(client, client.endpoint.recv(), time.monotonic())
                        except WireError as exc:
                            self._rejected(client, exc)
                self._finish_setup()
                now = time.monotonic()
                self._run_timers(now)
                self._churn.tick(now)
                self._heartbeats(now)
                self._joins.tick(now)
        except NodeSetupError as exc:
            log.error("%s", exc)
            for client in self.clients:  # the coordinator stops counting on them at once
                client.endpoint.send("leave", Leave(reason=str(exc)[:200]))
            raise
        finally:
            self._trainer.stop()
            self.close()

    def _receive_shared(self) -> None:
        """Hand each message waiting on the shared connection to the client it is for; one for a client without a
        session (crashed, or not hosted here) is dropped, as a closed socket of its own would drop it."""
        sock = self._shared.sock
        while sock.poll(0):
            try:
                received = self._shared.recv()
            except WireError as exc:
                self._rejected(exc.peer, exc)
                continue
            if received is None:  # tensors the connection holds for the messages that follow
                continue
            identity, msg = received
            client = self._attached.get(identity)
            if client is not None:
                self._receive(client, msg, time.monotonic())

    def _rejected(self, client: EmulatedClient | str | None, exc: WireError) -> None:
        """Count a bad message from the coordinator; log the first of each reason."""
        self.rejected[exc.reason] = self.rejected.get(exc.reason, 0) + 1
        self.metrics.rejected(exc.reason)
        if self.rejected[exc.reason] == 1:
            log.warning("%s: rejected a message from the coordinator (%s); further ones are only counted",
                        getattr(client, "id", client), exc)

    def close(self) -> None:
        """Close the sockets. The metrics endpoint stays up (``metrics.close()`` ends it)."""
        self._setup_thread.shutdown(wait=False, cancel_futures=True)
        self._joins.close()
        if self._shared is not None:
            self._shared.close()
        else:
            for client in self.clients:
                client.endpoint.close()
        self._trainer.close()
