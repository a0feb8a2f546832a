"""The run summary (``summary.json``): results, costs and counts of a finished or ended run.

:class:`SummaryBuilder` builds the record :class:`fcl_emu.monitoring.results.RunSummary` from the run state, the clock,
the server-side jobs, the checkpointer and the time account; the accuracy definitions it uses are in
:mod:`fcl_emu.monitoring.results` and docs/metrics.md.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from fcl_emu.coordinator.clock import RunClock
from fcl_emu.coordinator.edge_tier import FlatStar, Tier
from fcl_emu.coordinator.energy import energy_to_accuracy
from fcl_emu.coordinator.gpu_pool import Job
from fcl_emu.coordinator.privacy import run_privacy
from fcl_emu.coordinator.resume import Checkpointer
from fcl_emu.coordinator.server_jobs import ServerJobs
from fcl_emu.coordinator.state import RunState, TimeAccount
from fcl_emu.monitoring import results
from fcl_emu.monitoring.results import (RoundRecord, average_accuracy, average_forgetting, average_incremental_accuracy,
                                        learned_accuracy, spatial_retention, temporal_retention)
from fcl_emu.scenario.scenario import overlapping_shares_text

class SummaryBuilder:
    """``summary.json``'s record from the run's results and counters."""

    def __init__(self, state: RunState, clock: RunClock, jobs: ServerJobs, checkpointer: Checkpointer,
                 time_account: TimeAccount, heartbeat_interval_s: float, tier: Tier = FlatStar()):
        self.state, self.config, self.scenario, self.clock = state, state.config, state.scenario, clock
        self.jobs, self.checkpointer, self.time_account = jobs, checkpointer, time_account
        self.heartbeat_interval_s, self.tier = heartbeat_interval_s, tier

    def build(self, matrix, rounds: list[RoundRecord], wall: float, status: str, run_dir: Path,
              class_hits=None, node_hosts: dict[str, str] | None = None) -> results.RunSummary:
        st, tally = self.state, self.state.tally
        counts = st.registry.counts
        complete = bool(matrix)
        phases = Counter()
        for r in rounds:
            phases.update(r.phases_s)
        seen = [st.seen_accuracy(row[: t + 1], t) for t, row in enumerate(matrix)]
        bytes_by_type, tier_bytes = st.counters.nested(), self._tier_bytes()
        return results.RunSummary(
            status=status,
            run_id=st.run_id,
            run_dir=str(run_dir),
            method=self.config.method,
            method_options=self.config.method_options_model().model_dump(mode="json"),
            dataset=self.config.scenario.dataset,
            model=self.config.model,
            scenario=self.config.scenario.model_dump(mode="json"),
            seed=self.config.seed,
            overlapping_shares=overlapping_shares_text(self.scenario.overlapping_shares),
            accuracy_matrix=matrix,
            accuracy_seen=seen,
            accuracy_all=[self._all_accuracy(row[: t + 1], t) for t, row in enumerate(matrix)],
            accuracy_clients=list(st.client_accuracy),
            average_accuracy=average_accuracy(matrix) if complete else None,
            average_incremental_accuracy=average_incremental_accuracy(matrix) if complete else None,
            average_forgetting=average_forgetting(matrix) if complete else None,
            learned_accuracy=learned_accuracy(matrix),
            knowledge_retention=self._knowledge_retention(matrix, class_hits),
            bytes=bytes_by_type,
            messages={f"{t}/{d}": n for (t, d), n in sorted(st.counters.messages.items())},
            bytes_total=sum(st.counters.bytes.values()),
            rounds=len(rounds),
            rounds_skipped=sum(r.skipped for r in rounds),
            wall_clock_s=wall,
            clock=self.clock.kind,
            # emulated clock: what the federation would have taken (the host's wall clock is wall_clock_s)
            emulated_s=self.clock.emulated_now,
            host_timeouts=sum(r.host_timeout for r in rounds),
            bytes_discarded=sum(r.bytes_discarded for r in rounds),
            skipped_trainings=sum(r.skipped_trainings for r in rounds),
            host_cpu_saved_s=sum(r.host_cpu_saved_s for r in rounds),
            time=self.time_account.accounting(),
            phase_s=dict(phases),
            handling_s=dict(tally.handling_s),
            liveness=results.Liveness(heartbeat_interval_s=self.heartbeat_interval_s,
                                      liveness_timeout_s=st.registry.liveness_timeout_s),
            clients=results.Clients(
                configured=self.config.scenario.num_clients,
                joined=counts.joined,
                rejoined=counts.rejoined,
                left=counts.left,
                dropped=counts.dropped,
                online_at_end=len(st.registry.online()),
                switched_connection=tally.connection_switches,
            ),
            missed_deadline=sum(r.late for r in rounds),
            late_updates=tally.late_updates,
            late_side_channel=tally.late_side_channel,
            rejected_messages={**tally.rejected, **self.tier.refusals()},
            refused_handshakes=(_refused_handshakes(st.metrics) if self.config.security.transport == "curve"
                                else None),
            rejected_gpu_pool=dict(self.jobs.pool.rejected),
            secagg=_secagg_summary(rounds) if self.config.secagg.enabled else None,
            gpu_jobs=_jobs_summary(self.jobs.finished, self.config.gpu.workers, self.jobs.pool.device),
            resumes=self.checkpointer.resumes,
            checkpoints=results.Checkpoints(**self.checkpointer.stats),
            privacy=run_privacy(self.config, rounds),
            edge_node_hosts=dict(node_hosts or {}),
            energy_joules=self._energy(rounds, seen),
            tier_bytes=tier_bytes,
            link_bytes=results.link_bytes(bytes_by_type, tier_bytes),
        )

    def _tier_bytes(self) -> dict[str, dict[str, int]]:
        """Each tier's bytes under edge aggregators; none in a star."""
        return self.tier.summary_bytes(sum(v.get("received", 0) for v in self.state.counters.nested().values()))

    def _energy(self, rounds: list[RoundRecord], task_end_accuracy: list[float]) -> results.EnergyTotals | None:
        """The clients' energy over the run (emulated clock with device classes that give power figures)."""
        ledger = self.clock.energy
        totals = None if ledger is None else ledger.summary(self.clock.emulated_now)
        if totals is None:
            return None
        marks = [results.EnergyMark(**m) for m in energy_to_accuracy(rounds, task_end_accuracy)]
        return results.EnergyTotals(**totals, sat_out_rounds=sum(r.low_battery for r in rounds), to_accuracy=marks)

    def _all_accuracy(self, row: list[float | None], task: int) -> float:
        """Accuracy on the test samples of every class of the data set (FedCBC's global accuracy): a class not
        seen yet has no output, so its samples count as wrong."""
        seen = len(self.scenario.test_indices(self.scenario.seen_classes(task)))
        return self.state.seen_accuracy(row, task) * seen / len(self.scenario.test_labels)

    def _knowledge_retention(self, matrix, class_hits) -> results.KnowledgeRetention:
        """KR_t, KR_s and the private classes' accuracy (monitoring.results); the spatial terms need the
        final model's per-class hits, which a run resumed after its last task no longer has."""
        temporal = temporal_retention(matrix) if matrix else None
        if class_hits is None or len(matrix) != self.scenario.num_tasks:
            return results.KnowledgeRetention(temporal=temporal)
        per_task = self.state.evaluator.client_task_classes(len(matrix) - 1)
        trained = [np.unique(np.concatenate(tasks)) for tasks in per_task]
        return results.KnowledgeRetention(temporal=temporal, **spatial_retention(*class_hits, trained))


