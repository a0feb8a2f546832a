"""A round's measurements and its one record: :class:`RoundMeter` times the phases, evaluates when the round is due
to and builds the :class:`~fcl_emu.monitoring.results.RoundRecord` (``events.jsonl`` and the Prometheus metrics),
for synchronous rounds and asynchronous aggregations alike."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from fcl_emu.aggregation.update import ClientUpdate
from fcl_emu.coordinator.state import RunState
from fcl_emu.monitoring.results import RoundRecord

PHASES = ("select", "dispatch", "collect", "receive_updates", "aggregate", "evaluate")  # RoundRecord.phases_s


def mean_metrics(updates: list[ClientUpdate]) -> dict[str, float] | None:
    """The mean of each method metric (loss terms...) the round's clients reported (loss and training time
    have their own fields)."""
    sums: dict[str, list[float]] = {}
    for u in updates:
        for name, value in u.metrics.items():
            if name not in ("loss", "train_time_s") and math.isfinite(value):
                sums.setdefault(name, []).append(value)
    return {name: sum(v) / len(v) for name, v in sorted(sums.items())} or None


class RoundMeter:
    """Started when a round starts: the host seconds of each phase (``collect`` also gives ``receive_updates``,
    the part of it spent handling updates), the coordinator's CPU seconds up to evaluation, the bytes on the wire."""

    def __init__(self, state: RunState):
        self.state = state
        self.started, self.cpu_started = time.perf_counter(), time.process_time()
        self.bytes_before = dict(state.counters.bytes)
        self.phases_s = dict.fromkeys(PHASES, 0.0)
        self.cpu_s: float | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (added up when a phase runs several times)."""
        t0, handled = time.perf_counter(), self._update_handling_s()
        try:
            yield
        finally:
            self.phases_s[name] += time.perf_counter() - t0
            if name == "collect":
                self.phases_s["receive_updates"] += self._update_handling_s() - handled

    def evaluate(self, task: int, task_round: int) -> float | None:
        """Accuracy on the seen classes every ``eval_every`` rounds (a task's last round: at task end), timed as
        the ``evaluate`` phase; the round's CPU seconds stop before it."""
        self.cpu_s = time.process_time() - self.cpu_started
        cfg, state = self.state.config.rounds, self.state
        if task_round == cfg.rounds_per_task - 1 or (task_round + 1) % cfg.eval_every:
            return None
        with self.phase("evaluate"):
            return state.evaluator.accuracy_seen(state.server.eval_model(), task)

    def record(self, *, useful: list[ClientUpdate], losses: list[float], **fields: Any) -> RoundRecord:
        """The round's record from ``fields`` (its counts, as :class:`RoundRecord` names them) and what this meter
        measured; ``useful``: the updates aggregated (their method metrics and samples), ``losses`` the training
        losses reported. Written to ``events.jsonl`` and the metrics."""
        state = self.state
        finite = [x for x in losses if np.isfinite(x)]
        by_type = self._bytes_since()
        record = RoundRecord(
            **fields, client_metrics=mean_metrics(useful), samples=sum(u.num_samples for u in useful),
            mean_loss=float(np.mean(finite)) if finite else None,
            duration_s=time.perf_counter() - self.started,
            coordinator_cpu_s=self.cpu_s if self.cpu_s is not None else time.process_time() - self.cpu_started,
            phases_s=dict(self.phases_s), bytes_by_type=by_type,
            bytes_sent=sum(d.get("sent", 0) for d in by_type.values()),
            bytes_received=sum(d.get("received", 0) for d in by_type.values()),
            online=len(state.registry.online()))
        if state.recorder is not None:
            state.recorder.round(record)
        state.metrics.round_closed(duration_s=record.duration_s, phases_s=record.phases_s, selected=record.selected,
                                   participants=record.participants, missed_deadline=record.late,
                                   failed=record.failed, skipped=record.skipped, mean_loss=record.mean_loss,
                                   accuracy_seen_percent=record.accuracy_seen, emulated_s=record.emulated_s,
                                   emulated_clock_s=record.emulated_clock_s, host_timeout=record.host_timeout)
        if record.privacy is not None:
            state.metrics.privacy_epsilon.set(math.inf if record.privacy["epsilon"] is None
                                              else record.privacy["epsilon"])
        return record

    def _update_handling_s(self) -> float:
        """Seconds spent so far receiving and handling updates, plain and masked."""
        handling_s = self.state.tally.handling_s
        return handling_s["update"] + handling_s["secagg_masked"]

    def _bytes_since(self) -> dict[str, dict[str, int]]:
        """Bytes on the wire since the round started, as ``{type: {direction: bytes}}``."""
        out: dict[str, dict[str, int]] = {}
        for (msg_type, direction), n in self.state.counters.bytes.items():
            delta = n - self.bytes_before.get((msg_type, direction), 0)
            if delta:
                out.setdefault(msg_type, {})[direction] = delta
        return out
