"""The coordinator-side GPU worker pool: server-side jobs off the coordinator's event loop (docs/gpu.md).

``gpu.workers = N > 0`` starts N worker processes (gpu_worker/worker.py),
each owning one device (CUDA when present and asked for, the CPU otherwise),
connected to one ROUTER of the pool's own. ``N = 0`` runs jobs in one thread
of the coordinator process. Either way the pool only ever says which of its
sockets to poll, takes what arrives on them and is ticked: the coordinator's
serve loop stays the one place that waits, so joins and heartbeats go on
being answered while a job runs.

A job reports its steps as it goes (``jobs.step``): a worker sends each
report as a ``job_progress`` message on the same socket as its result, the
in-process runner writes it straight into the job; either way the job's
``steps`` holds the latest, for the coordinator to show while it waits.

A job that raises, outlives ``gpu.job_timeout_s`` (its worker is killed) or
loses its worker (the process died; it is started again) is retried
``gpu.retries`` times, then reported failed with every attempt's error.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from fcl_emu.gpu_worker import WORKER_KEY_NAME, GpuWorkerArgs, worker_device, worker_identity
from fcl_emu.coordinator.guard import LogOnce
from fcl_emu.methods import jobs
from fcl_emu.wire.framing import Limits, WireError
from fcl_emu.wire.messages import JobRequest, Shutdown
from fcl_emu.wire.auth import SERVER_NAME, ServerKeys
from fcl_emu.wire.sockets import ByteCounter, ServerEndpoint

log = logging.getLogger("fcl_emu.gpu_pool")

MAX_RESTARTS = 3  # per worker slot; after that the slot stays dead


@dataclass
class Job:
    """One job and what became of it; ``done`` once it succeeded or failed for good."""

    id: int
    kind: str
    inputs: Mapping[str, np.ndarray]
    options: dict[str, Any]
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None
    worker: str | None = None
    attempts: int = 0
    errors: list[str] = field(default_factory=list)  # one per failed attempt
    done: bool = False
    ok: bool = False
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    queue_s: float = 0.0  # waiting for a worker, summed over attempts
    run_s: float = 0.0  # on the device (the successful attempt, or the last one)
    steps: tuple[int, int] | None = None  # (done, total): the attempt's latest step report

    @property
    def error(self) -> str:
        return "; ".join(f"attempt {i + 1}: {e}" for i, e in enumerate(self.errors))


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen | None = None
    device: str = ""
    ready: bool = False  # said hello
    job: Job | None = None
    restarts: int = 0

    @property
    def identity(self) -> str:
        return worker_identity(self.index)

    @property
    def state(self) -> str:
        if self.proc is None:
            return "dead"
        return "busy" if self.job is not None else "idle" if self.ready else "starting"


class WorkerPool:
    def __init__(self, settings: Any, context: zmq.Context, *, count: ByteCounter, max_message_bytes: int,
                 metrics: Any = None, worker_metrics: tuple[str, int, float] | None = None,
                 keys: ServerKeys | None = None, key_dir: Path | None = None):
        """``settings``: the run config's ``gpu`` section; ``count``: the wire byte counter; ``worker_metrics``:
        (host, port of worker 0, linger seconds) when the workers serve /metrics (worker j on port + j);
        ``keys``: the coordinator's CurveZMQ keys, and ``key_dir`` the directory with the workers' key."""
        self.settings = settings
        self.worker_metrics = worker_metrics
        self.metrics = metrics
        self._ids = itertools.count(1)
        self._queue: collections.deque[Job] = collections.deque()
        self._workers: list[_Worker] = []
        self._endpoint: ServerEndpoint | None = None
        self._local: _LocalRunner | None = None
        self._context = context
        self._count = count
        self._limits = Limits(max_total_bytes=max_message_bytes)
        self._log_once = LogOnce(log)  # what its socket refuses, within the coordinator's log budgets
        self.rejected: collections.Counter[str] = collections.Counter()  # what its socket refused, by reason
        self._log_dir: Path | None = None
        self._keys = keys
        self._key_dir = key_dir
        self.device = "coordinator"

    # ------------------------------------------------------------------ life cycle
    def start(self, log_dir: Path) -> None:
        """Start the workers (their logs go to ``log_dir``), or the in-process runner."""
        if self.settings.workers == 0:
            device = worker_device(self.settings.device, 0)
            self._local = _LocalRunner(self._context, device)
            self.device = f"{device} (in the coordinator)"
            return
        self._endpoint = ServerEndpoint(self._context, "tcp://127.0.0.1:0", name="coordinator", limits=self._limits,
                                        count=self._count, keys=self._keys)
        self._log_dir = Path(log_dir)
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._workers = [_Worker(i) for i in range(self.settings.workers)]
        for worker in self._workers:
            self._spawn(worker)
        self.device = self.settings.device

    def _spawn(self, worker: _Worker) -> None:
        metrics = {}
        if self.worker_metrics is not None:
            host, port, linger = self.worker_metrics
            metrics = {"metrics_host": host, "metrics_port": port + worker.index, "metrics_linger": linger}
        keys = {}
        if self._keys is not None:
            keys = {"server_key": Path(self._key_dir) / f"{SERVER_NAME}.key",
                    "key": Path(self._key_dir) / f"{WORKER_KEY_NAME}.key_secret"}
        args = GpuWorkerArgs(self._endpoint.address, worker.index, self.settings.device, parent_pid=os.getpid(),
                             **metrics, **keys)
        cmd = [sys.executable, "-m", "fcl_emu.gpu_worker", *args.to_argv()]
        env = {**os.environ, "OMP_NUM_THREADS": str(self.settings.threads)}
        with open(self._log_dir / f"{worker.identity}.log", "ab") as out:
            worker.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        worker.ready, worker.job = False, None

    def close(self) -> None:
        for worker in self._workers:
            if worker.proc is not None and worker.ready and worker.proc.poll() is None:
                try:
                    self._endpoint.send(worker.identity, "shutdown", Shutdown(reason="run over"))
                except zmq.ZMQError:
                    pass
        for worker in self._workers:
            if worker.proc is not None:
                try:
                    worker.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    worker.proc.kill()
                    worker.proc.wait()
        if self._endpoint is not None:
            self._endpoint.close()
        if self._local is not None:
            self._local.close()

    # --------------------------------------------------------------------- jobs
    def submit(self, kind: str, inputs: Mapping[str, np.ndarray], options: Mapping[str, Any] | None = None) -> Job:
        jobs.get(kind)  # an unknown kind fails here, in the coordinator, at once
        size = sum(np.asarray(a).nbytes for a in inputs.values())
        if size > self._limits.max_total_bytes:
            raise ValueError(f"job {kind!r}: {size} bytes of inputs exceed network.max_message_bytes "
                             f"({self._limits.max_total_bytes})")
        job = Job(next(self._ids), kind, dict(inputs), dict(options or {}))
        self._queue.append(job)
        self.tick()
        return job

    @property
    def queued(self) -> int:
        return len(self._queue)

    def worker_states(self) -> dict[str, int]:
        states = collections.Counter(w.state for w in self._workers)
        if self._local is not None:
            states["busy" if self._local.job is not None else "idle"] += 1
        return dict(states)

    def sockets(self) -> list[zmq.Socket]:
        """What the coordinator's serve loop polls for the pool."""
        if self._endpoint is not None:
            return [self._endpoint.sock]
        return [] if self._local is None else [self._local.wake]

    def on_readable(self, sock: zmq.Socket) -> None:
        """Take everything waiting on one of :meth:`sockets`."""
        if self._local is not None and sock is self._local.wake:
            self._local.drain()
            self.tick()
            return
        while self._endpoint.sock.poll(0):
            try:
                received = self._endpoint.recv()
            except WireError as exc:
                self.rejected[exc.reason] += 1
                if self.metrics is not None:
                    self.metrics.rejected(exc.reason)
                self._log_once(exc.peer, exc.reason, f"gpu pool: rejected a message from {exc.peer!r} ({exc})")
                continue
            if received is None:  # a shared connection's close notice: workers have connections of their own
                continue
            peer, msg = received
            worker = next((w for w in self._workers if w.identity == peer), None)
            if worker is None:
                self._log_once(peer, "unknown peer", f"gpu pool: a message from unknown peer {peer!r}")
            elif msg.type == "worker_hello":
                worker.ready, worker.device = True, msg.body.device
                log.info("gpu worker %d ready on %s", worker.index, worker.device)
            elif msg.type == "job_progress":  # one of a job already over is dropped
                if worker.job is not None and msg.body.job_id == worker.job.id:
                    worker.job.steps = (msg.body.done, msg.body.total)
            elif msg.type == "error" and worker.job is not None:  # it rejected the job message
                job, worker.job = worker.job, None
                self._attempt_failed(job, msg.body.detail)
            elif msg.type == "job_result" and worker.job is not None and msg.body.job_id == worker.job.id:
                job, worker.job = worker.job, None
                body = msg.body
                late = time.monotonic() - job.started - self.settings.job_timeout_s
                if late > 0:  # it finished between two timeout checks: a timeout all the same
                    self._attempt_failed(job, f"timed out after {self.settings.job_timeout_s:g} s (its result "
                                              f"came {late:.2f} s too late)", run_s=body.run_s)
                elif body.ok:
                    self._finish(job, ok=True, run_s=body.run_s, outputs=msg.tensors, metrics=body.metrics)
                else:
                    self._attempt_failed(job, body.error, run_s=body.run_s)
            else:
                self._log_once(peer, f"ignored {msg.type}", f"gpu pool: ignoring {msg.type} from {peer}")
        self.tick()

    def tick(self) -> None:
        """Start queued jobs on idle workers; kill jobs past their timeout; restart dead workers."""
        now = time.monotonic()
        if self._local is not None:
            done = self._local.finished()
            if done is not None:
                job, ok, value, run_s = done
                if ok:
                    self._finish(job, ok=True, run_s=run_s, outputs=value.arrays, metrics=value.metrics)
                else:
                    self._attempt_failed(job, value, run_s=run_s)
            if self._local.job is None and self._queue:
                self._local.start(self._take())
            return
        for worker in self._workers:
            if worker.proc is None:
                continue
            code = worker.proc.poll()
            if code is not None:
                self._worker_died(worker, f"its worker process exited with code {code} (its log: "
                                          f"{self._log_dir / (worker.identity + '.log')})")
            elif worker.job is not None and now - worker.job.started > self.settings.job_timeout_s:
                worker.proc.send_signal(signal.SIGKILL)
                worker.proc.wait()
                self._worker_died(worker, f"timed out after {self.settings.job_timeout_s:g} s (worker killed)")
        for worker in self._workers:
            if worker.ready and worker.job is None and self._queue:
                job = self._take()
                job.worker = worker.identity
                try:
                    self._endpoint.send(worker.identity, "job", JobRequest(job_id=job.id, kind=job.kind,
                                                                          options=job.options), tensors=job.inputs)
                    worker.job = job
                except zmq.ZMQError as exc:
                    self._attempt_failed(job, f"could not be sent to {worker.identity}: {exc}")
        if self._queue and not any(w.proc is not None for w in self._workers):
            while self._queue:
                job = self._queue.popleft()
                job.errors.append("no GPU worker is left (each was restarted "
                                  f"{MAX_RESTARTS} times)")
                self._finish(job, ok=False)

    def _take(self) -> Job:
        job = self._queue.popleft()
        job.attempts += 1
        job.steps = None
        job.started = time.monotonic()
        job.queue_s += job.started - job.submitted
        return job

    def _worker_died(self, worker: _Worker, why: str) -> None:
        job, worker.job = worker.job, None
        log.warning("gpu worker %d: %s", worker.index, why)
        if job is not None:
            self._attempt_failed(job, why)
        if worker.restarts < MAX_RESTARTS:
            worker.restarts += 1
            self._spawn(worker)
        else:
            worker.proc = None

    def _attempt_failed(self, job: Job, error: str, run_s: float = 0.0) -> None:
        job.errors.append(error)
        job.run_s = run_s
        if job.attempts <= self.settings.retries:
            job.submitted = time.monotonic()
            self._queue.append(job)
        else:
            self._finish(job, ok=False)

    def _finish(self, job: Job, ok: bool, run_s: float = 0.0, outputs: Mapping[str, np.ndarray] | None = None,
                metrics: Mapping[str, float] | None = None) -> None:
        job.done, job.ok = True, ok
        if ok:
            job.run_s, job.outputs, job.metrics = run_s, dict(outputs or {}), dict(metrics or {})
        job.inputs = {}  # the pool holds no job's arrays once it is over
        if self.metrics is not None:
            self.metrics.gpu_job(job.kind, ok=ok, run_s=job.run_s, queue_s=job.queue_s,
                                 peak_memory_bytes=job.metrics.get("peak_memory_bytes"))


