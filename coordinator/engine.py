"""The coordinator: client registry, round engine, evaluation and results.

One thread serves one ROUTER socket. Everything a client sends is handled
by :meth:`Coordinator._handle` whenever the coordinator waits (for joins, for
updates), so joins, heartbeats and leaves are served during rounds. A round:

1. sample ``clients_per_round`` of the eligible online clients (seeded);
2. send each a ``task_start`` with the method's per-task assets if it has not
   had this task's assets yet, then a ``train_request`` with the global model;
3. collect ``update`` messages until every selected client answered, died
   (missed heartbeats, or its socket is gone) or the round deadline passed;
4. if at least ``min_participants`` updates arrived, aggregate them through
   the method's server part; otherwise skip the round;
5. evaluate, record the round, report progress.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import zmq

from coordinator import checkpoint
from coordinator.checkpoint import Checkpoint
from coordinator.evaluation import Evaluator
from coordinator.gpu_pool import Job, WorkerPool
from coordinator.registry import ClientRegistry, Status
from coordinator.secagg import SecAggConfig
from coordinator.secure_round import SecureOutcome, SecureRound
from edge_node.secagg import SecAggAbort, SecAggError
from edge_node.availability import client_availability, parse_availability
from edge_node.links import assign_profile, load_profiles
from coordinator.results import (RoundRecord, RunRecorder, average_accuracy, average_forgetting,
                                 average_incremental_accuracy, spatial_retention, temporal_retention)
from fcl_emu.config import RunConfig
from fcl_emu.launcher import gpu_worker_metrics_port
from methods import registry as methods
from methods.base import DELTA, ClientUpdate, DeltaLayout, ServerContext
from methods.models.classifier import build_model, resolve_model
from monitoring.metrics import CoordinatorMetrics
from scenario.datasets import load_dataset
from scenario.scenario import build_scenario
from wire.framing import Limits, Message, WireError
from wire.messages import (ASSET_TYPES, SECAGG_REPLIES, SIDE_CHANNEL_TYPES, EdgeSettings, Error, Shutdown, TaskAsset, TaskStart,
                           TrainRequest, Welcome)
from wire.sockets import Counters, ServerEndpoint, tee

log = logging.getLogger("fcl_emu.coordinator")

CLIENT_TYPES = frozenset({"join", "heartbeat", "leave", "update", "error", *SECAGG_REPLIES, *SIDE_CHANNEL_TYPES})
CHECKPOINT_DIR = "checkpoint"  # in the run directory (docs/resume.md)
SERVER, TORCH_RNG, CUDA_RNG = "server/", "rng/torch", "rng/cuda/"  # checkpoint array names
NOT_JOINED_INTERVAL_S = 1.0  # at most one `not_joined` error per peer in this time


class RunAborted(RuntimeError):
    """The run cannot go on (for example: not enough clients joined)."""


def _mean_metrics(updates: list[ClientUpdate]) -> dict[str, float] | None:
    """The mean of each method metric (loss terms...) the round's clients reported (loss and training time
    have their own fields)."""
    sums: dict[str, list[float]] = {}
    for u in updates:
        for name, value in u.metrics.items():
            if name not in ("loss", "train_time_s") and math.isfinite(value):
                sums.setdefault(name, []).append(value)
    return {name: sum(v) / len(v) for name, v in sorted(sums.items())} or None


class JobFailed(RunAborted):
    """A server-side job failed after its retries: the run ends cleanly with the job's errors."""


class BindError(RuntimeError):
    """The coordinator cannot bind its address (in use, or not an address of this host)."""


def run_fingerprint(config: RunConfig) -> str:
    """A hash of what decides a run's results: the config less data location, metrics, run directory and
    the GPU pool's size and device."""
    data = config.model_dump(mode="json", exclude={"metrics", "data_root", "run_dir", "download", "gpu"})
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


@dataclass
class _Round:
    task: int
    number: int
    selected: set[str]
    wanted: int  # updates that close the round early (clients_per_round; fewer than selected with overcommit)
    updates: list[ClientUpdate] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)  # reported an error
    lost: set[str] = field(default_factory=set)  # left or crashed and joined again during the round
    masked: set[str] = field(default_factory=set)  # secure aggregation: sent a masked input in time

    def answered(self) -> set[str]:
        return {u.client for u in self.updates} | self.masked | self.failed

    def pending(self, online: Callable[[str], bool]) -> set[str]:
        done = self.answered() | self.lost
        return {c for c in self.selected - done if online(c)}

    def done(self, online: Callable[[str], bool]) -> bool:
        useful = sum(u.num_samples > 0 for u in self.updates)
        return useful >= self.wanted or not self.pending(online)


