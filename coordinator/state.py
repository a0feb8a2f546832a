"""The run state: what the coordinator's parts share, built once per run by :mod:`fcl_emu.coordinator.lifecycle`.

:class:`RunState` holds the run's fixed parts (config, scenario, the method's server part, evaluator), its
collaborators with state of their own (client registry, byte counters, Prometheus metrics, the event recorder)
and where the run is (task, global round). :class:`Tally` counts what the summary and the checkpoints report;
:class:`TimeAccount` splits this process's wall clock by part of the lifecycle. Each part of the coordinator
(dispatch, rounds, checkpoints, summary, node watch) receives the state and reads only what it names.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from fcl_emu.aggregation.policies import RoundPolicy
from fcl_emu.coordinator.clients import ClientRegistry
from fcl_emu.coordinator.evaluation import Evaluator
from fcl_emu.coordinator.guard import LogOnce
from fcl_emu.methods.base import ServerPart
from fcl_emu.methods.registry import MethodSpec
from fcl_emu.monitoring.metrics import CoordinatorMetrics
from fcl_emu.monitoring.results import RunRecorder, TimeAccounting
from fcl_emu.runconfig import RunConfig
from fcl_emu.scenario.devices import DeviceSet
from fcl_emu.scenario.scenario import Scenario
from fcl_emu.wire.sockets import Counters

ProgressHook = Callable[[str, dict], None]


def no_progress(kind: str, info: dict) -> None:
    """The progress hook of a run nobody watches."""


@dataclass
class Tally:
    """Counts over the run (kept in checkpoints, reported in the summary)."""

    rejected: Counter[str] = field(default_factory=Counter)  # refused messages by reason
    handling_s: Counter[str] = field(default_factory=Counter)  # time spent receiving+handling, by message type
    handling_cpu_s: Counter[str] = field(default_factory=Counter)  # and the main thread's CPU time in it
    late_updates: int = 0
    late_side_channel: int = 0  # side-channel messages from outside the open round, dropped
    connection_switches: int = 0  # messages from a client over another connection than its last one


class TimeAccount:
    """This session's wall clock by part of the lifecycle (the summary's ``time``)."""

    def __init__(self):
        self.parts_s: Counter[str] = Counter()
        self.started = time.perf_counter()

    def restart(self) -> None:
        self.parts_s.clear()
        self.started = time.perf_counter()

    @contextmanager
    def spent(self, part: str) -> Iterator[None]:
        """Add the wall-clock time of the block to ``part``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.parts_s[part] += time.perf_counter() - t0

    def accounting(self) -> TimeAccounting:
        """Seconds per part, the session's wall clock and the fraction the parts account for."""
        wall = time.perf_counter() - self.started
        parts = {part: round(seconds, 4) for part, seconds in sorted(self.parts_s.items())}
        return TimeAccounting(wall_s=round(wall, 4), parts_s=parts,
                              accounted=round(sum(self.parts_s.values()) / wall, 4) if wall > 0 else None)


@dataclass
class RunState:
    """One run's shared state (see the module docstring)."""

    config: RunConfig
    scenario: Scenario
    spec: MethodSpec
    server: ServerPart
    model_name: str
    evaluator: Evaluator
    registry: ClientRegistry
    metrics: CoordinatorMetrics
    run_id: str
    rng: np.random.Generator
    log_once: LogOnce
    policy: RoundPolicy  # the round policy and its state (a server optimiser's moments); checkpointed
    devices: DeviceSet | None = None  # the device profiles clients are assigned at join (None: none)
    counters: Counters = field(default_factory=Counters.empty)
    tally: Tally = field(default_factory=Tally)
    progress: ProgressHook = no_progress
    recorder: RunRecorder | None = None  # events.jsonl, while run() runs
    client_accuracy: list[float | None] = field(default_factory=list)  # accuracy_clients after each task
    task: int = 0
    global_round: int = 0

    def event(self, kind: str, /, **fields) -> None:
        """An event into ``events.jsonl`` (none before the run's recorder exists)."""
        if self.recorder is not None:
            self.recorder.event(kind, **fields)

    def rejected(self, reason: str, peer: str | None, line: str) -> None:
        """A refused message or upload (``reason`` of wire.framing.REASONS): counted (summary.json, the metric) and
        its ``line`` logged once per peer and reason."""
        self.tally.rejected[reason] += 1
        self.metrics.rejected(reason)
        self.log_once(peer, reason, line)

    def seen_accuracy(self, row: list[float | None], task: int) -> float:
        """Accuracy on every seen class: the row's task accuracies weighted by their test samples."""
        counts = [len(self.scenario.test_indices(self.scenario.task_classes(t))) for t in range(task + 1)]
        return float(np.average([a for a in row if a is not None],
                                weights=[n for a, n in zip(row, counts) if a is not None]))
