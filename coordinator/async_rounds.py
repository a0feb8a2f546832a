"""Asynchronous aggregation on the emulated clock: FedBuff and FedAsync as a round policy
(``--aggregation fedbuff|fedasync``, :mod:`fcl_emu.runconfig.aggregation`).

The server keeps ``concurrency`` clients training at once. Each is sent the global model's current *version*
(the number of aggregations so far) and trains from it; its update arrives at ``sent + down + compute + up`` in
emulated time, as a synchronous round's would (:mod:`fcl_emu.coordinator.emulated`). Arrivals are taken one at a time
in emulated-time order (ties: the earlier dispatch, then the client id), so the outcome depends on the seed and
the scenario only, not on how many edge nodes trained the clients or how busy the host was. Each arrival frees
its client's slot, and the next client (seeded draw among the eligible clients not training) is dispatched at
once with the then current version. An update whose *staleness* (versions applied since its own) exceeds
``max_staleness`` is discarded.

- **FedBuff** (Nguyen et al., AISTATS 2022, Algorithm 1): every ``buffer`` kept updates the server adds their
  mean, each delta weighted ``s(t) = 1 / sqrt(1 + t)`` (:func:`fedbuff_weight`); the weights are not
  renormalised, so stale updates take smaller steps. Deviation: the mean is the project's sample-weighted
  FedAvg mean (the paper's is uniform) with a server learning rate of 1.
- **FedAsync** (Xie et al., 2019, eq. "x <- (1 - a_t) x + a_t x_new"): every kept update is mixed in on arrival,
  ``a_t = alpha * (1 + t) ** -a`` (:func:`fedasync_mixing`, the paper's polynomial staleness function), where
  ``x_new`` is the client's model: the version it was sent plus its delta.

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

import math
import time
from dataclasses import dataclass

import numpy as np

from fcl_emu.coordinator.clock import EmulatedTime
from fcl_emu.coordinator.dispatch import Dispatcher
from fcl_emu.coordinator.open_round import OpenRound, StaleUpdates
from fcl_emu.coordinator.rounds import RoundRunner, _mean_metrics
from fcl_emu.coordinator.state import RunState
from fcl_emu.methods.base import DELTA, Arrays, ClientUpdate
from fcl_emu.monitoring.results import RoundRecord


def fedbuff_weight(staleness: int) -> float:
    """FedBuff's staleness weight ``1 / sqrt(1 + staleness)``."""
    return 1.0 / math.sqrt(1.0 + staleness)


def fedasync_mixing(alpha: float, exponent: float, staleness: int) -> float:
    """FedAsync's mixing weight ``alpha * (1 + staleness) ** -exponent`` (polynomial staleness function)."""
    return alpha * (1.0 + staleness) ** -exponent


def _scaled(update: ClientUpdate, tensors: Arrays) -> ClientUpdate:
    return ClientUpdate(update.client, update.num_samples, tensors, update.loss, update.metrics)


def fedbuff_update(update: ClientUpdate, staleness: int) -> ClientUpdate:
    """The update with its float deltas weighted by :func:`fedbuff_weight` (integer buffers as they are)."""
    w = fedbuff_weight(staleness)
    return _scaled(update, {k: v * np.float32(w) if k.startswith(DELTA) and v.dtype.kind == "f" else v
                            for k, v in update.tensors.items()})


def fedasync_update(update: ClientUpdate, staleness: int, alpha: float, exponent: float, sent: Arrays,
                    current: Arrays) -> ClientUpdate:
    """The update as the delta that takes the current model ``x`` to ``(1 - a) x + a (sent + delta)``."""
    a = fedasync_mixing(alpha, exponent, staleness)
    out = {}
    for key, value in update.tensors.items():
        name = key[len(DELTA):]
        if key.startswith(DELTA) and value.dtype.kind == "f" and name in current:
            mixed = a * (sent[name].astype(np.float64) + value - current[name])
            out[key] = mixed.astype(value.dtype)
        else:
            out[key] = value
    return _scaled(update, out)


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


