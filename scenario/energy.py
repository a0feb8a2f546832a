"""Energy of a client's round on the emulated clock: computing, and the radio per byte up and down.

A client that trains spends ``compute_w x compute_s`` (its device class's power while training, times its
emulated compute time). Its radio follows the linear power-throughput model of Huang et al., "A Close
Examination of Performance and Power Characteristics of 4G LTE Networks" (MobiSys 2012): while a transfer at
``r`` Mbit/s lasts, the radio draws ``alpha x r + beta`` mW (``alpha``: per direction), and after the last byte an
LTE radio stays in its high-power tail for ``tail_s`` at ``tail_mw`` before it sleeps. A round has two
transfers (the download of its requests and model, the upload of its update), each followed by a tail.

Coefficients (Huang et al., their power model fitted on commercial networks):

========  ================  ==================  =======  =======================
radio     alpha up mW/Mbps  alpha down mW/Mbps  beta mW  tail
========  ================  ==================  =======  =======================
``wifi``  283.17            137.01              132.86   left out (under 0.25 s)
``lte``   438.39            51.97               1288.04  1060 mW for 11.576 s
========  ================  ==================  =======  =======================

No study here gives a 5G model in this form; a profile may give its own coefficients
(``radio: {up_mw_per_mbps, down_mw_per_mbps, base_mw, tail_mw, tail_s}``) for 5G or anything else. A profile
without a radio spends nothing on it; an unlimited link (no bandwidth) transfers in no time and spends only its
tail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pydantic


class RadioModel(pydantic.BaseModel):
    """A radio's power while it transfers at ``r`` Mbit/s: ``alpha x r + base_mw``; then its tail."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    up_mw_per_mbps: float = pydantic.Field(ge=0)
    down_mw_per_mbps: float = pydantic.Field(ge=0)
    base_mw: float = pydantic.Field(ge=0)
    tail_mw: float = pydantic.Field(0.0, ge=0)
    tail_s: float = pydantic.Field(0.0, ge=0)

    def transfer_j(self, direction: str, nbytes: int, bytes_s: float) -> float:
        """Joules of sending (``up``) or receiving (``down``) ``nbytes`` at ``bytes_s``, tail included."""
        if nbytes <= 0:
            return 0.0
        tail = self.tail_mw * self.tail_s / 1000.0
        if math.isinf(bytes_s):
            return tail
        mbps = bytes_s * 8 / 1e6
        alpha = self.up_mw_per_mbps if direction == "up" else self.down_mw_per_mbps
        return (alpha * mbps + self.base_mw) / 1000.0 * (nbytes / bytes_s) + tail


RADIOS: dict[str, RadioModel] = {
    "wifi": RadioModel(up_mw_per_mbps=283.17, down_mw_per_mbps=137.01, base_mw=132.86),
    "lte": RadioModel(up_mw_per_mbps=438.39, down_mw_per_mbps=51.97, base_mw=1288.04, tail_mw=1060.0,
                      tail_s=11.576),
}

KINDS = ("compute", "radio")  # the fields of Energy: the kinds the run's totals and metrics break energy into


@dataclass(frozen=True)
class Energy:
    """Joules one client spent in one round, by kind."""

    compute: float = 0.0
    radio: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.radio


def round_energy(profile, down_bytes: int, up_bytes: int, compute_s: float | None) -> Energy:
    """What a client of ``profile`` (a :class:`~fcl_emu.scenario.devices.DeviceProfile`) spent on a round in
    which it received ``down_bytes``, computed ``compute_s`` emulated seconds (None: it did not) and sent
    ``up_bytes``."""
    compute = profile.compute_w * compute_s if compute_s else 0.0
    radio = 0.0
    if profile.radio is not None:
        radio = (profile.radio.transfer_j("down", down_bytes, profile.downlink_bytes_s)
                 + profile.radio.transfer_j("up", up_bytes, profile.uplink_bytes_s))
    return Energy(compute, radio)
