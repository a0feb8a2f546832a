"""The edge-node process: many emulated clients, each with its own DEALER socket.

The main thread owns every socket: it polls them, answers the coordinator,
and sends each client's heartbeats on time. Local training runs on a single
trainer thread (clients of one node train one after another, as on one
device); it hands finished uploads back through an in-process queue and a
wake-up socket. An idle client holds its socket, a few counters and the
references to its task assets; no model copy.

Edge realism (docs/edge.md), driven by what each client's ``welcome`` says:

- availability: the client leaves (a ``leave``) when its availability model
  turns it off and joins again when it turns on, keeping its local state and
  telling the coordinator which task's assets it still holds;
- crashes: a client selected for a round dies during it with probability
  ``crash_rate``: its socket is closed without a goodbye, its in-memory state
  is lost (its on-disk store survives, as a device's storage would), and it
  restarts with a new socket ``crash_downtime_s`` later;
- device profiles: training results are held back until the profile's
  compute time has passed (``compute_factor`` times the measured training
  time, or ``ms_per_sample`` per sample trained), and train requests, task
  assets and updates go through the client's emulated link
  (scenario/links.py), so their delays follow the bytes actually sent.

All of the above runs in host time under ``--clock real`` only. Under the
emulated clock (the default, coordinator/emulated.py) the coordinator places
availability, crashes, compute and link times on its own clock: the node
sends everything at once and reports the CPU time of each client's own
training, which is what the emulated clock scales.

Timed actions (delayed sends and deliveries) wait in a heap that the main
loop runs; nothing sleeps, so one slow client never holds up the others.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import queue
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import zmq

from scenario.availability import client_draw, transitions
from scenario.links import Link
from scenario.devices import DeviceProfile
from secagg.client import SecAggClient
from secagg.protocol import SecAggAbort, SecAggError
from edge_node.store import ArrayStore, AssetCache, RoundPayloads
from methods import registry as methods
from methods.base import ClientContext, ClientPart, DeltaLayout, TrainingSettings, model_arrays
from methods.models.classifier import build_model
from methods.models.state import load_arrays
from methods.optim import LocalSGD
from monitoring.metrics import EdgeNodeMetrics
from scenario.datasets import DatasetNotFoundError, load_dataset
from scenario.scenario import Scenario, build_scenario
from scenario.spec import ScenarioSpec
from scenario.transforms import to_tensor
from wire.auth import ClientKeyring
from wire.framing import Message, WireError, frames_nbytes
from wire.messages import (ASSET_TYPES, EdgeSettings, Error, Heartbeat, Join, Leave, SecAggKeys, SecAggMasked,
                           SecAggShares, SecAggUnmask, SideChannel, TrainRequest, Update, client_id, plain_body)
from wire.sockets import ClientEndpoint, Counters, ensure_socket_capacity, tee

log = logging.getLogger("fcl_emu.edge_node")

DATA_DOWN = frozenset({"task_start", *ASSET_TYPES, "train_request"})  # what the emulated downlink delays
SECAGG_DOWN = frozenset({"secagg_setup", "secagg_peer_keys", "secagg_relay", "secagg_unmask_request",
                         "secagg_abort"})


class NodeSetupError(RuntimeError):
    """The node cannot take part in the run it joined (its clients have said they leave, giving the reason)."""


@dataclass
class _SecAggSession:
    """A client's side of one round's secure aggregation: the protocol state, and the two things its masked
    input waits for (the relayed shares, its training result), in whichever order they come."""

    round: int
    protocol: SecAggClient
    relay: dict[str, Any] | None = None
    result: _Result | None = None


@dataclass
class EmulatedClient:
    index: int
    endpoint: ClientEndpoint
    store: ArrayStore
    welcomed: bool = False
    closed: bool = False
    task: int = -1
    trained_task: int = -1
    classes: list[int] = field(default_factory=list)
    seen_classes: list[int] = field(default_factory=list)
    assets: dict[str, np.ndarray] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    last_sent: float = 0.0
    # edge realism
    generation: int = 0  # bumped when the client leaves or crashes: its work in flight is dropped
    available: bool = True  # what its availability model says now
    transitions: Iterator[tuple[float, bool]] | None = None
    next_transition: tuple[float, bool] | None = None
    link: Link | None = None
    crash_at: float | None = None  # monotonic time of a crash decided for this round
    down_until: float | None = None  # crashed: restarts at this monotonic time
    round_s: float = 1.0  # last time from train request to sent update (where a crash may fall)
    secagg: _SecAggSession | None = None  # this round's secure aggregation, if any

    @property
    def id(self) -> str:
        return self.endpoint.identity

    @property
    def active(self) -> bool:
        """Welcomed, online, not shut down: it heartbeats and trains."""
        return self.status == "active"

    @property
    def status(self) -> str:
        """closed, down (crashed), away (off by its availability model), joining or active."""
        if self.closed:
            return "closed"
        if self.down_until is not None:
            return "down"
        if not self.available:
            return "away"
        return "active" if self.welcomed else "joining"


@dataclass
class _RunSetup:
    """What a welcome configures; shared by all clients of one run."""

    run_id: str
    scenario: Scenario
    client_part: ClientPart
    settings: TrainingSettings
    model_name: str
    seed: int
    device: torch.device


@dataclass
class _Job:
    client: EmulatedClient
    round: int
    task: int
    model: Mapping[str, np.ndarray]  # the received global model (shared by the round's jobs)
    generation: int
    received_at: float
    request: TrainRequest  # local epochs and learning rate of this round


@dataclass
class _Result:
    client: EmulatedClient
    round: int
    task: int
    uploads: dict[str, np.ndarray] | None
    num_samples: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    generation: int = 0
    received_at: float = 0.0
    train_s: float = 0.0
    cpu_s: float = 0.0  # CPU time of the client's own training (not the wait for the trainer)
    samples_trained: int = 0  # local samples x local epochs
    finished_at: float = 0.0  # monotonic time the main thread got it
    secure: bool = False  # ``vector`` replaces ``uploads``: it goes through secure aggregation
    side: dict[str, tuple[int, dict[str, np.ndarray]]] = field(default_factory=dict)  # side-channel messages
    vector: np.ndarray | None = None


class EdgeNode:
    def __init__(self, connect: str, client_indices: list[int], *, name: str | None = None,
                 data_roots: list[Path] | None = None, state_dir: Path | None = None,
                 threads: int = 1, context: zmq.Context | None = None, keys: ClientKeyring | None = None):
        """``keys``: the clients connect over CurveZMQ with these keys (docs/security.md); None: plain TCP."""
        self.connect = connect
        self.keys = keys
        self.name = name or f"node-{os.getpid()}"
        self.data_roots = list(data_roots or [])
        self.context = context or zmq.Context.instance()
        ensure_socket_capacity(self.context, len(client_indices) + 1)  # the clients' DEALERs and the wake pair
        self.counters = Counters.empty()
        # Prometheus metrics (served only when asked: ``metrics.serve``, see ``fcl-emu node --metrics-port``)
        self.metrics = EdgeNodeMetrics()
        self._count = tee(self.counters, self.metrics.count_message)
        self.rejected: dict[str, int] = {}
        self._state_dir = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix="fcl-emu-node-"))
        self.assets = AssetCache()
        self.payloads = RoundPayloads()
        self.setup: _RunSetup | None = None
        self._datasets: dict[str, Any] = {}
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._results: queue.Queue[_Result] = queue.Queue()
        self._wake_addr = f"inproc://wake-{id(self)}"
        self._wake_rx = self.context.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_addr)
        self._threads = threads
        self._poller = zmq.Poller()
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._by_socket: dict[zmq.Socket, EmulatedClient] = {}
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = itertools.count()
        self._clock_origin: float | None = None  # local monotonic time of the coordinator's run clock 0
        self.edge = EdgeSettings()
        self.clients = [self._new_client(i) for i in client_indices]
        self.heartbeat_interval_s = 1.0
        self.metrics.watch(self.clients, self._jobs.qsize)

    def _new_client(self, index: int) -> EmulatedClient:
        cid = client_id(index)
        client = EmulatedClient(index, self._open_endpoint(cid), ArrayStore(self._state_dir / cid))
        self._attach(client)
        return client

    def _open_endpoint(self, cid: str) -> ClientEndpoint:
        return ClientEndpoint(self.context, self.connect, cid, count=self._count,
                              keys=None if self.keys is None else self.keys.for_identity(cid))

    def _attach(self, client: EmulatedClient) -> None:
        """Poll the client's socket."""
        self._by_socket[client.endpoint.sock] = client
        self._poller.register(client.endpoint.sock, zmq.POLLIN)

    def _join(self, client: EmulatedClient) -> None:
        self._send(client, "join", Join(node=self.name, pid=os.getpid(), client_index=client.index,
                                        assets_task=client.task if client.assets else -1))

    def _at(self, due: float, action: Callable[[], None]) -> None:
        """Run ``action`` on the main thread at monotonic time ``due``."""
        heapq.heappush(self._timers, (due, next(self._timer_seq), action))

    # ----------------------------------------------------------------- setup
    def _configure(self, body) -> None:
        if self.setup is not None and self.setup.run_id == body.run_id:
            return
        spec = ScenarioSpec(**body.scenario)
        dataset = self._datasets.get(spec.dataset)
        if dataset is None:
            dataset = self._datasets[spec.dataset] = load_dataset(spec.dataset, self.data_roots)
        method = methods.get(body.method)
        training = dict(body.training)
        device = training.pop("device", "cpu")
        seed = int(training.pop("seed", 0))
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.setup = _RunSetup(
            run_id=body.run_id,
            scenario=build_scenario(spec, dataset),
            client_part=method.client(method.options(**body.method_options)),
            settings=TrainingSettings(**training),
            model_name=body.model,
            seed=seed,
            device=torch.device(device),
        )
        self.heartbeat_interval_s = body.heartbeat_interval_s
        self.edge = body.edge
        log.info("%s configured for run %s: %s on %s", self.name, body.run_id, body.method, spec.dataset)

    def build_model(self, num_classes: int):
        s = self.setup
        return build_model(s.model_name, s.scenario.dataset.input_shape, num_classes)

    # -------------------------------------------------------------- training
    def _trainer(self) -> None:
        torch.set_num_threads(self._threads)
        wake = self.context.socket(zmq.PAIR)
        wake.connect(self._wake_addr)
        model_cache: dict[int, Any] = {}
        warm = False
        try:
            while (job := self._jobs.get()) is not None:
                if job.generation != job.client.generation:  # it left or crashed while the job waited
                    self.payloads.release(job.round, job.model)
                    self.metrics.trained(0.0, "cancelled")
                    continue
                if not warm:
                    self._warm_up()
                    warm = True
                started, cpu_started = time.perf_counter(), self._cpu_time()
                result = self._train(job, model_cache)
                result.train_s = time.perf_counter() - started
                result.cpu_s = self._cpu_time() - cpu_started
                result.samples_trained = result.num_samples * job.request.local_epochs
                result.generation, result.received_at = job.generation, job.received_at
                result.secure = job.request.secure
                outcome = "failed" if result.error is not None else "ok" if result.num_samples else "no_data"
                self.metrics.trained(result.train_s, outcome, result.num_samples)
                self._results.put(result)
                wake.send(b"")
        finally:
            wake.close(linger=0)

    def _warm_up(self) -> None:
        """One optimiser step of the run's model on a tiny batch before the first client's job: one-time costs
        (kernels' and autograd's first use) are the node's, not charged to whichever client trains first (the
        emulated clock scales its CPU time). Torch's global generator is left as it was."""
        s = self.setup
        with torch.random.fork_rng(devices=[]):
            model = self.build_model(s.scenario.dataset.num_classes).to(s.device)
            optimizer = LocalSGD(model.parameters(), lr=0.0)
            model(torch.zeros((2, *s.scenario.dataset.input_shape), device=s.device)).sum().backward()
            optimizer.step()

    def _cpu_time(self) -> float:
        """The trainer's clock for a client's own work: its thread's CPU time (torch computes in the calling
        thread with one thread); the process's with more threads; wall time on a GPU, where the work is the
        device's (the trainer is the only one using it)."""
        if self.setup is not None and self.setup.device.type == "cuda":
            return time.perf_counter()
        return time.thread_time() if self._threads == 1 else time.process_time()

    def _train(self, job: _Job, model_cache: dict[int, Any]) -> _Result:
        client = job.client
        s = self.setup
        try:
            indices = s.scenario.client_indices(client.index, client.task)
            if len(indices) == 0:  # under secure aggregation: a zero vector of weight 0
                vector = np.zeros(DeltaLayout.of(job.model).dim, np.float32) if job.request.secure else None
                return _Result(client, job.round, job.task, {}, 0, vector=vector)
            classifier = model_arrays(job.model)  # none for a method without a global classifier (FedCBC):
            model = self._classifier(classifier, model_cache) if classifier else None  # its train gets None
            ds = s.scenario.dataset
            ctx = ClientContext(
                client=client.id, task=client.task,
                task_classes=np.asarray(client.classes), seen_classes=np.asarray(client.seen_classes),
                x=to_tensor(ds.train_x[indices], ds.mean, ds.std),
                y=torch.from_numpy(np.asarray(s.scenario.client_labels(client.index, client.task), dtype=np.int64)),
                settings=replace(s.settings, lr=job.request.lr, local_epochs=job.request.local_epochs),
                global_state=job.model, assets=client.assets,
                state=client.state, store=client.store, build_model=self.build_model, device=s.device,
                mean=tuple(ds.mean), std=tuple(ds.std), dataset_classes=ds.num_classes,
                seed=zlib.crc32(f"{s.seed}/{client.index}/{job.round}".encode()),
                new_task=client.trained_task != client.task,
            )
            uploads, metrics = s.client_part.train(ctx, model)
            client.trained_task = client.task
            result = _Result(client, job.round, job.task, uploads, len(indices), metrics, side=ctx.outbox)
            if job.request.secure:  # the masked sum carries the float deltas as one vector
                result.vector, result.uploads = DeltaLayout.of(job.model).flatten(uploads), None
            return result
        except Exception as exc:  # reported to the coordinator, never kills the node
            log.exception("%s: training failed", client.id)
            return _Result(client, job.round, job.task, None, error=f"{type(exc).__name__}: {exc}")
        finally:
            self.payloads.release(job.round, job.model)

    def _classifier(self, arrays: Mapping[str, np.ndarray], model_cache: dict[int, Any]):
        """The received global classifier, in a model reused across jobs while its head size stays."""
        head = int(arrays["head.weight"].shape[0])
        model = model_cache.get(head)
        if model is None:
            model_cache.clear()
            model = model_cache[head] = self.build_model(head)
        return load_arrays(model, arrays)

    # ------------------------------------------------------------------ I/O
    def _on_message(self, client: EmulatedClient, msg: Message) -> None:
        if msg.type == "welcome":
            try:
                self._configure(msg.body)
            except DatasetNotFoundError as exc:
                roots = ", ".join(map(str, self.data_roots)) or "none given"
                raise NodeSetupError(f"{self.name} cannot take part in run {msg.body.run_id}: dataset "
                                     f"{exc.dataset!r} is not under its data roots ({roots})") from None
            client.welcomed = True
            self._start_edge(client, msg.body.edge)
        elif msg.type == "task_start":
            client.task = msg.task
            client.classes = list(msg.body.classes)
            client.seen_classes = list(msg.body.seen_classes)
            client.assets = {}
            if msg.body.restart:  # crashed on the emulated clock: what a restarted device has lost
                client.state, client.trained_task = {}, -1
            self.assets.retain([c.assets for c in self.clients])
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
            now = time.monotonic()
            self._jobs.put(_Job(client, msg.round, msg.task, self.payloads.acquire(msg.round, msg.tensors),
                                client.generation, now, msg.body))
            if self.edge.crash_rate > 0 and client_draw(self.setup.seed, "crash", client.index, msg.round) < \
                    self.edge.crash_rate:
                # dies somewhere between now and when its update would go out (judged by its last round)
                client.crash_at = now + client_draw(self.setup.seed, "crash-at", client.index, msg.round) * client.round_s
        elif msg.type in SECAGG_DOWN:
            self._on_secagg(client, msg)
        elif msg.type == "shutdown":  # the run is over for every client of this node
            for c in self.clients:
                c.closed = True
        elif msg.type == "error":
            if msg.body.code == "not_joined":  # a restarted (resumed) coordinator does not know this client
                if client.active:
                    log.info("%s: the coordinator does not know this client; joining again", client.id)
                    self._join(client)
                return
            log.warning("%s: coordinator says %s: %s", client.id, msg.body.code, msg.body.detail)
        else:
            log.warning("%s: ignoring unexpected %s", client.id, msg.type)

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

    def _deliver(self, result: _Result) -> None:
        """Send a finished job's update (under secure aggregation: its masked input, once the shares are
        there): after the emulated compute slowdown and uplink delay."""
        client = result.client
        result.finished_at = time.monotonic()
        if client.closed or result.generation != client.generation:
            return
        if result.secure:
            session = client.secagg
            if session is not None and session.round == result.round:
                session.result = result
                self._send_masked(client)
            return  # no session: it was aborted or refused, and the coordinator knows
        if result.error is not None:
            self._send(client, "error", Error(code="train_failed", detail=result.error[:500]),
                       round=result.round, task=result.task)
            return
        for kind, (items, tensors) in result.side.items():  # ahead of the update, on the same link
            self._upload(client, result, kind, SideChannel(items=items), tensors)
        self._upload(client, result, "update", Update(num_samples=result.num_samples, **self._report(result)),
                     result.uploads)

    @staticmethod
    def _report(result: _Result) -> dict[str, Any]:
        metrics = {str(k): float(v) for k, v in result.metrics.items()}  # numpy scalars from a method included
        return {"train_time_s": metrics.get("train_time_s", 0.0), "loss": metrics.get("loss", float("nan")),
                "metrics": metrics, "cpu_s": result.cpu_s}

    def _upload(self, client: EmulatedClient, result: _Result, msg_type: str, body, tensors) -> None:
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

    # ---------------------------------------------------- secure aggregation
    def _on_secagg(self, client: EmulatedClient, msg: Message) -> None:
        """One SecAgg+ message of the coordinator (docs/secagg.md). A refused message or an aborted protocol
        ends the client's session and is reported as an ``error`` (code ``secagg``)."""
        session = client.secagg
        if msg.type == "secagg_setup":
            session = client.secagg = _SecAggSession(msg.round, SecAggClient(client.id))
        elif session is None or session.round != msg.round:
            if msg.type != "secagg_abort":
                self._secagg_failed(client, msg.round, msg.task, f"{msg.type} for round {msg.round}, but this "
                                                                 f"client has no secure-aggregation session for it")
            return
        body = plain_body(msg.body)
        protocol = session.protocol
        try:
            if msg.type == "secagg_setup":
                self._secagg_reply(client, msg, "advertise_keys", "secagg_keys", SecAggKeys,
                                   protocol.on_setup(body))
            elif msg.type == "secagg_peer_keys":
                self._secagg_reply(client, msg, "share_keys", "secagg_shares", SecAggShares, protocol.on_keys(body))
            elif msg.type == "secagg_relay":
                session.relay = body
                self._send_masked(client)
            elif msg.type == "secagg_unmask_request":
                self._secagg_reply(client, msg, "unmasking", "secagg_unmask", SecAggUnmask,
                                   protocol.on_unmask(body))
            else:  # secagg_abort
                client.secagg = None
        except (SecAggError, SecAggAbort) as exc:
            self._secagg_failed(client, msg.round, msg.task, str(exc))

    def _secagg_reply(self, client: EmulatedClient, msg: Message, phase: str, msg_type: str, body_type,
                      reply: dict[str, Any]) -> None:
        self.metrics.secagg_phase(phase, client.secagg.protocol.timings[phase])
        self._send(client, msg_type, body_type(**reply), round=msg.round, task=msg.task)

    def _send_masked(self, client: EmulatedClient) -> None:
        """Mask and send the training result once both it and the relayed shares are there."""
        session = client.secagg
        result = session.result
        if session.relay is None or result is None:
            return
        if result.error is not None:
            client.secagg = None
            self._send(client, "error", Error(code="train_failed", detail=result.error[:500]),
                       round=result.round, task=result.task)
            return
        rng = np.random.default_rng(zlib.crc32(f"{self.setup.seed}/secagg/{client.index}/{result.round}".encode()))
        try:
            y = session.protocol.on_shares(session.relay, result.vector, result.num_samples, rng)["y"]
        except (SecAggError, SecAggAbort) as exc:
            self._secagg_failed(client, result.round, result.task, str(exc))
            return
        session.relay = session.result = None  # the shares stay in the protocol state; the inputs can go
        self.metrics.secagg_phase("masked_input", session.protocol.timings["masked_input"])
        self._upload(client, result, "secagg_masked", SecAggMasked(**self._report(result)), {"y": y})

    def _secagg_failed(self, client: EmulatedClient, round: int, task: int, detail: str) -> None:
        client.secagg = None
        log.warning("%s: secure aggregation: %s", client.id, detail)
        self._send(client, "error", Error(code="secagg", detail=detail[:500]), round=round, task=task)

    def _heartbeats(self, now: float) -> None:
        for client in self.clients:
            if client.active and now - client.last_sent >= self.heartbeat_interval_s:
                self._send(client, "heartbeat", Heartbeat())

    # ---------------------------------------------------------- edge realism
    def _start_edge(self, client: EmulatedClient, edge: EdgeSettings) -> None:
        """On a welcome: start the run clock, the client's availability model and its link (first time only)."""
        now = time.monotonic()
        if self._clock_origin is None:
            self._clock_origin = now - edge.clock_s
        if client.transitions is None:
            try:
                client.transitions = transitions(edge.availability)
                profile = None if edge.profile is None else DeviceProfile.from_wire(edge.profile)
                client.link = None if profile is None or edge.clock == "emulated" else Link(profile)
                if client.link is not None:
                    self.metrics.link_profile(profile.name)
            except ValueError as exc:
                log.error("%s: %s; it stays always available on an ideal link", client.id, exc)
                client.transitions = iter(())
            client.next_transition = next(client.transitions, None)
        self._follow_availability(client, now - self._clock_origin)

    def _edge_tick(self, now: float) -> None:
        """Run due timers; follow availability; crash and restart clients."""
        while self._timers and self._timers[0][0] <= now:
            heapq.heappop(self._timers)[2]()
        if self._clock_origin is None:
            return
        t = now - self._clock_origin
        for client in self.clients:
            if client.closed:
                continue
            if client.next_transition is not None and client.next_transition[0] <= t:
                self._follow_availability(client, t)
            if client.crash_at is not None and now >= client.crash_at:
                self._crash(client, now)
            elif client.down_until is not None and now >= client.down_until:
                self._restart(client)

    def _follow_availability(self, client: EmulatedClient, t: float) -> None:
        state = client.available
        while client.next_transition is not None and client.next_transition[0] <= t:
            state = client.next_transition[1]
            client.next_transition = next(client.transitions, None)
        if state == client.available:
            return
        client.available = state
        if client.down_until is not None:  # crashed: the restart joins if it is available then
            return
        if state:
            self._join(client)
            self.metrics.client_event("rejoin")
        elif client.welcomed:
            self._send(client, "leave", Leave(reason="unavailable"))
            client.generation += 1  # work in flight is abandoned; local state is kept
            client.crash_at, client.secagg = None, None
            self.metrics.client_event("leave")

    def _crash(self, client: EmulatedClient, now: float) -> None:
        """Die without a goodbye: the socket goes, in-memory state goes, the on-disk store stays."""
        client.crash_at = None
        self._poller.unregister(client.endpoint.sock)
        del self._by_socket[client.endpoint.sock]
        client.endpoint.close(linger_ms=0)  # the new socket of the restart is attached again
        client.generation += 1
        client.welcomed = False
        client.task = client.trained_task = -1
        client.classes, client.seen_classes, client.assets, client.state = [], [], {}, {}
        client.secagg = None
        self.assets.retain([c.assets for c in self.clients])
        client.down_until = now + self.edge.crash_downtime_s
        self.metrics.client_event("crash")
        log.info("%s crashed; restarting in %.1f s", client.id, self.edge.crash_downtime_s)

    def _restart(self, client: EmulatedClient) -> None:
        client.endpoint = self._open_endpoint(client.id)
        self._attach(client)
        client.down_until = None
        self.metrics.client_event("restart")
        if client.available:
            self._join(client)

    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until every client was shut down (or ``stop`` is set)."""
        stop = stop or threading.Event()
        trainer = threading.Thread(target=self._trainer, name="trainer", daemon=True)
        trainer.start()
        for client in self.clients:
            self._join(client)
        try:
            while not stop.is_set() and not all(c.closed for c in self.clients):
                wait_s = min(0.25, self.heartbeat_interval_s / 2)  # the welcome may change the interval
                if self._timers:
                    wait_s = min(wait_s, max(0.0, self._timers[0][0] - time.monotonic()))
                events = dict(self._poller.poll(timeout=math.ceil(1000 * wait_s)))
                for sock in events:
                    if sock is self._wake_rx:
                        while self._wake_rx.poll(0):
                            self._wake_rx.recv()
                        while not self._results.empty():
                            self._deliver(self._results.get())
                        continue
                    client = self._by_socket.get(sock)
                    while client is not None and sock in self._by_socket and sock.poll(0):
                        try:
                            self._receive(client, client.endpoint.recv(), time.monotonic())
                        except WireError as exc:
                            self._rejected(client, exc)
                now = time.monotonic()
                self._edge_tick(now)
                self._heartbeats(now)
        except NodeSetupError as exc:
            log.error("%s", exc)
            for client in self.clients:  # the coordinator stops counting on them at once
                client.endpoint.send("leave", Leave(reason=str(exc)[:200]))
            raise
        finally:
            self._jobs.put(None)
            trainer.join(timeout=30)
            self.close()

    def _rejected(self, client: EmulatedClient, exc: WireError) -> None:
        """Count a bad message from the coordinator; log the first of each reason."""
        self.rejected[exc.reason] = self.rejected.get(exc.reason, 0) + 1
        self.metrics.rejected(exc.reason)
        if self.rejected[exc.reason] == 1:
            log.warning("%s: rejected a message from the coordinator (%s); further ones are only counted",
                        client.id, exc)

    def leave(self, client: EmulatedClient, reason: str = "leaving") -> None:
        self._send(client, "leave", Leave(reason=reason))
        client.closed = True

    def close(self) -> None:
        """Close the sockets. The metrics endpoint stays up (``metrics.close()`` ends it)."""
        for client in self.clients:
            client.endpoint.close()
        self._wake_rx.close(linger=0)
