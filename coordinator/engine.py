"""The coordinator: one object that holds a run's state and runs it, task by task and round by round.

Its parts live one concept per file, as mixins of :class:`Coordinator`:

- :mod:`coordinator.dispatch`: serving the ROUTER socket, each client message by its type;
- :mod:`coordinator.rounds`: one round, phase by phase (select, dispatch, collect, aggregate, evaluate, record);
- :mod:`coordinator.secure_round`: a round's secure aggregation on the wire (SecAgg+);
- :mod:`coordinator.resume`: checkpoints after every round, and resuming from one;
- :mod:`coordinator.summary`: ``summary.json``;
- :mod:`coordinator.nodes`: noticing at once that an edge node started by a launcher has exited.

This file builds the state (scenario, method server part, registry, socket, GPU worker pool) and runs the
lifecycle (:meth:`Coordinator.run`): wait for the clients, then for each task: start it, run its rounds, end it
(the method's task-end work), evaluate and checkpoint; at the end tell every client to shut down and write the
summary. Server-side jobs (:meth:`Coordinator.run_job`) run on the GPU worker pool while the socket is served.
"""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import contextmanager
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import zmq

from coordinator.checkpoint import Checkpoint
from coordinator.dispatch import MessageDispatch
from coordinator.errors import BindError, JobFailed, RunAborted
from coordinator.evaluation import Evaluator
from coordinator.gpu_pool import Job, WorkerPool
from coordinator.guard import CONTROL_RATE_PER_S, LogOnce, RateLimiter
from coordinator.nodes import NodeExit, NodeWatch
from coordinator.registry import ClientRegistry, Status
from coordinator.emulated import EmulatedClock
from coordinator.resume import CHECKPOINT_DIR, Checkpointing, run_fingerprint
from coordinator.rounds import RoundEngine, OpenRound
from coordinator.secure_round import SecureRound
from coordinator.summary import RunSummary
from methods import registry as methods
from methods.base import ClientUpdate, ServerContext
from methods.models.classifier import build_model, resolve_model
from monitoring.metrics import CoordinatorMetrics
from monitoring.results import (RoundRecord, RunRecorder, average_accuracy, average_forgetting,
                                average_incremental_accuracy)
from runconfig import RunConfig, gpu_worker_metrics_port
from scenario.availability import parse_availability
from scenario.datasets import load_dataset
from scenario.devices import load_profiles
from scenario.scenario import build_scenario
from wire.auth import Allowlist, KeyFileError, ServerKeys, load_server_keys
from wire.framing import Limits
from wire.messages import Shutdown
from wire.sockets import Counters, ServerEndpoint, tee

__all__ = ["BindError", "CHECKPOINT_DIR", "Coordinator", "JobFailed", "NodeExit", "RunAborted", "run_fingerprint"]


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


ProgressHook = Callable[[str, dict], None]


