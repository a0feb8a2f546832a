"""The edge-node process: many emulated clients, each with its own DEALER socket.

The main thread owns every socket: it polls them, answers the coordinator,
and sends each client's heartbeats on time. Local training runs on a single
trainer thread (clients of one node train one after another, as on one
device); it hands finished uploads back through an in-process queue and a
wake-up socket. An idle client holds its socket, a few counters and the
references to its task assets; no model copy.
"""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import zmq

from edge_node.store import ArrayStore, AssetCache, RoundPayloads
from methods import registry as methods
from methods.base import ClientContext, ClientPart, TrainingSettings
from methods.models.classifier import build_model
from methods.models.state import load_arrays
from monitoring.metrics import EdgeNodeMetrics
from scenario.datasets import load_dataset
from scenario.scenario import Scenario, build_scenario
from scenario.spec import ScenarioSpec
from scenario.transforms import to_tensor
from wire.framing import Limits, Message, WireError
from wire.messages import Error, Heartbeat, Join, Leave, Update
from wire.sockets import ClientEndpoint, Counters, tee

log = logging.getLogger("fcl_emu.edge_node")


def client_id(index: int) -> str:
    return f"client-{index:04d}"


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

    @property
    def id(self) -> str:
        return self.endpoint.identity


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


@dataclass
class _Result:
    client: EmulatedClient
    round: int
    task: int
    uploads: dict[str, np.ndarray] | None
    num_samples: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None


class EdgeNode:
    def __init__(self, connect: str, client_indices: list[int], *, name: str | None = None,
                 data_roots: list[Path] | None = None, state_dir: Path | None = None,
                 threads: int = 1, context: zmq.Context | None = None):
        self.connect = connect
        self.name = name or f"node-{os.getpid()}"
        self.data_roots = list(data_roots or [])
        self.context = context or zmq.Context.instance()
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
        self.clients = [self._new_client(i) for i in client_indices]
        self.heartbeat_interval_s = 1.0
        self.metrics.watch(self.clients, self._jobs.qsize)

    def _new_client(self, index: int) -> EmulatedClient:
        cid = client_id(index)
        endpoint = ClientEndpoint(self.context, self.connect, cid, count=self._count)
        return EmulatedClient(index, endpoint, ArrayStore(self._state_dir / cid))

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
        try:
            while (job := self._jobs.get()) is not None:
                started = time.perf_counter()
                result = self._train(job, model_cache)
                outcome = "failed" if result.error is not None else "ok" if result.num_samples else "no_data"
                self.metrics.trained(time.perf_counter() - started, outcome, result.num_samples)
                self._results.put(result)
                wake.send(b"")
        finally:
            wake.close(linger=0)

    def _train(self, job: _Job, model_cache: dict[int, Any]) -> _Result:
        client = job.client
        s = self.setup
        try:
            indices = s.scenario.client_indices(client.index, client.task)
            if len(indices) == 0:
                return _Result(client, job.round, job.task, {}, 0)
            head = int(job.model["head.weight"].shape[0])
            model = model_cache.get(head)
            if model is None:
                model_cache.clear()
                model = model_cache[head] = self.build_model(head)
            load_arrays(model, job.model)
            ds = s.scenario.dataset
            ctx = ClientContext(
                client=client.id, task=client.task,
                task_classes=np.asarray(client.classes), seen_classes=np.asarray(client.seen_classes),
                x=to_tensor(ds.train_x[indices], ds.mean, ds.std),
                y=torch.from_numpy(np.asarray(s.scenario.train_labels[indices], dtype=np.int64)),
                settings=s.settings, global_state=job.model, assets=client.assets,
                state=client.state, store=client.store, build_model=self.build_model, device=s.device,
                seed=zlib.crc32(f"{s.seed}/{client.index}/{job.round}".encode()),
                new_task=client.trained_task != client.task,
            )
            uploads, metrics = s.client_part.train(ctx, model)
            client.trained_task = client.task
            return _Result(client, job.round, job.task, uploads, len(indices), metrics)
        except Exception as exc:  # reported to the coordinator, never kills the node
            log.exception("%s: training failed", client.id)
            return _Result(client, job.round, job.task, None, error=f"{type(exc).__name__}: {exc}")
        finally:
            self.payloads.release(job.round, job.model)

    # ------------------------------------------------------------------ I/O
    def _on_message(self, client: EmulatedClient, msg: Message) -> None:
        if msg.type == "welcome":
            self._configure(msg.body)
            client.welcomed = True
        elif msg.type == "task_start":
            client.task = msg.task
            client.classes = list(msg.body.classes)
            client.seen_classes = list(msg.body.seen_classes)
            client.assets = self.assets.intern_all(msg.tensors)
            self.assets.retain([c.assets for c in self.clients])
        elif msg.type == "train_request":
            if self.setup is None or client.task != msg.task:
                self._send(client, "error", Error(code="not_ready", detail="train request before task start"),
                           round=msg.round, task=msg.task)
                return
            self._jobs.put(_Job(client, msg.round, msg.task, self.payloads.acquire(msg.round, msg.tensors)))
        elif msg.type == "shutdown":
            client.closed = True
        elif msg.type == "error":
            log.warning("%s: coordinator says %s: %s", client.id, msg.body.code, msg.body.detail)
        else:
            log.warning("%s: ignoring unexpected %s", client.id, msg.type)

    def _send(self, client: EmulatedClient, msg_type: str, body, **kw) -> None:
        client.endpoint.send(msg_type, body, **kw)
        client.last_sent = time.monotonic()

    def _deliver(self, result: _Result) -> None:
        client = result.client
        if client.closed:
            return
        if result.error is not None:
            self._send(client, "error", Error(code="train_failed", detail=result.error[:500]),
                       round=result.round, task=result.task)
            return
        self._send(client, "update", Update(num_samples=result.num_samples,
                                            train_time_s=result.metrics.get("train_time_s", 0.0),
                                            loss=result.metrics.get("loss", float("nan")),
                                            metrics=result.metrics),
                   round=result.round, task=result.task, tensors=result.uploads)

    def _heartbeats(self, now: float) -> None:
        for client in self.clients:
            if client.welcomed and not client.closed and now - client.last_sent >= self.heartbeat_interval_s:
                self._send(client, "heartbeat", Heartbeat())

    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until every client was shut down (or ``stop`` is set)."""
        stop = stop or threading.Event()
        trainer = threading.Thread(target=self._trainer, name="trainer", daemon=True)
        trainer.start()
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        by_socket = {}
        for client in self.clients:
            poller.register(client.endpoint.sock, zmq.POLLIN)
            by_socket[client.endpoint.sock] = client
            self._send(client, "join", Join(node=self.name, pid=os.getpid(), client_index=client.index))
        try:
            while not stop.is_set() and not all(c.closed for c in self.clients):
                events = dict(poller.poll(timeout=int(1000 * min(0.25, self.heartbeat_interval_s / 2))))
                for sock in events:
                    if sock is self._wake_rx:
                        while self._wake_rx.poll(0):
                            self._wake_rx.recv()
                        while not self._results.empty():
                            self._deliver(self._results.get())
                        continue
                    client = by_socket[sock]
                    while sock.poll(0):
                        try:
                            self._on_message(client, client.endpoint.recv())
                        except WireError as exc:
                            self._rejected(client, exc)
                self._heartbeats(time.monotonic())
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
