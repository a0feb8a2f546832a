"""The coordinator's lifecycle: build a run's parts once, then run it task by task and round by round.

The parts are objects over one :class:`~fcl_emu.coordinator.state.RunState`, each receiving what it uses:

- :class:`~fcl_emu.coordinator.dispatch.Dispatcher` (:mod:`fcl_emu.coordinator.dispatch`): serving the ROUTER socket,
  each client message by its type;
- :class:`~fcl_emu.coordinator.rounds.RoundRunner` (:mod:`fcl_emu.coordinator.rounds`): one round, phase by phase, with
  :mod:`fcl_emu.coordinator.secure_round` for a round's SecAgg+;
- the run's clock (:mod:`fcl_emu.coordinator.clock`): real or emulated time, chosen once;
- :class:`~fcl_emu.coordinator.resume.Checkpointer`: checkpoints after every round, and resuming from one;
- :class:`~fcl_emu.coordinator.summary.SummaryBuilder`: ``summary.json``'s record;
- :class:`~fcl_emu.coordinator.nodes.NodeWatch`: noticing at once that an edge node started by a launcher has exited;
- :class:`~fcl_emu.coordinator.server_jobs.ServerJobs`: server-side jobs on the GPU worker pool while the socket
  is served.

:meth:`Coordinator.run`: wait for the clients, then for each task: start it, run its rounds, end it (the
method's task-end work), evaluate and checkpoint; at the end tell every client to shut down and write the
summary.
"""

from __future__ import annotations

import gc
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import zmq

from fcl_emu.aggregation.update import DeltaLayout
from fcl_emu.coordinator.async_rounds import AsyncRoundRunner
from fcl_emu.coordinator.checkpoint import Checkpoint
from fcl_emu.coordinator.clients import ClientRegistry, Status
from fcl_emu.coordinator.collection import make_collection
from fcl_emu.coordinator.edge_tier import EdgeTier
from fcl_emu.coordinator.clock import make_clock
from fcl_emu.coordinator.dispatch import Dispatcher
from fcl_emu.coordinator.errors import BindError, Diverged, Interrupted, JobFailed, RunAborted
from fcl_emu.coordinator.evaluation import Evaluator
from fcl_emu.coordinator.gpu_pool import Job, WorkerPool
from fcl_emu.coordinator.guard import CONTROL_RATE_PER_S, LogOnce, on_refused_handshake, RateLimiter
from fcl_emu.coordinator.devices import check_cuda, no_cuda
from fcl_emu.coordinator.nodes import NodeExit, NodeWatch
from fcl_emu.coordinator.privacy import cohort_for_noise, noise_to_update, round_noise_multiplier, run_privacy_part
from fcl_emu.coordinator.open_round import StaleUpdates
from fcl_emu.coordinator.resume import CHECKPOINT_DIR, Checkpointer, Resumed, run_fingerprint
from fcl_emu.coordinator.round_record import divergence
from fcl_emu.coordinator.rounds import RoundRunner
from fcl_emu.coordinator.server_jobs import JobSpec, ServerJobs
from fcl_emu.coordinator.state import ProgressHook, RunState, TimeAccount, no_progress
from fcl_emu.coordinator.summary import SummaryBuilder
from fcl_emu.methods import registry as methods
from fcl_emu.methods.base import ServerContext
from fcl_emu.methods.models.classifier import build_model, resolve_model
from fcl_emu.monitoring.metrics import CoordinatorMetrics
from fcl_emu.monitoring.results import (RoundRecord, RunRecorder, RunSummary, average_accuracy, average_forgetting,
                                average_incremental_accuracy, failure_status)
from fcl_emu.runconfig import RunConfig, gpu_worker_metrics_port
from fcl_emu.runconfig.config import PrivacyConfig
from fcl_emu.runconfig.adjustments import Adjustment, adjustments
from fcl_emu.runtime.run_log import LOG_NAME, run_log
from fcl_emu.scenario.datasets import load_dataset
from fcl_emu.methods.models.flops import training_flops_per_sample
from fcl_emu.scenario.device_classes import DEFAULT_CLASSES
from fcl_emu.scenario.devices import DeviceSet, load_profiles
from fcl_emu.scenario.scenario import build_scenario
from fcl_emu.wire.auth import Allowlist, KeyFileError, ServerKeys, load_server_keys
from fcl_emu.wire.framing import Limits
from fcl_emu.wire.messages import Shutdown
from fcl_emu.wire.sockets import ServerEndpoint, tee

