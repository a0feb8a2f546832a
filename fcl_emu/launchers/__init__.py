"""How ``fcl-emu up`` starts its edge nodes: one small interface (:class:`NodeLauncher`), one file per backend.

A backend gets the coordinator's address, the run configuration and a log directory, and starts one edge node
per :class:`NodeSpec` of :func:`node_specs`; every node runs ``python -m fcl_emu.edge_node`` with the arguments of
:func:`node_args` (:meth:`~fcl_emu.edge_node.args.NodeArgs.to_argv`; forked by ``up``'s zygote under the process
backend) and dials out to the coordinator, so a backend only decides *where* that node runs.
To add a backend (a container engine, an orchestrator), write ``fcl_emu/launchers/<name>.py`` with a
:class:`NodeLauncher` subclass and add it to :data:`BACKENDS`; nothing in the coordinator changes.
"""

from __future__ import annotations

from collections.abc import Callable

from fcl_emu.launchers.base import NodeLauncher, NodeSpec, node_args, node_assignment, node_specs
from fcl_emu.launchers.process import ProcessLauncher


def _process(cluster: str | None) -> NodeLauncher:
    return ProcessLauncher()


def _docker(cluster: str | None) -> NodeLauncher:
    from fcl_emu.launchers.docker import DockerLauncher  # the docker SDK only where containers are asked for

    return DockerLauncher()


def _swarm(cluster: str | None) -> NodeLauncher:
    from fcl_emu.containers.cluster import load_cluster
    from fcl_emu.launchers.swarm import SwarmLauncher

    return SwarmLauncher(load_cluster(cluster) if cluster else None)


BACKENDS: dict[str, Callable[[str | None], NodeLauncher]] = {"process": _process, "docker": _docker,
                                                             "swarm": _swarm}


def launcher(backend: str = "process", cluster: str | None = None) -> NodeLauncher:
    """A new launcher of ``backend`` (a key of :data:`BACKENDS`); ``cluster`` names the swarm backend's cluster
    (containers/cluster.py)."""
    try:
        make = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown edge-node backend {backend!r}; choose one of {', '.join(BACKENDS)}") from None
    return make(cluster)


__all__ = ["BACKENDS", "NodeLauncher", "NodeSpec", "ProcessLauncher", "launcher", "node_args", "node_assignment",
           "node_specs"]
