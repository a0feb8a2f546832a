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

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import zmq

from coordinator.evaluation import Evaluator
from coordinator.registry import ClientRegistry
from coordinator.results import (RoundRecord, RunRecorder, average_accuracy, average_forgetting,
                                 average_incremental_accuracy)
from fcl_emu.config import RunConfig
from methods import registry as methods
from methods.base import DELTA, ClientUpdate, ServerContext
from methods.models.classifier import build_model
from monitoring.metrics import CoordinatorMetrics
from scenario.datasets import load_dataset
from scenario.scenario import build_scenario
from wire.framing import Limits, Message, WireError
from wire.messages import Error, Shutdown, TaskStart, TrainRequest, Welcome
from wire.sockets import Counters, ServerEndpoint, tee

log = logging.getLogger("fcl_emu.coordinator")

CLIENT_TYPES = frozenset({"join", "heartbeat", "leave", "update", "error"})


class RunAborted(RuntimeError):
    """The run cannot go on (for example: not enough clients joined)."""


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
    updates: list[ClientUpdate] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)

    def pending(self, online: Callable[[str], bool]) -> set[str]:
        done = {u.client for u in self.updates} | self.failed
        return {c for c in self.selected - done if online(c)}


ProgressHook = Callable[[str, dict], None]


class Coordinator:
    def __init__(self, config: RunConfig, *, context: zmq.Context | None = None,
                 progress: ProgressHook | None = None):
        self.config = config
        self.progress = progress or (lambda kind, info: None)
        self.device = resolve_device(config.device)
        self.dataset = load_dataset(config.scenario.dataset, config.data_root, download=config.download)
        self.scenario = build_scenario(config.scenario, self.dataset)
        self.spec = methods.get(config.method)
        options = config.method_options_model()
        torch.manual_seed(config.seed)
        self.server = self.spec.server(ServerContext(
            options=options, scenario=self.scenario, build_model=self._build_model, seed=config.seed))
        self.evaluator = Evaluator(self.scenario, self.device)
        self.registry = ClientRegistry(config.network.liveness_timeout_s)
        self.counters = Counters.empty()
        # Prometheus metrics (served only when asked: ``metrics.serve``, see fcl_emu/run.py)
        self.metrics = CoordinatorMetrics()
        self.metrics.watch_online(lambda: self.registry.online_count)
        self.context = context or zmq.Context.instance()
        self.endpoint = ServerEndpoint(self.context, config.network.bind,
                                       limits=Limits(max_total_bytes=config.network.max_message_bytes),
                                       count=tee(self.counters, self.metrics.count_message))
        self.address = self.endpoint.address
        self.rng = np.random.default_rng(config.seed)
        self.run_id = uuid.uuid4().hex[:12]
        self.rejected: Counter[str] = Counter()
        self.handling_s: Counter[str] = Counter()  # time spent receiving+handling, by message type
        self._logged: set[str] = set()
        self.late_updates = 0
        self._round: _Round | None = None
        self._task = 0
        self._global_round = 0
        self._welcome_template = dict(
            run_id=self.run_id,
            scenario=config.scenario.model_dump(mode="json"),
            method=config.method,
            method_options=options.model_dump(mode="json"),
            model=config.model,
            training={**config.training.model_dump(), "seed": config.seed, "device": config.device},
            heartbeat_interval_s=config.network.heartbeat_interval_s,
        )

    def _build_model(self, num_classes: int):
        return build_model(self.config.model, self.dataset.input_shape, num_classes)

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

    def _send(self, client_id: str, msg_type: str, body, **kw) -> bool:
        """Send; a vanished peer (EHOSTUNREACH under ROUTER_MANDATORY) is declared dead."""
        try:
            self.endpoint.send(client_id, msg_type, body, **kw)
            return True
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
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
            raise WireError("unknown_sender", f"{msg.type!r} from a client that has not joined")
        self.registry.touch(peer)
        if msg.type == "leave":
            if self.registry.leave(peer):
                self.metrics.client_left()
            self.progress("leave", {"client": peer})
        elif msg.type == "update":
            self._on_update(peer, msg)
        elif msg.type == "error":
            r = self._round
            if r is not None and peer in r.selected and msg.round == r.number:
                r.failed.add(peer)
            log.warning("client %s reported %s: %s", peer, msg.body.code, msg.body.detail)

    def _on_join(self, peer: str, msg: Message) -> None:
        index = msg.body.client_index
        if not 0 <= index < self.config.scenario.num_clients:
            raise WireError("unknown_sender",
                            f"client index {index} outside 0..{self.config.scenario.num_clients - 1}")
        join_task = self.scenario.join_task(index)
        known = peer in self.registry.records
        was_online = self.registry.is_online(peer)
        record = self.registry.join(peer, index, msg.body.node, join_task)
        if not known:
            self.metrics.client_joined()
        elif not was_online:
            self.metrics.client_joined(rejoin=True)
        self._send(peer, "welcome", Welcome(join_task=join_task, **self._welcome_template),
                   task=self._task, round=self._global_round)
        self.progress("join", {"client": peer, "index": record.index})

    def _on_update(self, peer: str, msg: Message) -> None:
        r = self._round
        if r is None or msg.round != r.number or peer not in r.selected:
            self.late_updates += 1
            self.metrics.late_update()
            return
        if peer in {u.client for u in r.updates} | r.failed:
            raise WireError("unexpected", f"second update from {peer} in round {r.number}")
        self._check_delta(msg)
        body = msg.body
        r.updates.append(ClientUpdate(peer, body.num_samples, msg.tensors, body.loss))
        self.registry.records[peer].rounds_trained += 1

    def _check_delta(self, msg: Message) -> None:
        """A delta must name exactly the global model's tensors with their shapes."""
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

    def serve(self, until: Callable[[], bool], deadline: float) -> None:
        """Handle messages until ``until()`` holds or the monotonic ``deadline`` passes."""
        sock = self.endpoint.sock
        tick_ms = max(10, int(1000 * min(0.2, self.config.network.heartbeat_interval_s)))
        while not until():
            now = time.monotonic()
            if now >= deadline:
                return
            if sock.poll(min(tick_ms, int(1000 * (deadline - now)) + 1)):
                while sock.poll(0):
                    self._receive_one()
            for client_id in self.registry.expire():
                self.metrics.client_dropped("heartbeat_timeout")
                self.progress("dead", {"client": client_id})

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
        eligible = self.registry.eligible(task)
        k = min(cfg.clients_per_round, len(eligible))
        chosen = [eligible[i].client_id for i in sorted(self.rng.choice(len(eligible), size=k, replace=False))]
        self._global_round += 1
        r = _Round(task, self._global_round, set(chosen))
        self._round = r
        self.metrics.round_started(task, task_round, r.number)

        t0 = time.perf_counter()
        assets = self.server.task_assets(task) if any(
            self.registry.records[c].assets_task != task for c in chosen) else {}
        payload = self.server.round_tensors(task, r.number)
        seen = [int(c) for c in self.scenario.seen_classes(task)]
        classes = [int(c) for c in self.scenario.task_classes(task)]
        request = TrainRequest(local_epochs=self.config.training.local_epochs, lr=self.config.training.lr)
        for client_id in chosen:
            record = self.registry.records[client_id]
            if record.assets_task != task:
                if not self._send(client_id, "task_start", TaskStart(classes=classes, seen_classes=seen),
                                  task=task, round=r.number, tensors=assets):
                    continue
                record.assets_task = task
            self._send(client_id, "train_request", request, task=task, round=r.number, tensors=payload)
        t_dispatch = time.perf_counter() - t0

        t0, handled_before = time.perf_counter(), self.handling_s["update"]
        self.serve(lambda: not r.pending(self.registry.is_online), time.monotonic() + cfg.deadline_s)
        t_wait = time.perf_counter() - t0
        t_updates = self.handling_s["update"] - handled_before
        self._round = None
        late = len(r.pending(self.registry.is_online))

        t0 = time.perf_counter()
        useful = [u for u in r.updates if u.num_samples > 0]
        skipped = len(useful) < cfg.min_participants
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
        losses = [u.loss for u in useful if np.isfinite(u.loss)]
        record = RoundRecord(
            task=task, round=r.number, task_round=task_round, selected=len(chosen),
            participants=len(r.updates), late=late, failed=len(r.failed), skipped=skipped,
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

    def _bytes_since(self, before: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
        """Bytes on the wire since ``before`` (a copy of the counters), as ``{type: {direction: bytes}}``."""
        out: dict[str, dict[str, int]] = {}
        for (msg_type, direction), n in self.counters.bytes.items():
            delta = n - before.get((msg_type, direction), 0)
            if delta:
                out.setdefault(msg_type, {})[direction] = delta
        return out

    # ---------------------------------------------------------------------- run
    def run(self, run_dir: Path) -> dict:
        recorder = RunRecorder(run_dir, self.config.to_yaml())
        started = time.perf_counter()
        matrix: list[list[float | None]] = []
        rounds: list[RoundRecord] = []
        status = "completed"
        try:
            self.metrics.run_started(
                run_id=self.run_id, method=self.config.method, dataset=self.config.scenario.dataset,
                model=self.config.model, seed=self.config.seed, num_clients=self.config.scenario.num_clients,
                num_tasks=self.scenario.num_tasks, rounds_per_task=self.config.rounds.rounds_per_task,
                clients_per_round=self.config.rounds.clients_per_round)
            self._wait_for_clients()
            recorder.event("start", run_id=self.run_id, address=self.address, online=len(self.registry.online()))
            for task in range(self.scenario.num_tasks):
                self._task = task
                self.server.start_task(task)
                self.progress("task_start", {"task": task, "classes": len(self.scenario.task_classes(task))})
                for task_round in range(self.config.rounds.rounds_per_task):
                    record = self._run_round(task, task_round, recorder)
                    rounds.append(record)
                    self.progress("round", asdict(record))
                t0 = time.perf_counter()
                self.server.end_task(task)
                t_end_task = time.perf_counter() - t0
                row = self.evaluator.accuracy_per_task(self.server.eval_model(), task)
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
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        except RunAborted as exc:
            status = f"aborted: {exc}"
            raise
        finally:
            self._shutdown(status)
            summary = self._summary(matrix, rounds, time.perf_counter() - started, status, recorder.run_dir)
            recorder.summary(summary)
            recorder.event("end", status=status)
            recorder.close()
        return summary

    def _seen_accuracy(self, row: list[float], task: int) -> float:
        counts = [len(self.scenario.test_indices(self.scenario.task_classes(t))) for t in range(task + 1)]
        return float(np.average(row, weights=counts))

    def _shutdown(self, reason: str) -> None:
        for record in self.registry.online():
            self._send(record.client_id, "shutdown", Shutdown(reason=reason))

    def _summary(self, matrix, rounds: list[RoundRecord], wall: float, status: str, run_dir: Path) -> dict:
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
            "rejected_messages": dict(self.rejected),
        }

    def close(self) -> None:
        self.endpoint.close()
        self.metrics.close()
