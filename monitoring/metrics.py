"""Prometheus metrics of every fcl-emu process: the one place they are defined.

Each process (the coordinator, each edge node) builds one metrics object with
its own :class:`prometheus_client.CollectorRegistry` (never the global one, so
tests can hold several in one process) and, when asked, serves it on its own
port (:meth:`ProcessMetrics.serve`). The code being measured calls the small
methods below at the points where the numbers already exist: the wire byte
counter (every message), the coordinator's registry events, the round record,
the edge node's trainer.

Conventions: names start with ``fcl_``, values are in base units (seconds,
bytes, ratios in 0..1), counters end in ``_total``. No label holds a client
id: label values come from fixed sets (message types, directions, rejection
reasons, phases, outcomes) or from the scenario's task count, so the number of
series does not grow with the number of clients. The per-process role is a
label of the wire metrics; the file-based
service discovery adds ``role``, ``process`` and ``run_id`` to every series
(see docs/monitoring.md).

Hot path: a heartbeat arrives 300 times a second at the coordinator, and
every message goes through :meth:`ProcessMetrics.count_message`. Labelled
children are looked up once and cached as bound ``inc`` methods in a dict, so
an update is a dict lookup plus two lock-protected additions (about 1 us;
measured numbers in docs/results/performance.md).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector
from prometheus_client.exposition import generate_latest

from fcl_emu.wire.auth import HANDSHAKE_REFUSALS
from fcl_emu.wire.framing import REASONS
from fcl_emu.wire.messages import BODY_SCHEMAS

# ``_created`` series (one per counter and histogram child) double the series
# count and Prometheus ignores them in the text format: turn them off.
prometheus_client.disable_created_metrics()

ROLE_COORDINATOR = "coordinator"
ROLE_EDGE_NODE = "edge_node"
ROLE_GPU_WORKER = "gpu_worker"

MESSAGE_TYPES = tuple(BODY_SCHEMAS)
DIRECTIONS = ("sent", "received")
REJECT_REASONS = tuple(REASONS)
ROUND_PHASES = ("select", "dispatch", "collect", "receive_updates", "aggregate", "evaluate")
TASK_END_PHASES = ("end_task", "evaluate")
CLIENT_ROUND_OUTCOMES = ("selected", "participated", "missed_deadline", "failed")
DROP_REASONS = ("heartbeat_timeout", "unreachable", "node_exited", "crash")  # crash: on the emulated clock
JOIN_KINDS = ("first", "rejoin")
ROUND_OUTCOMES = ("aggregated", "skipped")
TRAIN_OUTCOMES = ("ok", "no_data", "failed", "cancelled")
CLIENT_EVENTS = ("leave", "rejoin", "crash", "restart")
LINK_DIRECTIONS = ("up", "down")
NODE_CLIENT_STATES = ("joining", "active", "away", "down", "closed")
SECAGG_PHASES = ("advertise_keys", "share_keys", "masked_input", "unmasking")
SECAGG_OUTCOMES = ("completed", "aborted")
GPU_JOB_OUTCOMES = ("ok", "failed")
GPU_WORKER_STATES = ("starting", "idle", "busy", "dead")
JOB_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)

# Buckets in seconds. Phases span a millisecond (dispatching to 30 clients) to
# minutes (collecting from stragglers); rounds and local training seconds to minutes.
PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                 60.0, 120.0, 300.0)
ROUND_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STALE_DISCARDS = ("too_stale", "task_end")  # why asynchronous aggregation discards an update
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)  # server model versions
TRAIN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ProcessMetrics:
    """What every process exports: wire traffic, rejected messages, process CPU and memory."""

    def __init__(self, role: str, registry: CollectorRegistry | None = None):
        self.role = role
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.wire_bytes = Counter(
            "fcl_wire_bytes", "Bytes on the wire (header and tensor frames) by message type and direction, "
            "as seen by this process.", ["role", "type", "direction"], registry=r)
        self.wire_messages = Counter(
            "fcl_wire_messages", "Messages on the wire by message type and direction, as seen by this process.",
            ["role", "type", "direction"], registry=r)
        self.rejected_messages = Counter(
            "fcl_wire_rejected_messages", "Received messages that failed validation, by reason "
            "(docs/wire.md).", ["role", "reason"], registry=r)
        for reason in REJECT_REASONS:  # every reason exists from the start, at 0
            self.rejected_messages.labels(role, reason)
        self.secagg_phase_duration = Histogram(
            "fcl_secagg_phase_duration_seconds", "Time of one SecAgg+ phase: on the coordinator the phase's "
            "wall-clock time (waiting for replies included), on an edge node one client's computation for it.",
            ["role", "phase"], buckets=PHASE_BUCKETS, registry=r)
        if role != ROLE_GPU_WORKER:
            for phase in SECAGG_PHASES:  # at 0 from the start: rate() sees a run's first observations too
                self.secagg_phase_duration.labels(role, phase)
        # fcl_process_cpu_seconds_total, fcl_process_resident_memory_bytes, ... (Linux /proc)
        ProcessCollector(namespace="fcl", registry=r)
        self._wire: dict[tuple[str, str], tuple[Callable[[float], None], Callable[[float], None]]] = {}
        self._server = None
        self._thread = None

    # --------------------------------------------------------------- hot path
    def count_message(self, msg_type: str, direction: str, nbytes: int) -> None:
        """A ``wire.sockets.ByteCounter``: called once per message sent or received."""
        try:
            add_bytes, add_message = self._wire[(msg_type, direction)]
        except KeyError:
            add_bytes, add_message = self._wire_children(msg_type, direction)
        add_bytes(nbytes)
        add_message(1)

    def _wire_children(self, msg_type: str, direction: str):
        children = (self.wire_bytes.labels(self.role, msg_type, direction).inc,
                    self.wire_messages.labels(self.role, msg_type, direction).inc)
        self._wire[(msg_type, direction)] = children
        return children

    def rejected(self, reason: str) -> None:
        self.rejected_messages.labels(self.role, reason).inc()

    def secagg_phase(self, phase: str, seconds: float) -> None:
        self.secagg_phase_duration.labels(self.role, phase).observe(seconds)

    # ---------------------------------------------------------------- serving
    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` in a daemon thread; returns the port (useful with 0).

        Raises ``OSError`` if the port cannot be bound.
        """
        self._server, self._thread = prometheus_client.start_http_server(port, host, registry=self.registry)
        return self._server.server_port

    def serve_as_aid(self, port: int, host: str, log: logging.Logger) -> bool:
        """:meth:`serve`, except that a port that cannot be bound is logged and the process runs on without
        ``/metrics`` (metrics are an aid); whether it serves."""
        try:
            self.serve(port, host)
            return True
        except OSError as exc:
            log.error("cannot serve /metrics on %s:%d (%s); running without it", host, port, exc)
            return False

    @property
    def port(self) -> int | None:
        return None if self._server is None else self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def exposition(self) -> bytes:
        """The text a scrape of ``/metrics`` returns."""
        return generate_latest(self.registry)

    def series(self) -> list[tuple[str, dict[str, str]]]:
        """Every exposed series (sample name and labels)."""
        return [(s.name, s.labels) for family in self.registry.collect() for s in family.samples]


