"""A secure round on the emulated clock: every SecAgg+ phase's messages placed on the federation's time.

The round runs the real protocol over the wire, as on the real clock (:mod:`fcl_emu.coordinator.secure_round`): the
same cryptography on every client, the same messages, the same recovery of the dropped clients' masks. What
the emulated clock decides is who dropped out of each phase, from the scenario and the seed only, so the same
seed gives the same survivors per phase, the same recovered sum and the same accuracy on a busy or a quiet
host and with any number of edge nodes.

Client c's timeline in a round opened at emulated time ``T`` (one FIFO link per client, kept across the
phases, :class:`fcl_emu.scenario.links.Link`); a phase opens when the one before it closed, and the coordinator
sends the phase's messages then:

- ``advertise_keys``: the round's downlink data (task start, assets, ``secagg_setup``, train request) has
  arrived at ``R``; its keys leave after the key generation's compute;
- ``share_keys`` and ``unmasking``: the phase's message (peer keys; unmask request) comes down, the reply
  leaves after its compute;
- ``masked_input``: the input is masked once both the relayed shares came down and its training ended
  (``R`` + its training compute), and leaves after the masking's compute.

Compute is placed as training's is (:meth:`fcl_emu.scenario.devices.DeviceProfile.compute_s`): training from the CPU
seconds the node measured (or ``ms_per_sample`` x the samples of its task data x local epochs, from the
scenario: the count itself travels only under the mask); each reply's cryptography from the CPU seconds it
carries (``cpu_s``; ``mask_cpu_s``) x ``compute_factor`` (nothing under ``ms_per_sample``, whose cost model
counts training samples only). Replies go up through the uplink, by their bytes.

A phase closes at the earliest of its deadline (``secagg.phase_timeout_s`` after it opened, for the key and
share phases never past the round's deadline ``T + deadline_s``; the masked input at the round's deadline,
or at the ``clients_per_round``-th masked input under overcommit) and the moment every client still in the
round has replied or is known to be gone. A client's reply counts if it arrives by the close and before the
client left: its availability model turned it off (noticed at once) or it crashed (``edge.crash_rate``, the
seeded draw of plain rounds, at a uniform point of the longest a secure round lasts, ``deadline_s +
phase_timeout_s``; noticed after ``min(liveness timeout, crash_downtime_s)`` as in plain rounds; a crash
drawn past the round's close does not happen in this round). A reply that does not count is left out of
the protocol, whose phase close then drops its sender: the later phases recover its masks, or the round
aborts with fewer than t clients.

Why the coordinator leaves the reply out rather than the node not sending it: the emulated clock is the
coordinator's (the nodes emulate nothing in host time under it, and a node cannot know when the others'
replies close a phase); every client runs its cryptography and sends every reply, so the coordinator's host
wait ends on messages, and a dropout goes through the server's real dropout path (its close, the
unmask requests naming the dropped, the Shamir recovery) on real messages, exactly as a real one would.
"""

from __future__ import annotations

import math

from fcl_emu.coordinator.emulated import EmulatedClock
from fcl_emu.coordinator.open_round import OpenRound
from fcl_emu.coordinator.secure_round import Alive, SecureOutcome, SecureRound, Serve
from fcl_emu.scenario.links import Link
from fcl_emu.secagg.protocol import PHASES
from fcl_emu.wire.framing import Message, link_nbytes


