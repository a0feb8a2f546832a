"""The run's clock, one interface with two implementations chosen once per run (:func:`make_clock`).

- :class:`RealTime` (``--clock real``): the federation's time is the host's. The edge nodes emulate
  availability, crashes, device speed and links in host seconds (their :class:`~fcl_emu.wire.messages.EdgeSettings`
  carry everything); a round waits in host time until enough updates arrived or its deadline passed.
- :class:`EmulatedTime` (the default): the federation's time is computed (:mod:`fcl_emu.coordinator.emulated`) from each
  client's own work, device and bytes, so the same seed gives the same rounds on a busy or a quiet host. The
  nodes emulate nothing in host time; a round waits until every selected client answered or is gone, then is
  closed in emulated time (a secure round: each of its SecAgg+ phases, :mod:`fcl_emu.coordinator.secure_timeline`).

The round runner and the dispatcher call the same methods on either; neither asks which one it has. A round's
collection (:mod:`fcl_emu.coordinator.collection`, plain or secure, also chosen once) asks for its kind of wait:
:meth:`RunClock.collect` or :meth:`RunClock.collect_secure`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from fcl_emu.coordinator.clients import ClientRecord
from fcl_emu.coordinator.emulated import ClientRound, EmulatedClock
from fcl_emu.coordinator.energy import EnergyLedger
from fcl_emu.coordinator.open_round import OpenRound
from fcl_emu.coordinator.secure_round import SecureOutcome, SecureRound
from fcl_emu.coordinator.secure_timeline import SecureTimeline
from fcl_emu.coordinator.state import RunState
from fcl_emu.scenario.availability import AvailabilitySpec, client_availability, parse_availability
from fcl_emu.scenario.devices import DeviceProfile
from fcl_emu.scenario.network_trace import client_trace, load_network_trace
from fcl_emu.wire.messages import EdgeSettings

Serve = Callable[[Callable[[], bool], float], None]  # serve(until, monotonic deadline): the dispatcher's loop
SideChannel = Callable[[str, int, str, dict[str, np.ndarray]], None]  # (client, task, type, tensors) to the method


class RunClock(ABC):
    """What the coordinator's rounds ask of time (see the module docstring)."""

    kind: str  # "real" or "emulated": the summary's ``clock``
    energy: EnergyLedger | None = None  # the clients' energy and batteries (the emulated clock's)

    def __init__(self, state: RunState, availability: AvailabilitySpec):
        self.state = state
        self.availability = availability
        self.started = time.monotonic()  # host time since the run started (a resumed run: since it first did)

    @property
    def emulated_now(self) -> float | None:
        """The emulated clock's time; None under the real clock."""
        return None

    def checkpoint_fields(self) -> dict:
        return {"run_clock_s": time.monotonic() - self.started, "emulated_clock_s": self.emulated_now}

    def restore(self, fields: dict) -> None:
        """Take a checkpoint's clock fields back (:meth:`checkpoint_fields`)."""
        self.started = time.monotonic() - fields["run_clock_s"]

    @abstractmethod
    def edge_settings(self, index: int, profile: DeviceProfile | None) -> EdgeSettings:
        """What client ``index``'s edge node emulates in host time."""

    def catch_up(self, task: int) -> list[ClientRecord]:
        """Bring the registry's view of who is online, and eligible for ``task``, up to now; returns the eligible
        clients. The run calls it once the population is in, so that the first round's selection does not do it
        for every client at once (at 100,000 clients: their first availability and battery schedules, and the
        sort of the eligible)."""
        return self.state.registry.eligible(task)

    def before_selection(self, task: int, serve: Serve) -> None:
        """Bring the registry's view of who is online up to the round's start (:meth:`catch_up`); with fewer than
        ``min_participants`` eligible, wait (in this clock's time) for clients to come back, within a deadline."""
        if len(self.catch_up(task)) < self.state.config.rounds.min_participants:
            self._await_quorum(task, serve)

    @abstractmethod
    def _await_quorum(self, task: int, serve: Serve) -> None:
        """Wait, in this clock's time and within a deadline, for enough eligible clients to come back."""

    def joined(self, client: str) -> None:
        """``client`` joined, or joined again, its device profile drawn."""

    def open_round(self, r: OpenRound) -> None:
        """The round ``r`` opens now."""

    def dispatched(self, r: OpenRound, client: str, profile: DeviceProfile, down_bytes: int) -> None:
        """``client`` was sent ``down_bytes`` for round ``r`` (task start, assets, train request)."""

    def answered(self, r: OpenRound, client: str, nbytes: int, cpu_s: float, samples_trained: int) -> None:
        """A selected client's answer (update or error) of ``nbytes`` arrived, after ``cpu_s`` of its work."""

    def hopeless(self, r: OpenRound) -> list[str]:
        """Selected clients of round ``r`` whose update is now known to be unable to count: the host may cancel
        their training (they join ``r.cancelled``). None under the real clock."""
        return []

    def hold_side_channel(self, r: OpenRound, client: str, msg_type: str, nbytes: int,
                          tensors: dict[str, np.ndarray]) -> bool:
        """Whether a side-channel message of the open round waits for the round's close (True) or goes to the
        method now (False)."""
        return False

    @abstractmethod
    def collect(self, r: OpenRound, serve: Serve, side_channel: SideChannel) -> None:
        """Serve until plain round ``r`` is over and close it (the updates that count, late, dropped)."""

    @abstractmethod
    def collect_secure(self, r: OpenRound, secure: SecureRound, serve: Serve) -> SecureOutcome:
        """Run secure round ``r``'s SecAgg+ phases, close it (late, dropped) and return its outcome."""


    def wide_area(self, r: OpenRound, seconds: float) -> None:
        """Round ``r`` spent ``seconds`` after its close on its edge aggregators' links to the coordinator (the
        model down, the aggregates up): the emulated clock moves on by them and the round's ``emulated_s`` counts
        them; in real time they are spent already."""


