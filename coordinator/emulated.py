"""The emulated clock: the federation's time, computed from each client's own work, device and link.

Under ``rounds.clock: emulated`` (the default for host processes, docs/edge.md) a round's outcome depends on the
scenario and the seed only, not on how the emulation was scheduled on the host. The idea is FedScale's virtual
clock; the coordinator keeps it:

- A round opens at emulated time ``T`` (the clock). Each selected client's update arrives at
  ``A = T + down + compute + up``: ``down`` is what the coordinator sent it for the round (task start, assets,
  train request) through its downlink (a network trace, :mod:`fcl_emu.scenario.network_trace`, makes its bandwidth
  vary with emulated time), ``compute`` its profile's compute time for its own training
  (:meth:`fcl_emu.scenario.devices.DeviceProfile.compute_s`: the CPU time the node measured for that client alone,
  times ``compute_factor``, or ``ms_per_sample`` per sample trained), and ``up`` its side-channel messages and
  update through its uplink (:class:`fcl_emu.scenario.links.Link`: bandwidth, FIFO, latency).
- The coordinator waits in host time until every selected client has answered or is gone (or the host-side
  safety timeout ``rounds.host_timeout_s`` fires, which the round's record reports), then closes the round
  in emulated time at the earliest of: ``T + deadline_s``; the arrival of the ``clients_per_round``-th useful
  update; the moment every selected client has arrived or is known to be gone. Updates that arrived by
  then are the round's; later ones are late (dropped, or kept for the next round under
  ``late_updates: next_round``). The clock moves on to the close.
- Availability models (scenario/availability.py) are followed here, on this clock: at a round's opening each
  connected client is on or *away*; a selected client whose model turns it off before its update arrives
  has left (noticed at once: a device that goes away says so).
- Crashes: a selected client crashes with probability ``edge.crash_rate`` (the same seeded draw as the edge
  node's under the real clock) at a uniform point of its round; its work is lost, the crash is noticed after
  ``min(liveness timeout, crash_downtime_s)`` (missed heartbeats, or its restart's join), it is away for
  ``crash_downtime_s``, and its next task start tells its node to drop its in-memory state and assets.

Late work is not done (``rounds.skip_late``): a client whose profile has a per-sample cost has a known
earliest arrival before it trains (its downlink, its exact compute time, its smallest possible upload). One
whose earliest arrival is after the latest the round can close (the deadline, or the ``clients_per_round``-th
useful update already in that no crash or leave can take away) is late whatever happens, and nothing of the
round depends on when exactly it would arrive: the coordinator cancels its training
(:meth:`EmulatedClock.beyond_close`). Not for clients drawn to crash in the round: where their crash falls
depends on their arrival.

Server-side work (aggregation, evaluation, generator training at task end) takes no emulated time, as in
FedScale: the clock measures the federation, the host wall clock (recorded beside it) the emulation.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from fcl_emu.scenario.availability import AvailabilitySpec, client_availability, client_draw, transitions
from fcl_emu.scenario.devices import DeviceProfile
from fcl_emu.scenario.links import Link
from fcl_emu.scenario.network_trace import BandwidthTrace


class _Presence:
    """One client's availability and crash state on the emulated clock."""

    def __init__(self, stream: Iterator[tuple[float, bool]]):
        self._stream = stream
        self._ahead: deque[tuple[float, bool]] = deque()  # read from the stream, not yet passed
        self.on = True
        self.down_until = -math.inf

    def _peek(self, i: int) -> tuple[float, bool] | None:
        while len(self._ahead) <= i:
            transition = next(self._stream, None)
            if transition is None:
                return None
            self._ahead.append(transition)
        return self._ahead[i]

    def follow(self, t: float) -> None:
        while (upcoming := self._peek(0)) is not None and upcoming[0] <= t:
            self.on = upcoming[1]
            self._ahead.popleft()

    def available(self, t: float) -> bool:
        return self.on and t >= self.down_until

    def off_between(self, t: float, until: float) -> float:
        """The first time in (t, until] its availability model turns it off; inf if none."""
        i = 0
        while (upcoming := self._peek(i)) is not None and upcoming[0] <= until:
            if not upcoming[1] and upcoming[0] > t:
                return upcoming[0]
            i += 1
        return math.inf

    def next_change(self, now: float) -> float:
        """When it may next become available: its next transition, or the end of a crash's downtime."""
        upcoming = self._peek(0)
        change = math.inf if upcoming is None else upcoming[0]
        return min(change, self.down_until) if self.down_until > now else change


