"""Run directory, event log and summary (``RunSummary``, the record of summary.json), and the FCIL metric
definitions.

Definitions (also in docs/metrics.md). ``A[t][i]`` is the accuracy (percent)
of the global model after task ``t`` on the test samples of task ``i``'s
classes, predicting over all classes seen so far (class-incremental: no task
identity at test time). Entries with ``i > t`` are ``null``.

- ``average_accuracy``: mean of the last row, ``1/T sum_i A[T-1][i]``.
- ``average_incremental_accuracy``: mean over ``t`` of the mean of row ``t``
  over tasks ``0..t`` (Rebuffi et al., iCaRL, 2017).
- ``learned_accuracy[t]``: ``A[t][t]``, each task's accuracy right after it
  was learned (the learnability gate of docs/reproduction.md reads it).
- ``average_incremental_accuracy`` is the time-averaged accuracy MFCL and
  GLFC report ("Avg."): theirs weighs each row by its test samples, which is
  the same on equal-sized tasks.
- ``average_forgetting``: mean over tasks ``i < T-1`` of
  ``max_{t < T-1} A[t][i] - A[T-1][i]`` (Chaudhry et al., 2018); 0 for one task.
- ``accuracy_seen[t]`` (FedCBC's global accuracy GA after task ``t``): accuracy
  on all test samples of the classes seen up to ``t``.
- ``knowledge_retention.temporal`` (KR_t): mean over tasks ``i < T-1`` of
  ``A[T-1][i] / max_t A[t][i]`` (percent): how much of the best the global
  model ever knew of a task is left at the end (100: nothing forgotten).
- ``knowledge_retention.spatial`` (KR_s): mean over clients ``k`` of the
  final accuracy on the test samples of the classes ``S_k`` that client
  ``k`` trained on: how much of every client's knowledge the global model
  holds; ``knowledge_retention.private`` is the final accuracy on the
  classes only one client trained on (``None`` if there are none).
- ``accuracy_clients[t]`` (AF-FCL's accuracy, its code's ``evaluate_all_``):
  every client that has joined by ``t`` scores the global model on the test
  samples of each of its tasks ``0..t``'s classes; correct predictions over
  samples summed over all those (client, task) test sets, so a class held by
  more clients weighs more.

Entries of ``A`` for a task that introduced no class (clients on their own
task sequences) are ``None`` and left out of every mean. FedCBC's paper
defines GA, KR_t and KR_s (its eq. 8-9); its text was not available here, so
KR_t and KR_s are the project's definitions of the same ideas (docs/metrics.md).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np


def average_accuracy(matrix: list[list[float | None]]) -> float:
    last = [a for a in matrix[-1] if a is not None]
    return float(np.mean(last)) if last else float("nan")


def average_incremental_accuracy(matrix: list[list[float | None]]) -> float:
    rows = [np.mean([a for a in row[: t + 1] if a is not None]) for t, row in enumerate(matrix)]
    return float(np.mean(rows)) if rows else float("nan")


def learned_accuracy(matrix: list[list[float | None]]) -> list[float | None]:
    return [row[t] for t, row in enumerate(matrix)]


def average_forgetting(matrix: list[list[float | None]]) -> float:
    if len(matrix) < 2:
        return 0.0
    final = matrix[-1]
    drops = []
    for i in range(len(matrix) - 1):
        if final[i] is not None:
            drops.append(max(matrix[t][i] for t in range(i, len(matrix) - 1)) - final[i])
    return float(np.mean(drops)) if drops else 0.0


def temporal_retention(matrix: list[list[float | None]]) -> float | None:
    """KR_t (percent): mean over tasks ``i < T-1`` of ``A[T-1][i] / max_t A[t][i]``, over tasks that introduced
    classes and were learned at some point; ``None`` with fewer than two tasks."""
    ratios = []
    for i in range(len(matrix) - 1):
        best = max((row[i] for row in matrix[i:] if row[i] is not None), default=0.0)
        if best > 0:
            ratios.append(matrix[-1][i] / best)
    return 100.0 * float(np.mean(ratios)) if ratios else None


def spatial_retention(hits: np.ndarray, totals: np.ndarray,
                      client_classes: list[np.ndarray]) -> dict[str, float | None]:
    """KR_s and the accuracy on private classes (percent) from the final model's correct predictions and test
    samples per class (``hits``, ``totals``, index = incremental label) and the classes each client trained on.
    Clients that trained on nothing are left out."""
    def accuracy(classes: np.ndarray) -> float:
        return 100.0 * float(hits[classes].sum()) / float(totals[classes].sum())

    held = [c[totals[c] > 0] for c in client_classes if len(c)]
    owners = np.bincount(np.concatenate(held + [np.empty(0, np.int64)]), minlength=len(totals))
    private = np.flatnonzero((owners == 1) & (totals > 0))
    return {"spatial": float(np.mean([accuracy(c) for c in held if len(c)])) if held else None,
            "private": accuracy(private) if len(private) else None}


def client_test_accuracy(hits: np.ndarray, totals: np.ndarray,
                         client_task_classes: list[list[np.ndarray]]) -> float | None:
    """``accuracy_clients`` (percent) from the model's correct predictions and test samples per class (``hits``,
    ``totals``, index = incremental label) and, per client, the classes of each of its tasks so far: correct over
    samples summed over every (client, task) test set. ``None`` when no client has trained on a class yet."""
    correct = samples = 0
    for tasks in client_task_classes:
        for classes in tasks:
            correct += int(hits[classes].sum())
            samples += int(totals[classes].sum())
    return 100.0 * correct / samples if samples else None


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed over it: ``path`` holds the old text or the new,
    never part of it. A failed write (a full disk, say) removes the temporary file and raises an
    :class:`OSError` naming ``path``."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise _naming(exc, path)


def _naming(exc: OSError, path: Path) -> OSError:
    """``exc``, naming ``path`` if it names no file (a failed write names none)."""
    exc.filename = exc.filename or str(path)
    return exc


def failure_status(exc: BaseException) -> str:
    """The status of a run that ``exc`` ended: ``failed: disk full (PATH)`` for a write that found no space left
    (or the user's quota spent), else ``failed: TYPE: MESSAGE``."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"failed: disk full ({exc.filename})" if exc.filename else "failed: disk full"
    return f"failed: {type(exc).__name__}: {exc}"


class SummaryNotWritten(Exception):
    """summary.json could not be written: the run's ``status`` can only be printed. A run that had completed
    until then is failed (its results are not recorded)."""

    def __init__(self, status: str, error: OSError):
        self.status = failure_status(error) if status == "completed" else status
        super().__init__(f"{error.filename} could not be written: {error.strerror or error}")


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _cut_partial_line(path: Path) -> None:
    """Truncate ``path`` after its last newline (events.jsonl holds one short line per round)."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end != len(data):
        with open(path, "rb+") as f:
            f.truncate(end)


@dataclass
class RoundRecord:
    task: int
    round: int  # global round index
    task_round: int
    selected: int
    participants: int
    late: int
    failed: int
    skipped: bool
    samples: int
    mean_loss: float | None
    accuracy_seen: float | None
    duration_s: float
    coordinator_cpu_s: float  # CPU time of the coordinator process in the round, evaluation excluded
    phases_s: dict[str, float]
    bytes_sent: int
    bytes_received: int
    bytes_by_type: dict[str, dict[str, int]]  # {message type: {"sent"/"received": bytes}} in this round
    online: int
    dropped: int = 0  # selected clients that left, died or restarted before answering
    # CPU time of the coordinator's main thread in select, dispatch and aggregate and in receiving and handling the
    # round's updates: its own work in the round (selecting, encoding, sending, receiving, decoding, checking,
    # aggregating), without ZeroMQ's I/O threads and the heartbeats and joins served meanwhile
    work_cpu_s: float = 0.0
    overcommitted: int = 0  # clients selected beyond clients_per_round (rounds.overcommit)
    stale_used: int = 0  # late updates of earlier rounds aggregated in this one (rounds.late_updates)
    secagg: dict[str, Any] | None = None  # secure aggregation: outcome, parameters, phase times, dropouts
    client_metrics: dict[str, float] | None = None  # mean of the method metrics the participants reported
    # device profiles: mean local training seconds per class (emulated clock: the profiles' compute time)
    train_s_by_class: dict[str, float] | None = None
    emulated_s: float | None = None  # emulated clock: the round's emulated duration (None: --clock real)
    emulated_clock_s: float | None = None  # emulated clock: the run's emulated time at the round's close
    host_timeout: bool = False  # emulated clock: closed by rounds.host_timeout_s with clients still working
    # emulated clock: bytes received from clients that left or crashed (in emulated time) before their upload
    # would have arrived; the host received them (they are in bytes_received), the federation would not have
    bytes_discarded: int = 0
    # emulated clock: trainings of this round cancelled because their update could no longer count, and the host
    # CPU seconds that saved (an estimate: their samples at the run's measured CPU time per sample)
    skipped_trainings: int = 0
    host_cpu_saved_s: float = 0.0
    # central DP (coordinator/privacy.py) after this round: epsilon for delta as Poisson-sampled and as sampled
    # (None without noise), noised rounds so far, the clip norm the last one used, the noise's standard deviation on
    # its mean, the next clip norm
    privacy: dict[str, Any] | None = None
    eligible: int | None = None  # synchronous rounds: the eligible online clients its cohort was drawn from
    # plain rounds: the clients whose own update of this round was aggregated (skipped round: none; secure: None)
    contributors: list[str] | None = None
    # emulated clock, device classes with power figures: joules [compute, radio] of each client the round (an
    # asynchronous aggregation: its dispatch waves) dispatched; clients that sat out for a low battery
    energy_j: dict[str, list[float]] | None = None
    low_battery: int = 0
    # why this round's model looks diverged (NaN or infinite values in it, or the clients' median training loss
    # non-finite or exploded; coordinator/round_record.py), else None
    diverged: str | None = None
    # edge aggregators: bytes on the clients' links to their aggregators in this round, {"sent"/"received": bytes}
    # as the aggregators reported them (the record's other bytes are the coordinator's: the edge-to-cloud tier)
    client_edge_bytes: dict[str, int] | None = None
    # edge aggregators: each asked one's clients ({"asked", "taken", "refused": by it, "missing": left out}) and,
    # where its aggregate was not taken, why ("outcome": a refusal's reason, "no answer", "unreachable")
    edge_aggregates: dict[str, dict[str, Any]] | None = None


# ------------------------------------------------------------------ summary.json
class SummaryPart(msgspec.Struct, frozen=True):
    """A nested object of ``summary.json``. Fields that older runs lack have defaults, so their files load.

    msgspec structs, like the wire's messages: reading a file checks every value's type and names the field at
    fault (``$.clients.joined``), and writing gives the fields in their order with the values as they are."""


class KnowledgeRetention(SummaryPart):
    """KR_t, KR_s and the accuracy on private classes (percent); None where a run cannot measure them."""

    temporal: float | None = None
    spatial: float | None = None
    private: float | None = None


class TimeAccounting(SummaryPart):
    """Where the coordinator's wall clock went (after a resume: since it resumed)."""

    wall_s: float
    parts_s: dict[str, float] = {}  # start, join, task_start, rounds, task_end, task_evaluation, checkpoints, ...
    accounted: float | None = None  # the fraction of wall_s the parts cover


class Liveness(SummaryPart):
    """The heartbeat interval the clients were given and the liveness timeout, after stretching."""

    heartbeat_interval_s: float
    liveness_timeout_s: float


class Clients(SummaryPart):
    """Client counts over the run."""

    configured: int = 0
    joined: int = 0  # distinct clients
    rejoined: int = 0
    left: int = 0  # graceful leave
    dropped: int = 0  # declared dead
    online_at_end: int = 0
    switched_connection: int = 0  # messages from a client over another connection than its last one


class SecAggTotals(SummaryPart):
    """Secure aggregation over the run: rounds by outcome, seconds and dropouts per phase (summed)."""

    completed: int = 0
    aborted: int = 0
    phase_s: dict[str, float] = {}
    dropouts: dict[str, int] = {}


class JobTotals(SummaryPart):
    """Server-side jobs of one kind: how many, how many failed, attempts, seconds queued and run."""

    jobs: int = 0
    failed: int = 0
    attempts: int = 0
    queue_s: float = 0.0
    run_s: float = 0.0


class GpuJobs(SummaryPart):
    """The GPU worker pool and its jobs by kind."""

    workers: int
    device: str
    by_kind: dict[str, JobTotals] = {}


class Checkpoints(SummaryPart):
    """Checkpoints saved, seconds spent on them in total, bytes of the latest."""

    saved: int = 0
    seconds: float = 0.0
    bytes: int = 0


class EnergyMark(SummaryPart):
    """The joules all clients had spent when the accuracy on the seen classes first reached ``accuracy``."""

    accuracy: int  # percent, a multiple of 10
    joules: float
    round: int


class EnergyTotals(SummaryPart):
    """The clients' energy over the run (emulated clock, docs/devices.md): joules in all, by kind (compute, radio)
    and by device class; battery levels (fractions) at the end; energy to each 10-point accuracy mark."""

    total: float
    by_kind: dict[str, float]
    by_device_class: dict[str, dict[str, float]]
    battery_at_end: dict[str, float] | None = None  # min and mean level of the batteries followed
    sitting_out_at_end: int = 0  # clients below edge.min_battery at the end
    sat_out_rounds: int = 0  # rounds x clients that sat out for a low battery
    to_accuracy: list[EnergyMark] = []


def energy_text(energy: EnergyTotals) -> str:
    """``12.3 kJ (18 %)``: the clients' energy and its compute share, as summaries print it."""
    share = energy.by_kind.get("compute", 0.0) / energy.total if energy.total else 0.0
    return f"{energy.total / 1000:.1f} kJ ({100 * share:.0f} %)"


class Privacy(SummaryPart):
    """Central differential privacy over the run: its settings, the rounds that released a noised mean, and the
    epsilon spent for ``delta`` (None without noise: no guarantee), as the accountant composed them."""

    mode: str
    noise_multiplier: float
    clip: float  # the clip norm of the last noised round (adaptive clipping: where it ended)
    adaptive: bool
    sampling_rate: float
    steps: int
    delta: float
    epsilon: float | None  # as Poisson sampling at sampling_rate would have spent it (the papers' analyses)
    accountant: str = "rdp"
    # as the rounds sampled: a fixed cohort from each round's eligible clients (the figure that holds; None without
    # noise, or for a run from before the rounds recorded their pool)
    epsilon_sampled: float | None = None


def epsilon_text(privacy: Privacy) -> str:
    """``3.81 as sampled; 2.55 if Poisson-sampled (1e-05)``: the epsilon a DP run spent for its delta, as summaries
    print it (the first holds); ``inf`` without noise; the Poisson figure alone for a run without its rounds'
    pools."""
    if privacy.epsilon is None:
        return f"inf (no noise: no guarantee) ({privacy.delta:g})"
    if privacy.epsilon_sampled is None:
        return f"{privacy.epsilon:.2f} if Poisson-sampled ({privacy.delta:g})"
    return f"{privacy.epsilon_sampled:.2f} as sampled; {privacy.epsilon:.2f} if Poisson-sampled ({privacy.delta:g})"


class LinkTraffic(SummaryPart):
    """Bytes one kind of link carried: ``down`` towards the clients, ``up`` towards the coordinator."""

    down: int = 0
    up: int = 0

    @property
    def total(self) -> int:
        return self.down + self.up


class LinkBytes(SummaryPart):
    """Bytes as the links saw them. ``coordinator``: the coordinator's own links (to its edge aggregators; in a
    star, to each client); ``clients``: the clients' links (to their edge aggregator, as the aggregators report
    them; in a star they are the coordinator's). ``tiers``: 1 in a star, 2 under edge aggregators."""

    coordinator: LinkTraffic
    clients: LinkTraffic
    tiers: int = 1


def link_bytes(bytes_by_type: dict[str, dict[str, int]], tier_bytes: dict[str, dict[str, int]]) -> LinkBytes:
    """:class:`LinkBytes` from summary.json's ``bytes`` (a star) or ``tier_bytes`` (edge aggregators)."""
    if not tier_bytes:  # every client's link is one of the coordinator's, each message counted whole
        star = LinkTraffic(down=sum(d.get("sent", 0) for d in bytes_by_type.values()),
                           up=sum(d.get("received", 0) for d in bytes_by_type.values()))
        return LinkBytes(coordinator=star, clients=star)
    coordinator, clients = tier_bytes["edge_cloud"], tier_bytes["client_edge"]
    return LinkBytes(coordinator=LinkTraffic(down=coordinator.get("sent", 0), up=coordinator.get("received", 0)),
                     clients=LinkTraffic(down=clients.get("sent", 0), up=clients.get("received", 0)), tiers=2)


def link_rows(summary: RunSummary) -> list[tuple[str, LinkTraffic | None]]:
    """The run's bytes as summaries print them, (name, link): one row in a star, ``bytes on the wire``; under edge
    aggregators one per tier, ``bytes at the coordinator`` and ``bytes on clients' links``. A run whose links are
    not known (partial: no summary.json) gives ``bytes counted at the coordinator`` without a link."""
    links = summary.link_bytes
    if links is None:
        return [("bytes counted at the coordinator", None)]
    if links.tiers == 1:
        return [("bytes on the wire", links.coordinator)]
    return [("bytes at the coordinator", links.coordinator), ("bytes on clients' links", links.clients)]


def link_text(link: LinkTraffic | None, bytes_total: int) -> str:
    """``27.3 MB (13.6 down, 13.7 up)``; ``bytes_total`` in MB where the link is not known."""
    if link is None:
        return f"{bytes_total / 1e6:.1f} MB"
    return f"{link.total / 1e6:.1f} MB ({link.down / 1e6:.1f} down, {link.up / 1e6:.1f} up)"


class RunSummary(SummaryPart, kw_only=True):
    """``summary.json``: results, costs and counts of a finished or ended run (keys: docs/metrics.md).

    The field order is the file's key order. ``status``, ``method``, ``dataset``, ``accuracy_matrix``,
    ``bytes_total``, ``rounds`` and ``wall_clock_s`` are in every summary.json ever written; the rest
    have defaults for the files of older runs."""

    status: str
    run_id: str | None = None
    run_dir: str | None = None
    method: str
    method_options: dict[str, Any] = {}
    dataset: str
    model: str | None = None
    scenario: dict[str, Any] = {}
    seed: int | None = None
    overlapping_shares: str | None = None  # clients sharing samples (scenario.overlapping_shares_text); None: none
    accuracy_matrix: list[list[float | None]]
    accuracy_seen: list[float] = []
    accuracy_all: list[float] = []
    accuracy_clients: list[float | None] = []
    average_accuracy: float | None = None
    average_incremental_accuracy: float | None = None
    average_forgetting: float | None = None
    learned_accuracy: list[float | None] = []
    knowledge_retention: KnowledgeRetention = KnowledgeRetention()
    bytes: dict[str, dict[str, int]] = {}  # {message type: {"sent"/"received": bytes}}
    messages: dict[str, int] = {}  # {"type/direction": count}
    bytes_total: int
    rounds: int
    rounds_skipped: int = 0
    wall_clock_s: float
    clock: str | None = None  # "emulated" or "real"; None: a run from before the emulated clock
    emulated_s: float | None = None  # emulated clock: what the federation would have taken
    host_timeouts: int = 0
    bytes_discarded: int = 0
    skipped_trainings: int = 0  # emulated clock: trainings cancelled as too late to count (docs/edge.md)
    host_cpu_saved_s: float = 0.0  # the host CPU seconds that saved (an estimate)
    time: TimeAccounting | None = None
    phase_s: dict[str, float] = {}
    handling_s: dict[str, float] = {}
    liveness: Liveness | None = None
    clients: Clients | None = None
    missed_deadline: int = 0
    late_updates: int = 0
    late_side_channel: int = 0
    rejected_messages: dict[str, int] = {}
    # CurveZMQ handshakes the allow-list refused, by reason, since the coordinator started (a resumed run counts
    # its last session's); None: a plain-TCP run, or a run from before they were recorded
    refused_handshakes: dict[str, int] | None = None
    rejected_gpu_pool: dict[str, int] = {}  # messages the GPU pool's socket refused, by reason
    secagg: SecAggTotals | None = None  # None: a run without --secagg
    gpu_jobs: GpuJobs | None = None
    resumes: int = 0
    checkpoints: Checkpoints | None = None
    privacy: Privacy | None = None  # None: a run without differential privacy
    edge_node_hosts: dict[str, str] = {}  # edge node -> the host it ran on (nodes started by `up`)
    energy_joules: EnergyTotals | None = None  # None: no device class with power figures, or the real clock
    # --edge-aggregators: bytes on each tier's links, {tier: {"sent"/"received": bytes}} seen from the tier's upper
    # end: "edge_cloud" (the coordinator's, as ``bytes``) and "client_edge" (the aggregators' reports); {}: a star
    tier_bytes: dict[str, dict[str, int]] = {}
    # bytes per kind of link and direction (``link_bytes``; a file without it gets it from ``bytes`` and
    # ``tier_bytes`` on loading); None: not known (a partial run, read from its events)
    link_bytes: LinkBytes | None = None

    @property
    def completed(self) -> bool:
        return self.status == "completed"

    @property
    def exit_code(self) -> int:
        """The command's exit code for this run: 0 completed; 128 + the signal's number for a run a signal
        interrupted (``interrupted: SIGTERM`` -> 143, Ctrl-C -> 130); 1 otherwise."""
        if self.completed:
            return 0
        kind, _, detail = self.status.partition(": ")
        if kind == "interrupted":
            return 128 + getattr(signal.Signals, detail or "SIGINT", signal.SIGINT).value
        return 1

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of summary.json (numpy numbers as Python numbers)."""
        return msgspec.to_builtins(self, enc_hook=_json_default)

    def write(self, path: Path) -> None:
        write_json_atomic(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: Any) -> RunSummary:
        """The record of a summary.json object; ``msgspec.ValidationError`` names the field at fault. A file from
        before ``link_bytes`` gets it from its ``bytes`` and ``tier_bytes``."""
        summary = msgspec.convert(data, cls)
        if summary.link_bytes is None and (summary.bytes or summary.tier_bytes):
            summary = msgspec.structs.replace(summary, link_bytes=link_bytes(summary.bytes, summary.tier_bytes))
        return summary

    @classmethod
    def load(cls, path: Path) -> RunSummary:
        """Read a summary.json (``OSError``, ``ValueError`` for text that is not JSON, ``msgspec.ValidationError``)."""
        return cls.from_dict(json.loads(Path(path).read_text()))


class RunRecorder:
    """Owns the run directory: config.yaml, events.jsonl, summary.json."""

    def __init__(self, run_dir: Path, config_yaml: str | None, elapsed_s: float = 0.0):
        """``config_yaml`` None continues a run (``--resume``): config.yaml stays as it is, a last line of
        events.jsonl cut short by a crash is removed, and event times go on from ``elapsed_s``."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        events = self.run_dir / "events.jsonl"
        if config_yaml is not None:
            (self.run_dir / "config.yaml").write_text(config_yaml)
        elif events.exists():
            _cut_partial_line(events)
        self._events = open(events, "a", buffering=1)
        self._lock = threading.Lock()  # events also come from the fault injector's thread
        self._lost = False  # a write of events.jsonl failed (a full disk, say): the run is ending
        self.started = time.time() - elapsed_s

    def event(self, kind: str, /, **fields: Any) -> None:
        """Append an event; the first that cannot be written raises an :class:`OSError` naming events.jsonl, and
        the later ones (while the run ends) are dropped."""
        record = {"event": kind, "time": self.elapsed(), **fields}
        line = json.dumps(record, default=_json_default) + "\n"
        with self._lock:
            if self._lost:
                return
            try:
                self._events.write(line)
            except OSError as exc:
                self._lost = True
                raise _naming(exc, Path(self._events.name))

    def elapsed(self) -> float:
        """Seconds since the run started (resumed runs go on from their elapsed time): every event's ``time``."""
        return round(time.time() - self.started, 4)

    def round(self, record: RoundRecord) -> None:
        self.event("round", **asdict(record))

    def summary(self, summary: RunSummary) -> Path:
        """Write summary.json; :class:`SummaryNotWritten` if it cannot be written."""
        path = self.run_dir / "summary.json"
        try:
            summary.write(path)
        except OSError as exc:
            raise SummaryNotWritten(summary.status, exc) from exc
        return path

    def close(self) -> None:
        """Close events.jsonl; once a write has failed, what could not be written is lost without a second error."""
        try:
            self._events.close()
        except OSError:
            if not self._lost:
                raise