class RealTime(RunClock):
    kind = "real"

    def edge_settings(self, index: int, profile: DeviceProfile | None) -> EdgeSettings:
        edge, seed = self.state.config.edge, self.state.config.seed
        return EdgeSettings(
            availability=client_availability(self.availability, index, seed, slot_s=edge.availability_slot_s,
                                             trace_time_scale=edge.trace_time_scale),
            profile=None if profile is None else profile.to_wire(), crash_rate=edge.crash_rate,
            crash_downtime_s=edge.crash_downtime_s, clock_s=time.monotonic() - self.started)

    def _await_quorum(self, task: int, serve: Serve) -> None:
        cfg, registry = self.state.config.rounds, self.state.registry
        wait_s = min(cfg.deadline_s, registry.liveness_timeout_s)
        serve(lambda: registry.online_count >= cfg.min_participants, time.monotonic() + wait_s)

    def collect(self, r: OpenRound, serve: Serve, side_channel: SideChannel) -> None:
        """Serve until the round is done or its deadline passed; every update that arrived counts."""
        online = self.state.registry.is_online
        serve(lambda: r.done(online), time.monotonic() + self.state.config.rounds.deadline_s)
        r.counted = list(r.updates)
        self._close(r)

    def collect_secure(self, r: OpenRound, secure: SecureRound, serve: Serve) -> SecureOutcome:
        """Run the protocol while the clients train, each phase for its time in host seconds, until the round's
        deadline."""
        cfg, online = self.state.config.rounds, self.state.registry.is_online
        outcome = secure.collect(serve, online, lambda c: online(c) and c not in r.failed and c not in r.lost,
                                 r.wanted, time.monotonic() + cfg.deadline_s, cfg.min_participants)
        self._close(r)
        return outcome

    def _close(self, r: OpenRound) -> None:
        """Count who missed the deadline and who dropped out; the training times are the reported ones."""
        online = self.state.registry.is_online
        r.late = len(r.pending(online))
        r.dropped = len(r.selected - r.answered() - r.pending(online))
        r.train_s, r.masked_in_time = dict(r.reported_s), set(r.masked)


