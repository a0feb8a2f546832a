"""The round engine: one round of federated training, its phases top to bottom in :meth:`RoundEngine._run_round`.

1. select: sample ``ceil(clients_per_round x overcommit)`` of the eligible online clients (seeded; under the
   emulated clock, online at the round's emulated start);
2. dispatch: send each a ``task_start`` with the method's per-task assets if it has not had this task's assets
   yet (and a ``secagg_setup`` in a secure round), then a ``train_request`` with the global model;
3. collect: serve the socket until ``clients_per_round`` updates arrived, every selected client answered or
   died (missed heartbeats, or its socket is gone), or the round deadline passed (a secure round runs the
   SecAgg+ phases meanwhile, :mod:`coordinator.secure_round`). Under the emulated clock: until every
   selected client answered or died (or ``host_timeout_s``), then close the round in emulated time
   (:mod:`coordinator.emulated`): who made the deadline, who is late, who left or crashed;
4. aggregate: if at least ``min_participants`` updates arrived (with late updates kept from the round before,
   under ``rounds.late_updates: next_round``), through the method's server part; otherwise skip the round;
5. evaluate: every ``eval_every`` rounds (a task's last round is evaluated at task end);
6. record: the :class:`~monitoring.results.RoundRecord` in ``events.jsonl`` and in the Prometheus metrics.

A mixin of :class:`coordinator.engine.Coordinator`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from coordinator.emulated import ClientRound
from coordinator.secure_round import SecureOutcome, SecureRound
from coordinator.guard import clip_update
from methods.base import ClientUpdate, DeltaLayout
from monitoring.results import RoundRecord, RunRecorder
from wire.framing import WireError
from wire.messages import ASSET_TYPES, TaskAsset, TaskStart, TrainRequest


@dataclass
class OpenRound:
    """The round in progress: who was chosen and what each has answered so far."""

    task: int
    number: int
    chosen: list[str]  # in selection order
    selected: set[str]  # emptied if a secure round aborts before it starts
    wanted: int  # updates that close the round early (clients_per_round; fewer than selected with overcommit)
    updates: list[ClientUpdate] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)  # reported an error
    lost: set[str] = field(default_factory=set)  # left or crashed and joined again during the round
    masked: set[str] = field(default_factory=set)  # secure aggregation: sent a masked input in time
    late: int = 0  # at the close: selected, online, and no answer yet
    dropped: int = 0  # at the close: selected, gone without an answer
    train_s: dict[str, float] = field(default_factory=dict)  # client -> its reported local training time
    # emulated clock (coordinator/emulated.py): when the round opened, each dispatched client's timeline,
    # side-channel messages held until the close (only the on-time clients' count)
    started_at: float = 0.0
    timeline: dict[str, ClientRound] | None = None
    side: list[tuple[str, str, dict[str, np.ndarray]]] = field(default_factory=list)
    emulated_s: float | None = None
    host_timeout: bool = False
    kept_late: list[ClientUpdate] = field(default_factory=list)  # late updates for the next round
    bytes_discarded: int = 0  # uploads of clients gone (in emulated time) before they would have arrived

    def answered(self) -> set[str]:
        return {u.client for u in self.updates} | self.masked | self.failed

    def pending(self, online: Callable[[str], bool]) -> set[str]:
        done = self.answered() | self.lost
        return {c for c in self.selected - done if online(c)}

    def done(self, online: Callable[[str], bool]) -> bool:
        useful = sum(u.num_samples > 0 for u in self.updates)
        return useful >= self.wanted or not self.pending(online)


def _mean_metrics(updates: list[ClientUpdate]) -> dict[str, float] | None:
    """The mean of each method metric (loss terms...) the round's clients reported (loss and training time
    have their own fields)."""
    sums: dict[str, list[float]] = {}
    for u in updates:
        for name, value in u.metrics.items():
            if name not in ("loss", "train_time_s") and math.isfinite(value):
                sums.setdefault(name, []).append(value)
    return {name: sum(v) / len(v) for name, v in sorted(sums.items())} or None


class RoundEngine:
    """One round of training, phase by phase (mixin of Coordinator; the phases: the module docstring)."""

    def _train_s_by_class(self, r: OpenRound) -> dict[str, float] | None:
        """Mean reported local training time of the round's participants per device class (with device profiles;
        under a container backend this is where a class's CPU limit shows)."""
        times: dict[str, list[float]] = {}
        for client, seconds in r.train_s.items():
            record = self.registry.records.get(client)
            if record is not None and record.device_class is not None and math.isfinite(seconds):
                times.setdefault(record.device_class, []).append(seconds)
        return {name: sum(v) / len(v) for name, v in sorted(times.items())} or None

    def _run_round(self, task: int, task_round: int, recorder: RunRecorder) -> RoundRecord:
        """One round, phase by phase; each phase's seconds go into the round's record."""
        started, cpu_started = time.perf_counter(), time.process_time()
        bytes_before = dict(self.counters.bytes)
        self._drain()  # leaves and joins that queued up during evaluation or task-end work
        r = self._phase_select(task, task_round)
        t_select = time.perf_counter() - started

        t0 = time.perf_counter()
        secure = self._phase_dispatch(r, task_round)
        t_dispatch = time.perf_counter() - t0

        t0, handled_before = time.perf_counter(), self._update_handling_s()
        outcome = self._phase_collect(r, secure)
        t_wait = time.perf_counter() - t0
        t_updates = self._update_handling_s() - handled_before

        t0 = time.perf_counter()
        useful, losses, stale_used, skipped = self._phase_aggregate(r, outcome)
        t_aggregate = time.perf_counter() - t0
        cpu_s = time.process_time() - cpu_started

        t0 = time.perf_counter()
        accuracy = self._phase_evaluate(task, task_round)
        t_eval = time.perf_counter() - t0

        cfg = self.config.rounds
        bytes_by_type = self._bytes_since(bytes_before)
        losses = [x for x in losses if np.isfinite(x)]
        record = RoundRecord(
            task=task, round=r.number, task_round=task_round, selected=len(r.chosen),
            participants=len(r.updates) + len(r.masked), late=r.late, failed=len(r.failed), skipped=skipped,
            dropped=r.dropped, overcommitted=len(r.chosen) - min(cfg.clients_per_round, len(r.chosen)),
            stale_used=stale_used,
            secagg=None if outcome is None else outcome.record,
            client_metrics=_mean_metrics(useful),
            train_s_by_class=self._train_s_by_class(r),
            samples=sum(u.num_samples for u in useful),
            mean_loss=float(np.mean(losses)) if losses else None,
            accuracy_seen=accuracy,
            duration_s=time.perf_counter() - started,
            coordinator_cpu_s=cpu_s,
            phases_s={"select": t_select, "dispatch": t_dispatch, "collect": t_wait, "receive_updates": t_updates,
                      "aggregate": t_aggregate, "evaluate": t_eval},
            bytes_sent=sum(d.get("sent", 0) for d in bytes_by_type.values()),
            bytes_received=sum(d.get("received", 0) for d in bytes_by_type.values()),
            bytes_by_type=bytes_by_type,
            online=len(self.registry.online()),
            emulated_s=r.emulated_s,
            emulated_clock_s=None if self.clock is None else self.clock.now,
            host_timeout=r.host_timeout,
            bytes_discarded=r.bytes_discarded,
        )
        self._phase_record(record, recorder)
        return record

    # ------------------------------------------------------------------ phases
    def _phase_select(self, task: int, task_round: int) -> OpenRound:
        """Sample the round's clients from the eligible online ones (seeded) and open the round. With fewer than
        ``min_participants`` online (every edge node restarting, a mass leave), first wait up to the liveness
        timeout (or the round deadline, if shorter) for clients to come back: a round that cannot reach its
        quorum would only be skipped, and a restarted node's clients rejoin within seconds."""
        cfg = self.config.rounds
        if self.clock is not None:
            self._follow_availability(self.clock.now)
        eligible = self.registry.eligible(task)
        if len(eligible) < cfg.min_participants:
            if self.clock is not None:
                self._await_quorum_emulated(task)
            else:
                wait_s = min(cfg.deadline_s, self.registry.liveness_timeout_s)
                self.serve(lambda: self.registry.online_count >= cfg.min_participants, time.monotonic() + wait_s)
            eligible = self.registry.eligible(task)
        k = min(math.ceil(cfg.clients_per_round * cfg.overcommit), len(eligible))
        chosen = [eligible[i].client_id for i in sorted(self.rng.choice(len(eligible), size=k, replace=False))]
        self._global_round += 1
        r = OpenRound(task, self._global_round, chosen, set(chosen), wanted=cfg.clients_per_round)
        if self.clock is not None:
            r.started_at, r.timeline = self.clock.now, {}
        self._round = r
        self.metrics.round_started(task, task_round, r.number)
        return r

    def _phase_dispatch(self, r: OpenRound, task_round: int) -> SecureRound | SecureOutcome | None:
        """Send each chosen client the task's start and assets (once per task), then its train request with the
        round's tensors. Returns the round's secure aggregation (aborted already if it could not start), or
        None in a plain round."""
        task, chosen = r.task, r.chosen
        assets = self.server.task_assets(task) if any(
            self.registry.records[c].assets_task != task for c in chosen) else {}
        unknown = set(assets) - set(ASSET_TYPES)
        if unknown:
            raise ValueError(f"method {self.spec.name!r} returned task assets of unknown kinds {sorted(unknown)}; "
                             f"the wire knows {', '.join(ASSET_TYPES)}")
        payload = self.server.round_tensors(task, r.number)
        seen = [int(c) for c in self.scenario.seen_classes(task)]
        classes = [int(c) for c in self.scenario.task_classes(task)]
        secure = self._open_secure_round(r) if self.config.secagg.enabled else None
        setups = secure.setup_messages() if isinstance(secure, SecureRound) else {}
        if isinstance(secure, SecureOutcome):
            r.selected = set()  # aborted before it started: no client is asked to train
        lr = self.server.learning_rate(task, task_round, self.config.training.lr)
        request = TrainRequest(local_epochs=self.config.training.local_epochs, lr=lr, secure=secure is not None)
        for client_id in chosen if r.selected else ():
            record = self.registry.records[client_id]
            sent = 0
            if record.assets_task != task:
                sent = self._send_task_start(client_id, task, r.number, classes, seen, assets, record.restarted)
                if not sent:
                    continue
                record.assets_task, record.restarted = task, False
            if setups and not self._send(client_id, "secagg_setup", setups[client_id], task=task, round=r.number):
                continue
            sent_request = self._send(client_id, "train_request", request, task=task, round=r.number,
                                      tensors=payload)
            if sent_request and r.timeline is not None:
                r.timeline[client_id] = ClientRound(record.profile, down_bytes=sent + sent_request)
        return secure

    def _phase_collect(self, r: OpenRound, secure: SecureRound | SecureOutcome | None) -> SecureOutcome | None:
        """Serve the socket until the round is done or its deadline passed (a secure round runs its protocol
        meanwhile); then close the round and count who missed the deadline and who dropped out."""
        if r.timeline is not None:
            self.serve(lambda: not r.pending(self.registry.is_online),
                       time.monotonic() + self.config.rounds.host_timeout_s)
            self._round = None
            self._close_emulated(r)
            return None
        deadline = time.monotonic() + self.config.rounds.deadline_s
        if isinstance(secure, SecureRound):
            self._secure = secure
            try:
                secure = secure.collect(self.serve, self.registry.is_online,
                                        lambda c: self.registry.is_online(c) and c not in r.failed and c not in r.lost,
                                        r.wanted, deadline, self.config.rounds.min_participants)
            finally:
                self._secure = None
        elif secure is None:
            self.serve(lambda: r.done(self.registry.is_online), deadline)
        self._round = None
        r.late = len(r.pending(self.registry.is_online))
        r.dropped = len(r.selected - r.answered() - r.pending(self.registry.is_online))
        return secure

    def _phase_aggregate(self, r: OpenRound, outcome: SecureOutcome | None
                         ) -> tuple[list[ClientUpdate], list[float], int, bool]:
        """Aggregate the round's useful updates (and late ones kept from the round before) through the method's
        server part, or skip the round. Returns (updates, their losses, stale updates used, skipped)."""
        stale = [u for u in self._stale if u.num_samples > 0] if self._stale_task == r.task else []
        self._stale, self._stale_task = r.kept_late, r.task  # emulated clock: this round's late ones, known now
        if outcome is None:
            useful = sorted([u for u in r.updates if u.num_samples > 0] + stale, key=lambda u: u.client)
            losses = [u.loss for u in useful]
            clip = self.config.security.clip_norm
            if clip is not None:
                useful = [clip_update(u, clip) for u in useful]
        else:  # one update: the unmasked weighted mean of the clients in the masked sum
            useful = [] if outcome.delta is None else [ClientUpdate("secagg", outcome.weight, outcome.delta)]
            losses = list(outcome.losses)
        skipped = not useful or (outcome is None and len(useful) < self.config.rounds.min_participants)
        if not skipped:
            self.server.aggregate(r.task, r.number, useful)
        return useful, losses, 0 if skipped or outcome is not None else len(stale), skipped

    def _phase_evaluate(self, task: int, task_round: int) -> float | None:
        """Accuracy on the seen classes every ``eval_every`` rounds (a task's last round: at task end)."""
        cfg = self.config.rounds
        last = task_round == cfg.rounds_per_task - 1
        if not last and (task_round + 1) % cfg.eval_every == 0:
            return self.evaluator.accuracy_seen(self.server.eval_model(), task)
        return None

    def _phase_record(self, record: RoundRecord, recorder: RunRecorder) -> None:
        """The round's record into ``events.jsonl`` and the Prometheus metrics."""
        recorder.round(record)
        self.metrics.round_closed(duration_s=record.duration_s, phases_s=record.phases_s, selected=record.selected,
                                  participants=record.participants, missed_deadline=record.late,
                                  failed=record.failed, skipped=record.skipped, mean_loss=record.mean_loss,
                                  accuracy_seen_percent=record.accuracy_seen, emulated_s=record.emulated_s,
                                  emulated_clock_s=record.emulated_clock_s, host_timeout=record.host_timeout)

    # ----------------------------------------------------------------- helpers
    def _open_secure_round(self, r: OpenRound) -> SecureRound | SecureOutcome:
        """The SecAgg+ round over the chosen clients; weights clipped to the largest client dataset of the task
        unless ``secagg.max_weight`` is set."""
        sa = self.config.secagg
        max_weight = sa.max_weight or max([1] + [len(self.scenario.client_indices(self.registry.records[c].index,
                                                                                  r.task)) for c in r.chosen])
        return SecureRound.open(r.chosen, DeltaLayout.of(self.server.global_state), sa, max_weight,
                                run_id=self.run_id, number=r.number, seed=self.config.seed * 1_000_003 + r.number,
                                send=lambda c, t, body: self._send(c, t, body, task=r.task, round=r.number),
                                metrics=self.metrics)

    # ----------------------------------------------------------- emulated clock
    def _follow_availability(self, t: float) -> None:
        """Move the emulated clock to ``t``; mark connected clients away or back by their availability models
        and crash downtimes."""
        if not self.clock.churns:  # everyone always available: nothing to follow
            self.clock.now = max(self.clock.now, t)
            return
        connected = self.registry.connected()
        states = self.clock.availability_at(t, ((r.client_id, r.index) for r in connected))
        for record in connected:
            available = states[record.client_id]
            if self.registry.set_away(record.client_id, not available):
                if available:
                    self.metrics.client_joined(rejoin=True)
                else:
                    self.metrics.client_left()
                self.progress("join" if available else "leave", {"client": record.client_id})

    def _await_quorum_emulated(self, task: int) -> None:
        """Too few clients online for a round: move the emulated clock to when enough are, within a deadline
        (or to the deadline: the round that follows is skipped)."""
        cfg = self.config.rounds
        until = self.clock.now + cfg.deadline_s
        while len(self.registry.eligible(task)) < cfg.min_participants:
            away = [(r.client_id, r.index) for r in self.registry.connected() if r.away and r.join_task <= task]
            t = self.clock.next_change(away)
            self._follow_availability(min(t, until))
            if t >= until:
                return

    def _close_emulated(self, r: OpenRound) -> None:
        """Close an emulated-clock round (coordinator.emulated): keep the updates that arrived by the close,
        hand their side-channel messages to the method, count the late, the gone and the crashed."""
        cfg = self.config.rounds
        r.host_timeout = bool(r.pending(self.registry.is_online))
        if r.host_timeout:
            self.log_once(None, "host timeout", f"round {r.number}: clients still working after the host-side "
                                                f"safety timeout of {cfg.host_timeout_s:g} s; they count as late")
        useful = {u.client for u in r.updates if u.num_samples > 0}
        indices = {c: self.registry.records[c].index for c in r.timeline}
        closing = self.clock.close(r.started_at, cfg.deadline_s, r.wanted, r.timeline, indices, useful, r.number)
        late = [u for u in r.updates if u.client in closing.arrived_late]
        r.updates = [u for u in r.updates if u.client in closing.on_time]
        for client, kind, tensors in r.side:
            if client in closing.on_time:
                try:
                    self._side_channel_to_method(r.task, kind, tensors)
                except WireError as exc:
                    exc.peer = client
                    self._reject(exc)
            else:
                self.late_side_channel += 1
        for client in closing.crashed:
            record = self.registry.records[client]
            record.restarted, record.assets_task = True, -1
            if self.registry.set_away(client, True, crashed=True):
                self.metrics.client_dropped("crash")
        self.late_updates += len(late)
        for _ in late:
            self.metrics.late_update()
        if cfg.late_updates == "next_round" and self.server.accepts_stale_updates:
            r.kept_late = [u for u in late if u.num_samples > 0][:math.ceil(cfg.clients_per_round * cfg.overcommit)]
        r.late = len(closing.late - r.failed)
        r.dropped = len(closing.gone) + len(r.selected - r.timeline.keys())
        r.bytes_discarded = sum(r.timeline[c].up_bytes for c in closing.lost_uploads)
        r.emulated_s = closing.closed_at - r.started_at
        r.train_s = {c: t.compute_s for c, t in r.timeline.items() if t.compute_s is not None}

    def _update_handling_s(self) -> float:
        """Seconds spent so far receiving and handling updates, plain and masked."""
        return self.handling_s["update"] + self.handling_s["secagg_masked"]

    def _send_task_start(self, client_id: str, task: int, number: int, classes: list[int], seen: list[int],
                         assets: dict[str, dict[str, np.ndarray]], restart: bool) -> int:
        """``task_start``, then one message per kind of the method's per-task assets (wire.ASSET_TYPES). Returns
        the bytes sent, 0 if the client is gone."""
        sent = self._send(client_id, "task_start", TaskStart(classes=classes, seen_classes=seen, restart=restart),
                          task=task, round=number)
        for kind, tensors in assets.items() if sent else ():
            n = self._send(client_id, kind, TaskAsset(), task=task, round=number, tensors=tensors)
            if not n:
                return 0
            sent += n
        return sent

    def _bytes_since(self, before: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
        """Bytes on the wire since ``before`` (a copy of the counters), as ``{type: {direction: bytes}}``."""
        out: dict[str, dict[str, int]] = {}
        for (msg_type, direction), n in self.counters.bytes.items():
            delta = n - before.get((msg_type, direction), 0)
            if delta:
                out.setdefault(msg_type, {})[direction] = delta
        return out