__all__ = ["BindError", "CHECKPOINT_DIR", "Coordinator", "Diverged", "Interrupted", "JobFailed", "NodeExit",
           "RunAborted", "run_fingerprint"]


def _trained_status(rounds: list[RoundRecord], task_end_accuracy: Sequence[float] = (),
                    chance: Sequence[float] = ()) -> str:
    """A finished run's status: ``completed`` only if every task trained and the model did not diverge; a model
    that diverged (:func:`~fcl_emu.coordinator.round_record.divergence`, with the accuracy on the seen classes at
    each task's end and chance on them) or a task whose every round was skipped (no client update, or fewer than
    ``min_participants``) makes it ``degraded``, and no trained round at all ``failed``."""
    if rounds and all(r.skipped for r in rounds):
        return "failed: every round was skipped (no usable client update arrived)"
    diverged = divergence(rounds, task_end_accuracy, chance)
    if diverged is not None:
        return f"degraded: diverged at round {diverged[0]} ({diverged[1]})"
    tasks = sorted({r.task for r in rounds})
    idle = [t for t in tasks if all(r.skipped for r in rounds if r.task == t)]
    if idle:
        return (f"degraded: task{'s' * (len(idle) > 1)} {', '.join(map(str, idle))} trained nothing (every round "
                f"was skipped: no usable client update arrived)")
    return "completed"


def _stop_if_diverged(record: RoundRecord, privacy: PrivacyConfig) -> None:
    """Raise :class:`Diverged` after a round of a DP run whose model diverged (:attr:`RoundRecord.diverged`: NaN or
    infinite values, or an exploded training loss, from which the model does not come back), unless
    ``privacy.on_divergence`` is ``continue``. An accuracy fallen to chance is judged at the run's end
    (:func:`_trained_status`): it may recover."""
    if record.diverged is not None and privacy.mode != "off" and privacy.on_divergence == "stop":
        raise Diverged(f"diverged at round {record.round} ({record.diverged})")


def resolve_device(choice: str) -> torch.device:
    """The coordinator's device for ``--device``: ``auto`` is CUDA where torch sees it; ``cuda`` without it
    raises :class:`~fcl_emu.coordinator.devices.DeviceError`."""
    if choice == "cuda":
        check_cuda("--device")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


