"""The default device mix: three phone classes, used under the emulated clock when no profiles file is given.

Every value is a cited measurement or a stated assumption (docs/devices.md lists them with their sources); a run
that needs other devices gives ``--device-profiles``. Compute is a throughput (``gflops``: sustained training
GFLOP/s), turned into seconds by the run's training work per sample (model and method,
:mod:`fcl_emu.methods.models.flops`), so the default emulated clock depends on nothing the host
measures.

- ``gflops``: Das et al., "Enabling On-Device Smartphone GPU based Training: Lessons Learned" (2022), measure
  15-30 GFLOP/s of training on the CPUs of Snapdragon 8-series phones (MNN): 30 for ``phone-high``, 15 for
  ``phone-mid``; ``phone-low`` (5) is an assumption, a third of ``phone-mid``.
- links: ``lte`` at 13 Mbit/s down and 6 up, the medians Huang et al. (MobiSys 2012) measured on LTE;
  ``phone-high`` on Wi-Fi at 50/20 and ``phone-low`` at 5/2 Mbit/s are assumptions. Radio power: Huang et al.
  (:mod:`fcl_emu.scenario.energy`).
- power while training (4, 3, 2 W), idle drain (0.05 W) and initial charge (uniformly 30-100 %) are
  assumptions; batteries are common phone capacities (5,000, 4,500, 4,000 mAh at 3.85 V).
"""

from __future__ import annotations

from fcl_emu.scenario.devices import ProfilesFile

_MAH_AT_3V85 = 3.85 / 1000  # Wh per mAh at a Li-ion cell's nominal 3.85 V

DEFAULT_CLASSES = ProfilesFile.model_validate({"profiles": [
    {"name": "phone-high", "share": 0.3, "gflops": 30.0, "radio": "wifi", "downlink_mbps": 50.0,
     "uplink_mbps": 20.0, "latency_ms": 10.0, "compute_w": 4.0, "idle_w": 0.05,
     "battery_wh": 5000 * _MAH_AT_3V85, "initial_charge": {"uniform": [0.3, 1.0]}},
    {"name": "phone-mid", "share": 0.4, "gflops": 15.0, "radio": "lte", "downlink_mbps": 13.0,
     "uplink_mbps": 6.0, "latency_ms": 35.0, "compute_w": 3.0, "idle_w": 0.05,
     "battery_wh": 4500 * _MAH_AT_3V85, "initial_charge": {"uniform": [0.3, 1.0]}},
    {"name": "phone-low", "share": 0.3, "gflops": 5.0, "radio": "lte", "downlink_mbps": 5.0,
     "uplink_mbps": 2.0, "latency_ms": 50.0, "compute_w": 2.0, "idle_w": 0.05,
     "battery_wh": 4000 * _MAH_AT_3V85, "initial_charge": {"uniform": [0.3, 1.0]}},
]})
