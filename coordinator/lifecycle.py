"""The coordinator's lifecycle over the parts :func:`~fcl_emu.coordinator.compose.compose` built once
(docs/architecture.md). :meth:`Coordinator.run`: tell the start-up advice (:mod:`~fcl_emu.coordinator.advice`), wait
for the clients, then for each task: start it, run its rounds, end it (:mod:`~fcl_emu.coordinator.task_end`: the
method's task-end work, the evaluation), checkpoint; at the end tell every client to shut down, judge the run's
status (:mod:`~fcl_emu.coordinator.run_status`) and write the summary.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import zmq

from fcl_emu.coordinator.advice import tell_advice
from fcl_emu.coordinator.checkpoint import Checkpoint
from fcl_emu.coordinator.clients import ClientRegistry, Status
from fcl_emu.coordinator.compose import compose
from fcl_emu.coordinator.contracts import Diverged, Interrupted, NodeExit, RunAborted
from fcl_emu.coordinator.gc_tuning import keep_out_of_collections, restore_collections
from fcl_emu.coordinator.gpu_pool import Job
from fcl_emu.coordinator.run_status import chance, stop_if_diverged, trained_status
from fcl_emu.coordinator.server_jobs import JobSpec
from fcl_emu.coordinator.state import ProgressHook
from fcl_emu.coordinator.task_end import end_task
from fcl_emu.gpu_worker import no_cuda
from fcl_emu.monitoring.metrics import CoordinatorMetrics
from fcl_emu.monitoring.results import RoundRecord, RunRecorder, RunSummary, failure_status
from fcl_emu.runconfig import RunConfig
from fcl_emu.runtime.run_log import LOG_NAME, run_log
from fcl_emu.wire.messages import Shutdown


class Coordinator:
    def __init__(self, config: RunConfig, *, context: zmq.Context | None = None,
                 progress: ProgressHook | None = None, resume: Checkpoint | None = None):
        """Build the run's state and parts (:func:`~fcl_emu.coordinator.compose.compose`). ``resume``: continue from
        this checkpoint of the same run (same run id and address)."""
        self.config = config
        p = compose(config, context=context, progress=progress, resume=resume)
        self.state, self.context, self.endpoint, self.allowlist = p.state, p.context, p.endpoint, p.allowlist
        self.pool, self.clock, self.nodes, self.privacy, self.tier = p.pool, p.clock, p.nodes, p.privacy, p.tier
        self.dispatcher, self.rounds, self.jobs, self.checkpointer = p.dispatcher, p.rounds, p.jobs, p.checkpointer
        self.time, self.summary, self.heartbeat_interval_s = p.time, p.summary, p.heartbeat_interval_s
        self.address, self.before_rounds, self._resumed = p.endpoint.address, p.before_rounds, p.resumed

    # ------------------------------------------------------------ what run.py and the benches use
    @property
    def run_id(self) -> str:
        return self.state.run_id

    @property
    def progress(self) -> ProgressHook:
        return self.state.progress

    @progress.setter
    def progress(self, hook: ProgressHook) -> None:
        self.state.progress = hook

    @property
    def metrics(self) -> CoordinatorMetrics:
        return self.state.metrics

    @property
    def server(self):
        return self.state.server

    @property
    def registry(self) -> ClientRegistry:
        return self.state.registry

    def serve(self, until: Callable[[], bool], deadline: float) -> None:
        """Serve the socket until ``until()`` holds or the monotonic ``deadline`` passes."""
        self.dispatcher.serve(until, deadline)

    def watch_nodes(self, exited: Callable[[], list[NodeExit]], started: int,
                    hosts: dict[str, str] | None = None) -> None:
        """Ask ``exited()`` for the nodes that have ended, each time the socket is served; ``started`` nodes, on
        ``hosts`` (node name -> host, for summary.json)."""
        self.nodes.watch(exited, started, hosts)

    def record_fault(self, action: str, **fields) -> None:
        """A fault injected into an edge node's container (containers/faults.py). Called from the injector's
        thread."""
        self.nodes.record_fault(action, **fields)

    def _wait_for_clients(self) -> None:
        expected = self.config.scenario.num_clients
        timeout = self.config.network.join_timeout_s
        registry = self.state.registry
        # every configured client has shown up (one that joined and died since is not waited for, nor one
        # whose node has exited)
        self.serve(lambda: len(registry.records) + self.nodes.unreachable_clients >= expected,
                   time.monotonic() + timeout)
        online = len(registry.eligible(0))
        if online < self.config.rounds.min_participants:
            raise RunAborted(f"only {online} clients joined within {timeout:.0f} s; "
                             f"at least {self.config.rounds.min_participants} are needed")
        self.progress("ready", {"online": len(registry.online()), "expected": expected})

    def _wait_before_rounds(self) -> None:
        """Serve the clients until each of :attr:`before_rounds` holds or its timeout passes (then go on,
        saying so in the log: these are conveniences, never a reason to stop the run)."""
        for what, condition, timeout_s in self.before_rounds:
            self.serve(condition, time.monotonic() + timeout_s)
            if not condition():
                logging.getLogger("fcl_emu.coordinator").warning(
                    "starting the rounds without %s (waited %.0f s)", what, timeout_s)

    def run(self, run_dir: Path) -> RunSummary:
        """Run (or, built with ``resume``, continue) the emulation; checkpoint after every round. The process's
        log goes to ``RUN_DIR/logs/coordinator.log`` meanwhile, and the library warnings and the clients' reports
        of a non-finite loss only there, counted in one line at the end (:mod:`fcl_emu.runtime.run_log`)."""
        with run_log(run_dir / "logs" / LOG_NAME) as log:
            try:
                return self._run(run_dir)
            finally:
                if (kept := log.summary()) is not None:
                    logging.getLogger("fcl_emu.coordinator").warning("%s", kept)

    def _run(self, run_dir: Path) -> RunSummary:
        state, config, scenario = self.state, self.config, self.state.scenario
        resumed, self._resumed = self._resumed, None
        recorder = RunRecorder(run_dir, config.to_yaml() if resumed is None else None,
                               elapsed_s=0.0 if resumed is None else resumed.wall_clock_s)
        started = time.perf_counter() - (0.0 if resumed is None else resumed.wall_clock_s)
        matrix: list[list[float | None]] = [] if resumed is None else resumed.matrix
        class_hits = None  # (correct, samples) per seen class after the latest task: spatial retention
        rounds: list[RoundRecord] = [] if resumed is None else resumed.rounds
        first_task, first_round = (0, 0) if resumed is None else (resumed.task, resumed.task_round)
        last_round = config.rounds.rounds_per_task - 1
        spent = self.time.spent

        def save(task: int, task_round: int) -> None:
            with spent("checkpoints"):
                self.checkpointer.save(run_dir, task, task_round, matrix, rounds, time.perf_counter() - started)

        status = "completed"
        state.recorder = recorder
        thresholds = gc.get_threshold()
        self.time.restart()
        try:
            tell_advice(state, self.privacy)
            with spent("start"):
                self._start_pool(run_dir)
            state.metrics.run_started(
                run_id=state.run_id, method=config.method, dataset=config.scenario.dataset,
                model=state.model_name, seed=config.seed, num_clients=config.scenario.num_clients,
                num_tasks=scenario.num_tasks, rounds_per_task=config.rounds.rounds_per_task,
                clients_per_round=config.rounds.clients_per_round)
            if resumed is None:
                with spent("join"):
                    self._wait_for_clients()
                    self._wait_before_rounds()
                recorder.event("start", run_id=state.run_id, address=self.address,
                               online=len(state.registry.online()))
                save(0, 0)
            else:
                with spent("join"):
                    missing = self.checkpointer.wait_for_rejoin(self.serve, own_nodes=self.nodes.started > 0)
                    self._wait_before_rounds()
                recorder.event("resume", run_id=state.run_id, address=self.address, task=first_task,
                               task_round=first_round, after_round=state.global_round,
                               resumes=self.checkpointer.resumes, online=len(state.registry.online()),
                               missing=len(missing))
                self.progress("resume", {"rounds": len(rounds), "task": first_task, "task_round": first_round})
            with spent("catch_up"):
                self.clock.catch_up(first_task)  # the population is in: its availability, batteries, the eligible
            with spent("collections"):
                keep_out_of_collections()
            for task in range(first_task, scenario.num_tasks):
                state.task = task
                resuming_task = task == first_task and first_round > 0
                if not resuming_task:  # a task resumed mid-way has its head grown in the checkpoint
                    with spent("task_start"):
                        state.server.start_task(task)
                self.progress("task_start", {"task": task, "classes": len(scenario.task_classes(task))})
                for task_round in range(first_round if resuming_task else 0, last_round + 1):
                    with spent("rounds"):
                        record = self.rounds.run_round(task, task_round)
                    rounds.append(record)
                    self.progress("round", asdict(record))
                    stop_if_diverged(record, config.privacy)
                    if task_round < last_round:  # after a task's last round: below, once the task has ended
                        save(task, task_round + 1)
                class_hits = end_task(state, self.time, task, matrix)
                save(task + 1, 0)
            status = trained_status(rounds, [state.seen_accuracy(row, t) for t, row in enumerate(matrix)],
                                    chance(scenario))
        except KeyboardInterrupt as exc:
            status = f"interrupted: {exc.signal_name if isinstance(exc, Interrupted) else 'SIGINT'}"
            raise
        except RunAborted as exc:
            status = f"aborted: {exc}"
            raise
        except Diverged as exc:  # ends the run like its end: the summary is returned
            status = f"failed: {exc}"
        except Exception as exc:  # a bug or a broken environment (a full disk): never recorded as completed
            status = failure_status(exc)
            raise
        finally:
            restore_collections(thresholds)
            with spent("shutdown"):
                self._shutdown(status)
            summary = self.summary.build(matrix, rounds, time.perf_counter() - started, status, recorder.run_dir,
                                         class_hits, node_hosts=self.nodes.hosts)
            recorder.summary(summary)
            recorder.event("end", status=status)
            recorder.close()
        return summary

    def _start_pool(self, run_dir: Path) -> None:
        """Start the GPU worker pool and check every worker's device before the run depends on it."""
        reason = no_cuda("--gpu-device") if self.config.gpu.device == "cuda" else None
        if reason:  # before any worker starts: it would fail the same way, and be started again
            raise RunAborted(f"the GPU worker pool cannot start: {reason}")
        self.pool.start(run_dir / "logs")
        if self.config.gpu.workers:
            self.run_jobs([("device.matmul", {}, {"seconds": 0.2, "size": 256})] * self.config.gpu.workers)

    def _shutdown(self, reason: str) -> None:
        """Tell every client that is reachable, away ones included (their node ends with the run)."""
        for record in list(self.state.registry.records.values()):
            if record.status is not Status.DEAD:
                # a node closes all its clients at the first shutdown: later sends may find them gone
                self.dispatcher.try_send(record.client_id, "shutdown", Shutdown(reason=reason))
        self.tier.shutdown(reason)

    # ------------------------------------------------------------ server-side jobs
    def run_job(self, kind: str, inputs: dict[str, np.ndarray], options: dict | None = None) -> Job:
        """Run a job on the GPU worker pool (methods call it through ``ServerContext.run_job``) and wait for
        it while serving the clients. Raises :class:`JobFailed` if it failed after its retries."""
        return self.run_jobs([(kind, inputs, options)])[0]

    def run_jobs(self, specs: list[JobSpec]) -> list[Job]:
        """Run several jobs side by side (as many at once as there are workers); see :meth:`run_job`."""
        return self.jobs.run(specs)

    def close(self) -> None:
        self.pool.close()
        self.endpoint.close()
        if self.allowlist is not None:
            self.allowlist.stop()
        self.state.metrics.close()
