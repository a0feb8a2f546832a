"""What a peer cannot make the coordinator do: flood it, fill its logs, or poison its model (docs/security.md).

- :class:`RateLimiter`: a token bucket per identity for control and error messages (joins, leaves, heartbeats,
  errors); a message over the rate is refused as ``rate_limited``, never handled.
- :class:`~fcl_emu.runtime.log_budget.LogOnce` (the edge aggregators' too): a refusal is logged once per (peer,
  reason), and at most 100 lines per reason, so one kind of refusal repeated cannot silence the others; everything
  is still counted.
- :func:`on_refused_handshake`: a handshake the allow-list refused is counted by reason and logged once per
  address, within the same budgets.

The norm bound on updates and clipping are aggregation's (:mod:`fcl_emu.aggregation.clipping`).

The buckets and the log memory are bounded, so peers with ever new identities cannot grow them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager


from fcl_emu.monitoring.metrics import CoordinatorMetrics
from fcl_emu.runtime.log_budget import LogOnce

CONTROL_RATE_PER_S = 5.0  # sustained control/error messages per identity, beyond its heartbeats
CONTROL_BURST = 30  # messages an identity may send at once (a rejoin, a leave, a burst of errors)
MAX_TRACKED = 100_000  # identities with a bucket; the least recently seen is forgotten first


class RateLimiter:
    """Token buckets keyed by identity: ``allow(peer)`` takes one token, False when the bucket is empty."""

    def __init__(self, rate_per_s: float = CONTROL_RATE_PER_S, burst: int = CONTROL_BURST,
                 max_tracked: int = MAX_TRACKED):
        self.rate, self.burst, self.max_tracked = rate_per_s, burst, max_tracked
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer -> (tokens, time)
        self._backlog = 0.0  # extra tokens a bucket may hold while a backlog is handled

    @contextmanager
    def backlog(self, unheard_s: float):
        """Messages handled inside were queued while the coordinator did not listen for ``unheard_s`` seconds
        (evaluating, aggregating, a busy host): each was sent on time but they arrive at once, so a bucket may
        hold the tokens of that whole time, not only a burst. A peer gains nothing it could not send at the
        sustained rate."""
        self._backlog = max(0.0, unheard_s) * self.rate
        try:
            yield
        finally:
            self._backlog = 0.0

    def allow(self, peer: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        tokens, then = self._buckets.pop(peer, (float(self.burst), now))
        tokens = min(self.burst + self._backlog, tokens + (now - then) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[peer] = (tokens - allowed, now)
        if len(self._buckets) > self.max_tracked:
            self._buckets.popitem(last=False)
        return allowed


def on_refused_handshake(metrics: CoordinatorMetrics, log_once: LogOnce) -> Callable[[str, str], None]:
    """The allow-list's ``on_refused`` (wire/auth.py): count the refusal, log it once per peer address."""
    def refused(address: str, reason: str) -> None:
        metrics.refused_handshake(reason)
        log_once(address, f"handshake {reason}", f"refused a CurveZMQ handshake from {address} ({reason}: its key "
                                                 f"is not in the run's roster)", budget="refused handshake")
    return refused
