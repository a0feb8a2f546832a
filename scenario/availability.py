"""Client availability (churn): when each emulated client is online.

The user picks one model for all clients (``edge.availability``,
``--availability``):

- ``always``: online for the whole run;
- ``bernoulli:P``: time is cut into slots of ``edge.availability_slot_s``
  seconds; in each slot a client is online with probability ``P``,
  independently of other slots and clients (the usual "each client is available
  each round with probability p" of FL papers, with the slot standing for a
  round: set the slot near your round length);
- ``onoff:MEAN_ON_S:MEAN_OFF_S``: alternating on and off sessions with
  exponentially distributed durations of the given means; a client starts on
  with the stationary probability ``on / (on + off)``;
- ``trace:PATH``: replay of an availability trace (:func:`load_trace`).

The coordinator resolves the model per client into a small JSON-able dict
(:func:`client_availability`, sent in the client's ``welcome``); the edge node
turns it into a stream of transitions (:func:`transitions`) on the
coordinator's run clock (seconds since the coordinator started). Every draw is
seeded by (run seed, client index), so a run's churn is reproducible.

Trace format. FedScale's client behaviour trace (``client_behave_trace``): a
mapping from client id to ``{"active": [t0, t2, ...], "inactive": [t1, t3,
...], "finish_time": T, ...}`` (seconds): the client comes online at each
``active`` time and goes off at the following ``inactive`` time; the pattern
repeats with period ``finish_time``. The file may be FedScale's pickle (read
with an unpickler that only builds dicts, lists, strings and numbers) or the
same structure in JSON or YAML. Emulated client ``i`` replays the ``i``-th
entry in sorted id order (wrapping around when the trace has fewer clients);
``edge.trace_time_scale`` converts trace seconds into run seconds (FedScale's
traces span days: 0.001 turns a day into 86 s). ``fcl-emu trace behaviour``
writes a synthetic one for any population (:mod:`.behaviour_trace`).
"""

from __future__ import annotations

import gc
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from fcl_emu.scenario.files import read_data

KINDS = ("always", "bernoulli", "onoff", "trace")
USAGE = "always | bernoulli:P | onoff:MEAN_ON_S:MEAN_OFF_S | trace:PATH"


@dataclass(frozen=True)
class AvailabilitySpec:
    kind: str
    p: float = 1.0
    mean_on_s: float = math.inf
    mean_off_s: float = 0.0
    path: Path | None = None


def parse_availability(text: str) -> AvailabilitySpec:
    """Parse ``always | bernoulli:P | onoff:ON:OFF | trace:PATH``; raises ValueError naming the problem."""
    kind, _, rest = text.strip().partition(":")
    if kind == "always" and not rest:
        return AvailabilitySpec("always")
    if kind == "bernoulli":
        p = _number(rest, "bernoulli:P")
        if not 0 < p <= 1:
            raise ValueError(f"availability bernoulli:P needs 0 < P <= 1, got {rest}")
        return AvailabilitySpec("bernoulli", p=p)
    if kind == "onoff":
        parts = rest.split(":")
        if len(parts) != 2:
            raise ValueError(f"availability onoff needs onoff:MEAN_ON_S:MEAN_OFF_S, got {text!r}")
        on, off = (_number(v, "onoff:MEAN_ON_S:MEAN_OFF_S") for v in parts)
        if on <= 0 or off < 0:
            raise ValueError(f"availability onoff needs MEAN_ON_S > 0 and MEAN_OFF_S >= 0, got {text!r}")
        return AvailabilitySpec("onoff", mean_on_s=on, mean_off_s=off)
    if kind == "trace" and rest:
        load_trace(Path(rest))  # fail now, naming the file, rather than at the first welcome
        return AvailabilitySpec("trace", path=Path(rest))
    raise ValueError(f"unknown availability {text!r}; use {USAGE}")