class Coordinator(MessageDispatch, RoundEngine, Checkpointing, RunSummary, NodeWatch):
    def __init__(self, config: RunConfig, *, context: zmq.Context | None = None,
                 progress: ProgressHook | None = None, resume: Checkpoint | None = None):
        """``resume``: continue from this checkpoint of the same run (same run id and address)."""
        self.config = config
        self.progress = progress or (lambda kind, info: None)
        self.device = resolve_device(config.device)
        if config.coordinator_threads is not None:
            torch.set_num_threads(config.coordinator_threads)
        self.dataset = load_dataset(config.scenario.dataset, config.data_root, download=config.download)
        self.scenario = build_scenario(config.scenario, self.dataset)
        self.spec = methods.get(config.method)
        options = config.method_options_model()
        self.model_name = resolve_model(config.model, self.dataset.input_shape, self.spec.server.needs_batchnorm,
                                        self.spec.server.small_model)
        torch.manual_seed(config.seed)
        self.server = self.spec.server(ServerContext(
            options=options, scenario=self.scenario, build_model=self._build_model, seed=config.seed,
            run_job=self.run_job, model_name=self.model_name, input_shape=tuple(self.dataset.input_shape),
            rounds_per_task=config.rounds.rounds_per_task))
        self.evaluator = Evaluator(self.scenario, self.device)
        self.heartbeat_interval_s, liveness_timeout_s = config.network.liveness(config.scenario.num_clients)
        self.registry = ClientRegistry(liveness_timeout_s)
        self.counters = Counters.empty()
        # Prometheus metrics (served only when asked: ``metrics.serve``, see fcl_emu/run.py)
        self.metrics = CoordinatorMetrics()
        self.metrics.watch_online(lambda: self.registry.online_count)
        self.context = context or zmq.Context.instance()
        keys, self.allowlist = self._keys()
        bind = config.network.bind if resume is None else resume.state["address"]
        try:
            self.endpoint = ServerEndpoint(self.context, bind,
                                           limits=Limits(max_total_bytes=config.network.max_message_bytes),
                                           count=tee(self.counters, self.metrics.count_message), keys=keys)
        except zmq.ZMQError as exc:
            if self.allowlist is not None:
                self.allowlist.stop()
            raise BindError(f"cannot bind {bind}: {exc}") from None
        self.address = self.endpoint.address
        first_port = gpu_worker_metrics_port(config, 0)
        self.pool = WorkerPool(config.gpu, self.context, count=tee(self.counters, self.metrics.count_message),
                               keys=keys, key_dir=config.security.keys,
                               max_message_bytes=config.network.max_message_bytes, metrics=self.metrics,
                               worker_metrics=None if first_port is None else (config.metrics.host, first_port,
                                                                               config.metrics.linger))
        self.metrics.watch_gpu_pool(lambda: self.pool.queued, self.pool.worker_states)
        self._jobs: list[Job] = []  # finished server-side jobs, for the summary
        self._recorder: RunRecorder | None = None
        self.rng = np.random.default_rng(config.seed)
        self.run_id = uuid.uuid4().hex[:12] if resume is None else resume.state["run_id"]
        self.rejected: Counter[str] = Counter()
        self.handling_s: Counter[str] = Counter()  # time spent receiving+handling, by message type
        self.wall_s: Counter[str] = Counter()  # this session's wall clock by part of the lifecycle (_spent)
        self._session_started = time.perf_counter()
        self.log_once = LogOnce(logging.getLogger("fcl_emu.coordinator"))  # refusals, client errors
        # control messages per peer: room for twice the heartbeat rate on top of the rest
        self.rate_limiter = RateLimiter(CONTROL_RATE_PER_S + 2.0 / self.heartbeat_interval_s)
        self.late_updates = 0
        self.connection_switches = 0  # messages from a client over another connection than its last one
        self.late_side_channel = 0  # side-channel messages from outside the open round, dropped
        self.client_accuracy: list[float | None] = []  # accuracy_clients after each task (AF-FCL's measure)
        self._stale: list[ClientUpdate] = []  # late updates kept for the next round (rounds.late_updates)
        self._stale_task = -1
        self._round: OpenRound | None = None
        self._secure: SecureRound | None = None  # the open secure-aggregation round (config.secagg)
        self._clock0 = time.monotonic()  # the run clock that availability models follow
        self._availability = parse_availability(config.edge.availability)
        self._profiles = load_profiles(config.edge.device_profiles) if config.edge.device_profiles else None
        edge = config.edge
        self.clock = EmulatedClock(  # None: the real clock (docs/edge.md)
            self._availability, seed=config.seed, slot_s=edge.availability_slot_s,
            trace_time_scale=edge.trace_time_scale, crash_rate=edge.crash_rate,
            crash_downtime_s=edge.crash_downtime_s, liveness_timeout_s=liveness_timeout_s,
        ) if config.emulated_clock else None
        self._task = 0
        self._global_round = 0
        # conditions the first round waits for once the clients are in, each (what, condition, timeout):
        # `up --prometheus` waits for its Prometheus's first scrape of every process (fcl_emu/run.py)
        self.before_rounds: list[tuple[str, Callable[[], bool], float]] = []
        self._welcome_template = dict(
            run_id=self.run_id,
            scenario=config.scenario.model_dump(mode="json"),
            method=config.method,
            method_options=options.model_dump(mode="json"),
            model=self.model_name,
            training={**config.training.model_dump(), "seed": config.seed, "device": config.device},
            heartbeat_interval_s=self.heartbeat_interval_s,
        )
        # checkpoints and resuming (docs/resume.md)
        self._not_joined_at: dict[str, float] = {}  # when each unknown peer was last told to join
        self._resumes = 0
        self._resumed: dict | None = None  # the checkpoint's results and position, until run() takes them
        self._checkpoints = {"saved": 0, "seconds": 0.0, "bytes": 0}
        if resume is not None:
            self._restore(resume)

    def _keys(self) -> tuple[ServerKeys | None, Allowlist | None]:
        """The run's keys and the ZAP handler that admits only them (CurveZMQ), or none (``--insecure``).
        Raises :class:`wire.auth.KeyFileError`."""
        security = self.config.security
        if security.transport == "plain":
            return None, None
        if security.keys is None:
            raise KeyFileError("CurveZMQ needs the run's key directory: write one with `fcl-emu keys` and pass "
                               "--keys, or run without authentication with --insecure")
        keys = load_server_keys(security.keys)
        return keys, Allowlist(self.context, keys)

    def _build_model(self, num_classes: int):
        return build_model(self.model_name, self.dataset.input_shape, num_classes)

    # ---------------------------------------------------------------------- run
    def _wait_for_clients(self) -> None:
        expected = self.config.scenario.num_clients
        timeout = self.config.network.join_timeout_s
        # every configured client has shown up (one that joined and died since is not waited for, nor one
        # whose node has exited)
        self.serve(lambda: len(self.registry.records) + self._unreachable_clients >= expected,
                   time.monotonic() + timeout)
        online = len(self.registry.eligible(0))
        if online < self.config.rounds.min_participants:
            raise RunAborted(f"only {online} clients joined within {timeout:.0f} s; "
                             f"at least {self.config.rounds.min_participants} are needed")
        self.progress("ready", {"online": len(self.registry.online()), "expected": expected})

    def _wait_before_rounds(self) -> None:
        """Serve the clients until each of :attr:`before_rounds` holds or its timeout passes (then go on,
        saying so in the log: these are conveniences, never a reason to stop the run)."""
        for what, condition, timeout_s in self.before_rounds:
            self.serve(condition, time.monotonic() + timeout_s)
            if not condition():
                logging.getLogger("fcl_emu.coordinator").warning(
                    "starting the rounds without %s (waited %.0f s)", what, timeout_s)

    def run(self, run_dir: Path) -> dict:
        """Run (or, built with ``resume``, continue) the emulation; checkpoint after every round."""
        resumed, self._resumed = self._resumed, None
        recorder = RunRecorder(run_dir, self.config.to_yaml() if resumed is None else None,
                               elapsed_s=0.0 if resumed is None else resumed["wall_clock_s"])
        started = time.perf_counter() - (0.0 if resumed is None else resumed["wall_clock_s"])
        matrix: list[list[float | None]] = [] if resumed is None else resumed["matrix"]
        class_hits = None  # (correct, samples) per seen class after the latest task: spatial retention
        rounds: list[RoundRecord] = [] if resumed is None else resumed["rounds"]
        first_task, first_round = (0, 0) if resumed is None else (resumed["task"], resumed["task_round"])
        last_round = self.config.rounds.rounds_per_task - 1

        def save(task: int, task_round: int) -> None:
            with self._spent("checkpoints"):
                self._save_checkpoint(run_dir, task, task_round, matrix, rounds, time.perf_counter() - started)

        status = "completed"
        self._recorder = recorder
        self._session_started = time.perf_counter()
        try:
            with self._spent("start"):
                self._start_pool(run_dir)
            self.metrics.run_started(
                run_id=self.run_id, method=self.config.method, dataset=self.config.scenario.dataset,
                model=self.model_name, seed=self.config.seed, num_clients=self.config.scenario.num_clients,
                num_tasks=self.scenario.num_tasks, rounds_per_task=self.config.rounds.rounds_per_task,
                clients_per_round=self.config.rounds.clients_per_round)
            if resumed is None:
                with self._spent("join"):
                    self._wait_for_clients()
                    self._wait_before_rounds()
                recorder.event("start", run_id=self.run_id, address=self.address, online=len(self.registry.online()))
                save(0, 0)
            else:
                with self._spent("join"):
                    missing = self._wait_for_rejoin()
                    self._wait_before_rounds()
                recorder.event("resume", run_id=self.run_id, address=self.address, task=first_task,
                               task_round=first_round, after_round=self._global_round, resumes=self._resumes,
                               online=len(self.registry.online()), missing=len(missing))
                self.progress("resume", {"rounds": len(rounds), "task": first_task, "task_round": first_round})
            for task in range(first_task, self.scenario.num_tasks):
                self._task = task
                resuming_task = task == first_task and first_round > 0
                if not resuming_task:  # a task resumed mid-way has its head grown in the checkpoint
                    with self._spent("task_start"):
                        self.server.start_task(task)
                self.progress("task_start", {"task": task, "classes": len(self.scenario.task_classes(task))})
                for task_round in range(first_round if resuming_task else 0, last_round + 1):
                    with self._spent("rounds"):
                        record = self._run_round(task, task_round, recorder)
                    rounds.append(record)
                    self.progress("round", asdict(record))
                    if task_round < last_round:  # after a task's last round: below, once the task has ended
                        save(task, task_round + 1)
                t0 = time.perf_counter()
                with self._spent("task_end"):
                    self.server.end_task(task)
                t_end_task = time.perf_counter() - t0
                with self._spent("task_evaluation"):
                    class_hits = self.evaluator.class_hits(self.server.eval_model(), task)
                    row = self.evaluator.accuracy_per_task(*class_hits, task)
                    self.client_accuracy.append(self.evaluator.client_accuracy(*class_hits, task))
                t_evaluate = time.perf_counter() - t0 - t_end_task
                matrix.append(row + [None] * (self.scenario.num_tasks - task - 1))
                seen = self._seen_accuracy(row, task)
                recorder.event("task_end", task=task, accuracy=row, accuracy_seen=seen,
                               accuracy_clients=self.client_accuracy[-1])
                self.metrics.task_ended(
                    task=task, matrix=matrix, accuracy_seen_percent=seen,
                    average_accuracy=average_accuracy(matrix), average_forgetting=average_forgetting(matrix),
                    average_incremental_accuracy=average_incremental_accuracy(matrix),
                    phases_s={"end_task": t_end_task, "evaluate": t_evaluate})
                self.progress("task_end", {"task": task, "accuracy": row})
                save(task + 1, 0)
            if rounds and all(r.skipped for r in rounds):
                status = "failed: every round was skipped (no usable client update arrived)"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        except RunAborted as exc:
            status = f"aborted: {exc}"
            raise
        except Exception as exc:  # a bug or a broken environment: never recorded as a completed run
            status = f"failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            with self._spent("shutdown"):
                self._shutdown(status)
            summary = self._summary(matrix, rounds, time.perf_counter() - started, status, recorder.run_dir,
                                    class_hits)
            recorder.summary(summary)
            recorder.event("end", status=status)
            recorder.close()
        return summary

    def _start_pool(self, run_dir: Path) -> None:
        """Start the GPU worker pool and check every worker's device before the run depends on it."""
        try:
            self.pool.start(run_dir / "logs")
        except RuntimeError as exc:  # --gpu-device cuda without CUDA here
            raise RunAborted(f"the GPU worker pool cannot start: {exc}") from None
        if self.config.gpu.workers:
            self.run_jobs([("device.matmul", {}, {"seconds": 0.2, "size": 256})] * self.config.gpu.workers)

    @contextmanager
    def _spent(self, part: str):
        """Add the wall-clock time of the block to ``part`` of this session's time (summary ``time``)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.wall_s[part] += time.perf_counter() - t0

    def _shutdown(self, reason: str) -> None:
        """Tell every client that is reachable, away ones included (their node ends with the run)."""
        for record in list(self.registry.records.values()):
            if record.status is not Status.DEAD:
                # a node closes all its clients at the first shutdown: later sends may find them gone
                self._try_send(record.client_id, "shutdown", Shutdown(reason=reason))

    # ------------------------------------------------------------ server-side jobs
    def run_job(self, kind: str, inputs: dict[str, np.ndarray], options: dict | None = None) -> Job:
        """Run a job on the GPU worker pool (methods call it through ``ServerContext.run_job``) and wait for
        it while serving the clients. Raises :class:`JobFailed` if it failed after its retries."""
        return self.run_jobs([(kind, inputs, options)])[0]

    def run_jobs(self, specs: list[tuple[str, dict[str, np.ndarray], dict | None]]) -> list[Job]:
        """Run several jobs side by side (as many at once as there are workers); see :meth:`run_job`."""
        submitted = [self.pool.submit(kind, inputs, options) for kind, inputs, options in specs]
        self.serve(lambda: all(j.done for j in submitted), time.monotonic() + 10**9)  # the pool's timeouts end them
        for job in submitted:
            self._jobs.append(job)
            if self._recorder is not None:
                self._recorder.event("job", id=job.id, job_kind=job.kind, ok=job.ok, worker=job.worker,
                                     attempts=job.attempts, queue_s=job.queue_s, run_s=job.run_s,
                                     error=job.error or None, metrics=job.metrics)
        failed = [j for j in submitted if not j.ok]
        if failed:
            raise JobFailed("; ".join(f"server-side job {j.kind!r} failed: {j.error}" for j in failed))
        return submitted

    def close(self) -> None:
        self.pool.close()
        self.endpoint.close()
        if self.allowlist is not None:
            self.allowlist.stop()
        self.metrics.close()