class Coordinator:
    def __init__(self, config: RunConfig, *, context: zmq.Context | None = None,
                 progress: ProgressHook | None = None, resume: Checkpoint | None = None):
        """Build the run's state and parts. ``resume``: continue from this checkpoint of the same run (same run
        id and address)."""
        self.config = config
        device = resolve_device(config.device)
        if config.coordinator_threads is not None:
            torch.set_num_threads(config.coordinator_threads)
        self.dataset = load_dataset(config.scenario.dataset, config.data_root, download=config.download)
        scenario = build_scenario(config.scenario, self.dataset)
        spec = methods.get(config.method)
        options = config.method_options_model()
        self.model_name = resolve_model(config.model, self.dataset.input_shape, spec.server.needs_batchnorm,
                                        spec.server.small_model, spec.server.large_model)
        torch.manual_seed(config.seed)
        server = spec.server(ServerContext(
            options=options, scenario=scenario, build_model=self._build_model, seed=config.seed,
            run_job=self.run_job, model_name=self.model_name, input_shape=tuple(self.dataset.input_shape),
            rounds_per_task=config.rounds.rounds_per_task, aggregator=config.security.robust_aggregator(),
            cohort_bound=config.security.adaptive_clip, refused=self._refused_upload))
        self.heartbeat_interval_s, liveness_timeout_s = config.network.liveness(config.scenario.num_clients)
        metrics = CoordinatorMetrics()  # served only when asked: ``metrics.serve``, see fcl_emu/run.py
        self.state = state = RunState(
            config=config, scenario=scenario, spec=spec, server=server, model_name=self.model_name,
            evaluator=Evaluator(scenario, device), registry=ClientRegistry(liveness_timeout_s), metrics=metrics,
            run_id=(config.metrics.run_id or uuid.uuid4().hex[:12]) if resume is None else resume.state["run_id"],
            rng=np.random.default_rng(config.seed), log_once=LogOnce(logging.getLogger("fcl_emu.coordinator")),
            progress=progress or no_progress, policy=config.aggregation.policy())
        state.devices = self._devices(options)
        metrics.watch_online(lambda: state.registry.online_count)
        self.context = context or zmq.Context.instance()
        keys, self.allowlist = self._keys()
        bind = config.network.bind if resume is None else resume.state["address"]
        count = tee(state.counters, metrics.count_message)
        try:
            self.endpoint = ServerEndpoint(self.context, bind,
                                           limits=Limits(max_total_bytes=config.network.max_message_bytes),
                                           count=count, keys=keys)
        except zmq.ZMQError as exc:
            if self.allowlist is not None:
                self.allowlist.stop()
            raise BindError(f"cannot bind {bind}: {exc}") from None
        self.address = self.endpoint.address
        first_port = gpu_worker_metrics_port(config, 0)
        self.pool = WorkerPool(config.gpu, self.context, count=count, keys=keys, key_dir=config.security.keys,
                               max_message_bytes=config.network.max_message_bytes, metrics=metrics,
                               worker_metrics=None if first_port is None else (config.metrics.host, first_port,
                                                                               config.metrics.linger))
        metrics.watch_gpu_pool(lambda: self.pool.queued, self.pool.worker_states)
        self.clock = make_clock(state, liveness_timeout_s)
        self.nodes = NodeWatch(state)
        self.privacy = run_privacy_part(config)  # central or distributed DP; None without
        m = config.topology.edge_aggregators
        self.edges = EdgeTier(state, m, liveness_timeout_s, config.topology.aggregate_wait_s(config.network)) \
            if m else None
        collection = make_collection(state, self.privacy, self.edges)
        stale = StaleUpdates(config.rounds.planned_cohort)
        self.dispatcher = Dispatcher(
            state, self.endpoint, self.pool, self.clock, collection, stale,
            # control messages per peer: room for twice the heartbeat rate on top of the rest
            RateLimiter(CONTROL_RATE_PER_S + 2.0 / self.heartbeat_interval_s),
            welcome=dict(run_id=state.run_id, scenario=config.scenario.model_dump(mode="json"),
                         method=config.method, method_options=options.model_dump(mode="json"),
                         model=self.model_name,
                         training={**config.training.model_dump(), "seed": config.seed, "device": config.device},
                         heartbeat_interval_s=self.heartbeat_interval_s, secure=config.secagg.enabled),
            on_tick=self.nodes.check, edges=self.edges)
        if self.edges is not None:
            self.edges.send, self.edges.serve = self.dispatcher.try_send, self.dispatcher.serve
            self.edges.wire_sent = lambda: self.endpoint.wire_sent
        policy = state.policy
        self.rounds = (AsyncRoundRunner(state, self.dispatcher, self.clock, collection, policy) if policy.asynchronous
                       else RoundRunner(state, self.dispatcher, self.clock, collection, stale, self.privacy,
                                           policy=policy))
        self.jobs = ServerJobs(state, self.pool, self.dispatcher.serve)
        self.checkpointer = Checkpointer(state, self.clock, self.address)
        self.time = TimeAccount()
        self.summary = SummaryBuilder(state, self.clock, self.jobs, self.checkpointer, self.time,
                                      self.heartbeat_interval_s, self.edges)
        # conditions the first round waits for once the clients are in, each (what, condition, timeout):
        # `up --prometheus` waits for its Prometheus's first scrape of every process (fcl_emu/run.py)
        self.before_rounds: list[tuple[str, Callable[[], bool], float]] = []
        self._resumed: Resumed | None = None if resume is None else self.checkpointer.restore(resume)
        if self._resumed is not None and self.privacy is not None:
            self.privacy.restore(self._resumed.rounds)

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

    def _refused_upload(self, detail: str) -> None:
        """An upload the method left out for lying beyond its round's cohort bound: a ``cohort_bound``
        rejection, counted and logged once."""
        self.state.rejected("cohort_bound", None, f"refused {detail}")

    def _keys(self) -> tuple[ServerKeys | None, Allowlist | None]:
        """The run's keys and the ZAP handler that admits only them (CurveZMQ), or none (``--insecure``).
        Raises :class:`fcl_emu.wire.auth.KeyFileError`."""
        security = self.config.security
        if security.transport == "plain":
            return None, None
        if security.keys is None:
            raise KeyFileError("CurveZMQ needs the run's key directory: write one with `fcl-emu keys` and pass "
                               "--keys, or run without authentication with --insecure")
        keys = load_server_keys(security.keys)
        return keys, Allowlist(self.context, keys, on_refused=on_refused_handshake(self.state.metrics,
                                                                                   self.state.log_once))

    def _devices(self, options) -> DeviceSet | None:
        """The run's device profiles: its profiles file, or under the emulated clock the default device mix
        (scenario/device_classes.py); their throughput turned into time by the run's model and method."""
        config = self.config
        if config.edge.device_profiles:
            profiles = load_profiles(config.edge.device_profiles)
        elif config.emulated_clock:
            profiles = DEFAULT_CLASSES
        else:
            return None
        plain = training_flops_per_sample(self.model_name, tuple(self.dataset.input_shape),
                                          self.state.scenario.num_classes)
        client, batch = self.state.spec.client, config.training.batch_size
        return DeviceSet(profiles, work=lambda task: plain * client.work_per_sample(options, batch, task),
                         measured=config.edge.compute == "measured")

    def _build_model(self, num_classes: int):
        return build_model(self.model_name, self.dataset.input_shape, num_classes)

    # ---------------------------------------------------------------------- run
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
            self._warn_adjustments()
            with spent("start"):
                self._start_pool(run_dir)
            state.metrics.run_started(
                run_id=state.run_id, method=config.method, dataset=config.scenario.dataset,
                model=self.model_name, seed=config.seed, num_clients=config.scenario.num_clients,
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
                _keep_out_of_collections()
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
                    _stop_if_diverged(record, config.privacy)
                    if task_round < last_round:  # after a task's last round: below, once the task has ended
                        save(task, task_round + 1)
                class_hits = self._end_task(task, matrix)
                save(task + 1, 0)
            status = _trained_status(rounds, [state.seen_accuracy(row, t) for t, row in enumerate(matrix)],
                                     self._chance())
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
            gc.unfreeze()  # what the run kept out of collections is collectable again once it ends
            gc.set_threshold(*thresholds)
            with spent("shutdown"):
                self._shutdown(status)
            summary = self.summary.build(matrix, rounds, time.perf_counter() - started, status, recorder.run_dir,
                                         class_hits, node_hosts=self.nodes.hosts)
            recorder.summary(summary)
            recorder.event("end", status=status)
            recorder.close()
        return summary

    def _warn_adjustments(self) -> None:
        """Tell once, at the session's start, each setting that another setting changes
        (:mod:`fcl_emu.runconfig.adjustments`): a ``config_warning`` event and a ``warning`` for the progress
        display."""
        for adjusted in [*adjustments(self.config), *self._slow_classes(), *self._noisy_privacy()]:
            self.state.event("config_warning", setting=adjusted.setting, value=adjusted.value,
                             message=adjusted.message)
            self.progress("warning", {"setting": adjusted.setting, "message": adjusted.message})

    def _noisy_privacy(self) -> list[Adjustment]:
        """Differential privacy whose noise on a round's mean is larger than the clipped mean can be
        (:func:`~fcl_emu.coordinator.privacy.noise_to_update`), with the cohort that would bring it under, for the
        run's largest model: its head over every class, in the last task. Told as an adjustment is, though it
        changes no setting."""
        settings, cohort = self.config.privacy, self.config.rounds.clients_per_round
        if self.privacy is None or not settings.noise_multiplier:
            return []
        server, scenario = self.state.server, self.state.scenario
        new_classes = len(scenario.seen_classes(scenario.num_tasks - 1)) - server.model.num_classes
        dim = DeltaLayout.of(server.global_state).dim + new_classes * (server.model.feature_dim + 1)  # weights, bias
        ratio = noise_to_update(settings, cohort, dim)
        if ratio <= 1:
            return []
        sigma = round_noise_multiplier(settings, cohort) * settings.clip / cohort
        needed = cohort_for_noise(settings, dim)
        clients = self.config.scenario.num_clients
        clip = f"C, adapting from {settings.clip:g}" if settings.adaptive.enabled else f"C = {settings.clip:g}"
        bring = (f"{needed} clients a round would bring it under C" if needed <= clients else
                 f"{needed} clients a round, more than the {clients} clients, would bring it under C")
        return [Adjustment("privacy.noise_multiplier", settings.noise_multiplier, (
            f"the DP noise on each round's mean ({sigma:.3g} on each of the model's {dim:,} values, a norm of about "
            f"{sigma * dim ** 0.5:.3g}) is {ratio:.1f} times the clipped mean's largest norm ({clip}): the "
            f"model learns only what the rounds average out, and may diverge; {bring} (--clients-per-round, "
            f"docs/privacy.md)"))]

    def _slow_classes(self) -> list[Adjustment]:
        """Device classes whose clients cannot make the round deadline even alone on their link: the model
        each way and the training of its share, in the task with the most work per sample (synchronous rounds
        on the emulated clock, modelled compute). Told as an adjustment is, though it changes no setting."""
        config, state = self.config, self.state
        if state.devices is None or not config.emulated_clock or config.aggregation.asynchronous:
            return []
        model_bytes = sum(a.nbytes for a in state.server.global_state.values())
        tasks = range(state.scenario.num_tasks)
        slow: dict[str, int] = {}
        sample = range(min(config.scenario.num_clients, 500))
        for index in sample:
            profile = state.devices.assign(index, config.seed)
            samples = len(state.scenario.client_indices(index, state.scenario.join_task(index)))
            for task in tasks:
                p = state.devices.in_task(profile, task)
                if p.ms_per_sample is None:
                    break
                need = (model_bytes / p.downlink_bytes_s + model_bytes / p.uplink_bytes_s + 2 * p.latency_s
                        + p.ms_per_sample * samples * config.training.local_epochs / 1000)
                if need > config.rounds.deadline_s:
                    slow[p.name] = slow.get(p.name, 0) + 1
                    break
        if not slow:
            return []
        share = 100 * sum(slow.values()) / len(sample)
        return [Adjustment("rounds.deadline_s", config.rounds.deadline_s, (
            f"{share:.0f} % of the clients ({', '.join(sorted(slow))}) need more than the "
            f"{config.rounds.deadline_s:g} s round deadline for a round's work ({model_bytes / 1e6:.1f} MB model "
            f"each way and their training, docs/devices.md): they will be late; --round-deadline sets it"))]

    def _chance(self) -> list[float]:
        """Chance on the seen classes after each task (percent): always answering the seen class with the most
        test samples."""
        scenario = self.state.scenario
        labels = scenario.test_labels
        out = []
        for task in range(scenario.num_tasks):
            counts = np.bincount(labels[scenario.test_indices(scenario.seen_classes(task))])
            out.append(100.0 * counts.max() / counts.sum() if counts.size else 0.0)
        return out

    def _end_task(self, task: int, matrix: list[list[float | None]]):
        """The method's task-end work, then the accuracy row (appended to ``matrix``), its event and metrics.
        Returns the evaluation's (correct, samples) per seen class."""
        state, spent = self.state, self.time.spent
        t0 = time.perf_counter()
        with spent("task_end"):
            state.server.end_task(task)
        t_end_task = time.perf_counter() - t0
        with spent("task_evaluation"):
            class_hits = state.evaluator.class_hits(state.server.eval_model(), task)
            row = state.evaluator.accuracy_per_task(*class_hits, task)
            state.client_accuracy.append(state.evaluator.client_accuracy(*class_hits, task))
        t_evaluate = time.perf_counter() - t0 - t_end_task
        matrix.append(row + [None] * (state.scenario.num_tasks - task - 1))
        seen = state.seen_accuracy(row, task)
        state.event("task_end", task=task, accuracy=row, accuracy_seen=seen,
                    accuracy_clients=state.client_accuracy[-1])
        state.metrics.task_ended(
            task=task, matrix=matrix, accuracy_seen_percent=seen,
            average_accuracy=average_accuracy(matrix), average_forgetting=average_forgetting(matrix),
            average_incremental_accuracy=average_incremental_accuracy(matrix),
            phases_s={"end_task": t_end_task, "evaluate": t_evaluate})
        self.progress("task_end", {"task": task, "accuracy": row, "accuracy_seen": seen})
        return class_hits

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
        if self.edges is not None:
            self.edges.shutdown(reason)

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


ROUND_GC_THRESHOLDS = (10_000, 20, 10)  # the cyclic collector's thresholds while the rounds run


def _keep_out_of_collections() -> None:
    """Move what is alive once the population has joined and been caught up with (its records, availability and
    battery schedules, the model and the data) out of the cyclic collector's passes, after one full collection so
    that no garbage stays, and collect less often while the rounds run. At 100,000 clients a full collection
    walked millions of such objects: 0.5-0.6 s of the coordinator's round whenever one fell in it, every round or
    two. With those frozen, the default thresholds (700, 10, 10) still ran a young collection every 700 new
    containers (a round's messages make hundreds of thousands) and a full one of everything made since the freeze
    every round or two: about 0.15 s of a round of 1,000 updates, against 0.05 s with
    :data:`ROUND_GC_THRESHOLDS` (2026-11-28, ``gc.callbacks``: no middle or full collection in the round). The
    oldest generation keeps its default ratio, so garbage cycles that lived long are still collected every
    ten middle collections. Objects that die are still freed by their reference counts; the run unfreezes and
    restores the thresholds when it ends."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*ROUND_GC_THRESHOLDS)
