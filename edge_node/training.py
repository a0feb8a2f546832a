"""Local training on an edge node: one trainer thread for all its clients.

Clients of one node train one after another, as on one device. The main
thread submits a :class:`TrainJob` per train request; the trainer hands each
:class:`TrainResult` back through an in-process queue and rings the
:attr:`Trainer.wake` socket, which the main thread polls with the clients'.
A job the coordinator cancels (:meth:`Trainer.cancel`: its update could no
longer count) is dropped if it waits, or stopped between two batches if it
runs; nothing is sent for it. Jobs are trained round by round, and within a
round in the order the node gives them (:meth:`Trainer.submit`): first come,
first served, or under the emulated clock the ones expected to arrive first
(the coordinator then learns early which others are too late and cancels
them). The order changes no result: each job is seeded by its client and
round, and loads the whole model it trains.
The trainer keeps the last global classifier's model across jobs while its
head size stays, warms up once before the first job, and measures each
client's own CPU time (what the emulated clock scales).
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

from fcl_emu.edge_node.client import TrainJob, TrainResult
from fcl_emu.edge_node.store import RoundPayloads
from fcl_emu.methods import registry as methods
from fcl_emu.aggregation.update import DeltaLayout
from fcl_emu.methods.base import ClientContext, ClientPart, TrainingCancelled, TrainingSettings
from fcl_emu.methods.models.state import model_arrays
from fcl_emu.methods.models.classifier import build_model
from fcl_emu.methods.models.state import load_arrays
from fcl_emu.methods.optim import LocalSGD
from fcl_emu.monitoring.metrics import EdgeNodeMetrics
from fcl_emu.scenario.scenario import Scenario, build_scenario
from fcl_emu.scenario.spec import ScenarioSpec
from fcl_emu.scenario.transforms import to_tensor
from fcl_emu.secagg.consistency import model_digest
from fcl_emu.wire.messages import Welcome

log = logging.getLogger("fcl_emu.edge_node")


@dataclass
class RunSetup:
    """What a welcome configures; shared by all clients of one run."""

    run_id: str
    scenario: Scenario
    client_part: ClientPart
    settings: TrainingSettings
    model_name: str
    seed: int
    device: torch.device

    @classmethod
    def from_welcome(cls, body: Welcome, spec: ScenarioSpec, dataset: Any) -> RunSetup:
        method = methods.get(body.method)
        training = dict(body.training)
        device = training.pop("device", "cpu")
        seed = int(training.pop("seed", 0))
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(
            run_id=body.run_id,
            scenario=build_scenario(spec, dataset),
            client_part=method.client(method.options(**body.method_options)),
            settings=TrainingSettings(**training),
            model_name=body.model,
            seed=seed,
            device=torch.device(device),
        )

    def build_model(self, num_classes: int):
        return build_model(self.model_name, self.scenario.dataset.input_shape, num_classes)


def as_trained(result: TrainResult, job: TrainJob) -> TrainResult:
    """A plain run's result: its uploads as trained (a client without samples sends none)."""
    return result


class AsMasked:
    """A secure run's result: the float deltas as the one vector the masked sum carries (a client without samples:
    zeros, of weight 0), and the digest of what the client was asked to train, which it signs with its masked input
    (:func:`fcl_emu.secagg.consistency.model_digest`). The digest of a round's model shared by its jobs
    (:class:`~fcl_emu.edge_node.store.RoundPayloads`) is computed once; the model is held with it, so no other
    payload can be taken for it."""

    def __init__(self) -> None:
        self._digests: list[tuple[int, Mapping[str, np.ndarray], tuple, bytes]] = []  # of the latest round

    def __call__(self, result: TrainResult, job: TrainJob) -> TrainResult:
        layout = DeltaLayout.of(job.model)
        result.vector = layout.flatten(result.uploads) if result.num_samples else np.zeros(layout.dim, np.float32)
        result.uploads = None
        result.model_digest = self._digest(job)
        return result

    def _digest(self, job: TrainJob) -> bytes:
        request = msgspec.structs.asdict(job.request)
        key = (job.task, tuple(sorted(request.items())))
        if self._digests and self._digests[0][0] != job.round:
            self._digests.clear()
        for _, model, known, digest in self._digests:
            if model is job.model and known == key:
                return digest
        digest = model_digest(job.round, job.task, request, job.model)
        self._digests.append((job.round, job.model, key, digest))
        return digest