class AsyncRoundRunner(RoundRunner):
    """``run_round`` runs the asynchronous policy up to its next aggregation (the module docstring)."""

    def __init__(self, state: RunState, dispatcher: Dispatcher, clock: EmulatedTime, stale: StaleUpdates):
        super().__init__(state, dispatcher, clock, stale)
        self.settings = state.config.aggregation
        self.concurrency = self.settings.resolved_concurrency(state.config.rounds.clients_per_round)
        self.needed = self.settings.buffer if self.settings.kind == "fedbuff" else 1
        self.version = 0
        self.versions: dict[int, Arrays] = {}  # fedasync: the global models clients may still train from
        self.flight: list[InFlight] = []
        self.waves = 0
        self.last_aggregation_at: float | None = None  # emulated; set at the first round (after a resume's restore)

    def run_round(self, task: int, task_round: int) -> RoundRecord:
        started, cpu_started = time.perf_counter(), time.process_time()
        bytes_before = dict(self.state.counters.bytes)
        if self.last_aggregation_at is None:
            self.last_aggregation_at = self.clock.emulated_now
        self.dispatcher.drain()
        self.state.global_round += 1
        number = self.state.global_round
        self.metrics.round_started(task, task_round, number)
        self.state.progress("round_start", {"task": task, "round": number})
        t0, handled_before = time.perf_counter(), self._update_handling_s()
        buffer, tally = self._collect(task, task_round)
        t_collect, t_updates = time.perf_counter() - t0, self._update_handling_s() - handled_before

        t0 = time.perf_counter()
        skipped = len(buffer) < self.needed
        applied = [] if skipped else self._aggregate(task, number, buffer)
        discarded, discarded_bytes = self._drain() if task_round == self.config.rounds.rounds_per_task - 1 else (0, 0)
        t_aggregate = time.perf_counter() - t0
        cpu_s = time.process_time() - cpu_started

        t0 = time.perf_counter()
        accuracy = self._phase_evaluate(task, task_round)
        t_eval = time.perf_counter() - t0

        useful = [f.update for f in buffer]
        losses = [u.loss for u in useful if np.isfinite(u.loss)]
        bytes_by_type = self._bytes_since(bytes_before)
        now = self.clock.emulated_now
        record = RoundRecord(
            task=task, round=number, task_round=task_round, selected=tally["dispatched"],
            participants=len(buffer), late=0, failed=tally["failed"], skipped=skipped, dropped=tally["lost"],
            stale_used=sum(staleness > 0 for _, staleness, _ in applied),
            client_metrics=_mean_metrics(useful), train_s_by_class=None,
            samples=sum(u.num_samples for u in useful),
            mean_loss=float(np.mean(losses)) if losses else None, accuracy_seen=accuracy,
            duration_s=time.perf_counter() - started, coordinator_cpu_s=cpu_s,
            phases_s={"select": 0.0, "dispatch": tally["dispatch_s"], "collect": t_collect,
                      "receive_updates": t_updates, "aggregate": t_aggregate, "evaluate": t_eval},
            bytes_sent=sum(d.get("sent", 0) for d in bytes_by_type.values()),
            bytes_received=sum(d.get("received", 0) for d in bytes_by_type.values()),
            bytes_by_type=bytes_by_type, online=len(self.registry.online()),
            emulated_s=now - self.last_aggregation_at, emulated_clock_s=now, host_timeout=tally["host_timeout"],
            bytes_discarded=discarded_bytes, contributors=[] if skipped else sorted(f.client for f in buffer))
        self.last_aggregation_at = now
        self._phase_record(record)
        self.state.event("async_aggregation", task=task, round=number, policy=self.settings.kind,
                         version=self.version, clients=[f.client for f in buffer],
                         staleness=[s for _, s, _ in applied], weights=[w for _, _, w in applied],
                         discarded_too_stale=tally["too_stale"], discarded_task_end=discarded)
        return record

    # ------------------------------------------------------------ the event loop
    def _collect(self, task: int, task_round: int) -> tuple[list[InFlight], dict]:
        """Keep ``concurrency`` clients training and take arrivals in emulated-time order until the buffer holds
        what one aggregation needs, or no client is left to train."""
        tally = dict(dispatched=0, failed=0, lost=0, too_stale=0, host_timeout=False, dispatch_s=0.0)
        buffer: list[InFlight] = []
        while len(buffer) < self.needed:
            self._fill(task, task_round, tally)
            if not self.flight:
                break
            arrived = min(self.flight, key=InFlight.order)
            self.flight.remove(arrived)
            self.clock.advance(arrived.arrival)
            if arrived.update is None:
                continue
            if self.version - arrived.version > self.settings.max_staleness:
                tally["too_stale"] += 1
                self.metrics.stale_update_discarded("too_stale")
                continue
            if arrived.update.num_samples > 0:
                buffer.append(arrived)
        return buffer, tally

    def _fill(self, task: int, task_round: int, tally: dict) -> None:
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
        t0 = time.perf_counter()
        self.dispatcher.round = r
        try:
            self._phase_dispatch(r, task_round)
            tally["dispatch_s"] += time.perf_counter() - t0
            self.state.progress("dispatched", {"task": task, "round": self.state.global_round,
                                               "selected": len(chosen)})
            online = self.registry.is_online
            self.dispatcher.serve(lambda: not r.pending(online), time.monotonic() + self.config.rounds.host_timeout_s)
        finally:
            self.dispatcher.round = None
        tally["host_timeout"] |= bool(r.pending(self.registry.is_online))
        tally["dispatched"] += len(chosen)
        updates = {u.client: u for u in r.updates}
        for client in chosen:
            took = r.timeline[client].arrival if client in r.timeline else None  # relative to the dispatch
            if took is None or client in r.lost:
                tally["lost"] += 1  # gone on the host before it answered: its slot is free again now
                continue
            tally["failed"] += client in r.failed
            self.flight.append(InFlight(client, self.version, self.waves, now + took,
                                        None if client in r.failed else updates.get(client),
                                        r.timeline[client].up_bytes))
        if self.settings.kind == "fedasync":
            self.versions[self.version] = self.state.server.global_state

    def _aggregate(self, task: int, number: int, buffer: list[InFlight]) -> list[tuple[str, int, float]]:
        """Apply the buffer through the method's server part; returns (client, staleness, weight) per update."""
        s = self.settings
        server = self.state.server
        applied, updates = [], []
        for f in buffer:
            staleness = self.version - f.version
            if s.kind == "fedbuff":
                updates.append(fedbuff_update(f.update, staleness))
                weight = fedbuff_weight(staleness)
            else:
                updates.append(fedasync_update(f.update, staleness, s.async_alpha, s.async_staleness_exponent,
                                               self.versions[f.version], server.global_state))
                weight = fedasync_mixing(s.async_alpha, s.async_staleness_exponent, staleness)
            applied.append((f.client, staleness, weight))
        server.aggregate(task, number, updates)
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
        self.flight, self.versions = [], {}
        return count, nbytes