class SecureTimeline:
    """One secure round's emulated times: each client's link, departure and replies, each phase's close."""

    def __init__(self, model: EmulatedClock, r: OpenRound, secure: SecureRound, indices: dict[str, int],
                 samples: dict[str, int], deadline_s: float):
        """``indices``: each dispatched client's scenario index; ``samples``: the samples it trains."""
        self.model, self.r, self.secure, self.indices, self.samples = model, r, secure, indices, samples
        self.deadline = r.started_at + deadline_s
        self.opened = r.started_at  # when the open phase opened
        self.phase_s: dict[str, float] = {}  # phase -> its emulated seconds
        self.late_masked: set[str] = set()  # masked inputs that arrived after their phase's close
        self.masked: set[str] = set()  # masked inputs that arrived by their phase's close
        self.host_timeout = False  # a phase's wait in host time ran out with clients still owing a reply
        self.links = {c: Link(t.profile, t.trace) for c, t in r.timeline.items()}
        self.ready = {c: self.links[c].arrival("down", t.down_bytes, r.started_at) for c, t in r.timeline.items()}
        self.gone_at: dict[str, float] = {}
        self.noticed_at: dict[str, float] = {}
        self.crash_at: dict[str, float] = {}  # crashes that come before any departure of its availability model
        span = deadline_s + secure.phase_timeout_s  # the longest a secure round lasts
        for client in r.timeline:
            index = indices[client]
            point = model.crash_point(index, r.number)
            crash = math.inf if point is None else r.started_at + point * span
            off = model.off_after(client, index, r.started_at, r.started_at + span)
            if crash < off:
                self.crash_at[client] = self.gone_at[client] = crash
                self.noticed_at[client] = crash + model.notice_delay_s
            elif off < math.inf:
                self.gone_at[client] = self.noticed_at[client] = off

    def _crypto_s(self, client: str, cpu_s: float) -> float:
        return self.r.timeline[client].profile.compute_s(cpu_s, 0)

    def _arrival(self, phase: int, client: str, msg: Message) -> float:
        """When ``client``'s reply ``msg`` of ``phase`` arrives in emulated time."""
        link, timeline = self.links[client], self.r.timeline[client]
        body = msg.body
        if phase == 1:
            ready = self.ready[client] + self._crypto_s(client, body.cpu_s)
        elif phase == 3:
            timeline.compute_s = timeline.profile.compute_s(body.cpu_s, self.samples[client])
            relayed = link.arrival("down", self.secure.sent.get(client, 0), self.opened)
            ready = max(relayed, self.ready[client] + timeline.compute_s) + self._crypto_s(client, body.mask_cpu_s)
        else:
            ready = link.arrival("down", self.secure.sent.get(client, 0), self.opened) + self._crypto_s(client,
                                                                                                       body.cpu_s)
        timeline.up_bytes += link_nbytes(msg)
        arrival = link.arrival("up", link_nbytes(msg), ready)
        if phase == 3:
            timeline.arrival = arrival
        return arrival

    def close(self, phase: int) -> set[str]:
        """Close ``phase`` in emulated time (the module docstring) and move on to its close; the clients whose
        held reply counts."""
        owed = self.secure.server.active
        arrivals = {}
        for client, msg in self.secure.held[phase].items():
            if client in self.links and client in owed:
                arrival = self._arrival(phase, client, msg)
                if arrival <= self.gone_at.get(client, math.inf):
                    arrivals[client] = arrival
        timeout = self.opened + self.secure.phase_timeout_s
        deadline = {1: min(timeout, self.deadline), 2: min(timeout, self.deadline), 3: self.deadline, 4: timeout}
        enough = math.inf
        if phase == 3:
            times = sorted(arrivals.values())
            enough = times[self.r.wanted - 1] if len(times) >= self.r.wanted else math.inf
        settled = [self.opened if c in self.r.failed else arrivals.get(c, self.noticed_at.get(c, math.inf))
                   for c in owed]
        closed = max(self.opened, min(deadline[phase], enough, max(settled, default=self.opened)))
        self.phase_s[PHASES[phase]] = closed - self.opened
        self.opened = closed
        if phase == 3:
            self.late_masked = {c for c, t in arrivals.items() if t > closed}
        return {c for c, t in arrivals.items() if t <= closed}

    def crashed(self) -> set[str]:
        """The clients that crashed during the round (by its close), now away for their downtime."""
        out = {c for c, t in self.crash_at.items() if t <= self.opened}
        for client in out:
            self.model.crashed(client, self.indices[client], self.crash_at[client])
        return out

    def run(self, serve: Serve, host_deadline: float, alive: Alive, online: Alive,
            min_participants: int) -> SecureOutcome:
        """Run the round's phases: each waits in host time until every client still in the round replied (or is
        gone on the host, or ``host_deadline`` passed), then closes in emulated time and takes the replies that
        count. The outcome's record adds each phase's emulated seconds (``emulated_phase_s``)."""
        secure = self.secure
        secure.hold()

        def wait(phase: int) -> None:
            serve(lambda: not secure.waiting(phase, alive), host_deadline)
            self.host_timeout |= bool(secure.waiting(phase, alive))
            on_time = self.close(phase)
            if phase == 3:
                self.masked = on_time
            secure.admit(phase, on_time)

        outcome = secure.run(wait, online, min_participants)
        outcome.record["emulated_phase_s"] = dict(self.phase_s)
        return outcome
