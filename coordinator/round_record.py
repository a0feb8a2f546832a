"""A round's measurements and its one record: :class:`RoundMeter` times the phases, evaluates when the round is due
to and builds the :class:`~fcl_emu.monitoring.results.RoundRecord` (``events.jsonl`` and the Prometheus metrics),
for synchronous rounds and asynchronous aggregations alike; and whether the run's rounds show it diverged
(:func:`divergence`, the statuses in docs/metrics.md)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from fcl_emu.aggregation.update import ClientUpdate
from fcl_emu.coordinator.state import RunState
from fcl_emu.monitoring.results import RoundRecord
from fcl_emu.wire.framing import square_sum

PHASES = ("select", "dispatch", "collect", "receive_updates", "aggregate", "evaluate")  # RoundRecord.phases_s

LOSS_LIMIT = 1000  # a median training loss above LOSS_LIMIT x ln(seen classes) (a uniform guess's loss): blown up
CHANCE_MARGIN = 1.1  # at chance: an accuracy on the seen classes at most 1.1 x chance
AT_CHANCE_TO_THE_END = 2  # ... in the run's last (at least) 2 evaluations, after it had learned


def round_divergence(model: Mapping[str, np.ndarray], losses: Sequence[float], seen_classes: int) -> str | None:
    """Why a round's outcome shows a diverged model, in a few words, or None: the aggregated model holds NaN or
    infinite values, or the median of the training losses the clients reported is NaN or infinite or above
    :data:`LOSS_LIMIT` times ln(seen classes). The median, so that a minority of the losses cannot decide
    it."""
    bad = [name for name, array in model.items() if array.dtype.kind == "f" and square_sum(array) is None]
    if bad:
        return f"the model holds NaN or infinite values after aggregation ({bad[0]})"
    if not losses:
        return None
    median = float(np.median([x if math.isfinite(x) else math.inf for x in losses]))
    limit = LOSS_LIMIT * math.log(max(2, seen_classes))
    if not math.isfinite(median):
        nonfinite = sum(not math.isfinite(x) for x in losses)
        return f"training loss became NaN or infinite on {nonfinite} of {len(losses)} clients"
    if median > limit:
        return f"median training loss {median:.3g}, over {limit:.0f} ({LOSS_LIMIT} x ln {max(2, seen_classes)})"
    return None


@dataclass(frozen=True)
class Evaluation:
    """The accuracy on the seen classes (percent) after round ``round`` and ``chance`` on them (percent): always
    answering the seen class with the most test samples."""
    round: int
    accuracy: float
    chance: float

    @property
    def at_chance(self) -> bool:
        return self.accuracy <= CHANCE_MARGIN * self.chance

    @property
    def learned(self) -> bool:
        """Clearly above chance: at least twice chance, or half-way from chance to 100 %, whichever is lower."""
        return self.accuracy >= min(2 * self.chance, (self.chance + 100) / 2)


def divergence(rounds: Sequence[RoundRecord], task_end_accuracy: Sequence[float] = (),
               chance: Sequence[float] = ()) -> tuple[int, str] | None:
    """The round where the run diverged and why, or None. Diverged: a round's :attr:`RoundRecord.diverged` (the
    first such round), or the accuracy on the seen classes fell to chance after having learned and stayed there:
    with the evaluations of the rounds and at each task's end (``task_end_accuracy[t]``, with ``chance[t]`` of
    task t), the last :data:`AT_CHANCE_TO_THE_END` or more are all at chance (at most :data:`CHANCE_MARGIN` x
    chance) and an earlier one had learned (:attr:`Evaluation.learned`); the round is the first of those at
    chance. Ordinary forgetting (FedAvg: each new task learnt, the old ones lost) stays well above chance."""
    first = next((r for r in rounds if r.diverged), None)
    if first is not None:
        return first.round, first.diverged
    evaluations = _evaluations(rounds, task_end_accuracy, chance)
    streak = len(evaluations)
    while streak and evaluations[streak - 1].at_chance:
        streak -= 1
    fell, before = evaluations[streak:], evaluations[:streak]
    best = max((e.accuracy for e in before if e.learned), default=None)
    if len(fell) < AT_CHANCE_TO_THE_END or best is None:
        return None
    return fell[0].round, (f"accuracy on the seen classes fell to {fell[0].accuracy:.1f} % after reaching "
                           f"{best:.1f} %, and stayed at chance ({fell[-1].chance:.1f} %) to the end")


def _evaluations(rounds: Sequence[RoundRecord], task_end_accuracy: Sequence[float],
                 chance: Sequence[float]) -> list[Evaluation]:
    """The run's evaluations in order: each round's ``accuracy_seen``, and each ended task's accuracy on the seen
    classes after that task's last round."""
    out: list[Evaluation] = []
    for i, r in enumerate(rounds):
        if r.accuracy_seen is not None and r.task < len(chance):
            out.append(Evaluation(r.round, r.accuracy_seen, chance[r.task]))
        task_ends = i + 1 == len(rounds) or rounds[i + 1].task != r.task
        if task_ends and r.task < min(len(task_end_accuracy), len(chance)):
            out.append(Evaluation(r.round, task_end_accuracy[r.task], chance[r.task]))
    return out