class Trainer:
    """The trainer thread, its job and result queues, and the wake-up socket the main thread polls.

    ``setup`` returns the run's current setup (None before the first welcome); ``masked``: the run aggregates
    securely (what the node was started with), so every result is packed for the masked sum."""

    def __init__(self, context: zmq.Context, *, threads: int, payloads: RoundPayloads, metrics: EdgeNodeMetrics,
                 setup: Callable[[], RunSetup | None], masked: bool = False):
        self._context = context
        self._pack = AsMasked() if masked else as_trained
        self._threads = threads
        self._payloads = payloads
        self._metrics = metrics
        self._setup = setup
        # (round, order, arrival) -> job: round by round, by the node's order, then first come first served
        self._jobs: queue.PriorityQueue[tuple[tuple[float, float, int], TrainJob | None]] = queue.PriorityQueue()
        self._arrivals = itertools.count()
        self._results: queue.Queue[TrainResult] = queue.Queue()
        self._cancelled: set[tuple[str, int]] = set()  # (client, round): jobs the coordinator cancelled
        self._cancel_lock = threading.Lock()
        self._stopping = threading.Event()  # the node is ending: every job counts as cancelled
        self._wake_addr = f"inproc://wake-{id(self)}"
        self.wake = context.socket(zmq.PAIR)
        self.wake.bind(self._wake_addr)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="trainer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread: the jobs still queued are dropped and the one training stops at its next batch (the
        node is ending: no result would be sent)."""
        self._stopping.set()
        self._jobs.put(((math.inf, 0.0, next(self._arrivals)), None))
        self._thread.join(timeout=30)

    def close(self) -> None:
        self.wake.close(linger=0)

    def submit(self, job: TrainJob, order: float = 0.0) -> None:
        """Queue ``job``; among its round's waiting jobs, those of lower ``order`` train first."""
        self._jobs.put(((job.round, order, next(self._arrivals)), job))

    def cancel(self, client: str, round: int) -> None:
        """Drop ``client``'s job of ``round``: before it starts, or between two of its batches."""
        with self._cancel_lock:
            self._cancelled.add((client, round))

    def _is_cancelled(self, job: TrainJob) -> bool:
        return self._stopping.is_set() or (job.client.id, job.round) in self._cancelled

    def _forget_cancels(self, job: TrainJob) -> None:
        """Cancels of the job's client up to its round are spent (a cancel may come after its job is done)."""
        with self._cancel_lock:
            self._cancelled = {(c, r) for c, r in self._cancelled if c != job.client.id or r > job.round}

    def queued(self) -> int:
        return self._jobs.qsize()

    def finished(self) -> Iterator[TrainResult]:
        """Once :attr:`wake` is readable: the results handed back since the last call."""
        while self.wake.poll(0):
            self.wake.recv()
        while not self._results.empty():
            yield self._results.get()

    def _run(self) -> None:
        torch.set_num_threads(self._threads)
        wake = self._context.socket(zmq.PAIR)
        wake.connect(self._wake_addr)
        model_cache: dict[int, Any] = {}
        warm = False
        try:
            while (job := self._jobs.get()[1]) is not None:
                if job.generation != job.client.generation or self._is_cancelled(job):  # left, crashed, cancelled
                    self._forget_cancels(job)
                    self._payloads.release(job.round, job.model)
                    self._metrics.trained(0.0, "cancelled")
                    continue
                if not warm:
                    self._warm_up()
                    warm = True
                started, cpu_started = time.perf_counter(), self._cpu_time()
                result = self._train(job, model_cache)
                result.train_s = time.perf_counter() - started
                result.cpu_s = self._cpu_time() - cpu_started
                self._forget_cancels(job)
                if result.cancelled:
                    self._metrics.trained(result.train_s, "cancelled")
                    continue
                result.samples_trained = result.num_samples * job.request.local_epochs
                result.generation, result.received_at = job.generation, job.received_at
                outcome = "failed" if result.error is not None else "ok" if result.num_samples else "no_data"
                self._metrics.trained(result.train_s, outcome, result.num_samples)
                self._results.put(result)
                wake.send(b"")
        finally:
            wake.close(linger=0)

    def _warm_up(self) -> None:
        """One optimiser step of the run's model on a tiny batch before the first client's job: one-time costs
        (kernels' and autograd's first use) are the node's, not charged to whichever client trains first (the
        emulated clock scales its CPU time). Torch's global generator is left as it was."""
        s = self._setup()
        with torch.random.fork_rng(devices=[]):
            model = s.build_model(s.scenario.dataset.num_classes).to(s.device)
            optimizer = LocalSGD(model.parameters(), lr=0.0)
            model(torch.zeros((2, *s.scenario.dataset.input_shape), device=s.device)).sum().backward()
            optimizer.step()

    def _cpu_time(self) -> float:
        """The trainer's clock for a client's own work: its thread's CPU time (torch computes in the calling
        thread with one thread); the process's with more threads; wall time on a GPU, where the work is the
        device's (the trainer is the only one using it)."""
        s = self._setup()
        if s is not None and s.device.type == "cuda":
            return time.perf_counter()
        return time.thread_time() if self._threads == 1 else time.process_time()

    def _train(self, job: TrainJob, model_cache: dict[int, Any]) -> TrainResult:
        client = job.client
        s = self._setup()
        try:
            if job.task != client.task:  # a task start came while the job waited: its round and task are over
                log.info("%s: skipped round %d of task %d, now in task %d", client.id, job.round, job.task,
                         client.task)
                return TrainResult(client, job.round, job.task, None, stale=True)
            indices = s.scenario.client_indices(client.index, client.task)
            if len(indices) == 0:
                return self._pack(TrainResult(client, job.round, job.task, {}, 0), job)
            classifier = model_arrays(job.model)  # none for a method without a global classifier (FedCBC):
            model = self._classifier(s, classifier, model_cache) if classifier else None  # its train gets None
            ds = s.scenario.dataset
            ctx = ClientContext(
                client=client.id, task=client.task,
                task_classes=np.asarray(client.classes), seen_classes=np.asarray(client.seen_classes),
                x=to_tensor(ds.train_x[indices], ds.mean, ds.std),
                y=torch.from_numpy(np.asarray(s.scenario.client_labels(client.index, client.task), dtype=np.int64)),
                settings=replace(s.settings, lr=job.request.lr, local_epochs=job.request.local_epochs),
                global_state=job.model, assets=client.assets,
                state=client.state, store=client.store, build_model=s.build_model, device=s.device,
                mean=tuple(ds.mean), std=tuple(ds.std), dataset_classes=ds.num_classes,
                seed=zlib.crc32(f"{s.seed}/{client.index}/{job.round}".encode()),
                new_task=client.trained_task != client.task,
                cancelled=lambda: self._is_cancelled(job),
            )
            uploads, metrics = s.client_part.train(ctx, model)
            client.trained_task = client.task
            return self._pack(TrainResult(client, job.round, job.task, uploads, len(indices), metrics,
                                          side=ctx.outbox), job)
        except TrainingCancelled:
            log.info("%s: round %d %s", client.id, job.round,
                     "dropped: the node is ending" if self._stopping.is_set() else "cancelled by the coordinator")
            return TrainResult(client, job.round, job.task, None, cancelled=True)
        except Exception as exc:  # reported to the coordinator, never kills the node
            log.exception("%s: training failed", client.id)
            return TrainResult(client, job.round, job.task, None, error=f"{type(exc).__name__}: {exc}")
        finally:
            self._payloads.release(job.round, job.model)

    @staticmethod
    def _classifier(s: RunSetup, arrays: Mapping[str, np.ndarray], model_cache: dict[int, Any]):
        """The received global classifier, in a model reused across jobs while its head size stays."""
        head = int(arrays["head.weight"].shape[0])
        model = model_cache.get(head)
        if model is None:
            model_cache.clear()
            model = model_cache[head] = s.build_model(head)
        return load_arrays(model, arrays)
