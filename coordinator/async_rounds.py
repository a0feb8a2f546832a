"""Asynchronous aggregation on the emulated clock: the round policies of :mod:`fcl_emu.aggregation.policies` that
take updates as they arrive (``--aggregation fedbuff|fedasync``). The synchronous rounds' sibling
(:mod:`fcl_emu.coordinator.rounds`): the same requests, meter and record, another loop.

The server keeps ``concurrency`` clients training at once. Each is sent the global model's current *version*
(the number of aggregations so far) and trains from it; its update arrives at ``sent + down + compute + up`` in
emulated time, as a synchronous round's would (:mod:`fcl_emu.coordinator.emulated`). Arrivals are taken one at a
time in emulated-time order (ties: the earlier dispatch, then the client id), so the outcome depends on the seed
and the scenario only, not on how many edge nodes trained the clients or how busy the host was. Each arrival frees
its client's slot, and the next client (seeded draw among the eligible clients not training) is dispatched at
once with the then current version. An update whose *staleness* (versions applied since its own) exceeds
``max_staleness`` is discarded; every ``policy.needed`` kept updates are aggregated, each weighed by the policy
(FedBuff: ``1 / sqrt(1 + staleness)``; FedAsync: mixed in with ``alpha (1 + staleness)^-a``).

Each aggregation's updates are bounded first as a plain round's cohort is
(:func:`fcl_emu.aggregation.defences.bound`: ``--max-update-norm`` on arrival, then the direction check,
``--clip-norm`` and the adaptive bound), over the buffer together with the last :data:`WINDOW` updates applied
in the task (FedAsync's buffer is one update): an update that agrees with nothing of them is refused
(``off_cohort``) and the rest are aggregated without it; one beyond ``--adaptive-clip`` times their median norm is
scaled down to it. The robust rules do not apply (the configuration refuses them: the staleness weights replace
the mean). As in a plain round of fewer than 3 updates, the first two updates of a FedAsync task are not checked
for direction.

Each aggregation is one round record (``events.jsonl``'s ``round``; reports and accuracy matrices read them
as they read synchronous rounds), followed by an ``async_aggregation`` event with every applied update's client,
staleness and weight; the staleness also goes into ``fcl_update_staleness_versions``.

Task boundaries: after a task's last aggregation the updates still in flight are discarded (counted in the
round's ``bytes_discarded`` and ``fcl_stale_updates_discarded_total{reason="task_end"}``). They were trained on
the finished task's classes from a model whose head the next task grows, so they neither fit the new model nor
belong to the new task: applying them would replay old-task data the clients no longer hold, which class-
incremental learning rules out. The clients are told the next task at their next dispatch, as in a synchronous
run.

What the emulated clock models here: device and link heterogeneity (stragglers) fully; availability when a
client is picked (an away client is not dispatched). A client that goes away while training still delivers,
and crashes are not drawn (the configuration refuses ``--crash-rate`` with an asynchronous policy). A run
resumed from a checkpoint starts with no client in flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fcl_emu.aggregation.defences import Defences, bound
from fcl_emu.aggregation.policies import RoundPolicy
from fcl_emu.aggregation.update import Arrays, ClientUpdate
from fcl_emu.coordinator.clock import EmulatedTime
from fcl_emu.coordinator.collection import Collection
from fcl_emu.coordinator.dispatch import Dispatcher
from fcl_emu.coordinator.open_round import OpenRound
from fcl_emu.coordinator.requests import RoundRequests
from fcl_emu.coordinator.round_record import RoundMeter
from fcl_emu.coordinator.state import RunState
from fcl_emu.monitoring.results import RoundRecord

WINDOW = 10  # the updates applied last in the task that each aggregation's buffer is bounded with


@dataclass
class InFlight:
    """One dispatched client: the version it was sent, and (once the host trained it) its emulated arrival."""

    client: str
    version: int
    wave: int  # the dispatch batch: the train request's round number, and the first tie-break after time
    arrival: float
    update: ClientUpdate | None  # None: it failed (an error, a refused update)
    up_bytes: int

    def order(self) -> tuple[float, int, str]:
        return self.arrival, self.wave, self.client


@dataclass
class Waves:
    """What the dispatch waves of one aggregation came to."""

    dispatched: int = 0
    failed: int = 0
    lost: int = 0  # gone on the host before answering
    too_stale: int = 0
    host_timeout: bool = False


class AsyncRoundRunner:
    """``run_round`` runs the asynchronous policy up to its next aggregation (the module docstring)."""

    def __init__(self, state: RunState, dispatcher: Dispatcher, clock: EmulatedTime, collection: Collection,
                 policy: RoundPolicy):
        self.state, self.config, self.registry, self.metrics = state, state.config, state.registry, state.metrics
        self.dispatcher, self.clock, self.policy = dispatcher, clock, policy
        self.requests = RoundRequests(state, dispatcher, clock, collection)
        self.concurrency = policy.options.resolved_concurrency(state.config.rounds.clients_per_round)
        self.version = 0
        self.versions: dict[int, Arrays] = {}  # the global models clients may still train from (policy's choice)
        self.flight: list[InFlight] = []
        self.waves = 0
        self.last_aggregation_at: float | None = None  # emulated; set at the first round (after a resume's restore)
        self.energy: dict[str, list[float]] = {}  # joules of the waves dispatched since the last aggregation
        self.defences = Defences.of(state.config.aggregation)
        self.window: list[ClientUpdate] = []  # the last WINDOW updates applied in the task, as they arrived

    def run_round(self, task: int, task_round: int) -> RoundRecord:
        meter = RoundMeter(self.state)
        if self.last_aggregation_at is None:
            self.last_aggregation_at = self.clock.emulated_now
        self.dispatcher.drain()
        self.state.global_round += 1
        number = self.state.global_round
        self.metrics.round_started(task, task_round, number)
        self.state.progress("round_start", {"task": task, "round": number, "task_round": task_round})
        with meter.phase("collect"):
            buffer, waves = self._collect(task, task_round, meter)
        with meter.phase("aggregate"):
            full = len(buffer) >= self.policy.needed
            buffer = self._bounded(buffer) if full else buffer
            skipped = not (full and buffer)
            applied = [] if skipped else self._aggregate(task, number, buffer)
            last = task_round == self.config.rounds.rounds_per_task - 1
            discarded, discarded_bytes = self._drain() if last else (0, 0)
        accuracy = meter.evaluate(task, task_round)
        useful = [f.update for f in buffer]
        now = self.clock.emulated_now
        record = meter.record(
            useful=useful, losses=[u.loss for u in useful], accuracy_seen=accuracy,
            task=task, round=number, task_round=task_round, selected=waves.dispatched, participants=len(buffer),
            late=0, failed=waves.failed, skipped=skipped, dropped=waves.lost,
            stale_used=sum(staleness > 0 for _, staleness, _ in applied), train_s_by_class=None,
            emulated_s=now - self.last_aggregation_at, emulated_clock_s=now, host_timeout=waves.host_timeout,
            bytes_discarded=discarded_bytes, contributors=[] if skipped else sorted(f.client for f in buffer),
            energy_j=self.energy or None, low_battery=len(self.clock.energy.sitting_out))
        self.last_aggregation_at, self.energy = now, {}
        self.state.event("async_aggregation", task=task, round=number, policy=self.policy.name,
                         version=self.version, clients=[f.client for f in buffer],
                         staleness=[s for _, s, _ in applied], weights=[w for _, _, w in applied],
                         discarded_too_stale=waves.too_stale, discarded_task_end=discarded)
        return record

    # ------------------------------------------------------------ the event loop
    def _collect(self, task: int, task_round: int, meter: RoundMeter) -> tuple[list[InFlight], Waves]:
        """Keep ``concurrency`` clients training and take arrivals in emulated-time order until the buffer holds
        what one aggregation needs, or no client is left to train."""
        waves = Waves()
        buffer: list[InFlight] = []
        while len(buffer) < self.policy.needed:
            self._fill(task, task_round, waves, meter)
            if not self.flight:
                break
            arrived = min(self.flight, key=InFlight.order)
            self.flight.remove(arrived)
            self.clock.advance(arrived.arrival)
            if arrived.update is None:
                continue
            if self.version - arrived.version > self.policy.options.max_staleness:
                waves.too_stale += 1
                self.metrics.stale_update_discarded("too_stale")
                continue
            if arrived.update.num_samples > 0:
                buffer.append(arrived)
        return buffer, waves

    def _fill(self, task: int, task_round: int, waves: Waves, meter: RoundMeter) -> None:
        """Dispatch seeded picks among the eligible idle clients up to ``concurrency`` at the emulated now, and
        serve the socket until each has answered or is gone (its emulated arrival is then known)."""
        self.clock.before_selection(task, self.dispatcher.serve)
        busy = {f.client for f in self.flight}
        idle = [r for r in self.registry.eligible(task) if r.client_id not in busy]
        k = min(self.concurrency - len(self.flight), len(idle))
        if k <= 0:
            return
        picks = sorted(self.state.rng.choice(len(idle), size=k, replace=False))
        chosen = [idle[i].client_id for i in picks]
        self.waves += 1
        r = OpenRound(task, self.waves, chosen, set(chosen), wanted=len(chosen))  # started_at 0: relative times
        now = self.clock.emulated_now
        self.dispatcher.round = r
        try:
            with meter.phase("dispatch"):
                self.requests.send(r, task_round, progress_round=self.state.global_round)
            online = self.registry.is_online
            self.dispatcher.serve(lambda: not r.awaiting(online), time.monotonic() + self.config.rounds.host_timeout_s)
        finally:
            self.dispatcher.round = None
        waves.host_timeout |= bool(r.pending(self.registry.is_online))
        waves.dispatched += len(chosen)
        for client, joules in self.clock.energy.spend(r.timeline, now).items():
            self.energy[client] = [a + b for a, b in zip(self.energy.get(client, [0.0, 0.0]), joules)]
        updates = {u.client: u for u in r.updates}
        for client in chosen:
            took = r.timeline[client].arrival if client in r.timeline else None  # relative to the dispatch
            if took is None or client in r.lost:
                waves.lost += 1  # gone on the host before it answered: its slot is free again now
                continue
            waves.failed += client in r.failed
            self.flight.append(InFlight(client, self.version, self.waves, now + took,
                                        None if client in r.failed else updates.get(client),
                                        r.timeline[client].up_bytes))
        if self.policy.keeps_sent_models:
            self.versions[self.version] = self.state.server.global_state

    def _bounded(self, buffer: list[InFlight]) -> list[InFlight]:
        """The buffer after the plain round's defences over it and :attr:`window` (the module docstring): the
        updates refused are counted under their reasons and left out, the others bounded; the window moves on."""
        earlier = [ClientUpdate(f"applied-{i}", u.num_samples, u.tensors, square_sums=u.square_sums)
                   for i, u in enumerate(self.window)]  # named apart from the buffer's (a client may be in both)
        kept, refused = bound([f.update for f in buffer] + earlier, self.defences, self.state.server.summable,
                              cohort="the buffer and the updates applied before it")
        for client, (reason, detail) in refused.items():
            if not client.startswith("applied-"):
                self.state.rejected(reason, client, detail)
        bounded = {u.client: u for u in kept}
        self.window = (self.window + [f.update for f in buffer if f.client in bounded])[-WINDOW:]
        return [InFlight(f.client, f.version, f.wave, f.arrival, bounded[f.client], f.up_bytes)
                for f in buffer if f.client in bounded]

    def _aggregate(self, task: int, number: int, buffer: list[InFlight]) -> list[tuple[str, int, float]]:
        """Apply the buffer through the method's server part, each update as the policy weighs it; returns
        (client, staleness, weight) per update."""
        server = self.state.server
        applied, updates = [], []
        for f in buffer:
            staleness = self.version - f.version
            update, weight = self.policy.weigh(f.update, staleness, self.versions.get(f.version), server.global_state)
            updates.append(update)
            applied.append((f.client, staleness, weight))
        self.policy.apply(server, task, number, updates)
        self.version += 1
        self.metrics.updates_applied([staleness for _, staleness, _ in applied])
        oldest = min([f.version for f in self.flight], default=self.version)
        self.versions = {v: m for v, m in self.versions.items() if v >= oldest}
        return applied

    def _drain(self) -> tuple[int, int]:
        """At a task's end: discard the updates in flight (the module docstring says why). Returns how many, and
        their upload bytes."""
        count, nbytes = len(self.flight), sum(f.up_bytes for f in self.flight)
        if count:
            self.metrics.stale_update_discarded("task_end", count)
        self.flight, self.versions, self.window = [], {}, []
        return count, nbytes