ProgressHook = Callable[[str, dict], None]


class Coordinator:
    def __init__(self, config: RunConfig, *, context: zmq.Context | None = None,
                 progress: ProgressHook | None = None, resume: Checkpoint | None = None):
        """``resume``: continue from this checkpoint of the same run (same run id and address)."""
        self.config = config
        self.progress = progress or (lambda kind, info: None)
        self.device = resolve_device(config.device)
        self.dataset = load_dataset(config.scenario.dataset, config.data_root, download=config.download)
        self.scenario = build_scenario(config.scenario, self.dataset)
        self.spec = methods.get(config.method)
        options = config.method_options_model()
        self.model_name = resolve_model(config.model, self.dataset.input_shape, self.spec.server.needs_batchnorm)
        torch.manual_seed(config.seed)
        self.server = self.spec.server(ServerContext(
            options=options, scenario=self.scenario, build_model=self._build_model, seed=config.seed,
            run_job=self.run_job, model_name=self.model_name, input_shape=tuple(self.dataset.input_shape),
            rounds_per_task=config.rounds.rounds_per_task))
        self.evaluator = Evaluator(self.scenario, self.device)
        self.registry = ClientRegistry(config.network.liveness_timeout_s)
        self.counters = Counters.empty()
        # Prometheus metrics (served only when asked: ``metrics.serve``, see fcl_emu/run.py)
        self.metrics = CoordinatorMetrics()
        self.metrics.watch_online(lambda: self.registry.online_count)
        self.context = context or zmq.Context.instance()
        bind = config.network.bind if resume is None else resume.state["address"]
        try:
            self.endpoint = ServerEndpoint(self.context, bind,
                                           limits=Limits(max_total_bytes=config.network.max_message_bytes),
                                           count=tee(self.counters, self.metrics.count_message))
        except zmq.ZMQError as exc:
            raise BindError(f"cannot bind {bind}: {exc}") from None
        self.address = self.endpoint.address
        first_port = gpu_worker_metrics_port(config, 0)
        self.pool = WorkerPool(config.gpu, self.context, count=tee(self.counters, self.metrics.count_message),
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
        self._logged: set[str] = set()
        self.late_updates = 0
        self.late_side_channel = 0  # side-channel messages from outside the open round, dropped
        self._stale: list[ClientUpdate] = []  # late updates kept for the next round (rounds.late_updates)
        self._stale_task = -1
        self._round: _Round | None = None
        self._secure: SecureRound | None = None  # the open secure-aggregation round (config.secagg)
        self._clock0 = time.monotonic()  # the run clock that availability models follow
        self._availability = parse_availability(config.edge.availability)
        self._profiles = load_profiles(config.edge.device_profiles) if config.edge.device_profiles else None
        self._task = 0
        self._global_round = 0
        self._welcome_template = dict(
            run_id=self.run_id,
            scenario=config.scenario.model_dump(mode="json"),
            method=config.method,
            method_options=options.model_dump(mode="json"),
            model=self.model_name,
            training={**config.training.model_dump(), "seed": config.seed, "device": config.device},
            heartbeat_interval_s=config.network.heartbeat_interval_s,
        )
        # checkpoints and resuming (docs/resume.md)
        self._not_joined_at: dict[str, float] = {}  # when each unknown peer was last told to join
        self._resumes = 0
        self._resumed: dict | None = None  # the checkpoint's results and position, until run() takes them
        self._checkpoints = {"saved": 0, "seconds": 0.0, "bytes": 0}
        if resume is not None:
            self._restore(resume)

    def _build_model(self, num_classes: int):
        return build_model(self.model_name, self.dataset.input_shape, num_classes)

    # ------------------------------------------------------------------ serving
    def _reject(self, exc: WireError) -> None:
        self.rejected[exc.reason] += 1
        self.metrics.rejected(exc.reason)
        if exc.reason not in self._logged:
            self._logged.add(exc.reason)
            log.warning("rejected a message from %r (%s); further rejections for this reason are only counted",
                        exc.peer, exc)
        if exc.peer and self.registry.is_online(exc.peer):
            self._send(exc.peer, "error", Error(code=exc.reason, detail=exc.detail[:500]))

    def _try_send(self, client_id: str, msg_type: str, body, **kw) -> bool:
        """Send; False if the peer is gone (EHOSTUNREACH under ROUTER_MANDATORY) or its queue is full."""
        try:
            self.endpoint.send(client_id, msg_type, body, **kw)
            return True
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            return False

    def _send(self, client_id: str, msg_type: str, body, **kw) -> bool:
        """Send; a vanished peer is declared dead."""
        if self._try_send(client_id, msg_type, body, **kw):
            return True
        if self.registry.drop(client_id):
            self.metrics.client_dropped("unreachable")
        return False

    def _handle(self, peer: str, msg: Message) -> None:
        try:
            self._dispatch(peer, msg)
        except WireError as exc:
            exc.peer = peer
            raise

    def _dispatch(self, peer: str, msg: Message) -> None:
        if msg.type not in CLIENT_TYPES:
            raise WireError("unexpected", f"{msg.type!r} is not a client-to-coordinator message")
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
            log.warning("client %s reported %s: %s", peer, msg.body.code, msg.body.detail)

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
        join_task = self.scenario.join_task(index)
        known = peer in self.registry.records
        was_online = self.registry.is_online(peer)
        r = self._round
        if r is not None and peer in r.selected and peer not in {u.client for u in r.updates}:
            r.lost.add(peer)  # left or crashed and came back: its work for this round is gone
        record = self.registry.join(peer, index, msg.body.node, join_task, msg.body.assets_task)
        if not known:
            self.metrics.client_joined()
        elif not was_online:
            self.metrics.client_joined(rejoin=True)
        self._send(peer, "welcome", Welcome(join_task=join_task, edge=self._edge_settings(index),
                                            **self._welcome_template),
                   task=self._task, round=self._global_round)
        self.progress("join", {"client": peer, "index": record.index})

    def _edge_settings(self, index: int) -> EdgeSettings:
        edge, seed = self.config.edge, self.config.seed
        return EdgeSettings(
            availability=client_availability(self._availability, index, seed, slot_s=edge.availability_slot_s,
                                             trace_time_scale=edge.trace_time_scale),
            profile=None if self._profiles is None else assign_profile(self._profiles, index, seed).to_wire(),
            crash_rate=edge.crash_rate, crash_downtime_s=edge.crash_downtime_s,
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
                self._check_update(msg, msg.task)
                self._stale.append(ClientUpdate(peer, msg.body.num_samples, msg.tensors, msg.body.loss,
                                                msg.body.metrics))
                self._stale_task = msg.task
            return
        if peer in {u.client for u in r.updates} | r.failed:
            raise WireError("unexpected", f"second update from {peer} in round {r.number}")
        self._check_update(msg, r.task)
        body = msg.body
        r.updates.append(ClientUpdate(peer, body.num_samples, msg.tensors, body.loss, body.metrics))
        self.registry.records[peer].rounds_trained += 1

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
        try:
            self.server.on_side_channel(r.task, msg.type, msg.tensors)
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

    def _check_update(self, msg: Message, task: int) -> None:
        """A delta must name exactly the global model's tensors with their shapes; the method checks the rest."""
        self._check_delta(msg)
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

    def _drain(self) -> None:
        """Handle every message already waiting, without blocking; then expire silent clients."""
        while self.endpoint.sock.poll(0):
            self._receive_one()
        self._expire()

    def _expire(self) -> None:
        for client_id in self.registry.expire():
            self.metrics.client_dropped("heartbeat_timeout")
            self.progress("dead", {"client": client_id})

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

    def _receive_one(self) -> None:
        """Receive, validate and handle one message; time it by message type."""
        started = time.perf_counter()
        msg_type = "rejected"
        try:
            peer, msg = self.endpoint.recv()
            msg_type = msg.type
            self._handle(peer, msg)
        except WireError as exc:
            self._reject(exc)
        elapsed = time.perf_counter() - started
        self.handling_s[msg_type] += elapsed
        self.metrics.handled(msg_type, elapsed)

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

    # ------------------------------------------------------------------- rounds
    def _wait_for_clients(self) -> None:
        expected = self.config.scenario.num_clients
        timeout = self.config.network.join_timeout_s
        # every configured client has shown up (one that joined and died since is not waited for)
        self.serve(lambda: len(self.registry.records) >= expected, time.monotonic() + timeout)
        online = len(self.registry.eligible(0))
        if online < self.config.rounds.min_participants:
            raise RunAborted(f"only {online} clients joined within {timeout:.0f} s; "
                             f"at least {self.config.rounds.min_participants} are needed")
        self.progress("ready", {"online": len(self.registry.online()), "expected": expected})

    def _run_round(self, task: int, task_round: int, recorder: RunRecorder) -> RoundRecord:
        cfg = self.config.rounds
        started, cpu_started = time.perf_counter(), time.process_time()
        bytes_before = dict(self.counters.bytes)
        self._drain()  # leaves and joins that queued up during evaluation or task-end work
        eligible = self.registry.eligible(task)
        k = min(math.ceil(cfg.clients_per_round * cfg.overcommit), len(eligible))
        chosen = [eligible[i].client_id for i in sorted(self.rng.choice(len(eligible), size=k, replace=False))]
        self._global_round += 1
        r = _Round(task, self._global_round, set(chosen), wanted=cfg.clients_per_round)
        self._round = r
        self.metrics.round_started(task, task_round, r.number)

        t0 = time.perf_counter()
        assets = self.server.task_assets(task) if any(
            self.registry.records[c].assets_task != task for c in chosen) else {}
        unknown = set(assets) - set(ASSET_TYPES)
        if unknown:
            raise ValueError(f"method {self.spec.name!r} returned task assets of unknown kinds {sorted(unknown)}; "
                             f"the wire knows {', '.join(ASSET_TYPES)}")
        payload = self.server.round_tensors(task, r.number)
        seen = [int(c) for c in self.scenario.seen_classes(task)]
        classes = [int(c) for c in self.scenario.task_classes(task)]
        secure = self._open_secure_round(chosen, task, r.number) if self.config.secagg.enabled else None
        setups = secure.setup_messages() if isinstance(secure, SecureRound) else {}
        if isinstance(secure, SecureOutcome):
            r.selected = set()  # aborted before it started: no client is asked to train
        lr = self.server.learning_rate(task, task_round, self.config.training.lr)
        request = TrainRequest(local_epochs=self.config.training.local_epochs, lr=lr, secure=secure is not None)
        for client_id in chosen if r.selected else ():
            record = self.registry.records[client_id]
            if record.assets_task != task:
                if not self._send_task_start(client_id, task, r.number, classes, seen, assets):
                    continue
                record.assets_task = task
            if setups and not self._send(client_id, "secagg_setup", setups[client_id], task=task, round=r.number):
                continue
            self._send(client_id, "train_request", request, task=task, round=r.number, tensors=payload)
        t_dispatch = time.perf_counter() - t0

        t0, handled_before = time.perf_counter(), self.handling_s["update"] + self.handling_s["secagg_masked"]
        deadline = time.monotonic() + cfg.deadline_s
        if isinstance(secure, SecureRound):
            self._secure = secure
            try:
                secure = self._collect_secure(r, secure, deadline)
            finally:
                self._secure = None
        elif secure is None:
            self.serve(lambda: r.done(self.registry.is_online), deadline)
        t_wait = time.perf_counter() - t0
        t_updates = self.handling_s["update"] + self.handling_s["secagg_masked"] - handled_before
        self._round = None
        late = len(r.pending(self.registry.is_online))
        dropped = len(r.selected - r.answered() - r.pending(self.registry.is_online))

        t0 = time.perf_counter()
        stale = [u for u in self._stale if u.num_samples > 0] if self._stale_task == task else []
        self._stale = []
        if secure is None:
            useful = sorted([u for u in r.updates if u.num_samples > 0] + stale, key=lambda u: u.client)
            losses = [u.loss for u in useful]
        else:  # one update: the unmasked weighted mean of the clients in the masked sum
            useful = [] if secure.delta is None else [ClientUpdate("secagg", secure.weight, secure.delta)]
            losses = list(secure.losses)
        skipped = not useful or (secure is None and len(useful) < cfg.min_participants)
        if not skipped:
            self.server.aggregate(task, r.number, useful)
        t_aggregate = time.perf_counter() - t0

        cpu_s = time.process_time() - cpu_started
        t0 = time.perf_counter()
        last = task_round == cfg.rounds_per_task - 1
        accuracy = None
        if not last and (task_round + 1) % cfg.eval_every == 0:
            accuracy = self.evaluator.accuracy_seen(self.server.eval_model(), task)
        t_eval = time.perf_counter() - t0

        bytes_by_type = self._bytes_since(bytes_before)
        losses = [x for x in losses if np.isfinite(x)]
        record = RoundRecord(
            task=task, round=r.number, task_round=task_round, selected=len(chosen),
            participants=len(r.updates) + len(r.masked), late=late, failed=len(r.failed), skipped=skipped,
            dropped=dropped, overcommitted=len(chosen) - min(cfg.clients_per_round, len(chosen)),
            stale_used=0 if skipped or secure is not None else len(stale),
            secagg=None if secure is None else secure.record,
            client_metrics=_mean_metrics(useful),
            samples=sum(u.num_samples for u in useful),
            mean_loss=float(np.mean(losses)) if losses else None,
            accuracy_seen=accuracy,
            duration_s=time.perf_counter() - started,
            coordinator_cpu_s=cpu_s,
            phases_s={"dispatch": t_dispatch, "collect": t_wait, "receive_updates": t_updates,
                      "aggregate": t_aggregate, "evaluate": t_eval},
            bytes_sent=sum(d.get("sent", 0) for d in bytes_by_type.values()),
            bytes_received=sum(d.get("received", 0) for d in bytes_by_type.values()),
            bytes_by_type=bytes_by_type,
            online=len(self.registry.online()),
        )
        recorder.round(record)
        self.metrics.round_closed(duration_s=record.duration_s, phases_s=record.phases_s, selected=record.selected,
                                  participants=record.participants, missed_deadline=record.late,
                                  failed=record.failed, skipped=record.skipped, mean_loss=record.mean_loss,
                                  accuracy_seen_percent=record.accuracy_seen)
        return record

    # ------------------------------------------------------- secure aggregation
    def _open_secure_round(self, chosen: list[str], task: int, number: int) -> SecureRound | SecureOutcome:
        """The SecAgg+ round over ``chosen``; an aborted outcome if it cannot even start (too few clients)."""
        sa = self.config.secagg
        max_weight = sa.max_weight or max([1] + [len(self.scenario.client_indices(self.registry.records[c].index,
                                                                                  task)) for c in chosen])
        config = SecAggConfig(neighbors=sa.neighbors, threshold=sa.threshold, ring_bits=sa.ring_bits,
                              clip=sa.clip, max_weight=max_weight)
        try:
            return SecureRound(chosen, DeltaLayout.of(self.server.global_state), config, run_id=self.run_id,
                               number=number, seed=self.config.seed * 1_000_003 + number,
                               send=lambda c, t, body: self._send(c, t, body, task=task, round=number),
                               metrics=self.metrics, phase_timeout_s=sa.phase_timeout_s)
        except (SecAggAbort, SecAggError) as exc:
            log.warning("round %d: secure aggregation cannot start: %s", number, exc)
            self.metrics.secagg_round(outcome="aborted", dropouts={}, recovered=0)
            return SecureOutcome(None, 0, (), {"outcome": "aborted", "reason": str(exc)})

    def _collect_secure(self, r: _Round, secure: SecureRound, deadline: float) -> SecureOutcome:
        """Run the protocol's phases while the clients train; the round's outcome (aborted: no delta)."""
        def alive(c: str) -> bool:
            return self.registry.is_online(c) and c not in r.failed and c not in r.lost

        try:
            masked = secure.until_masked(self.serve, alive, r.wanted, deadline)
            if masked < self.config.rounds.min_participants:
                raise SecAggAbort(f"only {masked} masked inputs, rounds.min_participants is "
                                  f"{self.config.rounds.min_participants}", "masked_input")
            return secure.unmask(self.serve, alive)
        except SecAggAbort as exc:
            log.warning("round %d: secure aggregation aborted: %s", r.number, exc)
            return secure.abort(str(exc), [c for c in secure.server.roster if self.registry.is_online(c)])

    def _send_task_start(self, client_id: str, task: int, number: int, classes: list[int], seen: list[int],
                         assets: dict[str, dict[str, np.ndarray]]) -> bool:
        """``task_start``, then one message per kind of the method's per-task assets (wire.ASSET_TYPES)."""
        if not self._send(client_id, "task_start", TaskStart(classes=classes, seen_classes=seen),
                          task=task, round=number):
            return False
        for kind, tensors in assets.items():
            if not self._send(client_id, kind, TaskAsset(), task=task, round=number, tensors=tensors):
                return False
        return True

    def _bytes_since(self, before: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
        """Bytes on the wire since ``before`` (a copy of the counters), as ``{type: {direction: bytes}}``."""
        out: dict[str, dict[str, int]] = {}
        for (msg_type, direction), n in self.counters.bytes.items():
            delta = n - before.get((msg_type, direction), 0)
            if delta:
                out.setdefault(msg_type, {})[direction] = delta
        return out

    # -------------------------------------------------------------- checkpoints
    def _save_checkpoint(self, run_dir: Path, task: int, task_round: int, matrix: list, rounds: list[RoundRecord],
                         wall_s: float) -> None:
        """Checkpoint atomically (docs/resume.md). ``(task, task_round)`` is the next round to run: task_round 0
        means the task has not started (its head is not grown yet); task == num_tasks, the run is complete."""
        t0 = time.perf_counter()
        arrays = {SERVER + k: v for k, v in self.server.state_arrays().items()}
        arrays[TORCH_RNG] = torch.get_rng_state().numpy()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i, state in enumerate(torch.cuda.get_rng_state_all()):
                arrays[f"{CUDA_RNG}{i}"] = state.numpy()
        state = {
            "run_id": self.run_id, "address": self.address, "fingerprint": run_fingerprint(self.config),
            "method": self.config.method, "saved_at": time.time(),
            "next": {"task": task, "task_round": task_round}, "global_round": self._global_round,
            "complete": task >= self.scenario.num_tasks,
            "wall_clock_s": wall_s, "run_clock_s": time.monotonic() - self._clock0,
            "rng": {"numpy": self.rng.bit_generator.state},
            "server": self.server.state_meta(),
            "registry": self.registry.snapshot(),
            "results": {
                "matrix": matrix, "rounds": [asdict(r) for r in rounds],
                "bytes": [[t, d, n] for (t, d), n in self.counters.bytes.items()],
                "messages": [[t, d, n] for (t, d), n in self.counters.messages.items()],
                "rejected": dict(self.rejected), "handling_s": dict(self.handling_s),
                "late_updates": self.late_updates, "late_side_channel": self.late_side_channel,
            },
            "resumes": self._resumes,
            "checkpoints": {**self._checkpoints, "saved": self._checkpoints["saved"] + 1},  # this one included
        }
        nbytes = checkpoint.save(run_dir / CHECKPOINT_DIR, state, arrays)
        elapsed = time.perf_counter() - t0
        self._checkpoints = {"saved": self._checkpoints["saved"] + 1,
                             "seconds": self._checkpoints["seconds"] + elapsed, "bytes": nbytes}
        log.debug("checkpoint before task %d round %d: %d bytes in %.3f s", task, task_round, nbytes, elapsed)

    def _restore(self, ckpt: Checkpoint) -> None:
        """Take over a checkpoint's state (the constructor's last step); run() continues after it."""
        s, arrays = ckpt.state, ckpt.arrays
        if s.get("fingerprint") != run_fingerprint(self.config):
            raise checkpoint.CheckpointError("the checkpoint was written under another configuration "
                                             "than this one (was config.yaml edited?)")
        try:
            self.server.load_state_arrays({k[len(SERVER):]: v for k, v in arrays.items() if k.startswith(SERVER)})
            self.server.load_state_meta(s["server"])
            # after the server: loading never draws from torch's RNG, but be sure nothing comes after this
            torch.set_rng_state(torch.from_numpy(np.array(arrays[TORCH_RNG])))
            cuda = [torch.from_numpy(np.array(v)) for k, v in sorted(arrays.items()) if k.startswith(CUDA_RNG)]
            if cuda and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(cuda)
            self.rng.bit_generator.state = s["rng"]["numpy"]
            self.registry.restore(s["registry"])
            res = s["results"]
            for t, d, n in res["bytes"]:
                self.counters.bytes[(t, d)] = n
            for t, d, n in res["messages"]:
                self.counters.messages[(t, d)] = n
            self.rejected.update(res["rejected"])
            self.handling_s.update(res["handling_s"])
            self.late_updates = res["late_updates"]
            self.late_side_channel = res["late_side_channel"]
            self._global_round = s["global_round"]
            self._task = min(s["next"]["task"], self.scenario.num_tasks - 1)
            self._clock0 = time.monotonic() - s["run_clock_s"]
            self._resumes = s["resumes"] + 1
            self._checkpoints = {"saved": s["checkpoints"]["saved"], "seconds": s["checkpoints"]["seconds"],
                                 "bytes": s["checkpoints"]["bytes"]}
            self._resumed = {"task": s["next"]["task"], "task_round": s["next"]["task_round"],
                             "matrix": res["matrix"], "rounds": [RoundRecord(**r) for r in res["rounds"]],
                             "wall_clock_s": s["wall_clock_s"]}
        except (KeyError, TypeError, ValueError) as exc:
            raise checkpoint.CheckpointError(f"corrupt checkpoint: cannot restore it ({type(exc).__name__}: "
                                             f"{exc})") from None

    def _wait_for_rejoin(self) -> list[str]:
        """After a resume: serve until the clients online at the checkpoint have joined again (their DEALERs
        reconnect on their own; any message of theirs is answered ``not_joined``). Stops early once none has
        come back for ``liveness_timeout_s`` after the first did (clients away for now), and at
        ``join_timeout_s``. Returns the clients that did not come back; they count as dropped."""
        net = self.config.network
        seen = {"awaiting": self.registry.awaiting_rejoin, "changed": None}

        def settled() -> bool:
            awaiting, now = self.registry.awaiting_rejoin, time.monotonic()
            if awaiting != seen["awaiting"]:
                seen.update(awaiting=awaiting, changed=now)
            return awaiting == 0 or (seen["changed"] is not None and now - seen["changed"] > net.liveness_timeout_s)

        self.serve(settled, time.monotonic() + net.join_timeout_s)
        missing = self.registry.drop_resumed()
        for _ in missing:
            self.metrics.client_dropped("heartbeat_timeout")
        online = len(self.registry.eligible(self._task))
        if online < self.config.rounds.min_participants:
            raise RunAborted(f"only {online} clients joined the resumed coordinator within "
                             f"{net.join_timeout_s:.0f} s; at least {self.config.rounds.min_participants} are needed")
        self.progress("ready", {"online": len(self.registry.online()), "expected": self.config.scenario.num_clients})
        return missing

    # ---------------------------------------------------------------------- run
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
            self._save_checkpoint(run_dir, task, task_round, matrix, rounds, time.perf_counter() - started)

        status = "completed"
        self._recorder = recorder
        try:
            try:
                self.pool.start(run_dir / "logs")
            except RuntimeError as exc:  # --gpu-device cuda without CUDA here
                raise RunAborted(f"the GPU worker pool cannot start: {exc}") from None
            if self.config.gpu.workers:  # check every worker's device before the run depends on it
                self.run_jobs([("device.matmul", {}, {"seconds": 0.2, "size": 256})] * self.config.gpu.workers)
            self.metrics.run_started(
                run_id=self.run_id, method=self.config.method, dataset=self.config.scenario.dataset,
                model=self.model_name, seed=self.config.seed, num_clients=self.config.scenario.num_clients,
                num_tasks=self.scenario.num_tasks, rounds_per_task=self.config.rounds.rounds_per_task,
                clients_per_round=self.config.rounds.clients_per_round)
            if resumed is None:
                self._wait_for_clients()
                recorder.event("start", run_id=self.run_id, address=self.address, online=len(self.registry.online()))
                save(0, 0)
            else:
                missing = self._wait_for_rejoin()
                recorder.event("resume", run_id=self.run_id, address=self.address, task=first_task,
                               task_round=first_round, after_round=self._global_round, resumes=self._resumes,
                               online=len(self.registry.online()), missing=len(missing))
                self.progress("resume", {"rounds": len(rounds), "task": first_task, "task_round": first_round})
            for task in range(first_task, self.scenario.num_tasks):
                self._task = task
                resuming_task = task == first_task and first_round > 0
                if not resuming_task:  # a task resumed mid-way has its head grown in the checkpoint
                    self.server.start_task(task)
                self.progress("task_start", {"task": task, "classes": len(self.scenario.task_classes(task))})
                for task_round in range(first_round if resuming_task else 0, last_round + 1):
                    record = self._run_round(task, task_round, recorder)
                    rounds.append(record)
                    self.progress("round", asdict(record))
                    if task_round < last_round:  # after a task's last round: below, once the task has ended
                        save(task, task_round + 1)
                t0 = time.perf_counter()
                self.server.end_task(task)
                t_end_task = time.perf_counter() - t0
                class_hits = self.evaluator.class_hits(self.server.eval_model(), task)
                row = self.evaluator.accuracy_per_task(*class_hits, task)
                t_evaluate = time.perf_counter() - t0 - t_end_task
                matrix.append(row + [None] * (self.scenario.num_tasks - task - 1))
                seen = self._seen_accuracy(row, task)
                recorder.event("task_end", task=task, accuracy=row, accuracy_seen=seen)
                self.metrics.task_ended(
                    task=task, matrix=matrix, accuracy_seen_percent=seen,
                    average_accuracy=average_accuracy(matrix), average_forgetting=average_forgetting(matrix),
                    average_incremental_accuracy=average_incremental_accuracy(matrix),
                    phases_s={"end_task": t_end_task, "evaluate": t_evaluate})
                self.progress("task_end", {"task": task, "accuracy": row})
                save(task + 1, 0)
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        except RunAborted as exc:
            status = f"aborted: {exc}"
            raise
        finally:
            self._shutdown(status)
            summary = self._summary(matrix, rounds, time.perf_counter() - started, status, recorder.run_dir,
                                    class_hits)
            recorder.summary(summary)
            recorder.event("end", status=status)
            recorder.close()
        return summary

    def _seen_accuracy(self, row: list[float | None], task: int) -> float:
        counts = [len(self.scenario.test_indices(self.scenario.task_classes(t))) for t in range(task + 1)]
        return float(np.average([a for a in row if a is not None], weights=[n for a, n in zip(row, counts)
                                                                             if a is not None]))

    def _knowledge_retention(self, matrix, class_hits) -> dict[str, float | None]:
        """KR_t, KR_s and the private classes' accuracy (coordinator.results); the spatial terms need the
        final model's per-class hits, which a run resumed after its last task no longer has."""
        out = {"temporal": temporal_retention(matrix) if matrix else None, "spatial": None, "private": None}
        if class_hits is not None and len(matrix) == self.scenario.num_tasks:
            clients = range(self.config.scenario.num_clients)
            trained = [np.unique(np.concatenate([self.scenario.client_classes(k, t) for t in range(len(matrix))]))
                       for k in clients]
            out.update(spatial_retention(*class_hits, trained))
        return out

    def _shutdown(self, reason: str) -> None:
        """Tell every client that is reachable, away ones included (their node ends with the run)."""
        for record in list(self.registry.records.values()):
            if record.status is not Status.DEAD:
                # a node closes all its clients at the first shutdown: later sends may find them gone
                self._try_send(record.client_id, "shutdown", Shutdown(reason=reason))

    def _summary(self, matrix, rounds: list[RoundRecord], wall: float, status: str, run_dir: Path,
                 class_hits=None) -> dict:
        counts = self.registry.counts
        complete = bool(matrix)
        phases = Counter()
        for r in rounds:
            phases.update(r.phases_s)
        return {
            "status": status,
            "run_id": self.run_id,
            "run_dir": str(run_dir),
            "method": self.config.method,
            "method_options": self.config.method_options_model().model_dump(mode="json"),
            "dataset": self.config.scenario.dataset,
            "model": self.config.model,
            "scenario": self.config.scenario.model_dump(mode="json"),
            "seed": self.config.seed,
            "accuracy_matrix": matrix,
            "accuracy_seen": [self._seen_accuracy(row[: t + 1], t) for t, row in enumerate(matrix)],
            "average_accuracy": average_accuracy(matrix) if complete else None,
            "average_incremental_accuracy": average_incremental_accuracy(matrix) if complete else None,
            "average_forgetting": average_forgetting(matrix) if complete else None,
            "knowledge_retention": self._knowledge_retention(matrix, class_hits),
            "bytes": self.counters.nested(),
            "messages": {f"{t}/{d}": n for (t, d), n in sorted(self.counters.messages.items())},
            "bytes_total": sum(self.counters.bytes.values()),
            "rounds": len(rounds),
            "rounds_skipped": sum(r.skipped for r in rounds),
            "wall_clock_s": wall,
            "phase_s": dict(phases),
            "handling_s": dict(self.handling_s),
            "clients": {
                "configured": self.config.scenario.num_clients,
                "joined": counts.joined,
                "rejoined": counts.rejoined,
                "left": counts.left,
                "dropped": counts.dropped,
                "online_at_end": len(self.registry.online()),
            },
            "missed_deadline": sum(r.late for r in rounds),
            "late_updates": self.late_updates,
            "late_side_channel": self.late_side_channel,
            "rejected_messages": dict(self.rejected),
            "secagg": _secagg_summary(rounds) if self.config.secagg.enabled else None,
            "gpu_jobs": _jobs_summary(self._jobs, self.config.gpu.workers, self.pool.device),
            "resumes": self._resumes,
            "checkpoints": dict(self._checkpoints),  # saved, seconds in total, bytes of the latest
        }

    def close(self) -> None:
        self.pool.close()
        self.endpoint.close()
        self.metrics.close()


def _jobs_summary(jobs: list[Job], workers: int, device: str) -> dict:
    """Server-side jobs over the run, by kind: how many, how many failed, attempts, seconds queued and run."""
    by_kind: dict[str, dict] = {}
    for job in jobs:
        k = by_kind.setdefault(job.kind, {"jobs": 0, "failed": 0, "attempts": 0, "queue_s": 0.0, "run_s": 0.0})
        k["jobs"] += 1
        k["failed"] += not job.ok
        k["attempts"] += job.attempts
        k["queue_s"] += job.queue_s
        k["run_s"] += job.run_s
    return {"workers": workers, "device": device, "by_kind": by_kind}


def _secagg_summary(rounds: list[RoundRecord]) -> dict:
    """Secure aggregation over the run: rounds by outcome, seconds and dropouts per phase (summed)."""
    records = [r.secagg for r in rounds if r.secagg is not None]
    phase_s, dropouts = Counter(), Counter()
    for rec in records:
        phase_s.update(rec.get("phase_s", {}))
        dropouts.update(rec.get("dropouts", {}))
    return {"completed": sum(rec["outcome"] == "completed" for rec in records),
            "aborted": sum(rec["outcome"] == "aborted" for rec in records),
            "phase_s": dict(phase_s), "dropouts": dict(dropouts)}
