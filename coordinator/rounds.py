"""The synchronous round engine: one round of federated training, its phases top to bottom in
:meth:`RoundRunner.run_round`.

1. select: sample the planned cohort, ``ceil(clients_per_round x overcommit)`` of the eligible online clients
   (seeded; under the emulated clock, online at the round's emulated start), and open the round's collection
   over them (:mod:`fcl_emu.coordinator.collection`: plain, or SecAgg+);
2. dispatch: send each its requests (:mod:`fcl_emu.coordinator.requests`: the task's start and assets once per
   task, a ``secagg_setup`` in a secure round, then a ``train_request`` with the global model);
3. collect: serve the socket until ``clients_per_round`` updates arrived, every selected client answered or
   died (missed heartbeats, or its socket is gone), or the round deadline passed (a secure round runs the
   SecAgg+ phases meanwhile). Under the emulated clock: until every selected client answered or died (or
   ``host_timeout_s``), then close the round in emulated time (:mod:`fcl_emu.coordinator.emulated`): who made the
   deadline, who is late, who left or crashed. How a round waits and closes is the run's clock's
   (:mod:`fcl_emu.coordinator.clock`);
4. aggregate: if the collection gathered at least its quorum of updates (``min_participants``, or what the run's
   rule needs; with late updates kept from the round before under ``rounds.late_updates: next_round``), through
   the round policy (:class:`~fcl_emu.aggregation.policies.sync.Sync`: the method's server part, then the run's
   server optimiser; under differential privacy as :mod:`fcl_emu.coordinator.privacy` releases them);
   otherwise skip the round;
5. evaluate: every ``eval_every`` rounds (a task's last round is evaluated at task end);
6. record: the :class:`~fcl_emu.monitoring.results.RoundRecord` (:mod:`fcl_emu.coordinator.round_record`).

:class:`RoundRunner` receives what it uses: the run state, the dispatcher that serves the socket and sends, the
clock, the collection, and the late updates kept between rounds. Its sibling for asynchronous policies is
:class:`~fcl_emu.coordinator.async_rounds.AsyncRoundRunner`.
"""

from __future__ import annotations

import math

from fcl_emu.aggregation.policies.sync import Sync
from fcl_emu.aggregation.update import ClientUpdate, DeltaLayout
from fcl_emu.coordinator.clock import RunClock
from fcl_emu.coordinator.collection import Collection, Gathered
from fcl_emu.coordinator.dispatch import Dispatcher
from fcl_emu.coordinator.open_round import OpenRound, StaleUpdates
from fcl_emu.coordinator.privacy import CentralPrivacy, DistributedPrivacy
from fcl_emu.coordinator.requests import RoundRequests
from fcl_emu.coordinator.round_record import RoundMeter
from fcl_emu.coordinator.state import RunState
from fcl_emu.monitoring.results import RoundRecord


