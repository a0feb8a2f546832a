"""Where each process of a run serves its Prometheus /metrics: one block of ports from ``metrics.port``.

The coordinator takes ``port``, edge node ``n`` of ``up`` takes ``port + 1 + n``, GPU worker ``j`` takes
``port + 1 + nodes + j`` (docs/monitoring.md).
"""

from __future__ import annotations

from fcl_emu.runconfig.config import RunConfig


def node_metrics_port(config: RunConfig, n: int) -> int | None:
    """Edge node ``n`` of ``up`` serves /metrics on the coordinator's port + 1 + n."""
    return None if config.metrics.port is None else config.metrics.port + 1 + n


def gpu_worker_metrics_port(config: RunConfig, j: int) -> int | None:
    """GPU worker ``j`` serves /metrics on the coordinator's port + 1 + nodes + j."""
    return None if config.metrics.port is None else config.metrics.port + 1 + config.nodes + j


def metrics_ports(config: RunConfig, start_nodes: bool) -> list[int]:
    """Every /metrics port of a run: the coordinator's, its edge nodes' (when it starts them), its workers'."""
    port = config.metrics.port
    nodes = [node_metrics_port(config, n) for n in range(config.nodes)] if start_nodes else []
    return [port, *nodes, *(gpu_worker_metrics_port(config, j) for j in range(config.gpu.workers))]
