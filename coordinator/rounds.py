"""The round engine: one round of federated training, its phases top to bottom in :meth:`RoundEngine._run_round`.

1. select: sample ``ceil(clients_per_round x overcommit)`` of the eligible online clients (seeded; under the
   emulated clock, online at the round's emulated start);
2. dispatch: send each a ``task_start`` with the method's per-task assets if it has not had this task's assets
   yet (and a ``secagg_setup`` in a secure round), then a ``train_request`` with the global model;
3. collect: serve the socket until ``clients_per_round`` updates arrived, every selected client answered or
   died (missed heartbeats, or its socket is gone), or the round deadline passed (a secure round runs the
   SecAgg+ phases meanwhile, :mod:`fcl_emu.coordinator.secure_round`). Under the emulated clock: until every
   selected client answered or died (or ``host_timeout_s``), then close the round in emulated time
   (:mod:`fcl_emu.coordinator.emulated`): who made the deadline, who is late, who left or crashed. How a round waits
   and closes is the run's clock's (:mod:`fcl_emu.coordinator.clock`);
4. aggregate: if at least ``min_participants`` updates arrived (with late updates kept from the round before,
   under ``rounds.late_updates: next_round``), through the method's server part (under central DP as one
   clipped and noised mean, :mod:`fcl_emu.coordinator.privacy`); otherwise skip the round;
5. evaluate: every ``eval_every`` rounds (a task's last round is evaluated at task end);
6. record: the :class:`~fcl_emu.monitoring.results.RoundRecord` in ``events.jsonl`` and in the Prometheus metrics.

:class:`RoundRunner` receives what it uses: the run state, the dispatcher that serves the socket and sends, the
clock, and the late updates kept between rounds.
"""

from __future__ import annotations

import math
import time

import numpy as np

from fcl_emu.coordinator.clock import RunClock
from fcl_emu.coordinator.dispatch import Dispatcher
from fcl_emu.coordinator.guard import clip_to_cohort, clip_update
from fcl_emu.coordinator.open_round import OpenRound, StaleUpdates
from fcl_emu.coordinator.privacy import DistributedPrivacy, run_privacy_part
from fcl_emu.coordinator.secure_round import SecureOutcome, SecureRound
from fcl_emu.coordinator.state import RunState
from fcl_emu.methods.base import ClientUpdate, DeltaLayout
from fcl_emu.monitoring.results import RoundRecord
from fcl_emu.wire.messages import ASSET_TYPES, TaskAsset, TaskStart, TrainRequest


def _mean_metrics(updates: list[ClientUpdate]) -> dict[str, float] | None:
    """The mean of each method metric (loss terms...) the round's clients reported (loss and training time
    have their own fields)."""
    sums: dict[str, list[float]] = {}
    for u in updates:
        for name, value in u.metrics.items():
            if name not in ("loss", "train_time_s") and math.isfinite(value):
                sums.setdefault(name, []).append(value)
    return {name: sum(v) / len(v) for name, v in sorted(sums.items())} or None


