"""The coordinator's composition root: :func:`compose` builds a run's parts once, each over one
:class:`~fcl_emu.coordinator.state.RunState` and receiving what it uses, and makes the run's choices once: the
clock (:func:`~fcl_emu.coordinator.clock.make_clock`), the tier below the coordinator
(:func:`~fcl_emu.coordinator.edge_tier.make_tier`: a flat star or edge aggregators), the collection
(:func:`~fcl_emu.coordinator.collection.make_collection`), differential privacy and the round policy.
:class:`~fcl_emu.coordinator.lifecycle.Coordinator` runs what it builds."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import zmq

from fcl_emu.coordinator.async_rounds import AsyncRoundRunner
from fcl_emu.coordinator.checkpoint import Checkpoint
from fcl_emu.coordinator.clients import ClientRegistry
from fcl_emu.coordinator.clock import RunClock, make_clock
from fcl_emu.coordinator.collection import make_collection
from fcl_emu.coordinator.contracts import BindError
from fcl_emu.coordinator.dispatch import Dispatcher, try_send
from fcl_emu.coordinator.edge_tier import Tier, make_tier
from fcl_emu.coordinator.evaluation import Evaluator
from fcl_emu.coordinator.gpu_pool import WorkerPool
from fcl_emu.coordinator.guard import CONTROL_RATE_PER_S, LogOnce, RateLimiter, on_refused_handshake
from fcl_emu.coordinator.nodes import NodeWatch
from fcl_emu.coordinator.open_round import StaleUpdates
from fcl_emu.coordinator.privacy import run_privacy_part
from fcl_emu.coordinator.resume import Checkpointer, Resumed
from fcl_emu.coordinator.rounds import RoundRunner
from fcl_emu.coordinator.server_jobs import ServerJobs
from fcl_emu.coordinator.state import ProgressHook, RunState, TimeAccount, no_progress
from fcl_emu.coordinator.summary import SummaryBuilder
from fcl_emu.gpu_worker import check_cuda
from fcl_emu.methods import registry as methods
from fcl_emu.methods.base import ServerContext
from fcl_emu.methods.models.classifier import build_model, resolve_model
from fcl_emu.methods.models.flops import training_flops_per_sample
from fcl_emu.monitoring.metrics import CoordinatorMetrics
from fcl_emu.runconfig import RunConfig, gpu_worker_metrics_port
from fcl_emu.scenario.datasets import load_dataset
from fcl_emu.scenario.device_classes import DEFAULT_CLASSES
from fcl_emu.scenario.devices import DeviceSet, load_profiles
from fcl_emu.scenario.scenario import build_scenario
from fcl_emu.wire.auth import Allowlist, KeyFileError, ServerKeys, load_server_keys
from fcl_emu.wire.framing import Limits
from fcl_emu.wire.sockets import ServerEndpoint, tee


@dataclass
class Parts:
    """What :func:`compose` builds: the run's state and the parts over it."""

    state: RunState
    context: zmq.Context
    endpoint: ServerEndpoint
    allowlist: Allowlist | None
    pool: WorkerPool
    clock: RunClock
    nodes: NodeWatch
    privacy: object  # the run's DP part (coordinator/privacy.py), None without
    tier: Tier
    dispatcher: Dispatcher
    rounds: RoundRunner | AsyncRoundRunner
    jobs: ServerJobs
    checkpointer: Checkpointer
    time: TimeAccount
    summary: SummaryBuilder
    heartbeat_interval_s: float
    resumed: Resumed | None
    # conditions the first round waits for once the clients are in, each (what, condition, timeout):
    # `up --prometheus` waits for its Prometheus's first scrape of every process (fcl_emu/run.py)
    before_rounds: list[tuple[str, Callable[[], bool], float]] = field(default_factory=list)