@dataclass
class ClientRound:
    """One selected client's part of a round on the emulated clock."""

    profile: DeviceProfile
    down_bytes: int = 0
    up_bytes: int = 0
    arrival: float | None = None  # emulated time its update (or error) arrived
    compute_s: float | None = None
    gone_at: float | None = None  # left or crashed at this emulated time
    noticed_at: float | None = None  # when the coordinator learns that it is gone
    crashed: bool = False
    earliest: float | None = None  # a lower bound on its arrival known before it trains (a per-sample cost)
    samples_trained: int = 0  # what it is to train (local samples x local epochs), where ``earliest`` is known
    trace: BandwidthTrace | None = None  # its bandwidth over time (a network trace), instead of its profile's


@dataclass
class Closing:
    """What the emulated clock decides at a round's close."""

    closed_at: float
    on_time: set[str] = field(default_factory=set)  # useful or empty updates that arrived by the close
    late: set[str] = field(default_factory=set)  # still working, or arrived after the close
    gone: set[str] = field(default_factory=set)  # left or crashed before the close
    crashed: set[str] = field(default_factory=set)  # crashed during the round (before or after the close)
    arrived_late: set[str] = field(default_factory=set)  # their answer arrived, after the close
    lost_uploads: set[str] = field(default_factory=set)  # sent on the host, but gone before it would arrive