class RoundRunner:
    """One round of training, phase by phase (the phases: the module docstring)."""

    def __init__(self, state: RunState, dispatcher: Dispatcher, clock: RunClock, stale: StaleUpdates):
        self.state, self.config, self.registry, self.metrics = state, state.config, state.registry, state.metrics
        self.dispatcher, self.clock, self.stale = dispatcher, clock, stale
        self.privacy = run_privacy_part(state.config)  # central or distributed DP; None without

    def _train_s_by_class(self, r: OpenRound) -> dict[str, float] | None:
        """Mean reported local training time of the round's participants per device class (with device profiles;
        under a container backend this is where a class's CPU limit shows)."""
        times: dict[str, list[float]] = {}
        for client, seconds in r.train_s.items():
            record = self.registry.records.get(client)
            if record is not None and record.device_class is not None and math.isfinite(seconds):
                times.setdefault(record.device_class, []).append(seconds)
        return {name: sum(v) / len(v) for name, v in sorted(times.items())} or None

    def run_round(self, task: int, task_round: int) -> RoundRecord:
        """One round, phase by phase; each phase's seconds go into the round's record."""
        started, cpu_started = time.perf_counter(), time.process_time()
        bytes_before = dict(self.state.counters.bytes)
        self.dispatcher.drain()  # leaves and joins that queued up during evaluation or task-end work
        r = self._phase_select(task, task_round)
        t_select = time.perf_counter() - started

        t0 = time.perf_counter()
        secure = self._phase_dispatch(r, task_round)
        t_dispatch = time.perf_counter() - t0
        self.state.progress("dispatched", {"task": task, "round": r.number, "selected": len(r.chosen)})

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
            emulated_clock_s=self.clock.emulated_now,
            host_timeout=r.host_timeout,
            bytes_discarded=r.bytes_discarded,
            skipped_trainings=len(r.cancelled - r.answered()),  # a cancel may cross an update already sent
            host_cpu_saved_s=r.host_cpu_saved_s,
            privacy=None if self.privacy is None else self.privacy.report(),
            contributors=None if outcome is not None else [] if skipped else sorted(
                u.client for u in r.updates if u.num_samples > 0),
        )
        self._phase_record(record)
        return record

    # ------------------------------------------------------------------ phases
    def _phase_select(self, task: int, task_round: int) -> OpenRound:
        """Sample the round's clients from the eligible online ones (seeded) and open the round. With fewer than
        ``min_participants`` online (every edge node restarting, a mass leave), first wait up to the liveness
        timeout (or the round deadline, if shorter) for clients to come back: a round that cannot reach its
        quorum would only be skipped, and a restarted node's clients rejoin within seconds."""
        cfg = self.config.rounds
        self.clock.before_selection(task, self.dispatcher.serve)
        eligible = self.registry.eligible(task)
        k = min(math.ceil(cfg.clients_per_round * cfg.overcommit), len(eligible))
        picks = sorted(self.state.rng.choice(len(eligible), size=k, replace=False))
        chosen = [eligible[i].client_id for i in picks]
        self.state.global_round += 1
        r = OpenRound(task, self.state.global_round, chosen, set(chosen), wanted=cfg.clients_per_round)
        self.clock.open_round(r)
        self.dispatcher.round = r
        self.metrics.round_started(task, task_round, r.number)
        self.state.progress("round_start", {"task": task, "round": r.number})
        return r

    def _phase_dispatch(self, r: OpenRound, task_round: int) -> SecureRound | SecureOutcome | None:
        """Send each chosen client the task's start and assets (once per task), then its train request with the
        round's tensors. Returns the round's secure aggregation (aborted already if it could not start), or
        None in a plain round."""
        task, chosen = r.task, r.chosen
        assets = self.state.server.task_assets(task) if any(
            self.registry.records[c].assets_task != task for c in chosen) else {}
        unknown = set(assets) - set(ASSET_TYPES)
        if unknown:
            raise ValueError(f"method {self.state.spec.name!r} returned task assets of unknown kinds "
                             f"{sorted(unknown)}; the wire knows {', '.join(ASSET_TYPES)}")
        payload = self.state.server.round_tensors(task, r.number)
        seen = [int(c) for c in self.state.scenario.seen_classes(task)]
        classes = [int(c) for c in self.state.scenario.task_classes(task)]
        secure = self._open_secure_round(r) if self.config.secagg.enabled else None
        setups = secure.setup_messages() if isinstance(secure, SecureRound) else {}
        if isinstance(secure, SecureOutcome):
            r.selected = set()  # aborted before it started: no client is asked to train
        lr = self.state.server.learning_rate(task, task_round, self.config.training.lr)
        request = TrainRequest(local_epochs=self.config.training.local_epochs, lr=lr, secure=secure is not None)
        for client_id in chosen if r.selected else ():
            record = self.registry.records[client_id]
            sent = 0
            if record.assets_task != task:
                sent = self._send_task_start(client_id, task, r.number, classes, seen, assets, record.restarted)
                if not sent:
                    continue
                record.assets_task, record.restarted = task, False
            setup = self.dispatcher.send(client_id, "secagg_setup", setups[client_id], task=task,
                                         round=r.number) if setups else 0
            if setups and not setup:
                continue
            sent_request = self.dispatcher.send(client_id, "train_request", request, task=task, round=r.number,
                                                tensors=payload)
            if sent_request:
                self.clock.dispatched(r, client_id, record.profile, sent + setup + sent_request)
        self.dispatcher.cancel(r, self.clock.hopeless(r))
        return secure

    def _phase_collect(self, r: OpenRound, secure: SecureRound | SecureOutcome | None) -> SecureOutcome | None:
        """Serve the socket until the round is over and close it, as the clock does (a secure round runs its
        protocol meanwhile)."""
        if isinstance(secure, SecureRound):
            self.dispatcher.secure = secure
        try:
            return self.clock.collect(r, secure, self.dispatcher.serve, self.dispatcher.side_channel)
        finally:
            self.dispatcher.round, self.dispatcher.secure = None, None

    def _phase_aggregate(self, r: OpenRound, outcome: SecureOutcome | None
                         ) -> tuple[list[ClientUpdate], list[float], int, bool]:
        """Aggregate the round's useful updates (and late ones kept from the round before) through the method's
        server part, or skip the round. A plain round's deltas are clipped first (``security.clip_norm``, then
        the adaptive bound ``security.adaptive_clip`` over the method's summed uploads); it needs at least
        ``min_participants`` updates, and as many as the run's aggregation rule takes. Returns (updates, their
        losses, stale updates used, skipped)."""
        stale = self.stale.take(r.task, r.kept_late)  # the emulated clock's late ones are known at the close
        security = self.config.security
        if outcome is None:
            useful = sorted([u for u in r.updates if u.num_samples > 0] + stale, key=lambda u: u.client)
            losses = [u.loss for u in useful]
            if security.clip_norm is not None:
                useful = [clip_update(u, security.clip_norm) for u in useful]
            if security.adaptive_clip is not None:
                useful = clip_to_cohort(useful, security.adaptive_clip, self.state.server.summable)
            quorum = max(self.config.rounds.min_participants, security.robust_aggregator().min_updates)
        else:  # one update: the unmasked weighted mean of the clients in the masked sum; no single one is seen
            useful = [] if outcome.delta is None else [ClientUpdate("secagg", outcome.weight, outcome.delta)]
            losses = list(outcome.losses)
            quorum = 1
        skipped = len(useful) < quorum
        if not skipped:
            self.state.server.aggregate(r.task, r.number, self._released(useful, r.number))
        return useful, losses, 0 if skipped or outcome is not None else len(stale), skipped

    def _released(self, updates: list[ClientUpdate], number: int) -> list[ClientUpdate]:
        """What the method's server part aggregates: the updates, or under central DP their clipped, equally
        weighted and noised mean as one update; under distributed DP the noised mean the secure round unmasked,
        once the round is accounted for (:mod:`fcl_emu.coordinator.privacy`)."""
        if self.privacy is None:
            return updates
        return self.privacy.release(updates, DeltaLayout.of(self.state.server.global_state), number)

    def _phase_evaluate(self, task: int, task_round: int) -> float | None:
        """Accuracy on the seen classes every ``eval_every`` rounds (a task's last round: at task end)."""
        cfg = self.config.rounds
        last = task_round == cfg.rounds_per_task - 1
        if not last and (task_round + 1) % cfg.eval_every == 0:
            return self.state.evaluator.accuracy_seen(self.state.server.eval_model(), task)
        return None

    def _phase_record(self, record: RoundRecord) -> None:
        """The round's record into ``events.jsonl`` and the Prometheus metrics."""
        if self.state.recorder is not None:
            self.state.recorder.round(record)
        self.metrics.round_closed(duration_s=record.duration_s, phases_s=record.phases_s, selected=record.selected,
                                  participants=record.participants, missed_deadline=record.late,
                                  failed=record.failed, skipped=record.skipped, mean_loss=record.mean_loss,
                                  accuracy_seen_percent=record.accuracy_seen, emulated_s=record.emulated_s,
                                  emulated_clock_s=record.emulated_clock_s, host_timeout=record.host_timeout)
        if record.privacy is not None:
            self.metrics.privacy_epsilon.set(math.inf if record.privacy["epsilon"] is None
                                             else record.privacy["epsilon"])

    # ----------------------------------------------------------------- helpers
    def _open_secure_round(self, r: OpenRound) -> SecureRound | SecureOutcome:
        """The SecAgg+ round over the chosen clients; weights clipped to the largest client dataset of the task
        unless ``secagg.max_weight`` is set; under distributed DP, its clients' clipping and noise."""
        sa, scenario = self.config.secagg, self.state.scenario
        max_weight = sa.max_weight or max([1] + [len(scenario.client_indices(self.registry.records[c].index, r.task))
                                                 for c in r.chosen])
        noise = None
        if isinstance(self.privacy, DistributedPrivacy):
            sa, noise = self.privacy.secagg_settings(sa), self.privacy.noise
        return SecureRound.open(r.chosen, DeltaLayout.of(self.state.server.global_state), sa, max_weight,
                                noise=noise,
                                run_id=self.state.run_id, number=r.number,
                                seed=self.config.seed * 1_000_003 + r.number,
                                send=lambda c, t, body: self.dispatcher.send(c, t, body, task=r.task, round=r.number),
                                metrics=self.metrics, reject=self.dispatcher.reject)

    def _update_handling_s(self) -> float:
        """Seconds spent so far receiving and handling updates, plain and masked."""
        handling_s = self.state.tally.handling_s
        return handling_s["update"] + handling_s["secagg_masked"]

    def _send_task_start(self, client_id: str, task: int, number: int, classes: list[int], seen: list[int],
                         assets: dict[str, dict[str, np.ndarray]], restart: bool) -> int:
        """``task_start``, then one message per kind of the method's per-task assets (wire.ASSET_TYPES). Returns
        the bytes sent, 0 if the client is gone."""
        sent = self.dispatcher.send(client_id, "task_start",
                                    TaskStart(classes=classes, seen_classes=seen, restart=restart),
                                    task=task, round=number)
        for kind, tensors in assets.items() if sent else ():
            n = self.dispatcher.send(client_id, kind, TaskAsset(), task=task, round=number, tensors=tensors)
            if not n:
                return 0
            sent += n
        return sent

    def _bytes_since(self, before: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
        """Bytes on the wire since ``before`` (a copy of the counters), as ``{type: {direction: bytes}}``."""
        out: dict[str, dict[str, int]] = {}
        for (msg_type, direction), n in self.state.counters.bytes.items():
            delta = n - before.get((msg_type, direction), 0)
            if delta:
                out.setdefault(msg_type, {})[direction] = delta
        return out