def resolve_device(choice: str) -> torch.device:
    """The coordinator's device for ``--device``: ``auto`` is CUDA where torch sees it; ``cuda`` without it
    raises :class:`~fcl_emu.gpu_worker.DeviceError`."""
    if choice == "cuda":
        check_cuda("--device")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def compose(config: RunConfig, *, context: zmq.Context | None = None, progress: ProgressHook | None = None,
            resume: Checkpoint | None = None) -> Parts:
    """Build the run's state and parts. ``resume``: continue from this checkpoint of the same run (same run id and
    address). Raises :class:`~fcl_emu.coordinator.contracts.BindError` and
    :class:`fcl_emu.wire.auth.KeyFileError`."""
    device = resolve_device(config.device)
    if config.coordinator_threads is not None:
        torch.set_num_threads(config.coordinator_threads)
    dataset = load_dataset(config.scenario.dataset, config.data_root, download=config.download)
    scenario = build_scenario(config.scenario, dataset)
    spec = methods.get(config.method)
    options = config.method_options_model()
    model_name = resolve_model(config.model, dataset.input_shape, spec.server.needs_batchnorm,
                               spec.server.small_model, spec.server.large_model)
    torch.manual_seed(config.seed)

    def run_job(kind: str, inputs: dict[str, np.ndarray], options: dict | None = None):
        """A job on the GPU worker pool, waited for while the clients are served (methods' ``run_job``)."""
        return jobs.run([(kind, inputs, options)])[0]

    server = spec.server(ServerContext(
        options=options, scenario=scenario, build_model=lambda n: build_model(model_name, dataset.input_shape, n),
        seed=config.seed, run_job=run_job, model_name=model_name, input_shape=tuple(dataset.input_shape),
        rounds_per_task=config.rounds.rounds_per_task, aggregator=config.aggregation.aggregator(),
        cohort_bound=config.aggregation.adaptive_clip,
        # an upload the method left out for lying beyond its round's cohort bound: counted and logged once
        refused=lambda detail: state.rejected("cohort_bound", None, f"refused {detail}")))
    heartbeat_interval_s, liveness_timeout_s = config.network.liveness(config.scenario.num_clients)
    metrics = CoordinatorMetrics()  # served only when asked: ``metrics.serve``, see fcl_emu/run.py
    state = RunState(
        config=config, scenario=scenario, spec=spec, server=server, model_name=model_name,
        evaluator=Evaluator(scenario, device), registry=ClientRegistry(liveness_timeout_s), metrics=metrics,
        run_id=(config.metrics.run_id or uuid.uuid4().hex[:12]) if resume is None else resume.state["run_id"],
        rng=np.random.default_rng(config.seed), log_once=LogOnce(logging.getLogger("fcl_emu.coordinator")),
        progress=progress or no_progress, policy=config.aggregation.round_policy())
    state.devices = _device_profiles(state, dataset.input_shape, options)
    metrics.watch_online(lambda: state.registry.online_count)
    context = context or zmq.Context.instance()
    keys, allowlist = _keys(state, context)
    bind = config.network.bind if resume is None else resume.state["address"]
    count = tee(state.counters, metrics.count_message)
    try:
        endpoint = ServerEndpoint(context, bind, limits=Limits(max_total_bytes=config.network.max_message_bytes),
                                  count=count, keys=keys)
    except zmq.ZMQError as exc:
        if allowlist is not None:
            allowlist.stop()
        raise BindError(f"cannot bind {bind}: {exc}") from None
    first_port = gpu_worker_metrics_port(config, 0)
    pool = WorkerPool(config.gpu, context, count=count, keys=keys, key_dir=config.security.keys,
                      max_message_bytes=config.network.max_message_bytes, metrics=metrics,
                      worker_metrics=None if first_port is None else (config.metrics.host, first_port,
                                                                      config.metrics.linger))
    metrics.watch_gpu_pool(lambda: pool.queued, pool.worker_states)
    clock = make_clock(state, liveness_timeout_s)
    nodes = NodeWatch(state)
    privacy = run_privacy_part(config)  # central or distributed DP; None without
    tier = make_tier(state, liveness_timeout_s, send=lambda *a, **kw: try_send(endpoint, *a, **kw),
                     wire_sent=lambda: endpoint.wire_sent)
    collection = make_collection(state, privacy, tier)
    stale = StaleUpdates(config.rounds.planned_cohort)
    dispatcher = Dispatcher(
        state, endpoint, pool, clock, collection, stale,
        # control messages per peer: room for twice the heartbeat rate on top of the rest
        RateLimiter(CONTROL_RATE_PER_S + 2.0 / heartbeat_interval_s),
        welcome=dict(run_id=state.run_id, scenario=config.scenario.model_dump(mode="json"),
                     method=config.method, method_options=options.model_dump(mode="json"), model=model_name,
                     training={**config.training.model_dump(), "seed": config.seed, "device": config.device},
                     heartbeat_interval_s=heartbeat_interval_s, secure=config.secagg.enabled),
        on_tick=nodes.check, tier=tier)
    policy = state.policy
    rounds = (AsyncRoundRunner(state, dispatcher, clock, collection, policy) if policy.asynchronous
              else RoundRunner(state, dispatcher, clock, collection, stale, privacy))
    jobs = ServerJobs(state, pool, dispatcher.serve)
    checkpointer = Checkpointer(state, clock, endpoint.address)
    time_account = TimeAccount()
    summary = SummaryBuilder(state, clock, jobs, checkpointer, time_account, heartbeat_interval_s, tier)
    resumed = None if resume is None else checkpointer.restore(resume)
    if resumed is not None and privacy is not None:
        privacy.restore(resumed.rounds)
    return Parts(state=state, context=context, endpoint=endpoint, allowlist=allowlist, pool=pool, clock=clock,
                 nodes=nodes, privacy=privacy, tier=tier, dispatcher=dispatcher, rounds=rounds, jobs=jobs,
                 checkpointer=checkpointer, time=time_account, summary=summary,
                 heartbeat_interval_s=heartbeat_interval_s, resumed=resumed)


def _keys(state: RunState, context: zmq.Context) -> tuple[ServerKeys | None, Allowlist | None]:
    """The run's keys and the ZAP handler that admits only them (CurveZMQ), or none (``--insecure``).
    Raises :class:`fcl_emu.wire.auth.KeyFileError`."""
    security = state.config.security
    if security.transport == "plain":
        return None, None
    if security.keys is None:
        raise KeyFileError("CurveZMQ needs the run's key directory: write one with `fcl-emu keys` and pass "
                           "--keys, or run without authentication with --insecure")
    keys = load_server_keys(security.keys)
    return keys, Allowlist(context, keys, on_refused=on_refused_handshake(state.metrics, state.log_once))


def _device_profiles(state: RunState, input_shape, options) -> DeviceSet | None:
    """The run's device profiles: its profiles file, or under the emulated clock the default device mix
    (scenario/device_classes.py); their throughput turned into time by the run's model and method."""
    config = state.config
    if config.edge.device_profiles:
        profiles = load_profiles(config.edge.device_profiles)
    elif config.emulated_clock:
        profiles = DEFAULT_CLASSES
    else:
        return None
    plain = training_flops_per_sample(state.model_name, tuple(input_shape), state.scenario.num_classes)
    client, batch = state.spec.client, config.training.batch_size
    return DeviceSet(profiles, work=lambda task: plain * client.work_per_sample(options, batch, task),
                     measured=config.edge.compute == "measured")
