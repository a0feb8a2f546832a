"""A synthetic population behaviour trace in FedScale's format, for any number of clients, from a seed.

FedScale's ``client_behave_trace`` (read by :func:`fcl_emu.scenario.availability.load_trace`) cannot be had
everywhere; :func:`behaviour_trace` writes a stand-in with the same fields and a stated daily pattern, and
:func:`trace_stats` measures any trace (this one, or FedScale's own file) the same way.

What the sources say (facts):

- FedScale's availability trace comes from the user-behaviour data of Yang et al. (WWW 2021, "Characterizing
  Impacts of Heterogeneity in Federated Learning upon Large-Scale Smartphone Data"): an input-method app's
  136k users over one week (31 January to 6 February 2020), 180 million events such as a charge starting or
  the screen locking (FedScale's ``benchmark/dataset/README.md``; Lai et al., ICML 2022).
- Yang et al.'s FLASH counts a device available while it is idle (screen locked), charging and on Wi-Fi,
  Google's eligibility rule (Bonawitz et al., SysML 2019); FedScale's README says it counts charging devices.
- The file is a pickled dict from client id to ``{"duration", "inactive", "finish_time", "active", "model"}``
  (FedScale's ``benchmark/dataset/data/device_info/README.md``); FedScale's runtime treats a client as on
  from each ``active`` time to the ``inactive`` time of the same rank, repeating every ``finish_time``.
- One entry of FedScale's file is quoted in REFL's code (Abdelmoniem et al., EuroSys 2023), with
  the note that the file holds 107,749 clients: ``finish_time`` 518,400 s (six days), 8 sessions in those
  six days, ``duration`` the sum of its on-intervals (211,625 s), ``model`` a phone model's name.

What this generator assumes (no source gives these numbers):

- Time 0 is midnight, and every client lives in the same time zone.
- Each day a client charges overnight with its own probability (Beta-distributed across clients, mean
  :data:`NIGHT_P_MEAN`): locked on Wi-Fi from about 23:00 (normal, sd 1.5 h) for a log-normal time of median
  7 h; and it has daytime sessions (a Poisson number a day, its own rate exponential across clients with mean
  :data:`DAY_RATE_MEAN`), starting uniformly between 07:00 and 22:00, log-normal of median 40 min.
  Together about 1.4 sessions a client a day, near the published entry's 8 in 6 days.
- A session running past ``finish_time`` wraps round to the start of the period (the pattern repeats), and
  overlapping sessions merge. No device ``model`` is drawn: the field stays out.

What follows from them, measured on 100,000 clients (seeds 0 and 1 agree to 0.01): :data:`TARGET_ONLINE_BY_HOUR`
(the fraction of clients online in each hour of the day: 64% at night, 5% in the afternoon),
:data:`TARGET_ONLINE` (24% of client-time) and :data:`TARGET_SESSIONS_PER_DAY`.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np

from fcl_emu.scenario.availability import TraceEntry

DAY_S = 86_400
HOUR_S = 3_600
DAYS = 6  # finish_time 518,400 s, as in the quoted entry of FedScale's file

NIGHT_P_MEAN = 0.7  # per-client probability of an overnight session each day: Beta(2.8, 1.2)
NIGHT_START_H, NIGHT_START_SD_H = 23.0, 1.5
NIGHT_MEDIAN_H, NIGHT_SIGMA = 7.0, 0.35
DAY_RATE_MEAN = 0.7  # daytime sessions a day, per-client rate exponential across clients
DAY_WINDOW_H = (7.0, 22.0)
DAY_MEDIAN_MIN, DAY_SIGMA = 40.0, 0.9

TARGET_ONLINE_BY_HOUR = (  # 00:00-01:00 first
    0.58, 0.64, 0.64, 0.59, 0.51, 0.41, 0.31, 0.24, 0.19, 0.14, 0.11, 0.09,
    0.07, 0.06, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.08, 0.15, 0.28, 0.44,
)
TARGET_ONLINE = 0.24
TARGET_SESSIONS_PER_DAY = 1.38


def behaviour_trace(clients: int, seed: int, days: int = DAYS) -> dict[int, dict]:
    """FedScale-format entries for clients ``0 .. clients-1``: ``active``, ``inactive`` (whole seconds),
    ``finish_time`` (``days`` days) and ``duration`` (the seconds on); the same seed gives the same trace."""
    if clients < 1 or days < 1:
        raise ValueError(f"a behaviour trace needs at least 1 client and 1 day, got {clients} clients, {days} days")
    owner, starts, ends = _sessions(clients, np.random.default_rng(seed), days)
    cuts = np.searchsorted(owner, np.arange(clients + 1)).tolist()
    on = np.concatenate([[0], np.cumsum(ends - starts)])[cuts].tolist()
    starts, ends, period = starts.tolist(), ends.tolist(), days * DAY_S
    return {c: {"active": starts[cuts[c]:cuts[c + 1]], "inactive": ends[cuts[c]:cuts[c + 1]], "finish_time": period,
                "duration": on[c + 1] - on[c]} for c in range(clients)}


def _sessions(clients: int, rng: np.random.Generator, days: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every client's merged on-intervals as flat arrays (owner, start, end), sorted by owner then start."""
    period = days * DAY_S
    night_p = rng.beta(4 * NIGHT_P_MEAN, 4 * (1 - NIGHT_P_MEAN), clients)
    on_night = rng.random((clients, days)) < night_p[:, None]
    night_owner, night_day = np.nonzero(on_night)
    night_start = night_day * DAY_S + rng.normal(NIGHT_START_H, NIGHT_START_SD_H, night_owner.size) * HOUR_S
    night_len = rng.lognormal(np.log(NIGHT_MEDIAN_H * HOUR_S), NIGHT_SIGMA, night_owner.size)

    counts = rng.poisson(rng.exponential(DAY_RATE_MEAN, clients)[:, None], (clients, days))
    day_owner = np.repeat(np.repeat(np.arange(clients), days), counts.ravel())
    day_day = np.repeat(np.tile(np.arange(days), clients), counts.ravel())
    low, high = DAY_WINDOW_H
    day_start = day_day * DAY_S + rng.uniform(low * HOUR_S, high * HOUR_S, day_owner.size)
    day_len = rng.lognormal(np.log(DAY_MEDIAN_MIN * 60), DAY_SIGMA, day_owner.size)

    owner = np.concatenate([night_owner, day_owner])
    start = np.floor(np.concatenate([night_start, day_start]) % period)
    end = start + np.maximum(1, np.ceil(np.minimum(np.concatenate([night_len, day_len]), period)))
    wraps = end > period  # the pattern repeats: the part past finish_time is on at the period's start
    owner = np.concatenate([owner, owner[wraps]])
    start = np.concatenate([start, np.zeros(int(wraps.sum()))])
    end = np.concatenate([np.minimum(end, period), end[wraps] - period])
    return _merge(owner, start.astype(np.int64), end.astype(np.int64), period)


