"""Fault plans: what to do to which edge-node container, and when (``--faults PLAN.yaml``).

The plan is part of the emulated world, like availability models and device profiles; it is validated with
the run's configuration and carried out by :class:`fcl_emu.containers.faults.FaultInjector` (docs/containers.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pydantic

from fcl_emu.scenario.files import load_model

NODE_ACTIONS = ("kill", "pause", "disconnect", "restart")
HOST_ACTIONS = ("lose_host", "partition", "slow_host")  # a host of a local cluster, everything on it at once
ACTIONS = NODE_ACTIONS + HOST_ACTIONS
NEEDS_CLUSTER = ("lose_host, partition and slow_host act on the hosts of a local cluster: run with --backend swarm "
                 "--cluster NAME (`fcl-emu cluster up`)")
UNDO = {"pause": "unpause", "disconnect": "reconnect", "partition": "heal", "slow_host": "restore"}
# where in a round its faults land: at its start (no client sent its request yet) or once the requests are sent
ROUND_POINTS = ("start", "dispatched")


class Fault(pydantic.BaseModel):
    """One entry of a fault plan: what to do, to which node, and when."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    action: Literal["kill", "pause", "disconnect", "restart", "lose_host", "partition", "slow_host"]
    node: str | None = pydantic.Field(None, description="an edge node's name (node-3)")
    host: str | None = pydantic.Field(None, description="host actions: a host of the cluster (local-2); unset: "
                                                        "one drawn at random among those that run edge nodes")
    cpus: float | None = pydantic.Field(None, gt=0, description="slow_host: the CPUs everything on the host shares")
    device_class: str | None = pydantic.Field(None, description="one node of this device class, drawn at random")
    round: int | None = pydantic.Field(None, ge=1, description="when this global round starts (1-based)")
    at_s: float | None = pydantic.Field(None, ge=0, description="seconds after the first round starts")
    rate_per_min: float | None = pydantic.Field(None, gt=0, description="Poisson arrivals at this rate")
    per_round: float | None = pydantic.Field(
        None, gt=0, le=1, description="at every round's start, each matching node independently with this "
                                      "probability (the per-round rate of the emulated crash_rate)")
    round_point: Literal["start", "dispatched"] = pydantic.Field(
        "start", description="round and per_round: at the round's start, before any client is sent its request, "
                             "or once the round's train requests are sent (its clients are training)")
    after_s: float = pydantic.Field(0.0, ge=0, description="delay after the round trigger (0: the round goes on "
                                                           "only once the fault has landed)")
    duration_s: float | None = pydantic.Field(
        5.0, ge=0, description="pause, disconnect, partition, slow_host: undone after this long (slow_host: "
                               "null keeps it slow to the end)")

    @pydantic.model_validator(mode="after")
    def _one_trigger(self) -> "Fault":
        triggers = [t for t in ("round", "at_s", "rate_per_min", "per_round") if getattr(self, t) is not None]
        if len(triggers) != 1:
            raise ValueError(f"a fault needs exactly one of round, at_s, rate_per_min, per_round (got "
                             f"{triggers or 'none'})")
        if self.node is not None and self.device_class is not None:
            raise ValueError("a fault names a node or a device_class, not both")
        if self.round_point != "start" and self.round is None and self.per_round is None:
            raise ValueError("round_point places a round's fault: it needs round or per_round")
        if self.action in HOST_ACTIONS:
            if self.node is not None or self.device_class is not None:
                raise ValueError(f"{self.action} acts on a host: name it with host, not node or device_class")
            if (self.action == "slow_host") != (self.cpus is not None):
                raise ValueError("slow_host needs cpus, and only slow_host takes it")
            if self.action == "partition" and self.duration_s is None:
                raise ValueError("a partition heals after duration_s")
        elif self.host is not None or self.cpus is not None:
            raise ValueError(f"{self.action} acts on an edge node: host and cpus are for lose_host, partition, "
                             f"slow_host")
        elif self.duration_s is None:
            raise ValueError(f"{self.action}: duration_s is a number of seconds")
        return self


class FaultPlan(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    faults: list[Fault] = pydantic.Field(min_length=1)


def load_plan(path: Path) -> FaultPlan:
    """Read and check a fault plan; raises ValueError naming the file and the problem."""
    return load_model(path, FaultPlan, "fault plan")