class EmulatedTime(RunClock):
    kind = "emulated"

    def __init__(self, state: RunState, availability: AvailabilitySpec, liveness_timeout_s: float):
        super().__init__(state, availability)
        edge = state.config.edge
        self.model = EmulatedClock(availability, seed=state.config.seed, slot_s=edge.availability_slot_s,
                                   trace_time_scale=edge.trace_time_scale, crash_rate=edge.crash_rate,
                                   crash_downtime_s=edge.crash_downtime_s, liveness_timeout_s=liveness_timeout_s)
        self._trained = [0.0, 0]  # CPU seconds and samples the clients' trainings took: the host's cost per sample
        self.traces = load_network_trace(edge.network_trace) if edge.network_trace else None
        self.energy = EnergyLedger(state, availability)

    @property
    def emulated_now(self) -> float:
        return self.model.now

    def checkpoint_fields(self) -> dict:
        return {**super().checkpoint_fields(), "energy": self.energy.checkpoint()}

    def restore(self, fields: dict) -> None:
        super().restore(fields)
        self.model.now = fields.get("emulated_clock_s") or 0.0  # crash downtimes in flight are not kept
        self.energy.restore(fields.get("energy"))

    def edge_settings(self, index: int, profile: DeviceProfile | None) -> EdgeSettings:
        """Nothing in host time: availability, crashes and delays are this clock's."""
        return EdgeSettings(profile=None if profile is None else profile.to_wire(), clock="emulated")

    def catch_up(self, task: int) -> list[ClientRecord]:
        self._follow_availability(self.model.now)
        self.energy.check(self.model.now)
        return super().catch_up(task)

    def joined(self, client: str) -> None:
        self.energy.joined(client)
        if self.model.churns:  # its availability is looked at from the next time the clock moves on
            self.model.schedule(client, self.state.registry.records[client].index, at=self.model.now)

    def open_round(self, r: OpenRound) -> None:
        r.started_at = self.model.now
        r.low_battery = len(self.energy.sitting_out)

    def advance(self, t: float) -> None:
        """Move the emulated clock to ``t`` (never back), following availability (asynchronous aggregation: an
        update's arrival)."""
        self._follow_availability(t)

    def wide_area(self, r: OpenRound, seconds: float) -> None:
        if seconds > 0:
            self._follow_availability(self.model.now + seconds)
            r.emulated_s = (r.emulated_s or 0.0) + seconds

    def dispatched(self, r: OpenRound, client: str, profile: DeviceProfile, down_bytes: int) -> None:
        index = self.state.registry.records[client].index
        if self.state.devices is not None:
            profile = self.state.devices.in_task(profile, r.task)
        c = r.timeline[client] = ClientRound(profile, down_bytes=down_bytes,
                                             trace=client_trace(self.traces, index) if self.traces else None)
        if self.skips_late:
            c.samples_trained = self._samples_trained(index, r.task)
            # a useful update carries a delta of every tensor of the global model (the dispatcher checks it)
            min_up_bytes = sum(a.nbytes for a in self.state.server.global_state.values()) if c.samples_trained else 0
            c.earliest = self.model.earliest_arrival(r.started_at, c, min_up_bytes)

    def answered(self, r: OpenRound, client: str, nbytes: int, cpu_s: float, samples_trained: int) -> None:
        timeline = r.timeline.get(client)
        if timeline is not None:
            timeline.up_bytes += nbytes
            timeline.arrival = self.model.arrival(r.started_at, timeline, cpu_s, samples_trained)
        if samples_trained:
            self._trained[0] += cpu_s
            self._trained[1] += samples_trained

    @property
    def skips_late(self) -> bool:
        """Whether late trainings are cancelled: asked for (``rounds.skip_late``), and nothing of the run
        depends on them (synchronous rounds: an asynchronous policy has no round deadline to be late for; no
        secure aggregation, no late updates kept for the next round, and a method whose jobs leave no client
        state behind)."""
        cfg, state = self.state.config, self.state
        keeps_late = cfg.rounds.late_updates == "next_round" and state.server.accepts_stale_updates
        return (cfg.rounds.skip_late and not cfg.aggregation.asynchronous and not cfg.secagg.enabled
                and not keeps_late and not state.spec.client.keeps_state)

    def hopeless(self, r: OpenRound) -> list[str]:
        """The clients the emulated clock knows are late whatever happens (EmulatedClock.beyond_close), where
        late trainings are cancelled. Their compute time is known: the round records it as if they trained."""
        registry, cfg = self.state.registry, self.state.config.rounds
        if not self.skips_late or (r.hopeless_checked and r.useful() < r.wanted):
            return []  # with fewer useful updates than wanted the round closes at its deadline: known at dispatch
        r.hopeless_checked = True
        useful = {u.client for u in r.updates if u.num_samples > 0}
        indices = {c: registry.records[c].index for c in r.timeline}
        late = self.model.beyond_close(r.started_at, cfg.deadline_s, r.wanted, r.timeline, indices, useful,
                                       r.number)
        cancelled = sorted(late - r.cancelled - r.answered() - r.lost)
        for client in cancelled:
            c = r.timeline[client]
            c.compute_s = c.profile.compute_s(0.0, c.samples_trained)
        r.cancelled.update(cancelled)
        if cancelled:
            self.state.metrics.skipped_trainings.inc(len(cancelled))
        return cancelled

    def hold_side_channel(self, r: OpenRound, client: str, msg_type: str, nbytes: int,
                          tensors: dict[str, np.ndarray]) -> bool:
        """It counts if the client's update makes the deadline: held until the close."""
        if client in r.timeline:
            r.timeline[client].up_bytes += nbytes
        r.side.append((client, msg_type, tensors))
        return True

    def collect(self, r: OpenRound, serve: Serve, side_channel: SideChannel) -> None:
        """Serve until every selected client answered or is gone (or the host-side safety timeout), then close
        the round in emulated time."""
        online = self.state.registry.is_online
        serve(lambda: not r.awaiting(online), time.monotonic() + self.state.config.rounds.host_timeout_s)
        self._close(r, side_channel)
        return None

    # ------------------------------------------------------------------ helpers
    def _follow_availability(self, t: float) -> None:
        """Move the emulated clock to ``t``; mark connected clients away or back by their availability models
        and crash downtimes: those whose state may have changed since they were last looked at (scheduled at
        their join, and then at their next change; one that left is scheduled again when it joins)."""
        if not self.model.churns:  # everyone always available: nothing to follow
            self.model.now = max(self.model.now, t)
            return
        registry, metrics = self.state.registry, self.state.metrics
        due = [(client, index) for client, index in self.model.due(max(self.model.now, t))
               if registry.is_online(client)]
        states = self.model.availability_at(t, due)
        for client, index in due:
            available = states[client]
            if registry.set_away(client, not available):
                if available:
                    metrics.client_joined(rejoin=True)
                else:
                    metrics.client_left()
                self.state.progress("join" if available else "leave", {"client": client})
            self.model.schedule(client, index)

    def _await_quorum(self, task: int, serve: Serve) -> None:
        """Too few clients online for a round: move the emulated clock to when enough are, within a deadline
        (or to the deadline: the round that follows is skipped); nothing is served meanwhile."""
        cfg, registry = self.state.config.rounds, self.state.registry
        until = self.model.now + cfg.deadline_s
        while len(registry.eligible(task)) < cfg.min_participants:
            away = [(r.client_id, r.index) for r in registry.connected() if r.away and r.join_task <= task]
            t = self.model.next_change(away)
            self._follow_availability(min(t, until))
            if t >= until:
                return

    def _close(self, r: OpenRound, side_channel: SideChannel) -> None:
        """Keep the updates that arrived by the close, hand their side-channel messages to the method, count the
        late, the gone and the crashed (coordinator.emulated)."""
        state = self.state
        cfg, registry, tally = state.config.rounds, state.registry, state.tally
        r.host_timeout = bool(r.pending(registry.is_online))
        if r.host_timeout:
            state.log_once(None, "host timeout", f"round {r.number}: clients still working after the host-side "
                                                 f"safety timeout of {cfg.host_timeout_s:g} s; they count as late")
        useful = {u.client for u in r.updates if u.num_samples > 0}
        indices = {c: registry.records[c].index for c in r.timeline}
        closing = self.model.close(r.started_at, cfg.deadline_s, r.wanted, r.timeline, indices, useful, r.number)
        late = [u for u in r.updates if u.client in closing.arrived_late]
        r.counted = [u for u in r.updates if u.client in closing.on_time]
        for client, kind, tensors in r.side:
            if client in closing.on_time:
                side_channel(client, r.task, kind, tensors)
            else:
                tally.late_side_channel += 1
        self._crashed(closing.crashed)
        self._late(len(late))
        if cfg.late_updates == "next_round" and state.server.accepts_stale_updates:
            r.kept_late = [u for u in late if u.num_samples > 0]
        gone_on_host = self._gone_on_host(r)
        r.late = len(closing.late - r.failed - gone_on_host)
        r.dropped = len(closing.gone | gone_on_host) + len(r.selected - r.timeline.keys())
        r.bytes_discarded = sum(r.timeline[c].up_bytes for c in closing.lost_uploads)
        r.emulated_s = closing.closed_at - r.started_at
        r.train_s = {c: t.compute_s for c, t in r.timeline.items() if t.compute_s is not None}
        cpu_s, samples = self._trained  # the cancelled trainings' samples at the host's CPU time per sample
        skipped = r.cancelled - r.answered()  # a cancel may cross an update already sent
        r.host_cpu_saved_s = sum(r.timeline[c].samples_trained for c in skipped) * cpu_s / max(samples, 1)
        r.energy = self.energy.spend(r.timeline, closing.closed_at)

    def collect_secure(self, r: OpenRound, secure: SecureRound, serve: Serve) -> SecureOutcome:
        """Run a secure round's phases, each closed in emulated time (:mod:`fcl_emu.coordinator.secure_timeline`);
        then count the late, the gone and the crashed as :meth:`_close` does."""
        state = self.state
        cfg, registry, online = state.config.rounds, state.registry, state.registry.is_online
        indices = {c: registry.records[c].index for c in r.timeline}
        samples = {c: self._samples_trained(i, r.task) for c, i in indices.items()}
        timeline = SecureTimeline(self.model, r, secure, indices, samples, cfg.deadline_s)
        outcome = timeline.run(serve, time.monotonic() + cfg.host_timeout_s,
                               lambda c: online(c) and c not in r.failed and c not in r.lost, online,
                               cfg.min_participants)
        closed_at = timeline.opened
        r.masked_in_time, r.host_timeout = timeline.masked, timeline.host_timeout
        if r.host_timeout:
            state.log_once(None, "host timeout", f"round {r.number}: clients still working after the host-side "
                                                 f"safety timeout of {cfg.host_timeout_s:g} s; they count as late")
        self._crashed(timeline.crashed())
        self._late(len(timeline.late_masked))
        gone = {c for c, t in timeline.gone_at.items() if t <= closed_at}
        gone_on_host = self._gone_on_host(r)
        r.late = len(r.timeline.keys() - r.masked_in_time - r.failed - gone - gone_on_host)
        r.dropped = len((gone | gone_on_host) - r.masked_in_time) + len(r.selected - r.timeline.keys())
        r.bytes_discarded = sum(r.timeline[c].up_bytes for c in gone - r.masked_in_time)
        r.emulated_s = closed_at - r.started_at
        r.train_s = {c: t.compute_s for c, t in r.timeline.items() if t.compute_s is not None}
        r.energy = self.energy.spend(r.timeline, closed_at)
        self.model.now = max(self.model.now, closed_at)
        return outcome

    def _gone_on_host(self, r: OpenRound) -> set[str]:
        """Dispatched clients that died on the host without an answer (their node killed, their host lost: declared
        dead, or back over a new connection with their work lost): dropped, as under the real clock, not late."""
        online = self.state.registry.is_online
        return {c for c in r.timeline.keys() - r.answered() - r.cancelled if not online(c) or c in r.lost}

    def _samples_trained(self, index: int, task: int) -> int:
        """The samples client ``index`` trains in a round of ``task``: its share, every local epoch."""
        return len(self.state.scenario.client_indices(index, task)) * self.state.config.training.local_epochs

    def _crashed(self, clients: set[str]) -> None:
        """``clients`` crashed in the round: away, and their next task start restarts them."""
        registry = self.state.registry
        for client in clients:
            record = registry.records[client]
            record.restarted, record.assets_task = True, -1
            if registry.set_away(client, True, crashed=True):
                self.state.metrics.client_dropped("crash")
            self.model.schedule(client, record.index)  # back when its downtime ends (or later, if off then)

    def _late(self, count: int) -> None:
        self.state.tally.late_updates += count
        for _ in range(count):
            self.state.metrics.late_update()


def make_clock(state: RunState, liveness_timeout_s: float) -> RunClock:
    """The run's clock, as its config says (``emulated_clock``)."""
    availability = parse_availability(state.config.edge.availability)
    if state.config.emulated_clock:
        return EmulatedTime(state, availability, liveness_timeout_s)
    return RealTime(state, availability)