class _LocalRunner:
    """``gpu.workers = 0``: one job at a time in a thread of the coordinator; an inproc socket says when it
    ended, so the serve loop wakes at once. Closed while a job runs (the run is ending), it cancels the job at
    the job's next step report (:class:`~fcl_emu.methods.jobs.Cancelled`) and waits for its thread: torch
    work left running in a thread while the interpreter exits aborts the process."""

    JOIN_S = 10.0  # the longest close waits for a cancelled job's thread

    def __init__(self, context: zmq.Context, device: torch.device):
        self.device = device
        self.job: Job | None = None
        self._result: tuple | None = None
        address = f"inproc://gpu-pool-{id(self)}"
        self.wake = context.socket(zmq.PAIR)
        self.wake.bind(address)
        self._signal = context.socket(zmq.PAIR)
        self._signal.connect(address)
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, job: Job) -> None:
        self.job = job
        job.worker = "coordinator"
        self._thread = threading.Thread(target=self._run, args=(job,), name=f"job-{job.id}", daemon=True)
        self._thread.start()

    def _step(self, job: Job, done: int, total: int) -> None:
        if self._cancel.is_set():
            raise jobs.Cancelled(f"job {job.id} ({job.kind}) cancelled: the run is ending")
        job.steps = (done, total)

    def _run(self, job: Job) -> None:
        start = time.perf_counter()
        try:
            result = (job, True, jobs.run(job.kind, job.inputs, job.options, self.device,
                                          lambda done, total: self._step(job, done, total)))
        except jobs.Cancelled as exc:
            result = (job, False, str(exc))
        except Exception as exc:  # reported as the job's error
            log.exception("job %d (%s) failed", job.id, job.kind)
            result = (job, False, f"{type(exc).__name__}: {exc}"[:1000])
        with self._lock:
            self._result = (*result, time.perf_counter() - start)
            self._signal.send(b"")

    def drain(self) -> None:
        while self.wake.poll(0):
            self.wake.recv()

    def finished(self) -> tuple | None:
        with self._lock:
            result, self._result = self._result, None
        if result is not None:
            self.job = None
        return result

    def close(self) -> None:
        self._cancel.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(self.JOIN_S)
            if self._thread.is_alive():
                log.warning("server job %s still runs after %.0f s (it reports no steps to be cancelled at)",
                            self._thread.name, self.JOIN_S)
        self.wake.close(linger=0)
        self._signal.close(linger=0)
