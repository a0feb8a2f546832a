"""The clients' energy and batteries on the emulated clock (docs/devices.md).

Each round, every client the round dispatched spends the energy of its work (:func:`fcl_emu.scenario.energy.
round_energy`: computing for its emulated compute time, its radio for the bytes it received and sent), charged to
its battery and to the run's totals by device class and kind. Between rounds a battery drains at its class's idle
power and, if ``edge.charging`` says so, charges at ``edge.charge_w`` while the client's availability model has it
available (``available``: plugged in and on Wi-Fi, as production federated learning asks of a phone) or away
(``away``: on the charger while it is off the network). A battery is followed lazily, from its last update to the
emulated now, so a round costs only its clients and the ones it checks.

A client below ``edge.min_battery`` of its capacity sits rounds out: the registry does not offer it for selection
until it is back above (a ``battery`` event each time it changes). Profiles without a battery never sit out.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Iterator

from fcl_emu.coordinator.emulated import ClientRound
from fcl_emu.coordinator.state import RunState
from fcl_emu.scenario.availability import AvailabilitySpec, client_availability, transitions
from fcl_emu.scenario.devices import DeviceProfile
from fcl_emu.scenario.energy import KINDS, round_energy


class _Windows:
    """A client's on/off transitions (its availability model), read forward: seconds on within an interval."""

    def __init__(self, stream: Iterator[tuple[float, bool]]):
        self._stream = stream
        self._on, self._next = True, next(stream, None)

    def seconds_on(self, t0: float, t1: float) -> float:
        """Seconds in ``[t0, t1]`` the client is available (calls move forward: ``t0`` is the last ``t1``)."""
        total, t = 0.0, t0
        while self._next is not None and self._next[0] <= t1:
            at, on = self._next
            if at > t and self._on:
                total += at - t
            t, self._on = max(t, at), on
            self._next = next(self._stream, None)
        return total + (t1 - t if self._on else 0.0)


class Battery:
    """One client's battery: joules left, followed from ``updated_at`` to any later emulated time."""

    def __init__(self, profile: DeviceProfile, windows: _Windows | None, charging: str, charge_w: float):
        self.capacity = profile.battery_j
        self.joules = profile.battery_j * profile.initial_charge
        self.idle_w, self.windows, self.charging, self.charge_w = profile.idle_w, windows, charging, charge_w
        self.updated_at = 0.0

    def at(self, t: float) -> float:
        """The level (a fraction of the capacity) at emulated time ``t``, after the idle drain and charging since
        the last update."""
        if t > self.updated_at:
            span = t - self.updated_at
            charged = 0.0
            if self.windows is not None:
                on = self.windows.seconds_on(self.updated_at, t)
                charged = on if self.charging == "available" else span - on
            self.joules = min(self.capacity, max(0.0, self.joules - self.idle_w * span + self.charge_w * charged))
            self.updated_at = t
        return self.joules / self.capacity

    def spend(self, joules: float, t: float) -> None:
        self.at(t)
        self.joules = max(0.0, self.joules - joules)


