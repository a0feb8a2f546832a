"""One emulated client's state on its edge node: its socket, store, task, and its edge-realism counters."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_node.store import ArrayStore
from scenario.links import Link
from wire.sockets import ClientEndpoint

if TYPE_CHECKING:
    from edge_node.secure_session import SecAggSession


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
