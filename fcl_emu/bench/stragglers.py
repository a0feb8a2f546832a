"""``fcl-emu bench churn --stragglers``: synchronous against asynchronous aggregation under stragglers.

A straggler point runs without churn on the emulated clock, its clients phones of
:data:`~fcl_emu.bench.churn.EMULATED_DEVICE`'s cost, a share ``s`` of them :data:`SLOWDOWN` times slower to
train (a device class ``straggler``). Each point runs one round policy (``--aggregations``): ``sync`` (rounds of
``clients_per_round``, waiting for the cohort up to the deadline) or ``fedbuff`` / ``fedasync`` with
``concurrency`` and ``buffer`` equal to ``clients_per_round``, so both aggregate as many updates per round. The
measure is the emulated time until the accuracy on the seen classes first reaches ``--target-accuracy`` in the
first task (every round is evaluated): :func:`fcl_emu.bench.churn.time_to_accuracy`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import yaml

from fcl_emu.bench.churn import EMULATED_DEVICE, point_config
from fcl_emu.runconfig.config import merge_config

SLOWDOWN = 10.0  # a straggler's training time against a phone's
DEFAULT_SHARES = (0.0, 0.2, 0.5)
DEFAULT_AGGREGATIONS = ("sync", "fedbuff")


def parse_shares(text: str) -> list[float]:
    """``0,20,50`` (percent) or ``0,0.2,0.5``: straggler shares in [0, 1)."""
    shares = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        try:
            value = float(item.rstrip("%"))
        except ValueError:
            raise ValueError(f"--stragglers: {item!r} is not a number") from None
        value = value / 100 if value > 1 or item.endswith("%") else value
        if not 0 <= value < 1:
            raise ValueError(f"--stragglers: {item} is outside [0, 100) %")
        shares.append(value)
    return sorted(set(shares))


def parse_aggregations(text: str) -> list[str]:
    from fcl_emu.aggregation.policies import POLICY_NAMES as allowed

    kinds = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [k for k in kinds if k not in allowed]
    if unknown or not kinds:
        raise ValueError(f"--aggregations: give some of {', '.join(allowed)} (got {text!r})")
    return list(dict.fromkeys(kinds))


def profiles_file(out: Path, share: float) -> Path:
    """The device profiles of a point: phones, and a ``share`` of stragglers."""
    profiles = [{**EMULATED_DEVICE, "share": 1.0 - share}]
    if share > 0:
        profiles.append({**EMULATED_DEVICE, "name": "straggler",
                         "ms_per_sample": EMULATED_DEVICE["ms_per_sample"] * SLOWDOWN, "share": share})
    path = Path(out) / f"devices-stragglers{share:.2f}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"profiles": profiles}))
    return path


def point_name(method: str, share: float, aggregation: str, seed: int) -> str:
    return f"{method}-stragglers{share:.2f}-{aggregation}-s{seed}"


def straggler_config(base: dict, method: str, share: float, aggregation: str, seed: int, out: Path) -> dict:
    """One point's config, validated (ValueError naming the problem)."""
    cohort = int(base.get("rounds", {}).get("clients_per_round", 30))
    policy: dict[str, Any] = {"name": aggregation}  # asynchronous: as many training at once as a round's cohort
    if aggregation != "sync":
        policy["concurrency"] = cohort
    if aggregation == "fedbuff":
        policy["buffer"] = cohort
    override: dict[str, Any] = {
        "edge": {"device_profiles": str(profiles_file(out, share).resolve())},
        "rounds": {"clock": "emulated", "eval_every": 1},
        "aggregation": {"policy": policy}}
    return point_config(merge_config(base, override), method, 0.0, 0.0, seed)


def points(base: dict, methods: Sequence[str], shares: Sequence[float], aggregations: Sequence[str], seed: int,
           out: Path) -> list[tuple[str, dict, dict[str, Any]]]:
    """Every straggler point: (run name, config, the row's own fields)."""
    return [(point_name(m, s, a, seed), straggler_config(base, m, s, a, seed, out),
             {"sweep": "stragglers", "aggregation": a, "stragglers": s})
            for m in methods for s in shares for a in aggregations]