class CoordinatorMetrics(ProcessMetrics):
    """The coordinator's metrics: clients, rounds, phases, accuracy, plus the wire."""

    def __init__(self, registry: CollectorRegistry | None = None):
        super().__init__(ROLE_COORDINATOR, registry)
        r = self.registry
        self.run_info = Info("fcl_run", "The run: id, method, dataset, model, scenario sizes, seed.", registry=r)
        self.clients_configured = Gauge("fcl_clients_configured", "Clients in the scenario.", registry=r)
        self.clients_online = Gauge("fcl_clients_online", "Clients online now (joined, not left, not dropped).",
                                    registry=r)
        self.client_joins = Counter("fcl_client_joins", "Joins: a client's first join or a rejoin after it "
                                    "left or was dropped.", ["kind"], registry=r)
        self.client_leaves = Counter("fcl_client_leaves", "Graceful leaves (a leave message).", registry=r)
        self.client_drops = Counter("fcl_client_drops", "Clients declared dead (crashed, killed or cut off): "
                                    "missed heartbeats or unreachable socket.", ["reason"], registry=r)
        self.container_faults = Counter("fcl_container_faults", "Faults injected into edge-node containers by the "
                                        "fault plan: kill, pause, unpause, disconnect, reconnect, restart.",
                                        ["action"], registry=r)
        self.host_faults = Counter("fcl_host_faults", "Faults a fault plan applied to whole hosts of a local "
                                   "cluster: lose_host, partition, heal, slow_host, restore.", ["action"], registry=r)
        self.late_updates = Counter("fcl_late_updates", "Updates that arrived after their round had closed "
                                    "(dropped).", registry=r)
        self.skipped_trainings = Counter("fcl_skipped_trainings", "Emulated clock: selected clients' trainings "
                                         "cancelled because their update could no longer count (it arrives "
                                         "after its round closes).", registry=r)
        self.refused_handshakes = Counter("fcl_refused_handshakes", "CurveZMQ handshakes the allow-list refused, "
                                          "by reason (unknown_key: a key not in the run's roster).", ["reason"],
                                          registry=r)
        self.handling_seconds = Counter("fcl_coordinator_handling_seconds", "Coordinator time receiving, "
                                        "validating and handling messages, by message type (rejected: "
                                        "'rejected').", ["type"], registry=r)
        self.tasks = Gauge("fcl_tasks", "Tasks in the scenario.", registry=r)
        self.rounds_per_task = Gauge("fcl_rounds_per_task", "Rounds per task.", registry=r)
        self.task = Gauge("fcl_task", "Current task (0-based).", registry=r)
        self.task_round = Gauge("fcl_task_round", "Current round within the task (0-based).", registry=r)
        self.round = Gauge("fcl_round", "Current global round number (1-based; 0 before the first).", registry=r)
        self.rounds = Counter("fcl_rounds", "Closed rounds by outcome: aggregated, or skipped for too few "
                              "updates.", ["outcome"], registry=r)
        self.tasks_completed = Counter("fcl_tasks_completed", "Tasks finished (evaluated).", registry=r)
        self.round_duration = Histogram("fcl_round_duration_seconds", "Wall-clock duration of a round.",
                                        buckets=ROUND_BUCKETS, registry=r)
        self.round_emulated_duration = Histogram(
            "fcl_round_emulated_duration_seconds", "Emulated-clock duration of a round: what the federation "
            "would have taken (docs/edge.md; none under --clock real).", buckets=ROUND_BUCKETS, registry=r)
        self.emulated_clock = Gauge("fcl_emulated_clock_seconds", "The run's emulated clock at the last round's "
                                    "close (stays 0 under --clock real).", registry=r)
        self.host_timeouts = Counter("fcl_round_host_timeouts", "Emulated-clock rounds closed by the host-side "
                                     "safety timeout before every selected client's work was done.", registry=r)
        self.phase_duration = Histogram("fcl_round_phase_duration_seconds", "Wall-clock duration of a round "
                                        "phase.", ["phase"], buckets=PHASE_BUCKETS, registry=r)
        self.task_end_duration = Histogram("fcl_task_end_phase_duration_seconds", "Wall-clock duration of the "
                                           "work at a task's end: the method's end_task, the per-task "
                                           "evaluation.", ["phase"], buckets=ROUND_BUCKETS, registry=r)
        self.update_staleness = Histogram(
            "fcl_update_staleness_versions", "Asynchronous aggregation: staleness of each applied update, in server "
            "model versions between the one its client trained from and the one it was applied to.",
            buckets=STALENESS_BUCKETS, registry=r)
        self.stale_updates_discarded = Counter(
            "fcl_stale_updates_discarded", "Asynchronous aggregation: updates discarded on arrival, by reason: "
            "too_stale (over --max-staleness) or task_end (trained on the previous task's classes).", ["reason"],
            registry=r)
        for reason in STALE_DISCARDS:
            self.stale_updates_discarded.labels(reason)
        self.round_clients = Gauge("fcl_round_clients", "Clients of the last closed round by outcome: selected, "
                                   "participated (update received), missed_deadline, failed.", ["state"],
                                   registry=r)
        self.client_rounds = Counter("fcl_client_rounds", "Client-rounds by outcome, summed over rounds: "
                                     "selected, participated, missed_deadline, failed.", ["outcome"], registry=r)
        self.round_train_loss = Gauge("fcl_round_train_loss", "Mean local training loss reported in the last "
                                      "aggregated round.", registry=r)
        self.accuracy = Gauge("fcl_task_accuracy_ratio", "Accuracy on task i's classes (label task) after the "
                              "last finished task: the last row of the accuracy matrix.", ["task"], registry=r)
        self.accuracy_seen = Gauge("fcl_accuracy_seen_ratio", "Accuracy on all classes seen so far, at the "
                                   "last evaluation.", registry=r)
        self.average_accuracy = Gauge("fcl_average_accuracy_ratio", "Average accuracy over the tasks seen, "
                                      "after the last finished task.", registry=r)
        self.average_incremental_accuracy = Gauge(
            "fcl_average_incremental_accuracy_ratio", "Average incremental accuracy after the last finished "
            "task.", registry=r)
        self.average_forgetting = Gauge("fcl_average_forgetting_ratio", "Average forgetting after the last "
                                        "finished task.", registry=r)
        self.secagg_rounds = Counter("fcl_secagg_rounds", "Rounds run under secure aggregation by outcome: "
                                     "completed (the masked sum was unmasked) or aborted (a phase kept fewer "
                                     "than t clients, or too few masked inputs for min_participants).",
                                     ["outcome"], registry=r)
        self.secagg_dropouts = Counter("fcl_secagg_dropouts", "Clients lost by secure aggregation in each "
                                       "phase (no reply in time, a bad reply, or too few live neighbours).",
                                       ["phase"], registry=r)
        self.secagg_recovered_masks = Counter("fcl_secagg_recovered_masks", "Dropped clients whose pairwise "
                                              "masks were reconstructed from Shamir shares.", registry=r)
        self.tier_bytes = Counter("fcl_tier_bytes", "Edge aggregators: bytes on the links of a tier below the "
                                  "coordinator (client_edge: between the clients and their edge aggregators, as the "
                                  "aggregators report them), by direction seen from the upper end.",
                                  ["tier", "direction"], registry=r)
        self.energy_joules = Counter("fcl_energy_joules", "Emulated clock: joules the clients spent, by device "
                                     "class and kind (compute: training; radio: bytes down and up).",
                                     ["device_class", "kind"], registry=r)
        self.battery_levels = Histogram("fcl_battery_level_ratio", "Emulated clock: battery level (a fraction of "
                                        "capacity) of each client after a round's work.",
                                        buckets=(0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
                                        registry=r)
        self.privacy_epsilon = Gauge("fcl_privacy_epsilon", "Differential privacy: epsilon spent so far for the run's "
                                     "delta, as the rounds sampled (as_sampled, the figure that holds) and as Poisson "
                                     "sampling would have (poisson); +Inf without noise.", ["sampling"], registry=r)
        for sampling in ("as_sampled", "poisson"):  # 0 until a DP round reports (and in a run without DP)
            self.privacy_epsilon.labels(sampling)
        self.gpu_jobs = Counter("fcl_gpu_jobs", "Server-side jobs of the GPU worker pool by kind and outcome "
                                "(ok, or failed after its retries).", ["kind", "outcome"], registry=r)
        self.gpu_job_duration = Histogram("fcl_gpu_job_duration_seconds", "Time of a job on its worker's "
                                          "device (the successful attempt, or the last one).", ["kind"],
                                          buckets=JOB_BUCKETS, registry=r)
        self.gpu_job_queue_wait = Histogram("fcl_gpu_job_queue_wait_seconds", "Time a job waited for a free "
                                            "worker, summed over its attempts.", ["kind"], buckets=JOB_BUCKETS,
                                            registry=r)
        self.gpu_queue = Gauge("fcl_gpu_queue_jobs", "Jobs waiting for a worker.", registry=r)
        self.gpu_workers = Gauge("fcl_gpu_workers", "GPU worker processes by state: starting, idle, busy, dead "
                                 "(without workers, the coordinator's job thread: idle or busy).", ["state"],
                                 registry=r)
        self.gpu_job_peak_memory = Gauge("fcl_gpu_job_peak_memory_bytes", "CUDA memory peak of the last job of "
                                         "each kind (CUDA workers only).", ["kind"], registry=r)
        for outcome in SECAGG_OUTCOMES:
            self.secagg_rounds.labels(outcome)
        for phase in SECAGG_PHASES:
            self.secagg_dropouts.labels(phase)
        for kind in JOIN_KINDS:
            self.client_joins.labels(kind)
        for reason in DROP_REASONS:
            self.client_drops.labels(reason)
        for reason in HANDSHAKE_REFUSALS:
            self.refused_handshakes.labels(reason)
        for outcome in ROUND_OUTCOMES:
            self.rounds.labels(outcome)
        for phase in ROUND_PHASES:
            self.phase_duration.labels(phase)
        for phase in TASK_END_PHASES:
            self.task_end_duration.labels(phase)
        self._handling: dict[str, Callable[[float], None]] = {}
        self._joins = {kind: self.client_joins.labels(kind).inc for kind in JOIN_KINDS}
        self._drops = {reason: self.client_drops.labels(reason).inc for reason in DROP_REASONS}

    # ------------------------------------------------------------- run start
    def run_started(self, *, run_id: str, method: str, dataset: str, model: str, seed: int, num_clients: int,
                    num_tasks: int, rounds_per_task: int, clients_per_round: int) -> None:
        self.run_info.info({"run_id": run_id, "method": method, "dataset": dataset, "model": model,
                            "seed": str(seed), "clients": str(num_clients), "tasks": str(num_tasks),
                            "rounds_per_task": str(rounds_per_task), "clients_per_round": str(clients_per_round)})
        self.clients_configured.set(num_clients)
        self.tasks.set(num_tasks)
        self.rounds_per_task.set(rounds_per_task)

    def watch_online(self, count: Callable[[], float]) -> None:
        """Read the number of online clients at scrape time (no cost when clients come and go)."""
        self.clients_online.set_function(count)

    # --------------------------------------------------------------- clients
    def client_joined(self, rejoin: bool = False) -> None:
        self._joins["rejoin" if rejoin else "first"]()

    def client_left(self) -> None:
        self.client_leaves.inc()

    def refused_handshake(self, reason: str) -> None:
        """A handshake the allow-list refused (called from the ZAP handler's thread)."""
        self.refused_handshakes.labels(reason).inc()

    def client_dropped(self, reason: str) -> None:
        self._drops[reason]()

    def edge_tier_bytes(self, direction: str, nbytes: int) -> None:
        self.tier_bytes.labels("client_edge", direction).inc(nbytes)

    def late_update(self) -> None:
        self.late_updates.inc()

    def energy(self, device_class: str, kind: str, joules: float) -> None:
        self.energy_joules.labels(device_class, kind).inc(joules)

    def battery_level(self, level: float) -> None:
        self.battery_levels.observe(level)

    def updates_applied(self, staleness: list[int]) -> None:
        """The staleness of each update an asynchronous aggregation applied."""
        for value in staleness:
            self.update_staleness.observe(value)

    def stale_update_discarded(self, reason: str, count: int = 1) -> None:
        self.stale_updates_discarded.labels(reason).inc(count)

    def handled(self, msg_type: str, seconds: float) -> None:
        """Hot path: once per received message."""
        try:
            add = self._handling[msg_type]
        except KeyError:
            add = self._handling[msg_type] = self.handling_seconds.labels(msg_type).inc
        add(seconds)

    # ---------------------------------------------------------------- rounds
    def round_started(self, task: int, task_round: int, number: int) -> None:
        self.task.set(task)
        self.task_round.set(task_round)
        self.round.set(number)

    def round_closed(self, *, duration_s: float, phases_s: Mapping[str, float], selected: int, participants: int,
                     missed_deadline: int, failed: int, skipped: bool, mean_loss: float | None,
                     accuracy_seen_percent: float | None, emulated_s: float | None = None,
                     emulated_clock_s: float | None = None, host_timeout: bool = False) -> None:
        self.rounds.labels("skipped" if skipped else "aggregated").inc()
        self.round_duration.observe(duration_s)
        if emulated_s is not None:
            self.round_emulated_duration.observe(emulated_s)
            self.emulated_clock.set(emulated_clock_s)
        if host_timeout:
            self.host_timeouts.inc()
        for phase, seconds in phases_s.items():
            self.phase_duration.labels(phase).observe(seconds)
        for state, n in (("selected", selected), ("participated", participants),
                         ("missed_deadline", missed_deadline), ("failed", failed)):
            self.round_clients.labels(state).set(n)
            self.client_rounds.labels(state).inc(n)
        if mean_loss is not None and math.isfinite(mean_loss):
            self.round_train_loss.set(mean_loss)
        if accuracy_seen_percent is not None:
            self.accuracy_seen.set(accuracy_seen_percent / 100.0)

    def secagg_round(self, *, outcome: str, dropouts: Mapping[str, int], recovered: int) -> None:
        self.secagg_rounds.labels(outcome).inc()
        for phase, n in dropouts.items():
            if n:
                self.secagg_dropouts.labels(phase).inc(n)
        if recovered:
            self.secagg_recovered_masks.inc(recovered)

    def watch_gpu_pool(self, queued: Callable[[], int], states: Callable[[], Mapping[str, int]]) -> None:
        """Read the pool's queue length and worker states at scrape time."""
        self.gpu_queue.set_function(queued)
        for state in GPU_WORKER_STATES:
            self.gpu_workers.labels(state).set_function(lambda state=state: states().get(state, 0))

    def gpu_job(self, kind: str, *, ok: bool, run_s: float, queue_s: float, peak_memory_bytes: float | None) -> None:
        self.gpu_jobs.labels(kind, "ok" if ok else "failed").inc()
        self.gpu_job_duration.labels(kind).observe(run_s)
        self.gpu_job_queue_wait.labels(kind).observe(queue_s)
        if peak_memory_bytes is not None:
            self.gpu_job_peak_memory.labels(kind).set(peak_memory_bytes)

    def task_ended(self, *, task: int, matrix: Sequence[Sequence[float | None]], accuracy_seen_percent: float,
                   average_accuracy: float, average_incremental_accuracy: float, average_forgetting: float,
                   phases_s: Mapping[str, float]) -> None:
        """After task ``task`` (``matrix``: the accuracy matrix so far, percent)."""
        for i, value in enumerate(matrix[task]):
            if value is not None:
                self.accuracy.labels(str(i)).set(value / 100.0)
        self.accuracy_seen.set(accuracy_seen_percent / 100.0)
        self.average_accuracy.set(average_accuracy / 100.0)
        self.average_incremental_accuracy.set(average_incremental_accuracy / 100.0)
        self.average_forgetting.set(average_forgetting / 100.0)
        for phase, seconds in phases_s.items():
            self.task_end_duration.labels(phase).observe(seconds)
        self.tasks_completed.inc()


class GpuWorkerMetrics(ProcessMetrics):
    """A GPU worker's metrics: whether it is running a job, its device memory, plus the wire (job traffic)
    and the process. The jobs themselves (kind, outcome, time) are counted by the coordinator."""

    def __init__(self, device: Any, registry: CollectorRegistry | None = None):
        super().__init__(ROLE_GPU_WORKER, registry)
        r = self.registry
        self.busy = Gauge("fcl_gpu_worker_busy", "1 while this worker runs a job, else 0.", registry=r)
        if getattr(device, "type", "cpu") == "cuda":
            import torch

            memory = Gauge("fcl_gpu_memory_allocated_bytes", "Device memory torch has allocated on this "
                           "worker's CUDA device.", ["device"], registry=r)
            memory.labels(str(device)).set_function(lambda: torch.cuda.memory_allocated(device))


class EdgeNodeMetrics(ProcessMetrics):
    """An edge node's metrics: its clients, local training, plus the wire (seen from the edge)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        super().__init__(ROLE_EDGE_NODE, registry)
        r = self.registry
        self.train_duration = Histogram("fcl_client_train_duration_seconds", "Wall-clock time of one client's "
                                        "local training job (data preparation, training, building the "
                                        "upload).", buckets=TRAIN_BUCKETS, registry=r)
        self.train_jobs = Counter("fcl_client_train_jobs", "Local training jobs by outcome: ok, no_data (the "
                                  "client holds no samples of the task), failed, cancelled (the client left or "
                                  "crashed before its turn, or the coordinator cancelled it: a job whose update "
                                  "could no longer count).", ["outcome"], registry=r)
        self.train_samples = Counter("fcl_client_train_samples", "Samples in the local datasets of finished "
                                     "training jobs.", registry=r)
        self.node_clients = Gauge("fcl_node_clients", "Emulated clients hosted here by state: joining (no "
                                  "welcome yet), active, away (off by its availability model), down (crashed, "
                                  "not restarted yet), closed (shut down).", ["state"], registry=r)
        self.train_queue = Gauge("fcl_node_train_queue_jobs", "Training jobs waiting for this node's trainer.",
                                 registry=r)
        self.client_events = Counter("fcl_node_client_events", "Edge events of this node's clients: leave and "
                                     "rejoin (availability model), crash and restart.", ["event"], registry=r)
        self.link_delay_seconds = Histogram(
            "fcl_link_delay_seconds", "Emulated link delay of a data message (queueing behind earlier "
            "messages, bytes / bandwidth, latency), by direction and device profile.", ["direction", "profile"],
            buckets=PHASE_BUCKETS, registry=r)
        self._train_outcome = {o: self.train_jobs.labels(o).inc for o in TRAIN_OUTCOMES}
        self._client_event = {e: self.client_events.labels(e).inc for e in CLIENT_EVENTS}

    def watch(self, clients: Iterable[Any], queue_size: Callable[[], int]) -> None:
        """Read client states (their ``status``) and the queue length at scrape time."""
        clients = list(clients)
        for state in NODE_CLIENT_STATES:
            self.node_clients.labels(state).set_function(lambda state=state: sum(c.status == state for c in clients))
        self.train_queue.set_function(queue_size)

    def client_event(self, event: str) -> None:
        self._client_event[event]()

    def link_profile(self, profile: str) -> None:
        """A client of this node got a link of ``profile``: its delay series exist from now on, at 0."""
        for direction in LINK_DIRECTIONS:
            self.link_delay_seconds.labels(direction, profile)

    def link_delay(self, direction: str, profile: str, seconds: float) -> None:
        self.link_delay_seconds.labels(direction, profile).observe(seconds)

    def trained(self, seconds: float, outcome: str, samples: int = 0) -> None:
        if outcome == "cancelled":
            self._train_outcome[outcome]()
            return
        self.train_duration.observe(seconds)
        self._train_outcome[outcome]()
        if samples:
            self.train_samples.inc(samples)
