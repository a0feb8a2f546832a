"""The federation's tiers (``topology:``): clients straight under the coordinator (a star, the default) or under
edge aggregators (hierarchical FL, docs/hierarchy.md); which runs a hierarchy can take is in
:mod:`~fcl_emu.runconfig.compatibility`."""

from __future__ import annotations

import pydantic


class TopologyConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    edge_aggregators: int = pydantic.Field(
        0, ge=0, le=1024, description=(
            "edge aggregators between the edge nodes and the coordinator, each a process of its own that relays "
            "its nodes' messages and sends one aggregate of its clients' updates up per round (0: every client "
            "talks to the coordinator; node n sits under aggregator n mod M)"))
    edge_rounds: int = pydantic.Field(
        1, ge=1, le=100, description="edge aggregations per cloud round (HierFAVG): each aggregator's clients train "
        "this many times a round, from its edge model after the first")
    aggregate_timeout_s: float | None = pydantic.Field(
        None, gt=0, description="seconds the coordinator waits for the edge aggregators' answers to a round's "
        "collect, whatever the client count (unset: network.liveness_timeout_s as set, before the heartbeat budget "
        "stretches it)")
    uplink_mbps: float | None = pydantic.Field(
        None, gt=0, description="emulated clock: megabits per second of each edge aggregator's link up to the "
        "coordinator (unset: not limited)")
    downlink_mbps: float | None = pydantic.Field(
        None, gt=0, description="emulated clock: megabits per second of each edge aggregator's link down from the "
        "coordinator (unset: not limited)")
    latency_ms: float = pydantic.Field(
        0.0, ge=0, description="emulated clock: one-way latency of each edge aggregator's link to the coordinator")

    def aggregate_wait_s(self, network) -> float:
        """Seconds a round waits for its edge aggregators' answers: ``aggregate_timeout_s``, else ``network``'s
        liveness timeout as set (a :class:`~fcl_emu.runconfig.config.NetworkConfig`; the heartbeat budget's stretch,
        which grows with the client count, left out)."""
        return self.aggregate_timeout_s or network.liveness_timeout_s

    def wide_area_s(self, down_bytes: int, up_bytes: int) -> float:
        """Seconds an aggregator's round takes on its link to the coordinator: the model down, the aggregate up
        (each with the latency)."""
        down = 0.0 if self.downlink_mbps is None else down_bytes * 8 / (self.downlink_mbps * 1e6)
        up = 0.0 if self.uplink_mbps is None else up_bytes * 8 / (self.uplink_mbps * 1e6)
        return down + up + 2 * self.latency_ms / 1000


def aggregator_name(index: int) -> str:
    """The identity edge aggregator ``index`` speaks under (its grant in a run's key directory)."""
    return f"edge-aggregator-{index}"


def aggregator_of_node(node: int, aggregators: int) -> int:
    """The edge aggregator that edge node ``node`` dials: nodes are dealt out round-robin."""
    return node % aggregators