def mean_metrics(updates: list[ClientUpdate]) -> dict[str, float] | None:
    """The mean of each method metric (loss terms...) the round's clients reported (loss and training time
    have their own fields)."""
    sums: dict[str, list[float]] = {}
    for u in updates:
        for name, value in u.metrics.items():
            if name not in ("loss", "train_time_s") and math.isfinite(value):
                sums.setdefault(name, []).append(value)
    return {name: sum(v) / len(v) for name, v in sorted(sums.items())} or None


# the messages that carry a round's updates to the coordinator: its clients' own, or their edge aggregators'
UPDATE_TYPES = ("update", "secagg_masked", "update_held", "secagg_masked_held", "edge_aggregate")


class RoundMeter:
    """Started when a round starts: the host seconds of each phase (``collect`` also gives ``receive_updates``,
    the part of it spent handling updates), the coordinator's CPU seconds up to evaluation (its process's, and its
    main thread's in select, dispatch, aggregate and handling the updates: ``work_cpu_s``), the bytes on the
    wire."""

    def __init__(self, state: RunState):
        self.state = state
        self.started, self.cpu_started = time.perf_counter(), time.process_time()
        self.bytes_before = dict(state.counters.bytes)
        self.phases_s = dict.fromkeys(PHASES, 0.0)
        self.cpu_s: float | None = None
        self.work_cpu_s = 0.0  # the main thread's CPU seconds in the phases before evaluation

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (added up when a phase runs several times)."""
        t0, cpu0, handled = time.perf_counter(), time.thread_time(), self._update_handling()
        try:
            yield
        finally:
            self.phases_s[name] += time.perf_counter() - t0
            if name == "collect":  # the work is the updates' (heartbeats and joins meanwhile are the idle cost)
                now_handled = self._update_handling()
                self.phases_s["receive_updates"] += now_handled[0] - handled[0]
                self.work_cpu_s += now_handled[1] - handled[1]
            elif name != "evaluate":
                self.work_cpu_s += time.thread_time() - cpu0

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
        losses reported; ``diverged`` from :func:`round_divergence`. Written to ``events.jsonl`` and the metrics."""
        state = self.state
        finite = [x for x in losses if np.isfinite(x)]
        by_type = self._bytes_since()
        diverged = round_divergence(state.server.global_state, losses,
                                    len(state.scenario.seen_classes(fields["task"])))
        record = RoundRecord(
            **fields, diverged=diverged, client_metrics=mean_metrics(useful),
            samples=sum(u.num_samples for u in useful),
            mean_loss=float(np.mean(finite)) if finite else None,
            duration_s=time.perf_counter() - self.started,
            coordinator_cpu_s=self.cpu_s if self.cpu_s is not None else time.process_time() - self.cpu_started,
            phases_s=dict(self.phases_s), work_cpu_s=self.work_cpu_s, bytes_by_type=by_type,
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
            for sampling, key in (("poisson", "epsilon"), ("as_sampled", "epsilon_sampled")):
                value = record.privacy.get(key)
                state.metrics.privacy_epsilon.labels(sampling).set(math.inf if value is None else value)
        return record

    def _update_handling(self) -> tuple[float, float]:
        """Seconds, and main-thread CPU seconds, spent so far receiving and handling updates, plain and masked (or
        their notices and aggregates from edge aggregators)."""
        tally = self.state.tally
        return (sum(tally.handling_s[t] for t in UPDATE_TYPES), sum(tally.handling_cpu_s[t] for t in UPDATE_TYPES))

    def _bytes_since(self) -> dict[str, dict[str, int]]:
        """Bytes on the wire since the round started, as ``{type: {direction: bytes}}``."""
        out: dict[str, dict[str, int]] = {}
        for (msg_type, direction), n in self.state.counters.bytes.items():
            delta = n - self.bytes_before.get((msg_type, direction), 0)
            if delta:
                out.setdefault(msg_type, {})[direction] = delta
        return out