class EnergyLedger:
    """What the run's clients spent, by device class and kind, and their batteries."""

    def __init__(self, state: RunState, availability: AvailabilitySpec):
        self.state = state
        self._availability = availability
        self.spent: dict[tuple[str, str], float] = defaultdict(float)  # (device class, kind) -> joules
        self.batteries: dict[str, Battery] = {}
        self.sitting_out: set[str] = set()
        self._threshold = state.config.edge.min_battery
        self._joined: list[str] = []  # clients that joined since the last check
        self._due: list[tuple[float, str]] = []  # heap of (emulated time a battery is due for a look, client)
        self._due_at: dict[str, float] = {}  # each client's current entry in it
        self._restored: dict[str, list[float]] = {}  # a resumed run's battery states, taken up at first use

    def checkpoint(self) -> dict:
        """What a resumed run needs to go on as this one would: the totals, the batteries and who sits out."""
        return {"spent": [[name, kind, joules] for (name, kind), joules in sorted(self.spent.items())],
                "batteries": {c: [b.joules, b.updated_at] for c, b in sorted(self.batteries.items())},
                "sitting_out": sorted(self.sitting_out)}

    def restore(self, saved: dict | None) -> None:
        if not saved:
            return
        self.spent.update({(name, kind): joules for name, kind, joules in saved["spent"]})
        self._restored = dict(saved["batteries"])
        self.sitting_out = set(saved["sitting_out"])

    def battery(self, client: str) -> Battery | None:
        """The client's battery (made at first use from its profile), or None if its profile has none."""
        battery = self.batteries.get(client)
        if battery is None:
            record = self.state.registry.records[client]
            if record.profile.battery_j is None:
                return None
            edge = self.state.config.edge
            windows = None
            if edge.charging != "never":
                windows = _Windows(transitions(client_availability(
                    self._availability, record.index, self.state.config.seed, slot_s=edge.availability_slot_s,
                    trace_time_scale=edge.trace_time_scale)))
            battery = self.batteries[client] = Battery(record.profile, windows, edge.charging, edge.charge_w)
            if client in self._restored:
                battery.joules, battery.updated_at = self._restored.pop(client)
                if windows is not None:
                    windows.seconds_on(0.0, battery.updated_at)  # its availability up to where it was followed
        return battery

    def check(self, now: float) -> None:
        """Mark which clients sit out for a low battery at ``now`` (the registry leaves them out of selection); a
        ``battery`` event for each that starts or stops sitting out.

        Only the batteries that may have crossed ``edge.min_battery`` are looked at: the clients that joined (or
        joined again) since the last check, and those due. A battery is due again at the earliest time it could
        cross: above the threshold, when its idle drain alone would take it there; below it, when charging with
        no drain could bring it back (never, without charging); a client that spent energy in a round is due at
        once. A round of 100,000 clients so looks at a few of them, not at every one."""
        registry = self.state.registry
        due = []
        joined, self._joined = self._joined, []
        for client in joined:
            first = self._first_due(client)
            if first is not None and first <= now:
                due.append(client)
            elif first is not None and first < math.inf:
                self._due_then(client, first)
        while self._due and self._due[0][0] <= now:
            at, client = heapq.heappop(self._due)
            if self._due_at.get(client) == at:  # not rescheduled since
                del self._due_at[client]
                due.append(client)
        for client in due:
            battery = self.battery(client)
            level = battery.at(now)
            low = level < self._threshold or level <= 0.0
            if low != (client in self.sitting_out):
                (self.sitting_out.add if low else self.sitting_out.discard)(client)
                self.state.event("battery", client=client, level=round(level, 6), sitting_out=low)
            registry.set_low_battery(client, low)
            self._schedule(client, battery)

    def joined(self, client: str) -> None:
        """``client`` joined or joined again (its profile drawn): looked at, or scheduled, at the next check."""
        self._joined.append(client)

    def _first_due(self, client: str) -> float | None:
        """When a client that joined is first due: at once if it has a battery already (it joined again) or one
        restored from a checkpoint, or if its battery starts below the threshold; else when its idle drain from
        its initial charge would reach the threshold (its battery is made then); None without a battery."""
        profile = self.state.registry.records[client].profile
        if profile.battery_j is None:
            return None
        if client in self.batteries:
            return -math.inf
        margin = profile.battery_j * (profile.initial_charge - self._threshold)
        if client in self._restored or margin < 0 or (margin == 0 and self._threshold == 0):
            return -math.inf
        return margin / profile.idle_w if profile.idle_w > 0 else math.inf

    def _schedule(self, client: str, battery: Battery) -> None:
        """When ``client``'s battery is next due for a look (:meth:`check`), from its level when last updated."""
        margin = battery.joules - self._threshold * battery.capacity
        if client not in self.sitting_out:
            rate = battery.idle_w
        else:
            margin = -margin
            rate = battery.charge_w - battery.idle_w if battery.charging != "never" else 0.0
        at = battery.updated_at + max(0.0, margin) / rate if rate > 0 else math.inf
        if math.isfinite(at):
            self._due_then(client, at)
        else:
            self._due_at.pop(client, None)

    def _due_then(self, client: str, at: float) -> None:
        """``client``'s battery is next due for a look at emulated time ``at`` (an earlier entry stands down)."""
        self._due_at[client] = at
        heapq.heappush(self._due, (at, client))

    def spend(self, timeline: dict[str, ClientRound], now: float) -> dict[str, list[float]]:
        """Charge each dispatched client of a round (or an asynchronous wave) the energy of its work at ``now``;
        returns ``{client: [compute J, radio J]}``."""
        out = {}
        metrics = self.state.metrics
        for client, c in sorted(timeline.items()):
            energy = round_energy(c.profile, c.down_bytes, c.up_bytes, c.compute_s)
            if not energy.total:
                continue
            out[client] = [energy.compute, energy.radio]
            for kind in KINDS:
                joules = getattr(energy, kind)
                self.spent[c.profile.name, kind] += joules
                metrics.energy(c.profile.name, kind, joules)
            battery = self.battery(client)
            if battery is not None:
                battery.spend(energy.total, now)
                metrics.battery_level(battery.joules / battery.capacity)
                self._due_then(client, now)  # due at the next check
        return out

    def summary(self, now: float) -> dict | None:
        """summary.json's ``energy_joules``: total, by kind, by device class; battery levels at the end."""
        if not self.spent:
            return None
        by_class: dict[str, dict[str, float]] = {}
        for (name, kind), joules in sorted(self.spent.items()):
            by_class.setdefault(name, dict.fromkeys(KINDS, 0.0))[kind] += joules
        by_kind = {kind: sum(v[kind] for v in by_class.values()) for kind in KINDS}
        levels = [b.at(now) for b in map(self.battery, self.state.registry.records) if b is not None]
        return {"total": sum(by_kind.values()), "by_kind": by_kind, "by_device_class": by_class,
                "battery_at_end": None if not levels else {"min": min(levels), "mean": math.fsum(levels) / len(levels)},
                "sitting_out_at_end": len(self.sitting_out)}


def energy_to_accuracy(rounds: list, task_end_accuracy: list[float]) -> list[dict]:
    """The joules every client together had spent when the run's accuracy on the seen classes (percent) first
    reached each 10-point mark: the round records' ``energy_j`` and ``accuracy_seen``, a task's last round taking
    the task's end-of-task accuracy."""
    out, spent, reached = [], 0.0, 0
    last_round = {r.task: r.round for r in rounds}
    for r in rounds:
        spent += sum(sum(v) for v in (r.energy_j or {}).values())
        accuracy = r.accuracy_seen
        if r.round == last_round[r.task] and r.task < len(task_end_accuracy):
            accuracy = task_end_accuracy[r.task]
        while accuracy is not None and accuracy >= reached + 10:
            reached += 10
            out.append({"accuracy": reached, "joules": spent, "round": r.round})
    return out
