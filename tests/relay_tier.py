"""A real edge aggregator between a coordinator's socket and a node's shared connection, for tests: the relay runs in
a thread of the test's process, both ends are the test's, over TCP."""

from __future__ import annotations

import threading
import time

import zmq

from fcl_emu.edge_aggregator.relay import EdgeAggregator
from fcl_emu.wire.sockets import ServerEndpoint, SharedConnection

AGGREGATOR = "edge-aggregator-0"


class Tier:
    """A coordinator's socket above, the aggregator ``AGGREGATOR`` between (a thread; ``aggregator``: its keyword
    arguments), a node's shared connection below. A context manager: leaving it stops and closes all three."""

    def __init__(self, **aggregator) -> None:
        self.ctx = zmq.Context()
        self.coordinator = ServerEndpoint(self.ctx, "tcp://127.0.0.1:0")
        self.aggregator = EdgeAggregator(AGGREGATOR, self.coordinator.address, "tcp://127.0.0.1:0",
                                         **{"heartbeat_interval_s": 0.2, **aggregator}, context=self.ctx)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.aggregator.run, args=(self.stop,), daemon=True)
        self.thread.start()
        self.node = SharedConnection(self.ctx, self.aggregator.address)

    def up_next(self, want: set[str], timeout_s: float = 10.0, sender: str | None = None):
        """The next message of a type in ``want`` (from ``sender``) that reaches the coordinator."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.coordinator.sock.poll(100):
                got = self.coordinator.recv()
                if got is not None and got[1].type in want and sender in (None, got[0]):
                    return got
        raise AssertionError(f"no {want} reached the coordinator")

    def __enter__(self) -> "Tier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.aggregator.close()
        self.node.close(linger_ms=0)
        self.coordinator.close()
        self.ctx.term()
