"""The emulated link of one client: when its real messages get through.

A client's :class:`fcl_emu.scenario.devices.DeviceProfile` gives its bandwidth per
direction and its one-way latency. A message of ``n`` bytes on a link of
``b`` bytes/s waits for the messages before it on the same direction (a FIFO
link), then ``n / b`` seconds, then the latency. Heartbeats and the
membership messages (join, welcome, leave, shutdown) are treated as a
separate control channel: latency only, so a long upload cannot make a
client miss its heartbeats. The profiles file and how profiles are drawn:
:mod:`fcl_emu.scenario.devices`. With a network trace (:mod:`fcl_emu.scenario.network_trace`)
the bandwidth varies with time instead: a message is through when the
bandwidth integrated from its start reaches its size.
"""

from __future__ import annotations

from fcl_emu.scenario.devices import DeviceProfile
from fcl_emu.scenario.network_trace import BandwidthTrace


class Link:
    """One client's emulated link: when a message of ``n`` bytes gets through, per direction (FIFO)."""

    def __init__(self, profile: DeviceProfile, trace: BandwidthTrace | None = None):
        self.profile, self.trace = profile, trace
        self._free_at = {"up": 0.0, "down": 0.0}

    def arrival(self, direction: str, nbytes: int, now: float, *, control: bool = False) -> float:
        """Monotonic time at which a message handed to the link at ``now`` arrives at the other end."""
        if control:
            return now + self.profile.latency_s
        start = max(now, self._free_at[direction])
        if self.trace is not None:
            done = self.trace.finish(start, nbytes)
        else:
            rate = self.profile.uplink_bytes_s if direction == "up" else self.profile.downlink_bytes_s
            done = start + nbytes / rate
        self._free_at[direction] = done
        return done + self.profile.latency_s