def _refused_handshakes(metrics) -> dict[str, int]:
    """The allow-list's refusals by reason, as counted in ``fcl_refused_handshakes_total`` (the ZAP handler's thread
    counts them there)."""
    return {sample.labels["reason"]: int(sample.value) for metric in metrics.refused_handshakes.collect()
            for sample in metric.samples if sample.name.endswith("_total")}


def _jobs_summary(jobs: list[Job], workers: int, device: str) -> results.GpuJobs:
    """Server-side jobs over the run, by kind: how many, how many failed, attempts, seconds queued and run."""
    by_kind: dict[str, list[Job]] = {}
    for job in jobs:
        by_kind.setdefault(job.kind, []).append(job)
    return results.GpuJobs(workers=workers, device=device, by_kind={
        kind: results.JobTotals(jobs=len(js), failed=sum(not j.ok for j in js), attempts=sum(j.attempts for j in js),
                                queue_s=sum((j.queue_s for j in js), 0.0), run_s=sum((j.run_s for j in js), 0.0))
        for kind, js in by_kind.items()})


def _secagg_summary(rounds: list[RoundRecord]) -> results.SecAggTotals:
    """Secure aggregation over the run: rounds by outcome, seconds and dropouts per phase (summed)."""
    records = [r.secagg for r in rounds if r.secagg is not None]
    phase_s, dropouts = Counter(), Counter()
    for rec in records:
        phase_s.update(rec.get("phase_s", {}))
        dropouts.update(rec.get("dropouts", {}))
    return results.SecAggTotals(completed=sum(rec["outcome"] == "completed" for rec in records),
                                aborted=sum(rec["outcome"] == "aborted" for rec in records),
                                phase_s=dict(phase_s), dropouts=dict(dropouts))