class EmulatedClock:
    """The run's emulated time, and every client's availability and crashes on it."""

    def __init__(self, availability: AvailabilitySpec, *, seed: int, slot_s: float, trace_time_scale: float,
                 crash_rate: float, crash_downtime_s: float, liveness_timeout_s: float, now: float = 0.0):
        self.now = now
        self._availability = availability
        self._seed, self._slot_s, self._scale = seed, slot_s, trace_time_scale
        self.crash_rate, self.crash_downtime_s = crash_rate, crash_downtime_s
        self.notice_delay_s = min(liveness_timeout_s, crash_downtime_s)
        self._presence: dict[str, _Presence] = {}
        self._due: list[tuple[float, int, str]] = []  # (when, index, client) heap of availability looks (due)
        self._scheduled: dict[str, float] = {}  # client -> when its live entry in _due is

    @property
    def churns(self) -> bool:
        """Whether clients ever go away (an availability model other than ``always``, or crashes)."""
        return self._availability.kind != "always" or self.crash_rate > 0

    def _of(self, client: str, index: int) -> _Presence:
        presence = self._presence.get(client)
        if presence is None:
            stream = transitions(client_availability(self._availability, index, self._seed, slot_s=self._slot_s,
                                                     trace_time_scale=self._scale))
            presence = self._presence[client] = _Presence(stream)
            presence.follow(self.now)
        return presence

    # ------------------------------------------------------------ availability
    def availability_at(self, t: float, clients: Iterable[tuple[str, int]]) -> dict[str, bool]:
        """Move the clock to ``t`` (never back) and say which of ``clients`` (id, index) are available then."""
        self.now = max(self.now, t)
        out = {}
        for client, index in clients:
            presence = self._of(client, index)
            presence.follow(self.now)
            out[client] = presence.available(self.now)
        return out

    def schedule(self, client: str, index: int, at: float | None = None) -> None:
        """Have :meth:`due` name ``client`` at ``at``, by default when its availability may next change (never
        if it cannot); its earlier schedule ends."""
        when = self._of(client, index).next_change(self.now) if at is None else at
        if when == math.inf:
            self._scheduled.pop(client, None)
            return
        self._scheduled[client] = when
        heapq.heappush(self._due, (when, index, client))

    def due(self, t: float) -> list[tuple[str, int]]:
        """The clients (id, index) scheduled at or before ``t``, in time order, each once; their schedules end.
        Following availability this way looks at the clients whose state may have changed, not at all of
        them: at 100,000 clients a round's start costs what the transitions since the last one cost."""
        out = []
        while self._due and self._due[0][0] <= t:
            when, index, client = heapq.heappop(self._due)
            if self._scheduled.get(client) == when:
                del self._scheduled[client]
                out.append((client, index))
        return out

    def next_change(self, clients: Iterable[tuple[str, int]]) -> float:
        """The earliest time after now at which one of ``clients`` may become available."""
        return min((self._of(c, i).next_change(self.now) for c, i in clients), default=math.inf)

    def off_after(self, client: str, index: int, start: float, until: float) -> float:
        """The first time in (start, until] the client's availability model turns it off; inf if none."""
        return self._of(client, index).off_between(start, until)

    def crashed(self, client: str, index: int, at: float) -> None:
        """The client crashed at ``at``: it is away for ``crash_downtime_s``."""
        self._of(client, index).down_until = at + self.crash_downtime_s

    # ------------------------------------------------------------------ rounds
    def crash_point(self, index: int, round: int) -> float | None:
        """Where in its round (a fraction) a selected client crashes, or None (seeded per client and round)."""
        if self.crash_rate > 0 and client_draw(self._seed, "crash", index, round) < self.crash_rate:
            return client_draw(self._seed, "crash-at", index, round)
        return None

    @staticmethod
    def arrival(start: float, c: ClientRound, cpu_s: float, samples_trained: int) -> float:
        """Emulated time at which a client's update arrives: downlink, its own compute, uplink."""
        link = Link(c.profile, c.trace)
        received = link.arrival("down", c.down_bytes, start)
        c.compute_s = c.profile.compute_s(cpu_s, samples_trained)
        return link.arrival("up", c.up_bytes, received + c.compute_s)

    @staticmethod
    def earliest_arrival(start: float, c: ClientRound, min_up_bytes: int) -> float | None:
        """A lower bound on when a client's update arrives, known before it trains: with a per-sample cost
        (``ms_per_sample``) its compute time is exact, and its upload is at least ``min_up_bytes``. None
        without a per-sample cost."""
        if c.profile.ms_per_sample is None:
            return None
        link = Link(c.profile, c.trace)
        received = link.arrival("down", c.down_bytes, start)
        return link.arrival("up", min_up_bytes, received + c.profile.compute_s(0.0, c.samples_trained))

    def beyond_close(self, start: float, deadline_s: float, wanted: int, clients: dict[str, ClientRound],
                     indices: dict[str, int], useful: set[str], number: int) -> set[str]:
        """Clients of the round in progress whose update cannot count whatever the others do: not answered, no
        crash drawn for the round, and an earliest arrival after the latest the round can close: its deadline,
        or the ``wanted``-th of the useful updates already in that nothing takes from the round (no crash, not
        away before they arrive). Such a client's exact arrival changes nothing of :meth:`close`: it comes
        after the close, and if it leaves first, it leaves after the close or at a time that does not depend
        on its arrival."""
        waiting = {k: c.earliest for k, c in clients.items() if c.arrival is None and c.earliest is not None
                   and self.crash_point(indices[k], number) is None}
        if not waiting:
            return set()
        sure = sorted(c.arrival for k, c in clients.items() if k in useful and c.arrival is not None
                      and self.crash_point(indices[k], number) is None
                      and self._of(k, indices[k]).off_between(start, c.arrival) >= c.arrival)
        latest_close = start + deadline_s if len(sure) < wanted else min(start + deadline_s, sure[wanted - 1])
        return {k for k, earliest in waiting.items() if earliest > latest_close}

    def close(self, start: float, deadline_s: float, wanted: int, clients: dict[str, ClientRound],
              indices: dict[str, int], useful: set[str], number: int) -> Closing:
        """Decide the round opened at ``start``: who crashed or left before their update arrived, when the
        round closes, and who made it. ``useful``: clients whose update carries samples. Moves the clock to
        the close."""
        for client, c in clients.items():
            span_end = c.arrival if c.arrival is not None else start + deadline_s
            crash = self.crash_point(indices[client], number)
            if crash is not None:
                c.crashed, c.gone_at = True, start + crash * (span_end - start)
                c.noticed_at = c.gone_at + self.notice_delay_s
            off = self._of(client, indices[client]).off_between(start, span_end)
            if off < span_end and (c.gone_at is None or off < c.gone_at):
                c.crashed, c.gone_at, c.noticed_at = False, off, off
        arrived = {k: c.arrival for k, c in clients.items() if c.arrival is not None
                   and (c.gone_at is None or c.arrival <= c.gone_at)}
        useful_times = sorted(t for k, t in arrived.items() if k in useful)
        enough = useful_times[wanted - 1] if len(useful_times) >= wanted else math.inf
        settled = [arrived.get(k, c.noticed_at if c.noticed_at is not None else math.inf)
                   for k, c in clients.items()]
        everyone = max(settled, default=start)
        closed_at = max(start, min(start + deadline_s, enough, everyone))
        out = Closing(closed_at, arrived_late={k for k, t in arrived.items() if t > closed_at},
                      lost_uploads={k for k, c in clients.items() if c.up_bytes and k not in arrived})
        for client, c in clients.items():
            if c.crashed:
                out.crashed.add(client)
                self._of(client, indices[client]).down_until = c.gone_at + self.crash_downtime_s
            if client in arrived and arrived[client] <= closed_at:
                out.on_time.add(client)
            elif c.gone_at is not None and c.gone_at <= closed_at:
                out.gone.add(client)
            else:
                out.late.add(client)
        self.now = max(self.now, closed_at)
        return out
