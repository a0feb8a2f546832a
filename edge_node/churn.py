"""Churn in host time (``--clock real``, docs/edge.md): clients that leave, come back, crash and restart.

What each client's ``welcome`` says, followed on the node's monotonic clock
(its origin is the coordinator's run clock at the first welcome):

- availability: the client leaves (a ``leave``) when its availability model
  turns it off and joins again when it turns on, keeping its local state and
  telling the coordinator which task's assets it still holds;
- crashes: a client selected for a round dies during it with probability
  ``crash_rate``: its socket is closed without a goodbye, its in-memory state
  is lost (its on-disk store survives, as a device's storage would), and it
  restarts with a new socket ``crash_downtime_s`` later.

A welcome also gives the client its emulated link (scenario/links.py) from
its device profile, under the real clock only. Under the emulated clock the
coordinator places availability and crashes on its own clock
(coordinator/emulated.py) and sends an ``always`` model and no crash rate.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable

from fcl_emu.edge_node.client import EmulatedClient
from fcl_emu.monitoring.metrics import EdgeNodeMetrics
from fcl_emu.scenario.availability import client_draw, transitions
from fcl_emu.scenario.devices import DeviceProfile
from fcl_emu.scenario.links import Link
from fcl_emu.wire.messages import EdgeSettings, Leave

log = logging.getLogger("fcl_emu.edge_node")

ClientAction = Callable[[EmulatedClient], None]


class Churn:
    """Availability, crashes and restarts of a node's clients.

    ``join`` sends a client's ``join``; ``send(client, msg_type, body)`` any other message; ``detach`` stops
    polling a client's socket and closes it at once; ``reconnect`` gives it a new socket and polls that;
    ``retain_assets`` lets go of the task assets that no client holds any longer.

    Each client's next event (an availability transition, a crash, a restart) waits in a heap by its monotonic
    time, so a tick costs the events due, not the node's population."""

    def __init__(self, *, join: ClientAction, send: Callable[..., None],
                 detach: ClientAction, reconnect: ClientAction, retain_assets: Callable[[], None],
                 metrics: EdgeNodeMetrics):
        self._join = join
        self._send = send
        self._detach = detach
        self._reconnect = reconnect
        self._retain_assets = retain_assets
        self._metrics = metrics
        self.edge = EdgeSettings()  # the run's crash rate and downtime (from its first welcome)
        self._clock_origin: float | None = None  # local monotonic time of the coordinator's run clock 0
        self._due: list[tuple[float, int, EmulatedClient]] = []  # (monotonic time, tie-break, client)
        self._next_event: dict[int, float] = {}  # client index -> the time of its entry in the heap that counts
        self._seq = itertools.count()

    def start(self, client: EmulatedClient, edge: EdgeSettings, now: float) -> None:
        """On a welcome: start the run clock, the client's availability model and its link (first time only)."""
        if self._clock_origin is None:
            self._clock_origin = now - edge.clock_s
        if client.transitions is None:
            try:
                client.transitions = transitions(edge.availability)
                profile = client.profile = None if edge.profile is None else DeviceProfile.from_wire(edge.profile)
                client.link = None if profile is None or edge.clock == "emulated" else Link(profile)
                if client.link is not None:
                    self._metrics.link_profile(profile.name)
            except ValueError as exc:
                log.error("%s: %s; it stays always available on an ideal link", client.id, exc)
                client.transitions = iter(())
            client.next_transition = next(client.transitions, None)
        self._follow_availability(client, now - self._clock_origin)
        self._schedule(client)

    def draw_crash(self, client: EmulatedClient, round: int, seed: int, now: float) -> None:
        """On a train request: whether the client crashes in this round, and when."""
        if self.edge.crash_rate > 0 and client_draw(seed, "crash", client.index, round) < self.edge.crash_rate:
            # dies somewhere between now and when its update would go out (judged by its last round)
            client.crash_at = now + client_draw(seed, "crash-at", client.index, round) * client.round_s
            self._schedule(client)

    def tick(self, now: float) -> None:
        """Follow availability; crash and restart clients: those whose next event is due."""
        if self._clock_origin is None:
            return
        t = now - self._clock_origin
        due = self._due
        while due and due[0][0] <= now:
            when, _, client = heapq.heappop(due)
            if self._next_event.get(client.index) != when:  # superseded by an earlier or later event
                continue
            del self._next_event[client.index]
            if client.closed:
                continue
            if client.next_transition is not None and client.next_transition[0] <= t:
                self._follow_availability(client, t)
            if client.crash_at is not None and now >= client.crash_at:
                self._crash(client, now)
            elif client.down_until is not None and now >= client.down_until:
                self._restart(client)
            self._schedule(client)

    def _schedule(self, client: EmulatedClient) -> None:
        """Put the client's next event in the heap; its earlier entry, if any, no longer counts."""
        times = [t for t in (client.crash_at, client.down_until) if t is not None]
        if client.next_transition is not None:
            times.append(self._clock_origin + client.next_transition[0])
        if not times:
            self._next_event.pop(client.index, None)
        elif self._next_event.get(client.index) != min(times):
            self._next_event[client.index] = min(times)
            heapq.heappush(self._due, (min(times), next(self._seq), client))

    def _follow_availability(self, client: EmulatedClient, t: float) -> None:
        state = client.available
        while client.next_transition is not None and client.next_transition[0] <= t:
            state = client.next_transition[1]
            client.next_transition = next(client.transitions, None)
        if state == client.available:
            return
        client.available = state
        if client.down_until is not None:  # crashed: the restart joins if it is available then
            return
        if state:
            self._join(client)
            self._metrics.client_event("rejoin")
        elif client.welcomed:
            self._send(client, "leave", Leave(reason="unavailable"))
            client.generation += 1  # work in flight is abandoned; local state is kept
            client.crash_at, client.secagg = None, None
            self._metrics.client_event("leave")

    def _crash(self, client: EmulatedClient, now: float) -> None:
        """Die without a goodbye: the socket goes, in-memory state goes, the on-disk store stays."""
        client.crash_at = None
        self._detach(client)  # the new socket of the restart is attached again
        client.generation += 1
        client.welcomed = False
        client.task = client.trained_task = -1
        client.classes, client.seen_classes, client.assets, client.state = [], [], {}, {}
        client.secagg = None
        self._retain_assets()
        client.down_until = now + self.edge.crash_downtime_s
        self._metrics.client_event("crash")
        log.info("%s crashed; restarting in %.1f s", client.id, self.edge.crash_downtime_s)

    def _restart(self, client: EmulatedClient) -> None:
        self._reconnect(client)
        client.down_until = None
        self._metrics.client_event("restart")
        if client.available:
            self._join(client)
