"""One emulated client's state on its edge node (its socket, store, task, edge-realism counters) and the work
about it: a training job and its result, and its side of a round's secure aggregation."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fcl_emu.edge_node.store import ArrayStore
from fcl_emu.scenario.devices import DeviceProfile
from fcl_emu.scenario.links import Link
from fcl_emu.secagg.client import SecAggClient
from fcl_emu.wire.messages import TrainRequest
from fcl_emu.wire.sockets import ClientEndpoint


@dataclass
class EmulatedClient:
    index: int
    endpoint: ClientEndpoint
    store: ArrayStore
    welcomed: bool = False
    closed: bool = False
    task: int = -1
    trained_task: int = -1
    classes: list[int] = field(default_factory=list)
    seen_classes: list[int] = field(default_factory=list)
    assets: dict[str, np.ndarray] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    last_sent: float = 0.0
    # edge realism
    generation: int = 0  # bumped when the client leaves or crashes: its work in flight is dropped
    available: bool = True  # what its availability model says now
    transitions: Iterator[tuple[float, bool]] | None = None
    next_transition: tuple[float, bool] | None = None
    link: Link | None = None
    profile: DeviceProfile | None = None  # its device profile (the welcome's)
    crash_at: float | None = None  # monotonic time of a crash decided for this round
    down_until: float | None = None  # crashed: restarts at this monotonic time
    round_s: float = 1.0  # last time from train request to sent update (where a crash may fall)
    secagg: SecAggSession | None = None  # this round's secure aggregation, if any

    @property
    def id(self) -> str:
        return self.endpoint.identity

    @property
    def active(self) -> bool:
        """Welcomed, online, not shut down: it heartbeats and trains."""
        return self.status == "active"

    @property
    def status(self) -> str:
        """closed, down (crashed), away (off by its availability model), joining or active."""
        if self.closed:
            return "closed"
        if self.down_until is not None:
            return "down"
        if not self.available:
            return "away"
        return "active" if self.welcomed else "joining"


@dataclass
class TrainJob:
    client: EmulatedClient
    round: int
    task: int
    model: Mapping[str, np.ndarray]  # the received global model (shared by the round's jobs)
    generation: int
    received_at: float
    request: TrainRequest  # local epochs and learning rate of this round


@dataclass
class TrainResult:
    client: EmulatedClient
    round: int
    task: int
    uploads: dict[str, np.ndarray] | None
    num_samples: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    generation: int = 0
    received_at: float = 0.0
    train_s: float = 0.0
    cpu_s: float = 0.0  # CPU time of the client's own training (not the wait for the trainer)
    samples_trained: int = 0  # local samples x local epochs
    finished_at: float = 0.0  # monotonic time the main thread got it
    side: dict[str, tuple[int, dict[str, np.ndarray]]] = field(default_factory=dict)  # side-channel messages
    vector: np.ndarray | None = None  # a secure run's: replaces ``uploads``, it goes through secure aggregation
    model_digest: bytes | None = None  # a secure run's: of what it was trained from (secagg.consistency)
    stale: bool = False  # not trained: its client had moved on to a newer task (nothing is sent)
    cancelled: bool = False  # stopped: the coordinator cancelled it (nothing is sent)

    def report(self) -> dict[str, Any]:
        """The loss, times and metrics that its ``update`` (or ``secagg_masked``) carries."""
        metrics = {str(k): float(v) for k, v in self.metrics.items()}  # numpy scalars from a method included
        return {"train_time_s": metrics.get("train_time_s", 0.0), "loss": metrics.get("loss", float("nan")),
                "metrics": metrics, "cpu_s": self.cpu_s}


@dataclass
class SecAggSession:
    """A client's side of one round's secure aggregation: the protocol state, and the two things its masked
    input waits for (the relayed shares, its training result), in whichever order they come."""

    round: int
    protocol: SecAggClient
    relay: dict[str, Any] | None = None
    result: TrainResult | None = None