class RoundRunner:
    """One round of training, phase by phase (the phases: the module docstring)."""

    def __init__(self, state: RunState, dispatcher: Dispatcher, clock: RunClock, collection: Collection,
                 stale: StaleUpdates, privacy: CentralPrivacy | DistributedPrivacy | None = None):
        """``privacy``: the run's differential privacy (:func:`~fcl_emu.coordinator.privacy.run_privacy_part`); the
        run's synchronous round policy (``state.policy``) applies each round's aggregate."""
        self.state, self.config, self.registry, self.metrics = state, state.config, state.registry, state.metrics
        self.dispatcher, self.clock, self.collection, self.stale = dispatcher, clock, collection, stale
        self.requests = RoundRequests(state, dispatcher, clock, collection)
        self.privacy = privacy
        self.policy: Sync = state.policy

    def run_round(self, task: int, task_round: int) -> RoundRecord:
        """One round, phase by phase; each phase's seconds go into the round's record."""
        meter = RoundMeter(self.state)
        with meter.phase("select"):
            self.dispatcher.drain()  # leaves and joins that queued up during evaluation or task-end work
            r = self._select(task, task_round)
        try:
            with meter.phase("dispatch"):
                self.requests.send(r, task_round)
            with meter.phase("collect"):
                self.collection.collect(r, self.clock, self.dispatcher.serve, self.dispatcher.side_channel)
        finally:
            self.dispatcher.round = None
        with meter.phase("aggregate"):
            gathered = self.collection.gathered(r, self.stale.take(r.task, r.kept_late))
            skipped = len(gathered.updates) < gathered.quorum
            if not skipped:
                self.policy.apply(self.state.server, r.task, r.number, self._released(gathered.updates, r))
        accuracy = meter.evaluate(task, task_round)
        return meter.record(
            # a client whose loss became NaN or infinite reports none: it counts as an infinite one
            useful=gathered.updates, losses=[*gathered.losses, *[math.inf] * len(r.nonfinite_loss)],
            accuracy_seen=accuracy, task=task, round=r.number, task_round=task_round, selected=len(r.chosen),
            participants=len(r.counted) + len(r.masked), late=r.late, failed=len(r.failed), skipped=skipped,
            dropped=r.dropped, overcommitted=len(r.chosen) - min(self.config.rounds.clients_per_round, len(r.chosen)),
            stale_used=0 if skipped else gathered.stale, secagg=gathered.secagg,
            train_s_by_class=self._train_s_by_class(r),
            emulated_s=r.emulated_s, emulated_clock_s=self.clock.emulated_now, host_timeout=r.host_timeout,
            bytes_discarded=r.bytes_discarded,
            skipped_trainings=len(r.cancelled - r.answered()),  # a cancel may cross an update already sent
            host_cpu_saved_s=r.host_cpu_saved_s,
            privacy=None if self.privacy is None else self.privacy.report(),
            contributors=_contributors(gathered, skipped), energy_j=r.energy, low_battery=r.low_battery,
            client_edge_bytes=gathered.client_edge_bytes, edge_aggregates=gathered.edge_aggregates,
            eligible=r.eligible)

    def _select(self, task: int, task_round: int) -> OpenRound:
        """Sample the round's clients from the eligible online ones (seeded) and open the round and its
        collection. With fewer than ``min_participants`` online (every edge node restarting, a mass leave), the
        clock first waits for clients to come back (:meth:`~fcl_emu.coordinator.clock.RunClock.before_selection`):
        a round that cannot reach its quorum would only be skipped."""
        cfg = self.config.rounds
        self.clock.before_selection(task, self.dispatcher.serve)
        eligible = self.registry.eligible(task)
        k = min(cfg.planned_cohort, len(eligible))
        picks = sorted(self.state.rng.choice(len(eligible), size=k, replace=False))
        chosen = [eligible[i].client_id for i in picks]
        self.state.global_round += 1
        number = self.state.global_round
        roster = self.collection.open(task, number, chosen, self.dispatcher.send, self.dispatcher.reject)
        r = OpenRound(task, number, chosen, set(roster), wanted=cfg.clients_per_round, eligible=len(eligible))
        self.clock.open_round(r)
        self.dispatcher.round = r
        self.metrics.round_started(task, task_round, r.number)
        self.state.progress("round_start", {"task": task, "round": r.number, "task_round": task_round})
        return r

    def _released(self, updates: list[ClientUpdate], r: OpenRound) -> list[ClientUpdate]:
        """What the method's server part aggregates: the updates, or under central DP their clipped, equally
        weighted and noised mean as one update; under distributed DP the noised mean the secure round unmasked,
        once the round is accounted for, as it sampled (:mod:`fcl_emu.coordinator.privacy`)."""
        if self.privacy is None:
            return updates
        return self.privacy.release(updates, DeltaLayout.of(self.state.server.global_state), r.number,
                                    sample=(len(r.chosen), r.eligible))

    def _train_s_by_class(self, r: OpenRound) -> dict[str, float] | None:
        """Mean local training time of the round's participants per device class (with device profiles; under a
        container backend this is where a class's CPU limit shows)."""
        times: dict[str, list[float]] = {}
        for client, seconds in r.train_s.items():
            record = self.registry.records.get(client)
            if record is not None and record.device_class is not None and math.isfinite(seconds):
                times.setdefault(record.device_class, []).append(seconds)
        return {name: sum(v) / len(v) for name, v in sorted(times.items())} or None


def _contributors(gathered: Gathered, skipped: bool) -> list[str] | None:
    """The record's ``contributors``: none in a skipped round; None where no single update is seen."""
    if gathered.contributors is None:
        return None
    return [] if skipped else gathered.contributors