def _number(text: str, form: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"availability {form}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"availability {form}: {text!r} is not finite")
    return value


# ---------------------------------------------------------------------- traces
@dataclass(frozen=True)
class TraceEntry:
    """One client's on-intervals within one period (seconds of the trace)."""

    intervals: tuple[tuple[float, float], ...]
    period: float


@lru_cache(maxsize=4)
def load_trace(path: Path) -> tuple[TraceEntry, ...]:
    """Read a FedScale-format availability trace (pickle, JSON or YAML); entries in sorted client-id order."""
    enabled = gc.isenabled()
    gc.disable()  # millions of small lists and tuples, no cycles: the collector's passes over them cost most
    try:
        data = read_data(path, "availability trace")
        if not isinstance(data, dict) or not data:
            raise ValueError(f"availability trace {path}: expected a non-empty mapping of client id to "
                             f"{{active, inactive, finish_time}}")
        return tuple(_entry(path, key, data[key]) for key in sorted(data, key=sort_key))
    finally:
        if enabled:
            gc.enable()


def sort_key(key: Any):
    return (0, int(key), "") if str(key).lstrip("-").isdigit() else (1, 0, str(key))


def _entry(path: Path, key: Any, value: Any) -> TraceEntry:
    where = f"availability trace {path}, client {key!r}"
    if not isinstance(value, dict) or not {"active", "inactive", "finish_time"} <= value.keys():
        raise ValueError(f"{where}: needs the fields active, inactive and finish_time")
    try:
        active = [float(t) for t in value["active"]]
        inactive = [float(t) for t in value["inactive"]]
        period = float(value["finish_time"])
    except (TypeError, ValueError):
        raise ValueError(f"{where}: active, inactive must be lists of numbers, finish_time a number") from None
    if not all(math.isfinite(t) and t >= 0 for t in active + inactive + [period]):
        raise ValueError(f"{where}: times must be finite and non-negative")
    if len(inactive) < len(active) - 1 or len(inactive) > len(active):
        raise ValueError(f"{where}: {len(active)} active times need as many inactive times (the last may be "
                         f"missing: on until finish_time)")
    ends = inactive + [max([period] + active)] * (len(active) - len(inactive))
    intervals = []
    last = 0.0
    for start, end in zip(active, ends):
        if end < start or start < last:
            raise ValueError(f"{where}: on-intervals must be increasing and not overlap ({start} to {end})")
        if end > start:
            intervals.append((start, end))
        last = end
    return TraceEntry(tuple(intervals), max(period, last))


def client_draw(seed: int, what: str, index: int, round: int) -> float:
    """A reproducible draw in [0, 1) for one client and round (crashes: whether, and where in the round)."""
    return zlib.crc32(f"{seed}/{what}/{index}/{round}".encode()) / 2**32


# ------------------------------------------------- per-client resolution (coordinator)
def client_availability(spec: AvailabilitySpec, index: int, seed: int, *, slot_s: float,
                        trace_time_scale: float) -> dict[str, Any]:
    """What one client's welcome carries: its availability model with its own seed."""
    client_seed = zlib.crc32(f"{seed}/availability/{index}".encode())
    if spec.kind == "always":
        return {"kind": "always"}
    if spec.kind == "bernoulli":
        return {"kind": "bernoulli", "p": spec.p, "slot_s": slot_s, "seed": client_seed}
    if spec.kind == "onoff":
        return {"kind": "onoff", "mean_on_s": spec.mean_on_s, "mean_off_s": spec.mean_off_s, "seed": client_seed}
    entries = load_trace(spec.path)
    entry = entries[index % len(entries)]
    return {"kind": "trace", "intervals": entry.intervals, "period": entry.period,  # shared, read-only: no copy
            "scale": trace_time_scale}


# ------------------------------------------------------------ transitions (edge node)
def transitions(model: dict[str, Any]) -> Iterator[tuple[float, bool]]:
    """``(time_s, online)`` pairs in increasing time, starting at time 0, on the run clock.

    Consecutive pairs may repeat a state; a finite stream means the last state holds for ever.
    Raises ValueError for a malformed model (it came over the wire).
    """
    kind = model.get("kind")
    if kind == "always":
        return iter([(0.0, True)])
    try:
        if kind == "bernoulli":
            return _bernoulli(float(model["p"]), float(model["slot_s"]), int(model["seed"]))
        if kind == "onoff":
            return _onoff(float(model["mean_on_s"]), float(model["mean_off_s"]), int(model["seed"]))
        if kind == "trace":
            intervals = model["intervals"]
            if not isinstance(intervals, tuple):  # from the wire; a tuple is a loaded entry's, already numbers
                intervals = [(float(a), float(b)) for a, b in intervals]
            return _trace(intervals, float(model["period"]), float(model["scale"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed availability model {model!r}: {exc}") from None
    raise ValueError(f"unknown availability kind {kind!r}")


def _bernoulli(p: float, slot_s: float, seed: int) -> Iterator[tuple[float, bool]]:
    rng = np.random.default_rng(seed)
    state = None
    slot = 0
    while True:
        block = rng.random(1024) < p
        for on in block:
            if on != state:
                state = bool(on)
                yield slot * slot_s, state
            slot += 1
        if p >= 1.0:
            return


def _onoff(mean_on: float, mean_off: float, seed: int) -> Iterator[tuple[float, bool]]:
    rng = np.random.default_rng(seed)
    if mean_off == 0:
        yield 0.0, True
        return
    on = bool(rng.random() < mean_on / (mean_on + mean_off))
    t = 0.0
    while True:
        yield t, on
        t += float(rng.exponential(mean_on if on else mean_off))
        on = not on


def _trace(intervals: list[tuple[float, float]], period: float, scale: float) -> Iterator[tuple[float, bool]]:
    if not intervals or period <= 0:
        yield 0.0, False
        return
    if intervals[0][0] > 0:
        yield 0.0, False
    cycle = 0
    while True:
        base = cycle * period
        for start, end in intervals:
            yield (base + start) * scale, True
            yield (base + end) * scale, False
        cycle += 1
