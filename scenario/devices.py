"""Device profiles: compute speed, link bandwidth and latency of each emulated client.

A profiles file (``edge.device_profiles``, ``--device-profiles``; YAML or JSON):

.. code-block:: yaml

    profiles:
      - name: flagship            # a label of the link metrics: keep the set small
        share: 0.4                # fraction of the clients (shares are normalised)
        compute_factor: 1.0       # local training takes this many times its measured CPU time
        uplink_mbps: 20           # megabits per second
        downlink_mbps: 50
        latency_ms: 30            # one way
      - name: phone
        share: 0.2
        gflops: 15                # or a training throughput: the run's work per sample over it
        radio: lte                # energy (docs/devices.md): wifi, lte, or {up_mw_per_mbps, ...}
        compute_w: 3.0            # watts while training
        idle_w: 0.05
        battery_wh: 17.3
        initial_charge: {uniform: [0.3, 1.0]}
      - name: budget
        share: 0.2
        ms_per_sample: {lognormal: {median: 12.0, sigma: 0.5}}   # or a fixed cost per sample trained
        uplink_mbps: {uniform: [1, 5]}
        downlink_mbps: 10
        latency_ms: {uniform: [50, 200]}
        container:                # real limits under `up --backend docker|swarm` (ignored by host processes)
          cpus: 0.25              # CPU share of each container hosting budget clients
          memory: 1g              # its memory limit: past it the kernel kills the node (recorded as a crash)
          uplink_mbit: 8          # kernel token-bucket (tbf) cap on the container's egress
    clients:                      # optional: pin clients to profiles
      7: budget

Each value is a number or a distribution (``uniform: [low, high]``,
``lognormal: {median, sigma}``), drawn once per client. A client's compute
time in a round (:meth:`DeviceProfile.compute_s`) is either its measured CPU
time of its own training times ``compute_factor`` (measured: depends on the
host), ``ms_per_sample`` times the samples it trained (local samples x local
epochs; exact and independent of the host, but blind to a method's extra work
per step), or, with ``gflops``, the run's training work per sample (model and
method, :class:`DeviceSet`) over that throughput: exact, host-independent and
method-aware. A profile gives one of the three (``compute: measured`` or
``modelled`` may say which). Without a profiles file, the emulated clock uses
the default device mix (:mod:`fcl_emu.scenario.device_classes`).

FedScale's device-capacity file (``client_device_capacity``: client id ->
``{"computation": ms per sample, "communication": kbit/s}``, a pickle, JSON or
YAML) is read as well: emulated client ``i`` gets the ``i``-th entry in sorted
id order (wrapping around), ``ms_per_sample = 3 x computation`` (FedScale's
own factor for a training pass over its inference latency) and
``communication`` as both up- and downlink bandwidth, no latency; all of them
form one device class, ``fedscale``. A missing bandwidth
means an unlimited link; a missing latency 0. The coordinator assigns a
profile to every client, seeded by the run seed (:func:`assign_profile`), and
sends it in the client's ``welcome``; the edge node applies its bandwidth and
latency to the client's real messages (:class:`fcl_emu.scenario.links.Link`).

Under a container backend the clients of one class share the containers of that class, so ``container``
limits are real: the kernel throttles, caps and kills. ``compute_factor`` still scales the measured time on top
of them; leave it at 1 for a class whose slowness comes from its CPU limit.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pydantic

from fcl_emu.scenario.availability import sort_key
from fcl_emu.scenario.energy import RADIOS, RadioModel
from fcl_emu.scenario.files import read_data, validate

Value = float | dict[str, Any]

_MEMORY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([bkmg]?)$")


def memory_limit(value: str) -> str:
    """A Docker memory limit (``512m``, ``2g``, ``1.5g``, bytes), normalised to lower case; at least 6 MB (the
    engine's minimum). Raises ValueError naming the accepted forms."""
    match = _MEMORY.match(str(value).strip().lower())
    if not match:
        raise ValueError(f"memory limit {value!r}: use a number of bytes or one with a unit b, k, m or g (512m, 2g)")
    scale = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[match.group(2)]
    if float(match.group(1)) * scale < 6 << 20:
        raise ValueError(f"memory limit {value!r} is below the 6 MB a container needs at least")
    return str(value).strip().lower()


def memory_bytes(limit: str) -> int:
    """Bytes of a limit accepted by :func:`memory_limit`."""
    number, unit = _MEMORY.match(limit).groups()
    return int(float(number) * {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit])


class ContainerLimits(pydantic.BaseModel):
    """Real limits of the containers that host one device class (container backends only)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    cpus: float | None = pydantic.Field(None, gt=0, description="CPUs of each container (0.25: a quarter core)")
    memory: str | None = pydantic.Field(None, description="memory limit of each container, no swap (512m, 2g)")
    uplink_mbit: float | None = pydantic.Field(None, gt=0, description="kernel tbf cap on the container's egress")

    @pydantic.field_validator("memory")
    @classmethod
    def _memory(cls, value: str | None) -> str | None:
        return value if value is None else memory_limit(value)


class _Profile(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    name: str = pydantic.Field(min_length=1, max_length=40)
    share: float = pydantic.Field(1.0, gt=0)
    compute: Literal["modelled", "measured"] | None = None  # measured: CPU time x compute_factor (host-dependent)
    compute_factor: Value = 1.0
    ms_per_sample: Value | None = None
    gflops: Value | None = None
    uplink_mbps: Value | None = None
    downlink_mbps: Value | None = None
    latency_ms: Value = 0.0
    compute_w: Value = 0.0
    idle_w: Value = 0.0
    radio: str | RadioModel | None = None
    battery_wh: Value | None = None
    initial_charge: Value = 1.0
    container: ContainerLimits | None = None

    @pydantic.model_validator(mode="after")
    def _one_compute_model(self) -> "_Profile":
        given = [k for k in ("ms_per_sample", "gflops") if getattr(self, k) is not None]
        if self.compute_factor != 1.0:
            given.append("compute_factor")
        if len(given) > 1:
            raise ValueError(f"profile {self.name!r}: give one of compute_factor, ms_per_sample and gflops, "
                             f"not {' and '.join(given)}")
        if self.compute == "measured" and given and given != ["compute_factor"]:
            raise ValueError(f"profile {self.name!r}: compute: measured takes compute_factor, not {given[0]}")
        if self.compute == "modelled" and (not given or given[0] == "compute_factor"):
            raise ValueError(f"profile {self.name!r}: compute: modelled needs ms_per_sample or gflops")
        if _support(self.initial_charge, "initial_charge")[1] > 1:
            raise ValueError(f"profile {self.name!r}: initial_charge is a fraction of the battery, at most 1")
        return self

    @pydantic.field_validator("radio")
    @classmethod
    def _radio(cls, value: str | RadioModel | None) -> str | RadioModel | None:
        if isinstance(value, str) and value not in RADIOS:
            raise ValueError(f"radio {value!r}: one of {', '.join(RADIOS)}, or a model "
                             f"{{up_mw_per_mbps, down_mw_per_mbps, base_mw, tail_mw, tail_s}}")
        return value

    @pydantic.field_validator("compute_factor", "ms_per_sample", "gflops", "uplink_mbps", "downlink_mbps",
                              "latency_ms", "compute_w", "idle_w", "battery_wh", "initial_charge")
    @classmethod
    def _value(cls, value: Value | None, info) -> Value | None:
        if value is None:
            return value
        low = _support(value, info.field_name)[0]
        may_be_zero = info.field_name in ("latency_ms", "compute_w", "idle_w", "initial_charge")
        if low < 0 or (not may_be_zero and low == 0):
            raise ValueError(f"{info.field_name} must be positive" + (" or zero" if may_be_zero else ""))
        return value


class ProfilesFile(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    profiles: list[_Profile] = pydantic.Field(min_length=1)
    clients: dict[int, str] = {}
    # a FedScale device-capacity file: (ms per sample, kbit/s) per trace client, in sorted id order
    trace: tuple[tuple[pydantic.PositiveFloat, pydantic.PositiveFloat], ...] = ()

    @pydantic.model_validator(mode="after")
    def _names(self) -> "ProfilesFile":
        names = [p.name for p in self.profiles]
        if len(set(names)) != len(names):
            raise ValueError("profile names must be unique")
        unknown = sorted(set(self.clients.values()) - set(names))
        if unknown:
            raise ValueError(f"clients: unknown profile(s) {unknown}")
        return self


def _support(value: Value, field: str) -> tuple[float, float]:
    """(lowest, highest) value a number or distribution can take; raises ValueError if malformed."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"{field} must be finite")
        return float(value), float(value)
    if isinstance(value, dict) and len(value) == 1:
        (dist, params), = value.items()
        if dist == "uniform" and isinstance(params, list) and len(params) == 2:
            low, high = (float(v) for v in params)
            if math.isfinite(low) and math.isfinite(high) and low <= high:
                return low, high
        if dist == "lognormal" and isinstance(params, dict) and params.keys() == {"median", "sigma"}:
            median, sigma = float(params["median"]), float(params["sigma"])
            if median > 0 and sigma >= 0 and math.isfinite(median * sigma):
                return 1e-12, math.inf
    raise ValueError(f"{field}: expected a number, {{uniform: [low, high]}} or "
                     f"{{lognormal: {{median: M, sigma: S}}}}, got {value!r}")


FEDSCALE_CLASS = "fedscale"
FEDSCALE_TRAINING_FACTOR = 3.0  # FedScale: a training pass over a sample costs 3x its inference latency


@lru_cache(maxsize=4)
def load_profiles(path: Path) -> ProfilesFile:
    """Read and validate a profiles file or a FedScale device-capacity file; raises ValueError naming the file
    and the problem."""
    data = read_data(path, "device profiles")
    if isinstance(data, dict) and data and "profiles" not in data:
        return _fedscale_capacities(path, data)
    return validate(data, ProfilesFile, "device profiles", path)


def _fedscale_capacities(path: Path, data: dict) -> ProfilesFile:
    entries = []
    for key in sorted(data, key=sort_key):
        value = data[key]
        if not isinstance(value, dict) or not {"computation", "communication"} <= value.keys():
            raise ValueError(f"device profiles {path}: client {key!r}: a FedScale device-capacity entry needs "
                             f"computation (ms per sample) and communication (kbit/s)")
        entries.append((value["computation"], value["communication"]))
    return validate({"profiles": [{"name": FEDSCALE_CLASS}], "trace": entries}, ProfilesFile, "device profiles",
                    path)


@dataclass(frozen=True)
class DeviceProfile:
    """One client's drawn profile. Its compute and link part is what the client's ``welcome`` carries
    (:meth:`to_wire`); its energy part (power, radio, battery) stays with the coordinator's emulated clock."""

    name: str = "default"
    compute_factor: float = 1.0
    ms_per_sample: float | None = None
    uplink_bytes_s: float = math.inf
    downlink_bytes_s: float = math.inf
    latency_s: float = 0.0
    gflops: float | None = None  # a throughput class: ms_per_sample is its work per sample over this
    compute_w: float = 0.0
    idle_w: float = 0.0
    radio: RadioModel | None = None
    battery_j: float | None = None
    initial_charge: float = 1.0

    _WIRE = ("name", "compute_factor", "ms_per_sample", "uplink_bytes_s", "downlink_bytes_s", "latency_s")

    def to_wire(self) -> dict[str, Any]:
        # JSON has no infinity: an unlimited link travels as null
        return {k: (None if isinstance(v, float) and math.isinf(v) else v)
                for k, v in ((k, getattr(self, k)) for k in self._WIRE)}
    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "DeviceProfile":
        """Raises ValueError for a malformed profile (it came over the wire)."""
        try:
            ms = data["ms_per_sample"]
            profile = cls(name=str(data["name"]), compute_factor=float(data["compute_factor"]),
                          ms_per_sample=None if ms is None else float(ms),
                          uplink_bytes_s=math.inf if data["uplink_bytes_s"] is None else float(data["uplink_bytes_s"]),
                          downlink_bytes_s=(math.inf if data["downlink_bytes_s"] is None
                                            else float(data["downlink_bytes_s"])),
                          latency_s=float(data["latency_s"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed device profile {data!r}: {exc}") from None
        if not (profile.compute_factor > 0 and (profile.ms_per_sample is None or profile.ms_per_sample > 0)
                and profile.uplink_bytes_s > 0 and profile.downlink_bytes_s > 0
                and 0 <= profile.latency_s < math.inf):
            raise ValueError(f"device profile out of range: {data!r}")
        return profile

    def compute_s(self, cpu_s: float, samples_trained: int) -> float:
        """Emulated seconds of one round's local training: ``ms_per_sample`` x samples trained if the profile
        gives it, else the measured CPU time x ``compute_factor``."""
        if self.ms_per_sample is not None:
            return self.ms_per_sample * samples_trained / 1000.0
        return cpu_s * self.compute_factor


@dataclass(frozen=True)
class DeviceSet:
    """The run's device profiles, and what turns a class's throughput (``gflops``) into time: ``work(task)``,
    the FLOPs a client trains per real sample in a task (the run's model and method,
    :mod:`fcl_emu.methods.models.flops`). ``measured`` (``edge.compute: measured``): every client's compute is its
    measured CPU time instead (host-dependent)."""

    profiles: ProfilesFile
    work: Callable[[int], float] | None = None
    measured: bool = False

    def assign(self, index: int, seed: int) -> DeviceProfile:
        """Client ``index``'s profile, its per-sample cost that of task 0 (:meth:`in_task` gives another's)."""
        return assign_profile(self.profiles, index, seed, flops_per_sample=None if self.work is None else self.work(0),
                              measured=self.measured)

    def in_task(self, profile: DeviceProfile, task: int) -> DeviceProfile:
        """``profile`` with its per-sample cost in ``task`` (a method's work per sample changes with the task)."""
        if profile.gflops is None or self.work is None:
            return profile
        return replace(profile, ms_per_sample=self.work(task) / (profile.gflops * 1e9) * 1000.0)


def assign_profile(profiles: ProfilesFile | None, index: int, seed: int, *, flops_per_sample: float | None = None,
                   measured: bool = False) -> DeviceProfile:
    """Client ``index``'s profile: pinned, or drawn by share; its values drawn from their distributions.
    ``gflops`` becomes a cost per sample through ``flops_per_sample`` (without it, only the name is meaningful);
    ``measured``: every client's compute is its measured CPU time (x ``compute_factor``)."""
    if profiles is None:
        return DeviceProfile()
    if profiles.trace:
        ms, kbit_s = profiles.trace[index % len(profiles.trace)]
        return DeviceProfile(name=FEDSCALE_CLASS, ms_per_sample=None if measured else FEDSCALE_TRAINING_FACTOR * ms,
                             uplink_bytes_s=kbit_s * 1000 / 8, downlink_bytes_s=kbit_s * 1000 / 8)
    rng = np.random.default_rng(zlib.crc32(f"{seed}/profile/{index}".encode()))
    shares = np.array([p.share for p in profiles.profiles])
    cdf = (shares / shares.sum()).cumsum()  # Generator.choice(p=...)'s own draw, without its checks: 20 us a client
    cdf /= cdf[-1]
    pick = int(cdf.searchsorted(rng.random(), side="right"))
    chosen = next(p for p in profiles.profiles if p.name == profiles.clients[index]) if index in profiles.clients \
        else profiles.profiles[pick]

    def draw(value: Value | None) -> float | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            return float(value)
        (dist, params), = value.items()
        if dist == "uniform":
            return float(rng.uniform(*params))
        return float(params["median"] * math.exp(params["sigma"] * rng.standard_normal()))

    def bytes_s(mbps: float | None) -> float:
        return math.inf if mbps is None else mbps * 1e6 / 8

    # every value is drawn, used or not, so that one setting never shifts the draws of the others
    factor, ms, gflops = draw(chosen.compute_factor), draw(chosen.ms_per_sample), draw(chosen.gflops)
    up, down, latency = draw(chosen.uplink_mbps), draw(chosen.downlink_mbps), draw(chosen.latency_ms)
    compute_w, idle_w, battery_wh = draw(chosen.compute_w), draw(chosen.idle_w), draw(chosen.battery_wh)
    charge = draw(chosen.initial_charge)
    if gflops is not None and flops_per_sample is not None:
        ms = flops_per_sample / (gflops * 1e9) * 1000.0
    if measured or chosen.compute == "measured":
        ms = gflops = None
    radio = RADIOS[chosen.radio] if isinstance(chosen.radio, str) else chosen.radio
    return DeviceProfile(name=chosen.name, compute_factor=factor, ms_per_sample=ms,
                         uplink_bytes_s=bytes_s(up), downlink_bytes_s=bytes_s(down), latency_s=latency / 1000.0,
                         gflops=gflops, compute_w=compute_w, idle_w=idle_w, radio=radio,
                         battery_j=None if battery_wh is None else battery_wh * 3600.0, initial_charge=charge)