def _merge(owner: np.ndarray, start: np.ndarray, end: np.ndarray, period: int):
    """Overlapping or touching intervals of one owner become one; sorted by owner, then start."""
    order = np.lexsort((start, owner))
    owner, start, end = owner[order], start[order], end[order]
    offset = owner.astype(np.int64) * (period + 1)  # each owner's times in its own range: one running maximum
    reach = np.maximum.accumulate(end + offset) - offset
    first = np.ones(owner.size, dtype=bool)
    first[1:] = (owner[1:] != owner[:-1]) | (start[1:] > reach[:-1])
    heads = np.nonzero(first)[0]
    return owner[heads], start[heads], np.maximum.reduceat(end, heads) if heads.size else end[heads]


def write_trace(trace: dict, path: Path) -> None:
    """Write ``trace`` as JSON when ``path`` ends in ``.json``, otherwise as a pickle (FedScale's own format)."""
    path = Path(path)
    if path.suffix == ".json":
        path.write_text(json.dumps(trace, separators=(",", ":")))
    else:
        path.write_bytes(pickle.dumps(trace, protocol=4))


# ------------------------------------------------------------------ statistics
@dataclass(frozen=True)
class TraceStats:
    """What :func:`trace_stats` measures of a trace."""

    clients: int
    days: float  # the mean period, in days
    online: float  # the fraction of client-time online
    online_by_hour: tuple[float, ...]  # the fraction of clients online in each hour of the day (0:00-1:00 first)
    sessions_per_day: float  # on-intervals a client a day (one cut by the period's end counts twice)

    def line(self) -> str:
        peak = int(np.nanargmax(self.online_by_hour))
        low = int(np.nanargmin(self.online_by_hour))
        return (f"{self.clients:,} clients over {self.days:g} days: online {self.online:.0%} of the time "
                f"({self.online_by_hour[peak]:.0%} at {peak:02d}:00-{peak + 1:02d}:00, {self.online_by_hour[low]:.0%} "
                f"at {low:02d}:00-{low + 1:02d}:00), {self.sessions_per_day:.2f} sessions a client a day")


def stats_of(trace: dict) -> TraceStats:
    """:func:`trace_stats` of a trace as :func:`behaviour_trace` returns it."""
    return trace_stats([TraceEntry(tuple(zip(v["active"], v["inactive"])), float(v["finish_time"]))
                        for v in trace.values()])


def trace_stats(entries: Sequence[TraceEntry]) -> TraceStats:
    """The fraction online (overall and by hour of the day: NaN for an hour no period reaches) and sessions a day
    of a loaded trace, time 0 taken as midnight; each client counts over its own period."""
    if not entries or not any(e.period for e in entries):
        raise ValueError("a trace with no clients or no time has no statistics")
    starts = np.fromiter(chain.from_iterable((a for a, _ in e.intervals) for e in entries), dtype=float)
    ends = np.fromiter(chain.from_iterable((b for _, b in e.intervals) for e in entries), dtype=float)
    periods = np.array([e.period for e in entries], dtype=float)
    hours = int(np.ceil(periods.max() / HOUR_S))
    online = _time_in_hours(starts, ends, hours)
    exposure = _time_in_hours(np.zeros_like(periods), periods, hours)
    hour_of_day = np.arange(hours) % 24
    seen = np.bincount(hour_of_day, exposure, 24)
    by_hour = np.divide(np.bincount(hour_of_day, online, 24), seen, out=np.full(24, np.nan), where=seen > 0)
    total = float(periods.sum())
    return TraceStats(clients=len(entries), days=total / len(entries) / DAY_S,
                      online=float((ends - starts).sum()) / total, online_by_hour=tuple(float(f) for f in by_hour),
                      sessions_per_day=starts.size / (total / DAY_S))


def _time_in_hours(starts: np.ndarray, ends: np.ndarray, hours: int) -> np.ndarray:
    """Seconds covered by the intervals in each hour ``[h, h+1)`` from time 0 (summed over the intervals)."""
    edges = np.arange(hours + 1) * float(HOUR_S)
    return np.diff(_covered_before(np.sort(starts), edges) - _covered_before(np.sort(ends), edges))


def _covered_before(times: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """For each edge ``x``: the sum of ``x - t`` over the sorted ``times`` before it."""
    n = np.searchsorted(times, edges)
    csum = np.concatenate([[0.0], np.cumsum(times)])
    return n * edges - csum[n]
