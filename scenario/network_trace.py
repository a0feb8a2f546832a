"""Network traces: each client's link bandwidth over emulated time (``edge.network_trace``, ``--network-trace``).

A trace file is laid out like FedScale's device-capacity file (:mod:`fcl_emu.scenario.devices`): a map from client id to
that client's entry, in a plain pickle, JSON or YAML file. Here an entry is the client's bandwidth over time,
piecewise constant: ``communication[i]`` kbit/s (FedScale's unit) from ``time[i]`` seconds of emulated time until
``time[i + 1]``; the first value also holds before ``time[0]``, the last one after the end of the trace.

.. code-block:: yaml

    "17": {time: [0, 60, 90], communication: [800, 0, 2400]}   # an outage from 60 s to 90 s
    "42": {time: [0], communication: [5000]}

Emulated client ``i`` gets the ``i``-th entry in sorted id order (wrapping around), as with FedScale's
device-capacity file. Its trace replaces the bandwidth of its device profile in both directions (latency and
compute stay the profile's): a message of ``n`` bytes handed to the link at ``t`` is through when the
bandwidth integrated from ``t`` reaches ``n`` (:meth:`BandwidthTrace.finish`). Traces follow the emulated clock
only (``rounds.clock: emulated``).
"""

from __future__ import annotations

import bisect
import math
from functools import lru_cache
from pathlib import Path

import pydantic

from fcl_emu.scenario.availability import sort_key
from fcl_emu.scenario.files import read_data, validate


class _Entry(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    time: list[pydantic.NonNegativeFloat] = pydantic.Field(min_length=1)
    communication: list[pydantic.NonNegativeFloat] = pydantic.Field(min_length=1)

    @pydantic.model_validator(mode="after")
    def _steps(self) -> "_Entry":
        if len(self.time) != len(self.communication):
            raise ValueError(f"{len(self.time)} times for {len(self.communication)} bandwidths")
        if any(b <= a for a, b in zip(self.time, self.time[1:])):
            raise ValueError("times must increase")
        if not all(math.isfinite(v) for v in (*self.time, *self.communication)):
            raise ValueError("times and bandwidths must be finite")
        if self.communication[-1] == 0:
            raise ValueError("the last bandwidth must be positive (it holds for ever)")
        return self


class BandwidthTrace:
    """One client's piecewise constant bandwidth over emulated time."""

    def __init__(self, times: list[float], bytes_per_s: list[float]):
        self.times, self.rates = list(times), list(bytes_per_s)

    def finish(self, start: float, nbytes: int) -> float:
        """When ``nbytes`` handed to the link at ``start`` are through: the bandwidth integrated from ``start``."""
        i = max(0, bisect.bisect_right(self.times, start) - 1)
        t, left = start, float(nbytes)
        while True:
            end = self.times[i + 1] if i + 1 < len(self.times) else math.inf
            rate = self.rates[i]
            if rate > 0 and left <= rate * (end - t):
                return t + left / rate
            left -= rate * (end - t)
            t, i = end, i + 1


@lru_cache(maxsize=4)
def load_network_trace(path: Path) -> tuple[BandwidthTrace, ...]:
    """The traces of a file, in sorted client id order; raises ValueError naming the file and the problem."""
    data = read_data(path, "network trace")
    if not isinstance(data, dict) or not data:
        raise ValueError(f"network trace {path}: expected a map from client id to "
                         f"{{time: [s, ...], communication: [kbit/s, ...]}}")
    traces = []
    for key in sorted(data, key=sort_key):
        entry = validate(data[key], _Entry, f"network trace (client {key!r})", path)
        traces.append(BandwidthTrace(entry.time, [kbit_s * 1000 / 8 for kbit_s in entry.communication]))
    return tuple(traces)


def client_trace(traces: tuple[BandwidthTrace, ...], index: int) -> BandwidthTrace:
    """Emulated client ``index``'s trace: the ``index``-th in sorted id order, wrapping around."""
    return traces[index % len(traces)]
