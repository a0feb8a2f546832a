"""Fault plans: what to do to which edge-node container, and when (``--faults PLAN.yaml``).

The plan is part of the emulated world, like availability models and device profiles; it is validated with
the run's configuration and carried out by :class:`containers.faults.FaultInjector` (docs/containers.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pydantic

from scenario.files import load_model

ACTIONS = ("kill", "pause", "disconnect", "restart")
UNDO = {"pause": "unpause", "disconnect": "reconnect"}


class Fault(pydantic.BaseModel):
    """One entry of a fault plan: what to do, to which node, and when."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    action: Literal["kill", "pause", "disconnect", "restart"]
    node: str | None = pydantic.Field(None, description="an edge node's name (node-3)")
    device_class: str | None = pydantic.Field(None, description="one node of this device class, drawn at random")
    round: int | None = pydantic.Field(None, ge=1, description="when this global round starts (1-based)")
    at_s: float | None = pydantic.Field(None, ge=0, description="seconds after the first round starts")
    rate_per_min: float | None = pydantic.Field(None, gt=0, description="Poisson arrivals at this rate")
    per_round: float | None = pydantic.Field(
        None, gt=0, le=1, description="at every round's start, each matching node independently with this "
                                      "probability (the per-round rate of the emulated crash_rate)")
    after_s: float = pydantic.Field(0.0, ge=0, description="delay after the round trigger")
    duration_s: float = pydantic.Field(5.0, ge=0, description="pause/disconnect: undone after this long")

    @pydantic.model_validator(mode="after")
    def _one_trigger(self) -> "Fault":
        triggers = [t for t in ("round", "at_s", "rate_per_min", "per_round") if getattr(self, t) is not None]
        if len(triggers) != 1:
            raise ValueError(f"a fault needs exactly one of round, at_s, rate_per_min, per_round (got "
                             f"{triggers or 'none'})")
        if self.node is not None and self.device_class is not None:
            raise ValueError("a fault names a node or a device_class, not both")
        return self


class FaultPlan(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    faults: list[Fault] = pydantic.Field(min_length=1)


def load_plan(path: Path) -> FaultPlan:
    """Read and check a fault plan; raises ValueError naming the file and the problem."""
    return load_model(path, FaultPlan, "fault plan")
